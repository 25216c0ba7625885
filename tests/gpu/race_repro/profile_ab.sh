#!/usr/bin/env bash
# Where the logits kernel's time goes, current source against BEFORE.cu (e.g. the kernel before
# the race fix): builds both like logits_ab.sh, then ncu (--set full, one next_n 2 launch at
# 32 x 128K) for each, and prints the two kernels' warp-state sections side by side and each
# one's 25 SASS instructions with the most stall samples. Reports and text go to ${OUT:-/tmp/prof}.
#   [SHAPE=32x131072] [ROWS=2] bash tests/gpu/race_repro/profile_ab.sh BEFORE.cu
set -uo pipefail
before=$(realpath "$1")
cd "$(dirname "$0")/../../.."
out=${OUT:-/tmp/prof}; mkdir -p "$out"
export SPIN_REQUIRE_NATIVE=1
source tests/gpu/device_env.sh
rm -rf /tmp/before && mkdir /tmp/before && cp -r spin_trtllm cpp benchmarks /tmp/before/
cp "$before" /tmp/before/cpp/src/indexer_logits.cu
rm -f /tmp/before/spin_trtllm/libspin_native*.so
(cd /tmp/before && python3 -m spin_trtllm._build > "$out/build_before.log" 2>&1) &
build_native "$out/build.log"
wait
profile() {  # NAME DIR
  (cd "$2" && PYTHONPATH="$2:$PYTHONPATH" timeout 120 ncu -k regex:logits_kernel \
     --launch-skip 3 --launch-count 1 --set full -f -o "$out/$1" \
     python3 benchmarks/bench_logits.py --shapes "${SHAPE:-32x131072}" --rows "${ROWS:-2}" \
     > "$out/ncu_$1.log" 2>&1)
  ncu -i "$out/$1.ncu-rep" --page details > "$out/$1_details.txt" 2>&1
  ncu -i "$out/$1.ncu-rep" --page source --csv --print-source sass > "$out/$1_sass.csv" 2>&1
}
profile after "$PWD"
profile before /tmp/before
for name in after before; do
  echo "== $name: $(grep -m1 -E "^ +Duration" "$out/${name}_details.txt")"
  grep -A30 "Section: Warp State Statistics" "$out/${name}_details.txt" | grep -E "^ +[A-Z]" | head -8
done
python3 - "$out" <<'PY'
import csv, sys
for name in ("after", "before"):
    rows = list(csv.DictReader(open(f"{sys.argv[1]}/{name}_sass.csv")))
    key = next((k for k in (rows[0] if rows else {}) if "Warp Stall Sampling (All" in k), None)
    if key is None:
        print(f"{name}: no stall-sampling column in the source page"); continue
    top = sorted(rows, key=lambda r: -float(r[key] or 0))[:25]
    total = sum(float(r[key] or 0) for r in rows)
    print(f"== {name}: {len(rows)} SASS instructions, {total:.0f} stall samples; the top 25:")
    for r in top:
        print(f"{float(r[key]):8.0f}  {r.get('Address', '')}  {r.get('Source', '')[:90]}")
PY
