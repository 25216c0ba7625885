#!/usr/bin/env bash
# The engine-loop test on a GPU: the TensorRT-LLM stand-in's decoder runner, MTP worker and DSA
# metadata on CUDA (real CUDA-graph capture and replay) driving DeepGEMM's own kernels through
# SPIN, then the same loop under compute-sanitizer memcheck. Logs go to ${OUT:-/tmp/spin-gpu}.
#   bash tests/gpu/engine_loop.sh
# Needs third_party/deepgemm.tar.gz (DeepGEMM with its cutlass and fmt headers, made by
# pack_deepgemm.sh) and the wheels of .whl/ where the machine lacks pydantic.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/spin-gpu}; mkdir -p "$out"
export SPIN_REQUIRE_NATIVE=1 TRTLLM_STANDIN_DEVICE=cuda TRTLLM_STANDIN_DEEPGEMM=real
source tests/gpu/device_env.sh
source tests/gpu/deepgemm_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
build_native "$out/build.log"
build_deepgemm "$out/deepgemm_build.log" || exit 1
python3 -m pytest -q -p no:cacheprovider tests/test_trtllm_engine_loop.py 2>&1 \
  | tee "$out/engine_loop.log" | tail -15
[ "${1:-}" = "quick" ] && exit 0
timeout 420 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
  -p no:cacheprovider tests/test_trtllm_engine_loop.py \
  > "$out/engine_loop_memcheck.log" 2>&1; echo "memcheck rc=$?" | tee -a "$out/engine_loop_memcheck.log"
tail -4 "$out/engine_loop_memcheck.log"
