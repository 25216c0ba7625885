"""Upstream: tensorrt_llm/_torch/memory_buffer_utils.py (not read; named by modules/top_k.py
@099929cb).
Stand-in for tensorrt_llm/_torch/memory_buffer_utils.py: named, reusable buffers.

Upstream hands CUDA-graph metadata stable-address buffers; here `Buffers.get_buffer` returns
a view of one storage per name, grown when too small (so a captured-graph test can check
that per-step outputs such as the indexer's topk buffer keep their address).
"""
import math

import torch

from .._utils import standin_device


class Buffers:
    def __init__(self):
        self._storage: dict = {}

    def get_buffer(self, shape, dtype, buffer_name: str, reserve_buffer: bool = False):
        numel = math.prod(shape)
        key = (buffer_name, dtype)
        store = self._storage.get(key)
        if store is None or store.numel() < numel:
            store = torch.zeros(numel, dtype=dtype, device=standin_device())
            self._storage[key] = store
        return store[:numel].view(*shape)


_GLOBAL = Buffers()


def get_memory_buffers() -> Buffers:
    return _GLOBAL
