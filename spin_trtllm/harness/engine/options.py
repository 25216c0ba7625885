"""The choices an Engine is built with (EngineOptions), checked once, and --device."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch

from ... import costs
from ... import logits as logits_backends
from ...config import SpinConfig
from ...errors import SpinError
from ...limits import BLOCK_SLOTS
from ...options import IndexerOptions

# (request id, context + pending token, depth) -> depth draft tokens, or None: the MTP head's
Drafter = Callable[[int, list[int], int], Optional[list[int]]]


def resolve_device(name: str) -> torch.device:
    """--device: "auto" (CUDA when present), "cpu", "cuda[:i]"; a clear error without CUDA."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpinError(f"--device {name}: this torch has no CUDA device")
    return dev


def resolve_backend(backend: "str | logits_backends.LogitsBackend", device: torch.device,
                    page_slots: int) -> "logits_backends.LogitsBackend":
    """A logits backend (name or object) for K-cache pages of page_slots slots; SpinError when
    it cannot read them. On the CPU the native backend runs the reference op, so with 32-slot
    pages (which its CUDA kernel cannot read) "native" there is the reference backend."""
    if isinstance(backend, str):
        if backend == "native" and page_slots != BLOCK_SLOTS and device.type != "cuda":
            backend = "reference"
        return logits_backends.resolve(backend, device, page_slots)
    if backend.page_slots != page_slots:
        raise SpinError(f"logits backend {backend.name!r} was made for {backend.page_slots}-slot "
                        f"pages, the engine's K cache has {page_slots}-slot pages (page_slots): "
                        f"resolve it with page_slots={page_slots}")
    return backend


@dataclass(frozen=True)
class EngineOptions:
    """How an Engine batches, which indexer it runs and what it records.

    max_batch: requests in one decode step; max_requests: requests holding a cache slot
    (running or admitted; default max_batch); num_pages: indexer K-cache pages (default:
    every request at max_context).
    cuda_graphs: default on for CUDA; measuring misses, tracing or timing the indexer runs
    steps eagerly. measure_miss: run the dense indexer beside as a shadow and record SPIN's
    miss rate; trace_request: the request id(s) whose decode steps make a SPIN trace
    (Engine.trace); time_indexer: time the indexer's share of each step (StepStats).
    drafter: (request id, context + pending token, depth) -> drafts; replaces the MTP head
    (a request it returns None for drafts with the head).
    state_initial_capacity: SPIN state starts at this many indexer slots per request and
    grows with the longest context (StatePool.ensure_capacity).
    logits_backend: where the decode indexer's logits come from (spin_trtllm.logits: native,
    deepgemm, reference), a name or a resolved backend; the Engine resolves a name once.
    switch (with SPIN): "spin" runs SPIN every step; "dense" runs the all-keep indexer;
    "auto" picks per step from `cost_model` (spin_trtllm.costs; default: H200 constants with
    the top-K priced as ops.topk runs it here) whether SPIN beats all-keep for the batch, so
    it is never the slower of the two. Steps run all-keep do not update SPIN's state; a
    request SPIN takes over again restarts warm-up. Default: "auto" on CUDA, "spin" on the
    CPU (the reference ops there).
    predictor (with SPIN): "spin" ranks blocks by SPIN's history, "probe" by each block's
    summary (mean key) scored with the current query (SpinIndexer), "hybrid" by both (the
    max of their rank shares); the summaries are built after every prefill and rebuilt for
    requests SPIN takes over again.
    overlap_update (SPIN without MTP, sm_90+): each layer's EMA update is launched to run
    beside its top-K on the same stream (SpinIndexer; ops.update's beside_previous).
    overlap_select (predictor "spin", sm_90+; off by default, see SpinIndexer): each layer's
    blocks are selected beside the previous layer's top-K instead of all layers in one launch
    (ops.select's beside_previous).
    page_slots: slots per indexer K-cache page, 64 or 32 (DeepSeek-V4 with tokens_per_block
    128: one 64-slot SPIN block spans two pages). The caches, the prefill indexer and the
    decode indexers all page by it. 32-slot pages need a logits backend that reads them
    (reference, deepgemm; not the native kernel): on the CPU, where "native" runs the
    reference op anyway, "native" resolves to "reference".
    """

    max_batch: int = 8
    max_requests: Optional[int] = None
    num_pages: Optional[int] = None
    cuda_graphs: Optional[bool] = None
    measure_miss: bool = False
    trace_request: Optional[int | Sequence[int]] = None
    time_indexer: bool = False
    drafter: Optional[Drafter] = None
    state_initial_capacity: int = 1024
    logits_backend: "str | logits_backends.LogitsBackend" = "native"
    switch: Optional[str] = None
    cost_model: Optional[costs.CostModel] = None
    predictor: str = "spin"
    overlap_update: bool = True
    overlap_select: bool = False
    page_slots: int = BLOCK_SLOTS

    def __post_init__(self):
        if self.max_batch < 1:
            raise SpinError(f"max_batch must be >= 1, got {self.max_batch}")
        requests = self.max_requests or self.max_batch
        if requests < self.max_batch:
            raise SpinError(f"max_requests ({requests}) must be >= max_batch ({self.max_batch})")
        self.indexer  # noqa: B018 - the indexer's choices are checked where they are made

    @property
    def indexer(self) -> IndexerOptions:
        """The indexer's choices, passed down whole to SpinIndexer."""
        backend = self.logits_backend
        return IndexerOptions(logits_backend=backend if isinstance(backend, str) else backend.name,
                              predictor=self.predictor, switch=self.switch,
                              overlap_update=self.overlap_update,
                              overlap_select=self.overlap_select,
                              page_slots=self.page_slots)

    @property
    def trace_requests(self) -> set[int]:
        r = self.trace_request
        return set() if r is None else ({r} if isinstance(r, int) else set(r))

    @property
    def eager_only(self) -> bool:
        """The shadow indexer (misses, traces) and indexer timing need eager steps."""
        return self.measure_miss or bool(self.trace_requests) or self.time_indexer

    def resolve(self, spin: Optional[SpinConfig], device: torch.device) -> "EngineOptions":
        """These options with every default that depends on the device filled in (max_requests,
        switch, cuda_graphs, cost_model, the logits backend object), checked against `spin`."""
        if self.predictor != "spin" and spin is None:
            raise SpinError(f"predictor={self.predictor!r} needs a SpinConfig (spin=None runs "
                            f"all-keep)")
        cuda_graphs = (device.type == "cuda" and not self.eager_only) \
            if self.cuda_graphs is None else self.cuda_graphs
        if cuda_graphs and (device.type != "cuda" or self.eager_only):
            raise SpinError("cuda_graphs needs a CUDA device and no miss measuring, tracing "
                            "or indexer timing")
        backend = resolve_backend(self.logits_backend, device, self.page_slots)
        return replace(
            self, max_requests=self.max_requests or self.max_batch,
            switch=self.indexer.switch_on(device.type),
            cuda_graphs=cuda_graphs,
            # the default model prices the top-K that ops.topk runs here (flashinfer's if
            # installed)
            cost_model=self.cost_model or costs.H200.for_device(device),
            logits_backend=backend)
