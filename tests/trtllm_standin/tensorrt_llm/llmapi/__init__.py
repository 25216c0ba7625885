"""Stand-in for tensorrt_llm/llmapi/__init__.py (the names the tests and integrations use)."""
from .llm_args import (BaseLlmArgs, CudaGraphConfig, DeepSeekSparseAttentionConfig,
                       DeepSeekV4SparseAttentionConfig, KvCacheConfig, LlmArgs, MTPDecodingConfig,
                       TorchLlmArgs)

__all__ = ["BaseLlmArgs", "CudaGraphConfig", "DeepSeekSparseAttentionConfig",
           "DeepSeekV4SparseAttentionConfig", "KvCacheConfig", "LlmArgs", "MTPDecodingConfig",
           "TorchLlmArgs"]
