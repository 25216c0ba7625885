"""spin-trtllm: SPIN (Shadow Predictive Indexer) for TensorRT-LLM's DSA indexer."""

from .errors import SpinConfigError, SpinError, TraceError

__version__ = "0.1.0"
__all__ = ["SpinConfig", "SpinError", "SpinConfigError", "TraceError", "__version__"]


def __getattr__(name: str):
    # SpinConfig on first use: `import spin_trtllm.cli` stays light (pydantic loads inside the
    # CLI's main, where Ctrl-C is handled)
    if name == "SpinConfig":
        from .config import SpinConfig

        return SpinConfig
    raise AttributeError(f"module 'spin_trtllm' has no attribute {name!r}")
