#!/usr/bin/env bash
# Profile every stage of the decode indexer with ncu on a CUDA machine (clocks not locked):
# select, dense logits, dense top-K, masked logits, masked top-K, update, in that order.
#   bash benchmarks/device_ncu.sh BATCH SLOTS SPARSITY [NEXT_N [K]]
# Writes ${OUT:-/tmp/spin-ncu}/ncu_<batch>x<slots>_<sparsity>.txt and prints its key lines.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/spin-ncu}; mkdir -p "$out"
batch=${1:?batch}; slots=${2:?slots}; rho=${3:?sparsity}; next_n=${4:-1}; k=${5:-512}
source tests/gpu/device_env.sh
build_native /tmp/spin-ncu-build.log
report="$out/ncu_${batch}x${slots}_${rho}.txt"
ncu --clock-control none --nvtx --nvtx-include "profile/" \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  --section Occupancy --section WarpStateStats --section LaunchStats \
  python3 benchmarks/bench_decode_indexer.py --profile --batch "$batch" --slots "$slots" \
  --sparsity "$rho" --next-n "$next_n" --topk "$k" > "$report" 2>&1
rc=$?
grep -E "^  [a-z_]+kernel|Duration|DRAM Throughput|Compute \(SM\) Throughput|Issue Slots Busy|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Warp Cycles Per Issued" "$report"
exit $rc
