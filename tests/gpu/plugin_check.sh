#!/usr/bin/env bash
# The TensorRT plugins on a CUDA machine: build the torch native library (torch.ops.spin on the
# kernels) and libspin_trtllm_plugins.so + plugin_harness, run the harness's checks, the GPU
# comparison of the plugins with torch.ops.spin (tests/gpu/test_tensorrt_plugins_gpu.py) and
# the CPU-side plugin/pass tests, then one case under compute-sanitizer. Logs go to
# ${OUT:-/tmp/spin-plugins}; a summary is printed at the end. Exit 0 when everything passed.
#   bash tests/gpu/plugin_check.sh
# TensorRT headers: third_party/TensorRT/include travels with the tree (carry it), or set
# TENSORRT_ROOT. Packages missing on the machine can come as wheels in .whl/.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/spin-plugins}; mkdir -p "$out"
cases=${SPIN_TRT_CASE_DIR:-/tmp/spin-plugin-cases}; rm -rf "$cases"; mkdir -p "$cases"
build=build/tensorrt
export SPIN_REQUIRE_NATIVE=1
source tests/gpu/device_env.sh
export SPIN_TRT_PLUGIN_DIR="$PWD/$build" SPIN_TRT_CASE_DIR="$cases"

summary=()
failed=0
note() { summary+=("$1"); }
# run NAME CMD...: output to $out/NAME.log; records "NAME: ok|FAILED (rc)" and the log's last line
run() {
  local name=$1; shift
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local last; last=$(grep -v '^\s*$' "$out/$name.log" | tail -1)
  if [ $rc -eq 0 ]; then note "$name: ok | $last"; else note "$name: FAILED (rc $rc) | $last"; failed=1; fi
  return $rc
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/gpu.txt" 2>&1
note "gpu: $(head -1 "$out/gpu.txt")"
run native_build python3 -m spin_trtllm._build
run plugin_build bash plugins/tensorrt/build.sh --out "$build"
if ! [ -x "$build/plugin_harness" ] || grep -q "skipped" "$out/plugin_build.log"; then
  note "plugins not built: $(tail -1 "$out/plugin_build.log") (carry third_party/TensorRT/include or set TENSORRT_ROOT)"
  failed=1
else
  run harness_check "$build/plugin_harness" check "$build/libspin_trtllm_plugins.so"
  run pytest_plugins python3 -m pytest -q -p no:cacheprovider -rs tests/gpu/test_tensorrt_plugins_gpu.py \
    tests/test_tensorrt_plugins_build.py tests/test_tensorrt_pass.py
  grep -E "^(FAILED|ERROR|SKIPPED)" "$out/pytest_plugins.log" | head -20 > "$out/pytest_problems.txt"
  [ -s "$out/pytest_problems.txt" ] && note "pytest problems: see pytest_problems.txt ($(wc -l < "$out/pytest_problems.txt") lines)"
  case_dir=$(ls -d "$cases"/mtp2_union_0 2>/dev/null || ls -d "$cases"/* 2>/dev/null | head -1)
  if [ -n "$case_dir" ] && command -v compute-sanitizer >/dev/null 2>&1; then
    for tool in memcheck racecheck; do
      timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 \
        "$build/plugin_harness" run "$build/libspin_trtllm_plugins.so" "$case_dir" > "$out/$tool.log" 2>&1
      rc=$?
      if grep -q "Device not supported" "$out/$tool.log"; then
        note "$tool: unavailable on this machine (compute-sanitizer: Device not supported)"
      elif [ $rc -eq 0 ]; then
        note "$tool: ok | $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$tool.log" | tail -1) ($(basename "$case_dir"))"
      else
        note "$tool: FAILED (rc $rc) | $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/$tool.log" | tail -1)"
        failed=1
      fi
    done
  else
    note "sanitizer: skipped (no case directory or no compute-sanitizer)"
  fi
fi

echo "==== plugin_check summary (logs in $out) ===="
printf '%s\n' "${summary[@]}"
[ $failed -eq 0 ] && echo "plugin_check: PASSED" || echo "plugin_check: FAILED"
exit $failed
