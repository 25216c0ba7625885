#!/usr/bin/env bash
# On a CUDA machine: build the native library, train the dsa-lite stdlib model and write its
# checkpoint + model card to ${OUT:-/tmp/spin-train}.   bash benchmarks/device_train.sh [--seconds S]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/spin-train}; mkdir -p "$out"
source tests/gpu/device_env.sh
build_native "$out/build.log"
python3 -m spin_trtllm.cli train-tiny --out "$out/dsa_lite_stdlib.safetensors" \
  --json "$out/train.json" "$@" 2>&1 | tee "$out/train.log" | tail -n 30
