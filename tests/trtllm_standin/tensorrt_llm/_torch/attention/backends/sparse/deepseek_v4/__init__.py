"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/deepseek_v4/__init__.py."""
from .backend import DeepseekV4TrtllmAttention
from .cache_manager import DeepseekV4CacheManager
from .compressor import Compressor
from .indexer import DeepseekV4Indexer
from .metadata import DeepseekV4TrtllmAttentionMetadata
from .params import DeepseekV4AttentionType, DeepSeekV4MetadataParams, DeepSeekV4Params

__all__ = ["Compressor", "DeepSeekV4MetadataParams", "DeepSeekV4Params", "DeepseekV4AttentionType",
           "DeepseekV4CacheManager", "DeepseekV4Indexer", "DeepseekV4TrtllmAttention",
           "DeepseekV4TrtllmAttentionMetadata"]
