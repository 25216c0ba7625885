"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/csa2/ (DeepSeek-V4.1)."""
from .module import DeepseekV41Attention
from .params import CSA2Layout, CSA2Params

__all__ = ["CSA2Layout", "CSA2Params", "DeepseekV41Attention"]
