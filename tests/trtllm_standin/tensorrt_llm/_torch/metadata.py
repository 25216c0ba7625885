"""Upstream: tensorrt_llm/_torch/metadata.py (not read; fields from dsa/metadata.py @186080bb).
Stand-in for tensorrt_llm/_torch/metadata.py: KVCacheParams (fields the DSA path reads)."""
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class KVCacheParams:
    use_cache: bool = True
    num_cached_tokens_per_seq: List[int] = field(default_factory=list)
    block_ids_per_seq: Optional[List[list]] = None
    num_extra_kv_tokens: int = 0
