#!/usr/bin/env bash
# Every test marked `gpu`, on a CUDA machine: builds the native library and DeepGEMM (for the
# TensorRT-LLM stand-in's engine loop) side by side, then `pytest -m gpu tests/`. The sanitizer
# runs live in device_check.sh and engine_loop.sh. Logs go to ${OUT:-/tmp/spin-gpu}.
#   bash tests/gpu/all_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/spin-gpu}; mkdir -p "$out"
export SPIN_REQUIRE_NATIVE=1 TRTLLM_STANDIN_DEVICE=cuda TRTLLM_STANDIN_DEEPGEMM=real
source tests/gpu/device_env.sh
source tests/gpu/deepgemm_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
build_deepgemm "$out/deepgemm_build.log" & dg=$!
build_native "$out/build.log"
wait $dg || { echo "DeepGEMM build failed"; exit 1; }
export PYTHONPATH="$DG_SRC:$PYTHONPATH"
python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/ 2>&1 | tee "$out/all_gpu.log" | tail -25
