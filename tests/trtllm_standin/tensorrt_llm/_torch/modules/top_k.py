"""Stand-in for tensorrt_llm/_torch/modules/top_k.py.

Mirrored: TopKImplementation, TopK(top_k, *, prefill_implementation, decode_implementation,
compress_ratio, gvr_self_sampling), needs_gvr_prior, forward(scores, output_indices, *,
is_prefill, row_starts, row_ends, sequence_lengths, scan_lengths, next_n, max_seq_len,
gvr_ext_kwargs, radix_aux_indices, radix_aux_logits) dispatching to
torch.ops.trtllm.indexer_topk_prefill / indexer_topk_decode / cute_dsl_gvr_topk_decode, and
update_gvr_prior_from_prefill.

Version skew: the stored top_k.py (099929cb) is older than the indexer that calls it (it
lacks gvr_self_sampling and radix_aux_*); this stand-in takes the caller's arguments
(dsa/indexer.py @0b228a79). The CuTe DSL radix / self-sampling engines, emission and
prescore are not modelled (they never engage without SM100).
"""
from __future__ import annotations

from enum import Enum

import torch
import torch.nn as nn


class TopKImplementation(str, Enum):
    TORCH = "torch"
    CUDA_RADIX = "cuda_radix"
    CUTE_DSL_RADIX = "cute_dsl_radix"
    CUDA_GVR = "cuda_gvr"
    CUTE_DSL_GVR = "cute_dsl_gvr"
    CUTE_DSL_GVR_V2 = "cute_dsl_gvr_v2"


_GVR = {TopKImplementation.CUDA_GVR, TopKImplementation.CUTE_DSL_GVR,
        TopKImplementation.CUTE_DSL_GVR_V2}
_TEMPORAL_GVR = {TopKImplementation.CUDA_GVR, TopKImplementation.CUTE_DSL_GVR}


class TopK(nn.Module):
    def __init__(self, top_k: int, *, prefill_implementation=None, decode_implementation=None,
                 compress_ratio: int = 1, gvr_self_sampling: bool = False) -> None:
        super().__init__()
        self.top_k = top_k
        self.prefill_implementation = TopKImplementation(
            prefill_implementation or TopKImplementation.CUDA_RADIX)
        self.decode_implementation = TopKImplementation(
            decode_implementation or TopKImplementation.CUDA_RADIX)
        self.compress_ratio = compress_ratio
        self.gvr_self_sampling = gvr_self_sampling

    @property
    def needs_gvr_prior(self) -> bool:
        return self.decode_implementation in _TEMPORAL_GVR

    def forward(self, scores, output_indices, *, is_prefill: bool, row_starts=None,
                row_ends=None, sequence_lengths=None, scan_lengths=None, next_n: int = 1,
                max_seq_len=None, gvr_ext_kwargs=None, radix_aux_indices=None,
                radix_aux_logits=None):
        if is_prefill:
            assert row_starts is not None and row_ends is not None
            torch.ops.trtllm.indexer_topk_prefill(scores, row_starts, row_ends, output_indices,
                                                  self.top_k)
            return output_indices
        assert sequence_lengths is not None and scan_lengths is not None
        if self.decode_implementation in _GVR and gvr_ext_kwargs is not None:
            prior = gvr_ext_kwargs.get("gvr_prior_indices")
            assert prior is not None
            torch.ops.trtllm.cute_dsl_gvr_topk_decode(
                scores, prior, sequence_lengths, output_indices, self.top_k, next_n=next_n,
                compress_ratio=self.compress_ratio, max_seq_len=int(max_seq_len or 0),
                order_row=gvr_ext_kwargs.get("gvr_row_order"))
            return output_indices
        torch.ops.trtllm.indexer_topk_decode(
            scores, sequence_lengths, output_indices, next_n, self.top_k, pre_idx=None,
            heuristic_scratch=None, compress_ratio=self.compress_ratio,
            radix_aux_indices=radix_aux_indices, radix_aux_logits=radix_aux_logits)
        return output_indices

    def update_gvr_prior_from_prefill(self, prefill_topk, seq_lens, gvr_prior_indices,
                                      request_offset: int = 0) -> None:
        """Seed each context request's prior with its last prefill row."""
        if gvr_prior_indices is None or prefill_topk.shape[0] == 0:
            return
        last = torch.cumsum(seq_lens.long(), 0) - 1
        rows = prefill_topk[last]
        gvr_prior_indices[request_offset:request_offset + rows.shape[0]].copy_(rows)

    def reset_gvr_emission_rows(self, rows) -> None:
        pass
