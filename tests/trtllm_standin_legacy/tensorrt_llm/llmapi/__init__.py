"""Stand-in for tensorrt_llm/llmapi (release 1.2)."""
from .llm_args import BaseLlmArgs, DeepSeekSparseAttentionConfig, TorchLlmArgs

__all__ = ["BaseLlmArgs", "DeepSeekSparseAttentionConfig", "TorchLlmArgs"]
