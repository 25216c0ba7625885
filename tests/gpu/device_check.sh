#!/usr/bin/env bash
# Build the native library and run the GPU tests on a CUDA machine, then the same tests under
# compute-sanitizer memcheck and racecheck. Logs go to ${OUT:-/tmp/spin-gpu}.
#   bash tests/gpu/device_check.sh [quick]
# Packages missing on the machine can come as wheels in .whl/ (see README, GPU tests).
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/spin-gpu}; mkdir -p "$out"
export SPIN_REQUIRE_NATIVE=1
source tests/gpu/device_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -m spin_trtllm._build --check 2>&1 | tee "$out/build_check.log"
build_native "$out/build.log"
tail -1 "$out/build.log"
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_*.py tests/test_reference_props.py \
  2>&1 | tee "$out/pytest_gpu.log" | tail -15
[ "${1:-}" = "quick" ] && exit 0
timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
  -m gpu tests/test_ops_*.py > "$out/memcheck.log" 2>&1; echo "memcheck rc=$?" | tee -a "$out/memcheck.log"
tail -4 "$out/memcheck.log"
# racecheck leaves out the tests marked no_racecheck (the largest cases, CUDA graphs, the
# exploration distribution and the cluster top-K on few distinct keys): one of those had not
# finished after 100 s under racecheck (it passes plain and under memcheck); the same cluster
# path is racechecked on random and all-zero rows
timeout 420 compute-sanitizer --tool racecheck --error-exitcode 9 python3 -m pytest -q -p no:cacheprovider \
  -m "gpu and not no_racecheck" tests/test_ops_native.py tests/test_ops_select.py \
  tests/test_ops_logits.py tests/test_ops_topk.py tests/test_ops_update.py tests/test_ops_step.py \
  tests/test_ops_probe.py > "$out/racecheck.log" 2>&1; echo "racecheck rc=$?" | tee -a "$out/racecheck.log"
tail -4 "$out/racecheck.log"
