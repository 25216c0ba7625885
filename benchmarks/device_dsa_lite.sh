#!/usr/bin/env bash
# On a CUDA machine: build the native library, run the dsa-lite GPU tests, then the dsa-lite
# step benchmark. Logs and results go to ${OUT:-/tmp/spin-dsa-lite}.
#   bash benchmarks/device_dsa_lite.sh [bench_dsa_lite.py flags]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/spin-dsa-lite}; mkdir -p "$out"
export SPIN_REQUIRE_NATIVE=1
source tests/gpu/device_env.sh
build_native "$out/build.log"
python3 -m pytest -q -p no:cacheprovider tests/test_harness_gpu.py 2>&1 | tee "$out/pytest_harness_gpu.log" | tail -5
python3 benchmarks/bench_dsa_lite.py --json "$out/dsa_lite.jsonl" --markdown "$out/dsa_lite.md" "$@" \
  2>&1 | tee "$out/bench.log" | tail -n 60
