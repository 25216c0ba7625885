"""Upstream: tensorrt_llm/_utils.py (not read; the names come from the imports in dsa/indexer.py
@0b228a79 and dsa/metadata.py @186080bb).
Stand-in for tensorrt_llm/_utils.py: only the helpers the sparse-attention path imports.

Simplified: `get_sm_version()` returns 0 on the CPU, so every SM-gated fast path (SM90
expanded MTP buffers, SM100 CuTe DSL / GVR engines) stays off unless a test monkeypatches it;
with the stand-in's device set to a GPU it returns that GPU's.
Stand-in only: `standin_device()`, where the metadata's device buffers (upstream's *_cuda
tensors) and the indexer K cache live: the CPU, or TRTLLM_STANDIN_DEVICE (e.g. cuda).
"""
import os

import torch


def standin_device() -> torch.device:
    return torch.device(os.environ.get("TRTLLM_STANDIN_DEVICE", "cpu"))


def get_sm_version() -> int:
    device = standin_device()
    if device.type == "cuda":                  # the stand-in on a GPU: the GPU's own
        major, minor = torch.cuda.get_device_capability(device)
        return major * 10 + minor
    return 0


def is_sm_100f() -> bool:
    return get_sm_version() in (100, 103)


def prefer_pinned() -> bool:
    return False


def maybe_pin_memory(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
