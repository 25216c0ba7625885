#!/usr/bin/env bash
# Every GPU test on a CUDA machine, then under compute-sanitizer: builds the native library and
# DeepGEMM (the TensorRT-LLM stand-in's engine loop), runs every test marked `gpu` (the engine
# loop on CUDA included) and lists which of the library's kernels they launched, then runs every
# GPU test except the `large` shapes (each has a smaller case on the same path) under memcheck,
# racecheck, synccheck and initcheck, side by side, each tool in two shards (the op tests, the
# rest) with a limit of SANITIZER_LIMIT seconds (default 420). racecheck and synccheck check the
# kernels of namespace spin only (DeepGEMM's and torch's are upstream's); memcheck and initcheck
# check every kernel. Logs go to ${OUT:-/tmp/spin-gpu}.
#   bash tests/gpu/device_check.sh [quick]        (quick: no sanitizers)
# Needs third_party/deepgemm.tar.gz (tests/gpu/deepgemm_env.sh) and .whl/ where pydantic is missing.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/spin-gpu}; mkdir -p "$out"
export SPIN_REQUIRE_NATIVE=1 TRTLLM_STANDIN_DEVICE=cuda TRTLLM_STANDIN_DEEPGEMM=real
source tests/gpu/device_env.sh
source tests/gpu/deepgemm_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
build_deepgemm "$out/deepgemm_build.log" & dg=$!
build_native "$out/build.log"
wait $dg || { echo "DeepGEMM build failed"; exit 1; }
export PYTHONPATH="$DG_SRC:$PYTHONPATH"
pytest=(python3 -m pytest -q -p no:cacheprovider -rs)

# The plain run first: it also compiles DeepGEMM's kernels once for the sanitizer runs.
SPIN_KERNEL_LOG="$out/kernels.json" "${pytest[@]}" -m gpu tests/ > "$out/gpu_tests.log" 2>&1
tail -1 "$out/gpu_tests.log"
python3 tests/gpu/kernel_coverage.py "$out/kernels.json" spin_trtllm/libspin_native.so \
  > "$out/kernel_coverage.txt" 2>&1
tail -1 "$out/kernel_coverage.txt"
[ "${1:-}" = "quick" ] && exit 0

only_spin="--kernel-name kns=spin"
compute-sanitizer --help | grep -q -- "--kernel-name" || only_spin="--filter kns=spin"
limit=${SANITIZER_LIMIT:-420}
shards=("tests/test_ops_*.py" "tests/ --ignore-glob=tests/test_ops_*.py")
sanitize() {  # TOOL [options]: both shards side by side; one log per shard
  local tool=$1 i; shift
  for i in 0 1; do
    (
      # shellcheck disable=SC2086  # the shard's words split on purpose
      timeout "$limit" compute-sanitizer --tool "$tool" --error-exitcode 9 --print-limit 20 "$@" \
        "${pytest[@]}" -m "gpu and not large" ${shards[$i]} > "$out/${tool}_$i.log" 2>&1
      echo "$tool shard $i: rc=$? (9: errors found, 124: over ${limit}s)" >> "$out/${tool}_$i.log"
    ) &
  done
}
start=$SECONDS
sanitize memcheck
sanitize racecheck $only_spin
sanitize synccheck $only_spin
sanitize initcheck
wait
echo "sanitizers: $((SECONDS - start)) s"
# one summary per sanitized process (the tests' own subprocesses included)
for log in "$out"/{memcheck,racecheck,synccheck,initcheck}_[01].log; do
  echo "== $(basename "$log"): $(grep -E "passed|failed" "$log" | tail -1) | $(tail -1 "$log")"
  grep -hE "(ERROR|RACECHECK) SUMMARY" "$log" | sed 's/^=* *//' | sort | uniq -c
done
