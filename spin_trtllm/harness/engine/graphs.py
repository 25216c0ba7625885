"""The CUDA-graph capture cache of the decode step (select + model forward)."""

from __future__ import annotations

from typing import Callable, Hashable

import torch

Outputs = tuple[torch.Tensor, torch.Tensor]     # (logits, hidden) of the step's rows


class GraphCache:
    """One captured step per key (the engine's: batch size, SPIN or all-keep). A key's first
    step runs eagerly, then is captured for later steps; every graph shares one memory pool.
    The graphs hold the SPIN state's addresses, so a new state generation (the pool was
    reallocated) drops them all."""

    def __init__(self, generation: int = 0):
        self.entries: dict[Hashable, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.generation = generation
        self._pool = None

    def __len__(self) -> int:
        return len(self.entries)

    def invalidate(self, generation: int) -> None:
        """Drop every graph when the state generation changed since they were captured."""
        if generation != self.generation:
            self.entries.clear()
            self.generation = generation

    def run(self, key: Hashable, step: Callable[[], Outputs],
            sync: Callable[[], None]) -> Outputs:
        """Replay `key`'s graph; without one, run `step` (the real step), then capture it. The
        outputs of a replay are the graph's buffers: the next replay overwrites them."""
        if key in self.entries:
            graph, logits, hidden = self.entries[key]
            graph.replay()
            return logits, hidden
        out = step()
        sync()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits, hidden = step()
        self.entries[key] = (graph, logits, hidden)
        return out
