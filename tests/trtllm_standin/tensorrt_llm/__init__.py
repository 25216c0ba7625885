"""Stand-in for tensorrt_llm/__init__.py (NVIDIA/TensorRT-LLM main, read 2026-12 through the
search index; see .notes/trtllm_contracts.md for the per-file commits).

Simplified: importing it registers CPU implementations of the `torch.ops.trtllm` ops that the
DSA / DeepSeek-V4 decode path calls (upstream loads them from its C++ library), and exposes
`__version__` and `deep_gemm`. Nothing else of upstream's top-level API is provided.
"""
from . import deep_gemm  # noqa: F401  (upstream: tensorrt_llm.deep_gemm, vendored DeepGEMM)
from ._torch import custom_ops  # noqa: F401  (registers torch.ops.trtllm.*)
from .version import __version__

__all__ = ["__version__", "deep_gemm"]
