#!/usr/bin/env bash
# On a CUDA machine: build the native library, run the dsa-lite GPU tests, then the dsa-lite
# step benchmark. Logs and results go to ${OUT:-/tmp/spin-dsa-lite}.
#   [DSA_LITE_TESTS=0] [BENCH_LIMIT=SECONDS] bash benchmarks/device_dsa_lite.sh [bench flags]
# DSA_LITE_TESTS=0 skips the tests (a call spent on the benchmark alone); BENCH_LIMIT stops the
# benchmark after that many seconds with Ctrl-C's signal, on which it still reports the engines'
# runs so far (SPIN_NATIVE_PREBUILT, tests/gpu/device_env.sh, skips the build).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/spin-dsa-lite}; mkdir -p "$out"
export SPIN_REQUIRE_NATIVE=1
source tests/gpu/device_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
build_native "$out/build.log"
if [ "${DSA_LITE_TESTS:-1}" != 0 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_harness_gpu.py 2>&1 |
    tee "$out/pytest_harness_gpu.log" | tail -5
fi
limit=()
[ -n "${BENCH_LIMIT:-}" ] && limit=(timeout -s INT "$BENCH_LIMIT")
"${limit[@]}" python3 benchmarks/bench_dsa_lite.py --json "$out/dsa_lite.jsonl" \
  --markdown "$out/dsa_lite.md" "$@" 2>&1 | tee "$out/bench.log" | tail -n 60
