"""`import spin_trtllm.trtllm` enables SPIN in TensorRT-LLM's PyTorch backend (idempotent).

Same as `import spin_trtllm.integrations.trtllm.patch`; raises ImportError with one clear line
when tensorrt_llm is not installed, SpinError on an unsupported TensorRT-LLM version.
"""

from .integrations.trtllm.patch import SpinBlock, activate  # noqa: F401  (activates on import)

__all__ = ["activate", "SpinBlock"]
