# Build the logits kernel before and after the named-barrier handoff, check and racecheck the
# new one, and time both alternately in one run.
set -uo pipefail
cd "$(dirname "$0")/../../.."
source tests/gpu/device_env.sh > /dev/null 2>&1
export SPIN_REQUIRE_NATIVE=1
rm -rf /tmp/old && mkdir /tmp/old && cp -r spin_trtllm cpp benchmarks /tmp/old/
cp tests/gpu/race_repro/indexer_logits_before.cu /tmp/old/cpp/src/indexer_logits.cu
(cd /tmp/old && python3 -m spin_trtllm._build > $OUT/build_old.log 2>&1; echo "old build rc=$?") &
build_native $OUT/build.log; echo "new build rc=$?"
wait
python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_logits.py tests/test_ops_step.py tests/test_ops_probe.py > $OUT/tests.log 2>&1; tail -1 $OUT/tests.log
timeout 220 compute-sanitizer --tool racecheck --racecheck-report all --print-limit 20 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_ops_logits.py -k "refill_every_stage" > $OUT/race.log 2>&1; echo "racecheck rc=$?"; grep -E "SUMMARY|passed|failed" $OUT/race.log
for i in 1 2; do
  python3 benchmarks/bench_logits.py --json $OUT/after$i.json | sed "s/^/after: /"
  (cd /tmp/old && PYTHONPATH=/tmp/old:$PYTHONPATH python3 benchmarks/bench_logits.py --json $OUT/before$i.json | sed "s/^/before: /")
done
