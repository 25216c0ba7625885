#!/usr/bin/env bash
# Same-run A/B of the logits kernel: builds the package again with BEFORE.cu in place of
# cpp/src/indexer_logits.cu (in /tmp/before), and once more per VARIANT.cu (/tmp/variant1, ...),
# runs the logits tests on the current kernel, plain and under racecheck, synccheck and memcheck,
# then times every build with benchmarks/bench_logits.py, in a rotating order. Logs go to
# ${OUT:-/tmp/ab}.
#   [ROUNDS=4] [CHECKS=0] [SHAPES="96x131072 ..."] [BEFORE_PREBUILT=before.so.gz] \
#     bash tests/gpu/race_repro/logits_ab.sh BEFORE.cu [VARIANT.cu ...]
# BEFORE_PREBUILT (and SPIN_NATIVE_PREBUILT for the current one, tests/gpu/device_env.sh) take
# libraries built from the same sources by an earlier call instead of compiling them here.
# CHECKS=0 skips the tests and sanitizers (which check the current kernel only). With BEFORE.cu
# equal to the current kernel it measures the noise of the comparison (A/A).
set -uo pipefail
sources=()
for f in "$@"; do sources+=("$(realpath "$f")"); done
[ ${#sources[@]} -ge 1 ] || { echo "usage: $0 BEFORE.cu [VARIANT.cu ...]"; exit 2; }
[ -z "${BEFORE_PREBUILT:-}" ] || BEFORE_PREBUILT=$(realpath "$BEFORE_PREBUILT")
cd "$(dirname "$0")/../../.."
out=${OUT:-/tmp/ab}; mkdir -p "$out"
export SPIN_REQUIRE_NATIVE=1
source tests/gpu/device_env.sh
names=(before)
for ((k = 1; k < ${#sources[@]}; k++)); do names+=("variant$k"); done
for ((k = 0; k < ${#sources[@]}; k++)); do
  dir=/tmp/${names[k]}
  rm -rf "$dir" && mkdir "$dir" && cp -r spin_trtllm cpp benchmarks "$dir/"
  cp "${sources[k]}" "$dir/cpp/src/indexer_logits.cu"
  rm -f "$dir"/spin_trtllm/libspin_native*.so
  if [ $k = 0 ] && [ -n "${BEFORE_PREBUILT:-}" ]; then   # BEFORE.cu's library, from an earlier call
    gzip -dc "$BEFORE_PREBUILT" > "$dir/spin_trtllm/libspin_native.so" ||
      { echo "cannot unpack BEFORE_PREBUILT=$BEFORE_PREBUILT"; exit 1; }
    echo "before: prebuilt (BEFORE.cu's sources: the caller's word)"
  else
    (cd "$dir" && python3 -m spin_trtllm._build > "$out/build_${names[k]}.log" 2>&1
     echo "${names[k]}: build rc=$?") &
  fi
done
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
shapes=${SHAPES:-"96x131072 32x131072 32x32768 8x32768"}
bench() {  # NAME ROUND: one bench_logits.py run of the current build (after) or another
  if [ "$1" = after ]; then
    python3 benchmarks/bench_logits.py --shapes $shapes --json "$out/after_r$2.json"
  else (cd "/tmp/$1" && PYTHONPATH="/tmp/$1:$PYTHONPATH" python3 benchmarks/bench_logits.py \
          --shapes $shapes --json "$out/$1_r$2.json")
  fi > /dev/null
}
table() {  # the median table of the rounds so far (a timed-out call still shows them)
python3 - "$out" after "${names[@]}" <<'PY'
import glob, json, statistics, sys
out, builds = sys.argv[1], sys.argv[2:]
runs = {k: [json.load(open(f))["rows"] for f in sorted(glob.glob(f"{out}/{k}_r*.json"))]
        for k in builds}
others = [k for k in builds if k != "before"]
print(f"{'shape':>16} {'rows':>4} {'before us':>9} " +
      " ".join(f"{k + ' us':>14} {k[:8] + '/bef':>12}" for k in others) +
      f"  (medians of {len(runs['before'])} runs)")
for j, row in enumerate(runs["before"][0]):
    med = {k: statistics.median(r[j]["us"] for r in v) for k, v in runs.items() if v}
    print(f"{row['batch']:>6} x {row['slots']:>7} {row['rows']:>4} {med['before']:9.1f} " +
          " ".join(f"{med[k]:14.1f} {med[k] / med['before']:12.3f}" for k in others if k in med))
PY
}
# a rotating order: each build first in some round (the first run of a round may see colder clocks)
builds=(after "${names[@]}")
n=${#builds[@]}
for i in $(seq "${ROUNDS:-4}"); do
  for ((k = 0; k < n; k++)); do bench "${builds[(k + i) % n]}" "$i"; done
  table
done
