"""SPIN for TensorRT-LLM's PyTorch backend.

- `adapter`: SpinDecodeAdapter, TensorRT-LLM's decode metadata -> SpinIndexer (no tensorrt_llm
  needed; tested against dsa-lite);
- `config_ext`: the `spin:` field on TensorRT-LLM's sparse-attention configs;
- `bundle`: `spin-trtllm build` (LLM-API YAML + Triton model repository);
- `patch`: the activation itself (`import spin_trtllm.trtllm`), needs tensorrt_llm.
"""

from .adapter import DecodeBatch, SpinDecodeAdapter
from .bundle import BundleOptions, write_bundle

__all__ = ["DecodeBatch", "SpinDecodeAdapter", "BundleOptions", "write_bundle"]
