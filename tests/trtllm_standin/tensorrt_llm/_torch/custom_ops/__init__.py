"""Stand-in for tensorrt_llm/_torch/custom_ops/: registers CPU `torch.ops.trtllm` ops."""
from . import torch_custom_ops  # noqa: F401
