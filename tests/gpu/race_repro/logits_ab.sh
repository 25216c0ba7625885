#!/usr/bin/env bash
# Same-run A/B of the logits kernel: builds the package a second time with BEFORE.cu in place of
# cpp/src/indexer_logits.cu (in /tmp/before), runs the logits tests on the current kernel, plain
# and under racecheck, synccheck and memcheck, then times both kernels with
# benchmarks/bench_logits.py, alternating. Logs go to ${OUT:-/tmp/ab}.
#   [ROUNDS=4] bash tests/gpu/race_repro/logits_ab.sh BEFORE.cu
# With BEFORE.cu equal to the current kernel it measures the noise of the comparison (A/A).
set -uo pipefail
before=$(realpath "$1")
cd "$(dirname "$0")/../../.."
out=${OUT:-/tmp/ab}; mkdir -p "$out"
export SPIN_REQUIRE_NATIVE=1
source tests/gpu/device_env.sh
rm -rf /tmp/before && mkdir /tmp/before && cp -r spin_trtllm cpp benchmarks /tmp/before/
cp "$before" /tmp/before/cpp/src/indexer_logits.cu
rm -f /tmp/before/spin_trtllm/libspin_native*.so
(cd /tmp/before && python3 -m spin_trtllm._build > "$out/build_before.log" 2>&1; echo "before: build rc=$?") &
build_native "$out/build.log"; echo "after: build rc=$?"
wait
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_logits.py tests/test_ops_step.py \
  tests/test_ops_probe.py > "$out/tests.log" 2>&1; tail -1 "$out/tests.log"
for tool in racecheck synccheck memcheck; do
  timeout 200 compute-sanitizer --tool $tool --kernel-name kns=logits_kernel --error-exitcode 9 \
    python3 -m pytest -q -p no:cacheprovider -m "gpu and not large" tests/test_ops_logits.py \
    > "$out/$tool.log" 2>&1 &
done
wait
for tool in racecheck synccheck memcheck; do
  echo "$tool: $(grep -hE "SUMMARY|passed|failed" "$out/$tool.log" | tr '\n' ' ')"
done
shapes="96x131072 32x131072 32x32768 8x32768"
bench() {  # NAME ROUND: one bench_logits.py run of the current (after) or the BEFORE build
  if [ "$1" = after ]; then python3 benchmarks/bench_logits.py --shapes $shapes --json "$out/after$2.json"
  else (cd /tmp/before && PYTHONPATH=/tmp/before:$PYTHONPATH python3 benchmarks/bench_logits.py \
          --shapes $shapes --json "$out/before$2.json")
  fi > /dev/null
}
# alternating, each build first in every other round (the first run of a round may see colder clocks)
for i in $(seq "${ROUNDS:-4}"); do
  if [ $((i % 2)) = 1 ]; then bench after "$i"; bench before "$i"; else bench before "$i"; bench after "$i"; fi
done
python3 - "$out" <<'PY'
import glob, json, statistics, sys
runs = {k: [json.load(open(f))["rows"] for f in sorted(glob.glob(f"{sys.argv[1]}/{k}*.json"))]
        for k in ("before", "after")}
print(f"{'shape':>16} {'rows':>4} {'before us':>10} {'after us':>9} {'after/before':>12}  (medians of {len(runs['after'])} runs)")
for j, row in enumerate(runs["after"][0]):
    b = statistics.median(r[j]["us"] for r in runs["before"])
    a = statistics.median(r[j]["us"] for r in runs["after"])
    print(f"{row['batch']:>6} x {row['slots']:>7} {row['rows']:>4} {b:10.1f} {a:9.1f} {a / b:12.3f}")
PY
