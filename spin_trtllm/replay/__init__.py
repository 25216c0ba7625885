"""Trace format, synthetic traces, replay metrics, predictor comparison and plots."""

__all__ = ["SpinTrace"]


def __getattr__(name: str):
    # SpinTrace on first use: importing a light submodule (synth_config, for the CLI's parser)
    # must not import torch
    if name == "SpinTrace":
        from .trace import SpinTrace

        return SpinTrace
    raise AttributeError(f"module 'spin_trtllm.replay' has no attribute {name!r}")
