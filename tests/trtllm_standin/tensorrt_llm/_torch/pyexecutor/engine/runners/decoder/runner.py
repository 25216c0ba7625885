"""Upstream: tensorrt_llm/_torch/pyexecutor/engine/runners/decoder/runner.py @0ea8c1de
(DecoderRunner; the decode step was moved there out of PyTorchModelEngine).
Stand-in for the part of DecoderRunner that drives the attention metadata in a decode step.

Mirrored, in upstream's order:
- the host prepares the step (attn_metadata.prepare(), outside any graph), then forward():
  a batch whose key has a captured graph replays it; a key seen for the first time is
  captured by CUDAGraphRunner.capture (warm-up run, capture, replay); other steps (context
  requests, graphs off) run _forward_step eagerly;
- _forward_step(): _preprocess_inputs(), then the model forward (model_forward: here a
  callable the caller passes, the indexer layers and the one-model speculative worker); this
  is the function CUDAGraphRunner.capture records;
- _preprocess_inputs(): attn_metadata.on_update_kv_lens() on every step ("invalidate
  per-forward-pass caches so they are recomputed (and captured)"), then, with speculative
  decoding and the overlap scheduler, kv_lens_cuda[num_ctx:num_seqs] +=
  previous_kv_lens_offsets_cuda (the previous step's new_tokens_lens - tokens_per_step: zero
  or negative, because the host prepared the step as if every draft was accepted) and
  on_update_kv_lens() again. Inside the graph: the additions are replayed every step;
- after warm-up and capture runs kv_lens_cuda is restored (CUDAGraphRunner, as upstream's
  _postprocess_inputs and _restore_spec_decode_capture_state do).
Simplified: no input ids / position ids buffers, LoRA, multimodal, pipeline parallel, helix;
one graph key per (generation requests, tokens per request); the caller fills
previous_kv_lens_offsets_cuda (a static device buffer) before each forward.
"""
from typing import Callable, Optional

import torch

from ....cuda_graph_runner import CUDAGraphRunner


class DecoderRunner:
    def __init__(self, model_forward: Callable, *, max_batch_size: int,
                 use_cuda_graph: bool = True, is_spec_decode: bool = False,
                 disable_overlap_scheduler: bool = False, capture_context=None,
                 device: Optional[torch.device] = None):
        self.model_forward = model_forward
        self.is_spec_decode = is_spec_decode
        self.disable_overlap_scheduler = disable_overlap_scheduler
        self.cuda_graph_runner = CUDAGraphRunner(use_cuda_graph, capture_context)
        # zero for requests without a previous step in flight
        self.previous_kv_lens_offsets_cuda = torch.zeros(max_batch_size, dtype=torch.int32,
                                                         device=device)

    def _preprocess_inputs(self, attn_metadata, spec_metadata) -> None:
        attn_metadata.on_update_kv_lens()
        if self.is_spec_decode and not self.disable_overlap_scheduler:
            nc, ns = attn_metadata.num_contexts, attn_metadata.num_seqs
            attn_metadata.kv_lens_cuda[nc:ns] += self.previous_kv_lens_offsets_cuda[:ns - nc]
            attn_metadata.on_update_kv_lens()

    def _forward_step(self, inputs, attn_metadata, spec_metadata):
        self._preprocess_inputs(attn_metadata, spec_metadata)
        return self.model_forward(inputs, attn_metadata, spec_metadata)

    def forward(self, inputs, attn_metadata, spec_metadata=None):
        """One step after attn_metadata.prepare(); the graph key is the generation batch."""
        graphs = self.cuda_graph_runner
        if not graphs.enabled or attn_metadata.num_contexts > 0:
            return self._forward_step(inputs, attn_metadata, spec_metadata)
        key = (attn_metadata.num_generations,
               attn_metadata.num_tokens // max(attn_metadata.num_generations, 1))
        if graphs.needs_capture(key):
            return graphs.capture(
                key, lambda: self._forward_step(inputs, attn_metadata, spec_metadata),
                attn_metadata)
        return graphs.replay(key, attn_metadata)
