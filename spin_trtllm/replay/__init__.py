"""Trace format, synthetic traces, replay metrics, predictor comparison and plots."""

from .trace import SpinTrace

__all__ = ["SpinTrace"]
