"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/csa2/params.py (af563dfc).

Mirrored names: CSA2Params(SparseParams) with algorithm == "csa2" (field(init=False)),
indices_block_size 1, layout, compute_backend; CSA2Layout. Only what shows that V4.1 lowers to
its own params type. The layout fields here are the ones named in shared/REFERENCE.md
(compress ratios, kv/index source layers, candidate prefilter); UNVERIFIED beyond that.
"""
from dataclasses import dataclass, field
from typing import List, Literal, Optional

from ..params import SparseParams


@dataclass(frozen=True)
class CSA2Layout:
    compress_ratios: List[int]
    kv_source_layer_ids: List[int] = field(default_factory=list)
    index_source_layer_ids: List[int] = field(default_factory=list)
    candidate_source_layer_id: Optional[int] = None
    candidate_block_size: int = 8
    candidate_topk_blocks: int = 2048


@dataclass(frozen=True)
class CSA2Params(SparseParams):
    algorithm: Literal["csa2"] = field(init=False, default="csa2")
    indices_block_size: int = field(init=False, default=1)
    layout: Optional[CSA2Layout] = None
    compute_backend: str = "auto"
