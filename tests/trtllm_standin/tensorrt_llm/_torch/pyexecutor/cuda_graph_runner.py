"""Upstream: tensorrt_llm/_torch/pyexecutor/cuda_graph_runner.py (the newest stored version, read
by id 57911617740 in the GitHub index, newer than 7b437aaa; no commit shown).
Stand-in for tensorrt_llm/_torch/pyexecutor/cuda_graph_runner.py.

Mirrored:
- CUDA_GRAPH_DUMMY_REQUEST_ID = 2^64 - 1, the padding request of a graph batch;
- CUDAGraphRunner.capture(key, capture_forward_fn, attn_metadata): WARMUP_STEPS (1) eager runs
  of the forward, kv_lens_cuda saved before and restored after each (then
  on_update_kv_lens(), as _restore_spec_decode_capture_state does), then one capture under
  torch.cuda.graph(graph, pool=memory_pool) (the first graph's pool shared by later ones),
  then a replay that produces the step's outputs; replay(key, attn_metadata): only
  graph.replay() (no Python of the forward runs), with the metadata object the graph was
  captured with.
Simplified: no piecewise graphs, multi-stream or padding policy; keys are chosen by the caller.
On a machine without CUDA (the stand-in's CPU runs), capture runs the forward once more under
the caller's `capture_context` (tests use it to refuse host reads of device tensors) and replay
runs the forward again: a CPU run checks call order, not replay.

UNVERIFIED here: the dummy request's kv length and block offsets; the stand-in gives it
`1 + max_draft_tokens` tokens on one page (`padding_dummy_request`).
"""
import contextlib

import torch

CUDA_GRAPH_DUMMY_REQUEST_ID = (1 << 64) - 1
WARMUP_STEPS = 1


def padding_dummy_request(kv_cache_manager, max_draft_tokens: int = 0) -> int:
    """Stand-in helper: make sure the padding request exists; returns its id."""
    if not kv_cache_manager.has_request(CUDA_GRAPH_DUMMY_REQUEST_ID):
        kv_cache_manager.add_dummy_requests([CUDA_GRAPH_DUMMY_REQUEST_ID],
                                            token_nums=[1 + max_draft_tokens], is_gen=True)
    return CUDA_GRAPH_DUMMY_REQUEST_ID


class CUDAGraphRunner:
    def __init__(self, enabled: bool = True, capture_context=None):
        self.enabled = enabled
        self.graphs: dict = {}
        self.graph_metadata: dict = {}
        self.graph_outputs: dict = {}
        self.memory_pool = None
        self.capture_context = capture_context or contextlib.nullcontext

    def needs_capture(self, key) -> bool:
        return key not in self.graphs

    def _restore(self, attn_metadata, saved: torch.Tensor) -> None:
        attn_metadata.kv_lens_cuda.copy_(saved)
        attn_metadata.on_update_kv_lens()

    def capture(self, key, capture_forward_fn, attn_metadata):
        saved = attn_metadata.kv_lens_cuda.clone()
        for _ in range(WARMUP_STEPS):
            capture_forward_fn()
            self._restore(attn_metadata, saved)
        cuda = attn_metadata.kv_lens_cuda.is_cuda
        if cuda:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.memory_pool):
                output = capture_forward_fn()
            if self.memory_pool is None:
                self.memory_pool = graph.pool()
        else:
            graph = capture_forward_fn
            with self.capture_context():
                output = capture_forward_fn()
        self._restore(attn_metadata, saved)
        self.graphs[key] = graph
        self.graph_metadata[key] = attn_metadata
        self.graph_outputs[key] = output
        return self.replay(key, attn_metadata)

    def replay(self, key, attn_metadata):
        assert self.graph_metadata[key] is attn_metadata, \
            "a graph replays with the metadata it was captured with"
        graph = self.graphs[key]
        if isinstance(graph, torch.cuda.CUDAGraph):
            graph.replay()
            return self.graph_outputs[key]
        return graph()
