#!/usr/bin/env bash
# Build the native library on a CUDA machine and run the decode-indexer benchmark.
#   bash benchmarks/device_bench.sh [bench_decode_indexer.py flags]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/spin-bench}; mkdir -p "$out"
source tests/gpu/device_env.sh
build_native "$out/build.log"
python3 benchmarks/bench_decode_indexer.py --json "$out/bench.json" --markdown "$out/bench.md" "$@" \
  > "$out/bench.log" 2>&1
rc=$?
tail -n 25 "$out/bench.log"
exit $rc
