#!/usr/bin/env bash
# On a CUDA machine: build the native library and DeepGEMM (third_party/deepgemm.tar.gz, made
# by tests/gpu/pack_deepgemm.sh; carry it), run the GPU tests of the compacted-table path
# (spin.compact/remap, top-K row lengths, deepgemm backend == native on random inputs and on
# dsa-lite), then benchmarks/bench_deepgemm_path.py with the given flags; with
# third_party/flashinfer_topk.tar.gz carried, flashinfer's top-K is timed beside spin's for the
# dense rows (tests/gpu/flashinfer_env.sh). Logs in $OUT.
#   bash benchmarks/device_deepgemm.sh [bench_deepgemm_path.py flags]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/spin-dg}; mkdir -p "$out"
export SPIN_REQUIRE_NATIVE=1
source tests/gpu/device_env.sh
source tests/gpu/deepgemm_env.sh
# the two builds are independent: DeepGEMM's single g++ compile runs beside ours
( build_deepgemm "$out/deepgemm_build.log" ) & dg_pid=$!
t0=$(date +%s)
build_native "$out/build.log"
wait $dg_pid || { echo "DeepGEMM build failed"; exit 1; }
export PYTHONPATH="$DG_SRC:$PYTHONPATH"
if [ -f third_party/flashinfer_topk.tar.gz ]; then
  source tests/gpu/flashinfer_env.sh
  setup_flashinfer "$out/flashinfer_setup.log" && export PYTHONPATH="$FI_ENV/site:$PYTHONPATH"
fi
echo "builds: $(( $(date +%s) - t0 )) s"
python3 -m pytest -q -p no:cacheprovider tests/test_ops_compact.py tests/test_logits_backends.py \
  -m gpu 2>&1 | tee "$out/pytest_dg.log" | tail -4
python3 -m pytest -q -p no:cacheprovider tests/test_ops_topk.py -m gpu 2>&1 \
  | tee "$out/pytest_topk.log" | tail -2
python3 benchmarks/bench_deepgemm_path.py --json "$out/bench_dg.json" --markdown "$out/bench_dg.md" \
  "$@" > "$out/bench_dg.log" 2>&1
rc=$?
tail -n 30 "$out/bench_dg.log"
exit $rc
