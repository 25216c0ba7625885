"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/params.py (file version 09d521c5).

Mirrored: SparseParams, SparseMetadataParams, SparseBackendForwardArgs (topk_indices),
SparseRuntimeParams (sparse_attn_indices, sparse_attn_kv_lens, ...). Simplified: the C++
schema annotations are dropped; block-sparse routing payloads are omitted.
"""
from dataclasses import dataclass
from typing import Optional

import torch


class SparseParams:
    algorithm: str


class SparseMetadataParams:
    pass


@dataclass(kw_only=True)
class SparseBackendForwardArgs:
    topk_indices: Optional[torch.Tensor] = None


@dataclass(kw_only=True)
class SparseRuntimeParams:
    sparse_attn_indices: Optional[torch.Tensor] = None
    sparse_attn_offsets: Optional[torch.Tensor] = None
    sparse_attn_kv_lens: Optional[torch.Tensor] = None
