#!/usr/bin/env bash
# Same-run A/B of the logits kernel: builds the package a second time with BEFORE.cu in place of
# cpp/src/indexer_logits.cu (in /tmp/before), runs the logits tests on the current kernel, plain
# and under racecheck, synccheck and memcheck, then times both kernels with
# benchmarks/bench_logits.py, alternating. Logs go to ${OUT:-/tmp/ab}.
#   [ROUNDS=4] [CHECKS=0] [BEFORE_PREBUILT=before.so.gz] \
#     bash tests/gpu/race_repro/logits_ab.sh BEFORE.cu
# BEFORE_PREBUILT (and SPIN_NATIVE_PREBUILT for the current one, tests/gpu/device_env.sh) take
# libraries built from the same sources by an earlier call instead of compiling them here.
# CHECKS=0 skips the tests and sanitizers. With BEFORE.cu equal to the current kernel it
# measures the noise of the comparison (A/A).
set -uo pipefail
before=$(realpath "$1")
[ -z "${BEFORE_PREBUILT:-}" ] || BEFORE_PREBUILT=$(realpath "$BEFORE_PREBUILT")
cd "$(dirname "$0")/../../.."
out=${OUT:-/tmp/ab}; mkdir -p "$out"
export SPIN_REQUIRE_NATIVE=1
source tests/gpu/device_env.sh
rm -rf /tmp/before && mkdir /tmp/before && cp -r spin_trtllm cpp benchmarks /tmp/before/
cp "$before" /tmp/before/cpp/src/indexer_logits.cu
rm -f /tmp/before/spin_trtllm/libspin_native*.so
if [ -n "${BEFORE_PREBUILT:-}" ]; then   # BEFORE.cu's library, packed by an earlier call
  gzip -dc "$BEFORE_PREBUILT" > /tmp/before/spin_trtllm/libspin_native.so ||
    { echo "cannot unpack BEFORE_PREBUILT=$BEFORE_PREBUILT"; exit 1; }
  echo "before: prebuilt (BEFORE.cu's sources: the caller's word)"
else
  (cd /tmp/before && python3 -m spin_trtllm._build > "$out/build_before.log" 2>&1
   echo "before: build rc=$?") &
fi
build_native "$out/build.log"; echo "after: build rc=$?"
wait
if [ "${CHECKS:-1}" = 1 ]; then
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_logits.py \
    tests/test_ops_step.py tests/test_ops_probe.py > "$out/tests.log" 2>&1; tail -1 "$out/tests.log"
  for tool in racecheck synccheck memcheck; do
    timeout 200 compute-sanitizer --tool $tool --kernel-name kns=logits_kernel --error-exitcode 9 \
      python3 -m pytest -q -p no:cacheprovider -m "gpu and not large" tests/test_ops_logits.py \
      > "$out/$tool.log" 2>&1 &
  done
  wait
  for tool in racecheck synccheck memcheck; do
    echo "$tool: $(grep -hE "SUMMARY|passed|failed" "$out/$tool.log" | tr '\n' ' ')"
  done
fi
shapes="96x131072 32x131072 32x32768 8x32768"
bench() {  # NAME ROUND: one bench_logits.py run of the current (after) or the BEFORE build
  if [ "$1" = after ]; then python3 benchmarks/bench_logits.py --shapes $shapes --json "$out/after$2.json"
  else (cd /tmp/before && PYTHONPATH=/tmp/before:$PYTHONPATH python3 benchmarks/bench_logits.py \
          --shapes $shapes --json "$out/before$2.json")
  fi > /dev/null
}
table() {  # the median table of the rounds so far (a timed-out call still shows them)
python3 - "$out" <<'PY'
import glob, json, statistics, sys
runs = {k: [json.load(open(f))["rows"] for f in sorted(glob.glob(f"{sys.argv[1]}/{k}*.json"))]
        for k in ("before", "after")}
print(f"{'shape':>16} {'rows':>4} {'before us (min-max)':>22} {'after us (min-max)':>22} "
      f"{'after/before':>12}  (medians of {len(runs['after'])} runs)")
for j, row in enumerate(runs["after"][0]):
    b = [r[j]["us"] for r in runs["before"]]
    a = [r[j]["us"] for r in runs["after"]]
    cell = lambda v: f"{statistics.median(v):7.1f} ({min(v):.1f}-{max(v):.1f})"
    print(f"{row['batch']:>6} x {row['slots']:>7} {row['rows']:>4} {cell(b):>22} {cell(a):>22} "
          f"{statistics.median(a) / statistics.median(b):12.3f}")
PY
}
# alternating, each build first in every other round (the first run of a round may see colder clocks)
for i in $(seq "${ROUNDS:-4}"); do
  if [ $((i % 2)) = 1 ]; then bench after "$i"; bench before "$i"; else bench before "$i"; bench after "$i"; fi
  table
done
