"""spin-trtllm: SPIN (Shadow Predictive Indexer) for TensorRT-LLM's DSA indexer."""

from .config import SpinConfig
from .errors import SpinConfigError, SpinError, TraceError

__version__ = "0.1.0"
__all__ = ["SpinConfig", "SpinError", "SpinConfigError", "TraceError", "__version__"]
