"""Upstream: tensorrt_llm/_utils.py (not read; the names come from the imports in dsa/indexer.py
@0b228a79 and dsa/metadata.py @186080bb).
Stand-in for tensorrt_llm/_utils.py: only the helpers the sparse-attention path imports.

Simplified: `get_sm_version()` returns 0 (no GPU), so every SM-gated fast path (SM90 expanded
MTP buffers, SM100 CuTe DSL / GVR engines) stays off unless a test monkeypatches it.
"""
import torch


def get_sm_version() -> int:
    return 0


def is_sm_100f() -> bool:
    return get_sm_version() in (100, 103)


def prefer_pinned() -> bool:
    return False


def maybe_pin_memory(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
