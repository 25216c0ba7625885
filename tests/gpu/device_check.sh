#!/usr/bin/env bash
# Every GPU test on a CUDA machine, plain and under compute-sanitizer, in steps that each fit one
# 10-minute device call:
#   bash tests/gpu/device_check.sh plain              every test marked gpu (the TensorRT-LLM
#       stand-in's engine loop on DeepGEMM included) in PLAIN_SHARDS processes (default 4) that
#       share them out as the sanitizer shards do (order: sanitizer_order/plain.times), then the
#       library's kernels that its tests not marked large (the sanitized ones) launched
#       (SPIN_KERNEL_LOG per process, merged into kernels.json by kernel_coverage.py)
#   bash tests/gpu/device_check.sh sanitize [TOOL...] every GPU test except the `large` shapes
#       (each has a smaller case on the same path) under each TOOL (default: memcheck racecheck
#       synccheck initcheck), side by side, each tool in SANITIZER_SHARDS processes (default: as
#       many as keep one process per CPU core and 6-8 GiB of GPU memory; racecheck twice as many)
#       that share its tests out as they go (SPIN_TEST_QUEUE,
#       spin_trtllm/testing/queue_plugin.py), the longest known first (SANITIZER_ORDER: .times
#       files of an earlier run, colon-separated; default tests/gpu/sanitizer_order/TOOL.times,
#       racecheck's for a tool without one; empty: collection order; SPIN_TEST_ORDER), with a
#       limit of SANITIZER_LIMIT seconds (default: what is left of CALL_LIMIT, 585 s from the
#       script's start, after the builds, less 45 s for the summary; 480 in `all`)
#   bash tests/gpu/device_check.sh                    both, one after the other
# The whole suite under every tool takes three calls on an H100 (16 cores, 79 GiB):
# `sanitize memcheck synccheck`, `sanitize racecheck`, `sanitize initcheck` (README's timings).
# SANITIZE_PATHS="tests/test_ops_topk.py ..." (default tests/) narrows `sanitize` to those test
# files: after a change to one kernel, its tests under every tool in one call, not the suite's.
# With KERNEL_LOG=FILE (a plain run's kernels.json, carried to a later call; while the kernel
# instances keep a7eb71c's names, tests/gpu/sanitizer_order/kernels.json) `sanitize` also lists,
# per tool, the library's kernels that the tests it ran launched (coverage_TOOL.txt): every
# kernel instance must show up under every tool (kernel_coverage.py calls a log of other kernels
# stale).
# Never run two steps at once: on 16 cores, plain beside 15 sanitizer processes finished 13 tests
# in 390 s (alone: 312 tests in 371 s). Every test's seconds and outcome go to a .times file
# (SPIN_TEST_TIMES) as it ends, so a step cut off at its limit still shows what it covered.
# memcheck, racecheck and synccheck check the kernels of namespace spin only: DeepGEMM's and
# torch's are upstream's, and left uninstrumented they run at full speed, which keeps the engine
# tests inside the limit. initcheck instruments every kernel: it sees only the writes of the
# kernels it instruments, so a buffer torch's fill kernel zeroed would read as uninitialized.
# Every tool leaves out the tests marked own_profiler (they run torch.profiler themselves).
# racecheck also leaves out the tests marked no_racecheck (it fails on them with no kernel
# instrumented) and racecheck_slow (top-K shapes it takes minutes on; smaller twins run there);
# initcheck and racecheck those marked slow_schedule (engine schedules, minutes each there),
# whose brief_schedule twins (fewer steps, shorter prompts) run there alone;
# initcheck those marked no_initcheck (bf16 models: it does not see cuBLAS's GEMMs write;
# tests/gpu/initcheck_repro.py shows that). initcheck runs with
# tests/gpu/initcheck_suppressions.xml, which leaves the memcpy sources read at a graph launch
# unchecked: it reports some that a kernel of the same graph wrote (the engine loop's warm-up;
# initcheck_repro.py's graph_spin_topk_copy, where the copy equals what was written).
# Only the test process is sanitized: the second processes some tests start run the same kernels.
# A test process that holds more than memory_cap's GiB of GPU memory before its next test stops,
# and run_queue starts a fresh one on the same queue (TEST_MEMORY_CAP=GIB overrides the cap).
# `sanitize` runs the stand-in's torch emulation of DeepGEMM unless SANITIZE_DEEPGEMM=real (the
# tests that need DeepGEMM itself skip there); `plain` and `all` build and run DeepGEMM.
# Each step builds the native library first (SPIN_NATIVE_PREBUILT in tests/gpu/device_env.sh
# skips that); plain also leaves it packed as $OUT/libspin_native.so.gz, with the digest of its
# sources in $OUT/libspin_native.so.sources, for a later call.
# Logs go to ${OUT:-/tmp/spin-gpu}: the builds', the summaries (plain's on stdout, kernels.json
# and kernel_coverage.txt; sanitize's summary.txt and coverage_TOOL.txt) and every process's own
# packed (plain.tar.gz, shards.tar.gz): at most 8 files a step (the device returns 8).
# Needs third_party/deepgemm.tar.gz (tests/gpu/pack_deepgemm.sh) and .whl/ where pydantic is
# missing.
set -uo pipefail
cd "$(dirname "$0")/../.."
step=${1:-all}; [ $# -gt 0 ] && shift
case $step in plain|sanitize|all) ;; *) echo "usage: $0 [plain | sanitize [TOOL...]]"; exit 2;; esac
out=${OUT:-/tmp/spin-gpu}; mkdir -p "$out"
export SPIN_REQUIRE_NATIVE=1 TRTLLM_STANDIN_DEVICE=cuda
source tests/gpu/device_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
real_deepgemm=1
[ "$step" = sanitize ] && [ "${SANITIZE_DEEPGEMM:-}" != real ] && real_deepgemm=0
if [ $real_deepgemm = 1 ]; then
  export TRTLLM_STANDIN_DEEPGEMM=real
  source tests/gpu/deepgemm_env.sh
  build_deepgemm "$out/deepgemm_build.log" & dg=$!
fi
build_native "$out/build.log"
if [ $real_deepgemm = 1 ]; then
  wait $dg || { echo "DeepGEMM build failed"; exit 1; }
  export PYTHONPATH="$DG_SRC:$PYTHONPATH"
fi
if [ "$step" != sanitize ]; then
  gzip -c spin_trtllm/libspin_native.so > "$out/libspin_native.so.gz"
  native_sources > "$out/libspin_native.so.sources"
fi
pytest=(python3 -m pytest -q -p no:cacheprovider -rs)
# torch's CPU threads for each of N processes: a core's share (OMP_NUM_THREADS overrides). At
# torch's default every process starts a thread per core: 3 plain processes so ran the tests
# 1.76x slower than one alone (2026-12-06, an H100), and a dozen sanitizer shards fought over
# the cores for their tests' CPU references
threads_each() {
  local share=$(( $(nproc) / $1 ))
  echo "${OMP_NUM_THREADS:-$(( share > 0 ? share : 1 ))}"
}

gpu_gib=$(( $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1) / 1024 ))
# GPU memory a test process may hold before its next test, for N processes: half a process's
# share of the GPU (the other half for that test); past it the process stops and a fresh one
# takes the queue on (SPIN_TEST_MEMORY_CAP, spin_trtllm/testing/queue_plugin.py). A guard
# against memory the sanitizer holds (host backtraces: tool_opts below).
# All four tools on an H100 (79 GiB, 10 processes): 3 GiB.
memory_cap() {
  local cap=$(( gpu_gib / (2 * $1) ))
  echo "${TEST_MEMORY_CAP:-$(( cap > 0 ? cap : 1 ))}"
}
cap_given=${TEST_MEMORY_CAP:-1}
[[ "$cap_given" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)$ && "$cap_given" =~ [1-9] ]] ||
  { echo "TEST_MEMORY_CAP must be a positive number of GiB, got '$TEST_MEMORY_CAP'"; exit 2; }
[[ "${PLAIN_SHARDS:-4}" =~ ^[1-9][0-9]*$ ]] ||
  { echo "PLAIN_SHARDS must be a positive integer, got '$PLAIN_SHARDS'"; exit 2; }
# run_queue END LOG CAP CMD...: CMD (a pytest process of a SPIN_TEST_QUEUE), its output appended
# to LOG, started again whenever it stopped over CAP GiB, until the queue is drained or $SECONDS
# reaches END. Returns 9 if any run found sanitizer errors (--error-exitcode 9), else the last
# run's status (124: cut off at END).
run_queue() {
  local end=$1 log=$2 cap=$3 restart rc left found=0; shift 3
  restart=$(mktemp -u)
  while :; do
    rm -f "$restart"
    left=$((end - SECONDS))   # once: `timeout 0` would mean no limit at all
    [ "$left" -gt 0 ] || { rc=124; break; }
    SPIN_TEST_MEMORY_CAP=$cap SPIN_TEST_RESTART=$restart timeout "$left" "$@" >> "$log" 2>&1
    rc=$?
    [ $rc = 9 ] && found=9
    [ -f "$restart" ] || break
    echo "process restarted: $(cat "$restart")" >> "$log"
  done
  rm -f "$restart"
  [ $rc = 124 ] && echo "deadline reached" >> "$log"
  [ $found = 9 ] && return 9
  return $rc
}
restarts() { cat "$@" | grep -c "^process restarted"; }   # in run_queue's LOG files

if [ "$step" != sanitize ]; then
  # PLAIN_SHARDS processes share the tests out, the longest first
  n=${PLAIN_SHARDS:-4} plain_queue=$(mktemp -d)
  plain_threads=$(threads_each "$n")
  # every process's log, .times and kernel log (appended to: a fresh folder), packed at the end
  procs="$out/plain"; rm -rf "$procs"; mkdir -p "$procs"
  start=$SECONDS
  # DeepGEMM compiles its kernels at first use: once here, not in every process at once (a
  # member of the queue: the tests it runs count, and no other process runs them again)
  SPIN_TEST_QUEUE="$plain_queue" SPIN_KERNEL_LOG="$procs/kernels_warmup.json" \
    SPIN_TEST_TIMES="$procs/gpu_tests_warmup.times" timeout 240 "${pytest[@]}" \
    -m gpu tests/test_logits_backends.py > "$procs/gpu_tests_warmup.log" 2>&1
  plain_limit=${PLAIN_LIMIT:-$(( ${CALL_LIMIT:-585} - SECONDS - 30 ))}
  [ "$plain_limit" -ge 60 ] || { echo "plain limit ${plain_limit} s: too little left"; exit 2; }
  for ((i = 0; i < n; i++)); do
    (
      OMP_NUM_THREADS=$plain_threads SPIN_TEST_QUEUE="$plain_queue" \
        SPIN_TEST_ORDER=tests/gpu/sanitizer_order/plain.times \
        SPIN_KERNEL_LOG="$procs/kernels_$i.json" SPIN_TEST_TIMES="$procs/gpu_tests_$i.times" \
        run_queue $((SECONDS + plain_limit)) "$procs/gpu_tests_$i.log" "$(memory_cap "$n")" \
        "${pytest[@]}" -m gpu tests/
      echo "plain process $i/$n: rc=$? (124: over ${plain_limit}s)" >> "$procs/gpu_tests_$i.log"
    ) &
  done
  wait; rm -rf "$plain_queue"
  for log in "$procs"/gpu_tests_*.log; do
    echo "$(grep -E "passed|failed" "$log" | tail -1) | $(tail -1 "$log")"
  done
  grep -hE " (failed|error) " "$procs"/gpu_tests_*.times
  echo "plain: $(cat "$procs"/gpu_tests_*.times | grep -c " passed ") passed," \
    "$(cat "$procs"/gpu_tests_*.times | grep -Ec " (failed|error) ") failed or errors" \
    "($((SECONDS - start)) s, $(restarts "$procs"/gpu_tests_*.log) restarts)"
  python3 tests/gpu/kernel_coverage.py "$procs"/kernels_*.json spin_trtllm/libspin_native.so \
    --merged "$out/kernels.json" > "$out/kernel_coverage.txt" 2>&1
  tail -1 "$out/kernel_coverage.txt"
  tar -czf "$out/plain.tar.gz" -C "$out" plain && rm -rf "$procs"
fi
[ "$step" = plain ] && exit 0

tools=("$@"); [ ${#tools[@]} -eq 0 ] && tools=(memcheck racecheck synccheck initcheck)
only_spin="--kernel-name kns=spin"
# not `| grep -q`: grep's early exit breaks the pipe, which pipefail reads as "no such option"
[[ "$(compute-sanitizer --help 2>&1)" == *--kernel-name* ]] || only_spin="--filter kns=spin"
# One process per core: each tool one share, racecheck two. And no more processes than the GPU
# holds: under memcheck and synccheck, which run the long engine schedules, a test process
# reached 6.0-7.4 GiB (12 of them ran an H100's 79 GiB out of memory), under racecheck and
# initcheck (brief schedules) 6; a share's processes are counted at that size.
shares=0 share_gib=0
for tool in "${tools[@]}"; do
  case $tool in
    racecheck) shares=$((shares + 2)) share_gib=$((share_gib + 12));;
    initcheck) shares=$((shares + 1)) share_gib=$((share_gib + 6));;
    *) shares=$((shares + 1)) share_gib=$((share_gib + 8));;
  esac
done
by_cores=$(( $(nproc) / shares )) by_memory=$(( gpu_gib / share_gib ))
shards=$(( by_cores < by_memory ? by_cores : by_memory ))
shards=${SANITIZER_SHARDS:-$(( shards > 0 ? shards : 1 ))}
[[ "$shards" =~ ^[1-9][0-9]*$ ]] ||
  { echo "SANITIZER_SHARDS must be a positive integer, got '$shards'"; exit 2; }
if [[ " ${tools[*]} " == *" initcheck "* ]] &&
   [[ "$(compute-sanitizer --help 2>&1)" != *--suppressions* ]]; then
  echo "this compute-sanitizer has no --suppressions (tests/gpu/initcheck_suppressions.xml)"
  exit 2
fi
echo "sanitizer processes: $shards per share, $shares shares ($(nproc) cores, $gpu_gib GiB)"
sanitizer_threads=$(threads_each $((shards * shares)))
# DeepGEMM compiles its kernels at first use: once here, not in every sanitized shard at once
[ $real_deepgemm = 1 ] && timeout 240 "${pytest[@]}" -m "gpu and not large" \
  tests/test_logits_backends.py tests/test_trtllm_standin.py > "$out/deepgemm_warmup.log" 2>&1
# what the build left of a 10-minute call (CALL_LIMIT); `all` is two calls' work: 480 s
left=$(( ${CALL_LIMIT:-585} - SECONDS - 45 )); [ "$step" = all ] && left=480
limit=${SANITIZER_LIMIT:-$left}
[ "$limit" -ge 60 ] || { echo "sanitizer limit ${limit} s: CALL_LIMIT leaves too little"; exit 2; }
echo "sanitizer limit: $limit s"
start=$SECONDS end=$((SECONDS + limit)) cap=$(memory_cap $((shards * shares)))
echo "GPU memory a process may hold before its next test: $cap GiB"
read -ra opts <<< "$only_spin"
shard_dir="$out/shards"; rm -rf "$shard_dir"; mkdir -p "$shard_dir"   # packed at the end
queue_dir=$(mktemp -d)   # a fresh queue per run: a test claimed in an earlier run would be skipped
trap 'rm -rf "$queue_dir"' EXIT
for tool in "${tools[@]}"; do
  n=$shards marks="gpu and not large and not own_profiler"
  if [ "$tool" = initcheck ] || [ "$tool" = racecheck ]; then
    marks="$marks and not slow_schedule"
    [ "$tool" = initcheck ] && marks="$marks and not no_initcheck"
  else
    marks="$marks and not brief_schedule"
  fi
  [ "$tool" = racecheck ] && n=$((2 * shards)) &&   # about half memcheck's speed on these tests
    marks="$marks and not no_racecheck and not racecheck_slow"
  order=tests/gpu/sanitizer_order/$tool.times
  [ -f "$order" ] || order=tests/gpu/sanitizer_order/racecheck.times
  # initcheck instruments every kernel (above); its suppressions: graph launches' memcpy sources
  # Device backtraces only: a saved host backtrace keeps the launching Python frames alive
  # (sanitizer_frames_repro.py: 400 frames, 1.67 GiB after 200 calls of the model's rope
  # under memcheck; none with `device`). initcheck keeps both: its suppressions match host
  # frames (with device frames alone, 62 reports of graph-launch copies in the engine-loop
  # tests; H100, 2026-12-07), and its brief schedules stay under the memory cap.
  tool_opts=("${opts[@]}" --show-backtrace device)
  [ "$tool" = initcheck ] && tool_opts=(--suppressions tests/gpu/initcheck_suppressions.xml
    --show-backtrace yes)
  for ((i = 0; i < n; i++)); do
    (
      # no launch timeout: a dozen processes starting at once take longer than its 10 s
      OMP_NUM_THREADS=$sanitizer_threads \
        SPIN_TEST_QUEUE="$queue_dir/$tool" SPIN_TEST_ORDER="${SANITIZER_ORDER-$order}" \
        SPIN_TEST_TIMES="$shard_dir/${tool}_$i.times" \
        run_queue "$end" "$shard_dir/${tool}_$i.log" "$cap" compute-sanitizer --tool "$tool" \
        --launch-timeout 0 --target-processes application-only --error-exitcode 9 \
        --print-limit 20 "${tool_opts[@]}" \
        "${pytest[@]}" -m "$marks" ${SANITIZE_PATHS:-tests/}
      echo "$tool shard $i/$n: rc=$? (9: errors found, 124: over ${limit}s)" \
        >> "$shard_dir/${tool}_$i.log"
    ) &
  done
done
wait
# Each report's first line (an access, race, barrier or API error: "========= " then a word, not
# the banner, a summary or the tool's own status), anywhere in a line (pytest's progress dots
# may come first): counted in every shard's log, those cut off at the limit too (they never
# print a summary). Nine '=' exactly: pytest's own "===== ... =====" lines are longer.
not_reports='COMPUTE-SANITIZER|(ERROR|RACECHECK|LEAK) SUMMARY|Target application'
not_reports+="|Error: (process didn.t terminate|couldn.t find exit code)"
reports() {
  grep -ohE '(^|[^=])========= [^ =].*' "$@" | sed -E 's/^[^=]//' |
    grep -vE "^========= ($not_reports)"
}
for tool in "${tools[@]}"; do
  for log in "$shard_dir/${tool}"_*.log; do
    echo "== $(basename "$log"): $(grep -E "passed|failed" "$log" | tail -1) | $(tail -1 "$log")"
  done
  grep -hE "(ERROR|RACECHECK) SUMMARY" "$shard_dir/${tool}"_*.log | sed 's/^=* *//' | sort | uniq -c
  echo "$tool: $(reports "$shard_dir/${tool}"_*.log | wc -l) reports in all shards' logs;" \
    "$(cat "$shard_dir/${tool}"_*.times 2>/dev/null | grep -vc " skipped ") tests ran;" \
    "$(restarts "$shard_dir/${tool}"_*.log) restarts; slowest:"
  reports "$shard_dir/${tool}"_*.log | sed -E 's/ (at|to) 0x[0-9a-f]+//g' | sort | uniq -c | head -5
  cat "$shard_dir/${tool}"_*.times 2>/dev/null | grep -v " skipped " | sort -rn | head -15
  if [ -n "${KERNEL_LOG:-}" ]; then
    python3 tests/gpu/kernel_coverage.py "$KERNEL_LOG" spin_trtllm/libspin_native.so \
      --ran "$shard_dir/${tool}"_*.times > "$out/coverage_$tool.txt" 2>&1
    echo "$tool coverage: $(tail -1 "$out/coverage_$tool.txt")"
    grep -E "NEVER LAUNCHED|STALE KERNEL LOG" "$out/coverage_$tool.txt"
  fi
done 2>&1 | tee "$out/summary.txt"
echo "sanitizers: $((SECONDS - start)) s" | tee -a "$out/summary.txt"
tar -czf "$out/shards.tar.gz" -C "$out" shards && rm -rf "$shard_dir"
