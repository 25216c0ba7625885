"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/deepseek_v4/params.py.

Mirrored names: DeepSeekV4Params (DSAParams + compress_ratios, window_size),
DeepSeekV4MetadataParams (DSAMetadataParams + compress_ratios, window_size,
enable_kv_cache_offload), DeepseekV4AttentionType, DEEPSEEK_V4_SPARSE_RATIO (4),
DEEPSEEK_V4_SLIDING_ATTENTION, is_compress_layer(). The params file itself (50aec1cb) was not
read; its field list is inferred from to_sparse_params() in llm_args.py (UNVERIFIED).
"""
import enum
from dataclasses import dataclass, field
from typing import List, Literal

from ..dsa.params import DSAMetadataParams, DSAParams

DEEPSEEK_V4_SPARSE_RATIO = 4


class DeepseekV4AttentionType(enum.IntEnum):
    SWA = 0
    COMPRESS = 1
    COMPRESSOR_KV = 2
    COMPRESSOR_SCORE = 3
    INDEXER_COMPRESS = 4
    INDEXER_COMPRESSOR_KV = 5
    INDEXER_COMPRESSOR_SCORE = 6


DEEPSEEK_V4_SLIDING_ATTENTION = (DeepseekV4AttentionType.SWA,)


def is_compress_layer(compress_ratio: int) -> bool:
    return compress_ratio > 1


@dataclass(frozen=True)
class DeepSeekV4Params(DSAParams):
    algorithm: Literal["deepseek_v4"] = field(init=False, default="deepseek_v4")
    compress_ratios: List[int] = field(default_factory=list)
    window_size: int = 128


@dataclass(frozen=True)
class DeepSeekV4MetadataParams(DSAMetadataParams):
    compress_ratios: List[int] = field(default_factory=lambda: [1])
    window_size: int = 128
    enable_kv_cache_offload: bool = False
