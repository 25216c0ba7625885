#!/usr/bin/env bash
# Build and install spin-trtllm for the torch that is installed.
# Today the package is pure Python: every op runs through the reference implementation
# (spin_trtllm.reference). The native CUDA library (cpp/) and the TensorRT plugins
# (plugins/) are built here once they exist; see cpp/README.md and plugins/README.md.
#   ./build.sh          install (editable) with the test extras
#   ./build.sh test     install, then run the test suite
set -euo pipefail
cd "$(dirname "$0")"
python -c "import torch" 2>/dev/null || {
  echo "build.sh: torch is not installed; install it first (CPU: pip install torch==2.13.0)" >&2
  exit 1
}
pip install -e ".[test]"
echo "build.sh: pure-Python build (no native library yet); ops run through the reference"
if [ "${1:-}" = "test" ]; then
  python -m pytest -q
fi
