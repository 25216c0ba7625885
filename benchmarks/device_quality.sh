#!/usr/bin/env bash
# Issue 17 item 6 for one checkpoint (e.g. one trained at a length that covers the prompts:
# `bash benchmarks/device_train.sh --seq-len 8704 --batch 4`): in the engine, bits per byte
# and miss of SPIN, the probe and the hybrid at rho 0.3/0.5/0.7 on 4 held-out windows; then
# SPIN trace v2 of held-out windows 0..3, the predictor replays at equal effective sparsity
# and quality_bounds at 50% (QUALITY.md).
# Results under ${OUT:-/tmp/spin-quality}; DEVICE=cpu runs it without a GPU (slow).
# PREDICTORS (default "spin probe hybrid"; also gauss), PAGE_SLOTS
# (64, or 32: V4's tokens_per_block 128) and LOGITS (the engine's logits backend; default
# native, reference where the pages are 32 slots: neither the native kernel nor DeepGEMM's
# SM90 kernel reads them) choose the engine rows.
#   bash benchmarks/device_quality.sh CHECKPOINT [PROMPT_BYTES (8192)] [STEPS (256)]
set -uo pipefail
cd "$(dirname "$0")/.."
ckpt=${1:?usage: device_quality.sh CHECKPOINT [PROMPT_BYTES] [STEPS]}
prompt=${2:-8192}
steps=${3:-256}
device=${DEVICE:-cuda}
out=${OUT:-/tmp/spin-quality}; mkdir -p "$out"
[ -f "$ckpt" ] || { echo "device_quality.sh: no checkpoint at $ckpt" >&2; exit 2; }
if [ "$device" != cpu ]; then
  export SPIN_REQUIRE_NATIVE=1
  source tests/gpu/device_env.sh
  build_native "$out/build.log"
fi
t0=$SECONDS
page_slots=${PAGE_SLOTS:-64}
logits=${LOGITS:-$([ "$page_slots" = 64 ] && echo native || echo reference)}
read -ra predictors <<< "${PREDICTORS:-spin probe hybrid}"
python3 benchmarks/quality.py --out "$out/engine" --checkpoint "$ckpt" --device "$device" \
  --prompts 4 --mtp-prompts 0 --prompt-tokens "$prompt" --steps "$steps" \
  --sparsity 0.3 0.5 0.7 --predictor "${predictors[@]}" --page-slots "$page_slots" \
  --logits-backend "$logits" --bpb-only 2>&1 | tee "$out/engine.log" | tail -n 16
echo "engine rows: $((SECONDS - t0)) s"
for i in 0 1 2 3; do  # side by side on a GPU, one after another on the CPU
  python3 -m spin_trtllm.cli trace "$out/held$i.safetensors" --checkpoint "$ckpt" --held-out "$i" \
    --prompt-tokens "$prompt" --steps "$steps" --device "$device" --quiet > "$out/trace$i.log" 2>&1 &
  [ "$device" = cpu ] && wait
done
wait
tail -qn 1 "$out"/trace?.log
echo "traces: $((SECONDS - t0)) s"
python3 benchmarks/quality_predictors.py "$out"/held?.safetensors --jobs "$(nproc)" --json "$out/predictors.json" \
  --markdown "$out/predictors.md" 2>&1 | tail -n 3
cat "$out/predictors.md" 2>/dev/null
# what ranking by exact block statistics of the true scores would miss at 50% (the bound)
python3 benchmarks/quality_bounds.py "$out"/held?.safetensors --sparsity 0.5 \
  --json "$out/bounds_0.5.json" 2>&1 | tail -n 8
echo "done: $((SECONDS - t0)) s"
