"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/dsa/__init__.py."""
from .backend import DSATrtllmAttention
from .cache_manager import DSACacheManager
from .indexer import Indexer
from .metadata import DSAtrtllmAttentionMetadata
from .params import DSAMetadataParams, DSAParams

__all__ = ["DSACacheManager", "DSAMetadataParams", "DSAParams", "DSATrtllmAttention",
           "DSAtrtllmAttentionMetadata", "Indexer"]
