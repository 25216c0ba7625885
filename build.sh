#!/usr/bin/env bash
# Build and install spin-trtllm for the torch that is installed.
#   ./build.sh          install (editable, with test extras) and build the native library:
#                       CUDA kernels when torch has CUDA and nvcc exists (sm_90a + sm_90;
#                       SPIN_CUDA_ARCHS="100 120" adds targets), otherwise a CPU-only package
#                       whose ops run through the reference. Where nvcc exists, every .cu file
#                       is also compiled for sm_90a as a check. Where nvcc and TensorRT headers
#                       exist (TENSORRT_ROOT or third_party/TensorRT/include) it also builds
#                       the TensorRT plugins.
#   ./build.sh test     the same, then run the test suite
set -euo pipefail
cd "$(dirname "$0")"
python -c "import torch" 2>/dev/null || {
  echo "build.sh: torch is not installed; install it first (CPU: pip install torch==2.13.0)" >&2
  exit 1
}
pip install -e ".[test]"
python -m spin_trtllm._build --check
python -m spin_trtllm._build
# TensorRT plugins (build/tensorrt/libspin_trtllm_plugins.so + plugin_harness) where nvcc and
# TensorRT headers exist; otherwise plugins/tensorrt/build.sh prints one line and returns 0
bash plugins/tensorrt/build.sh
if [ "${1:-}" = "test" ]; then
  python -m pytest -q
fi
