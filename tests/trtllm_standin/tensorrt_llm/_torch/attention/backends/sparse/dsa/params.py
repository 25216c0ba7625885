"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/dsa/params.py (version 4b1c788d).

Mirrored as upstream: use_self_sampling_gvr(), DSABackendForwardArgs, DSAMetadataParams,
DSAParams (frozen dataclasses; a field added later must go through object.__setattr__).
"""
from dataclasses import dataclass, field
from typing import List, Literal, Optional

import torch

from ..params import SparseBackendForwardArgs, SparseMetadataParams, SparseParams


def use_self_sampling_gvr(*, enable_heuristic_topk: bool, use_self_sampling_topk: bool,
                          index_topk, compress_ratio: int, is_cute_dsl_available: bool,
                          sm_version: int) -> bool:
    return (enable_heuristic_topk and use_self_sampling_topk and is_cute_dsl_available
            and sm_version in (100, 103) and index_topk in (512, 1024, 2048)
            and compress_ratio in (1, 4))


@dataclass(kw_only=True)
class DSABackendForwardArgs(SparseBackendForwardArgs):
    indexer_intermediates: Optional[List[torch.Tensor]] = None


@dataclass(frozen=True)
class DSAMetadataParams(SparseMetadataParams):
    indexer_max_chunk_size: int
    max_sparse_topk: Optional[int]
    index_head_dim: int
    enable_indexer_skip: bool
    enable_heuristic_topk: bool
    use_cute_dsl_topk: bool
    use_cute_dsl_paged_mqa_logits: bool
    q_split_threshold: int
    has_shared_indexer_layers: bool = False
    mtp_index_share: bool = False
    use_self_sampling_topk: bool = True
    use_gvr_emission: bool = False
    use_gvr_prescore: bool = False


@dataclass(frozen=True)
class DSAParams(SparseParams):
    algorithm: Literal["dsa"] = field(init=False, default="dsa")
    index_n_heads: Optional[int] = None
    index_head_dim: Optional[int] = None
    index_topk: Optional[int] = None
    indexer_max_chunk_size: Optional[int] = None
    skip_indexer_for_short_seqs: bool = True
    use_cute_dsl_topk: bool = False
    use_cute_dsl_paged_mqa_logits: bool = False
    q_split_threshold: int = 8192
    indexer_rope_interleave: bool = False
    enable_heuristic_topk: bool = False
    use_self_sampling_topk: bool = True
    use_gvr_emission: bool = False
    use_gvr_prescore: bool = False
    indexer_k_dtype: Literal["fp8", "fp4"] = "fp8"
    is_full_indexer_layer: bool = True
    mtp_index_share: bool = False

    @property
    def indices_block_size(self) -> int:
        return 1
