"""Decode-step times of dsa-lite at a given context and batch (CUDA graphs, synthetic caches).

Used by benchmarks/bench_dsa_lite.py and the GPU demo. Each request's `context` tokens of cache
are random values (Engine.add_synthetic: step times do not depend on them); after `warmup`
steps, `steps` decode steps are timed:
  step ms     wall time of Engine.step() (host scheduling, verification and drafting included)
  forward ms  GPU time of the captured step (select + every layer), CUDA events
  prepare / launch / wait / after ms
              the step's wall time by host phase: batch metadata and indexer.prepare, the
              graph replay call, waiting for the logits, and verification, drafting and the
              final sync (JSON only)
  scored_gb   K-cache bytes the indexer's logits read per step (every slot of every scored
              block, all indexer layers, each page once; 0 for "null")
indexer:
  "null"   fixed top-K ids and no indexer work (what the rest of the step costs)
  "dense"  the all-keep indexer
  "spin"   SPIN at target sparsity `rho` every step
  "auto"   SPIN where the cost model says it beats all-keep, all-keep elsewhere
predictor (spin and auto): "spin" (SPIN's history), "probe" (block summaries scored with the
current query, IndexerOptions(predictor="probe")) or "hybrid" (both, merged by rank).
Engines built one after another in one process run slower (from the fourth on, every step,
the no-indexer engine's too), so benchmarks/bench_dsa_lite.py measures each engine in a fresh
process.
"""

from __future__ import annotations

import gc
import statistics
from typing import Any, Callable, Optional

import torch

from ..config import SpinConfig
from .. import logits as logits_backends
from ..costs import indexer_bytes, traffic_bytes
from .config import DsaLiteConfig, v4_flash_indexer
from .engine import Engine

INDEXERS = ("null", "dense", "spin", "auto")


class NullIndexer:
    """Fixed top-K ids, no work: the rest of the step."""

    def __init__(self, rows: int, k: int, layers: int, device):
        self.top = torch.arange(k, dtype=torch.int32, device=device).repeat(layers, rows, 1)
        self.batch, self.next_n = 0, 1

    def prepare(self, request_ids, context_lens, *args):
        self.batch, self.next_n = len(request_ids), context_lens.shape[1]

    def select(self):
        pass

    def layer(self, layer, q, w, kv):
        return self.top[layer, :self.batch * self.next_n]

    def finish(self, accepted=None):
        pass


def step_config(context: int, mtp_depth: int, decode_steps: int) -> DsaLiteConfig:
    """v4_flash_indexer() with room for `context` tokens and `decode_steps` decode steps."""
    return v4_flash_indexer(mtp_depth=mtp_depth, max_context=context + decode_steps
                            * (mtp_depth + 1) + mtp_depth + 8)


def synthetic_engine(cfg: DsaLiteConfig, weights, spin: Optional[SpinConfig], context: int,
                     batch: int, decode_steps: int,
                     backend: "str | logits_backends.LogitsBackend" = "native",
                     cuda_graphs: bool = True, switch: Optional[str] = None,
                     predictor: str = "spin", overlap_update: bool = True,
                     overlap_select: bool = False) -> Engine:
    """A CUDA engine with `batch` requests already decoding over `context` tokens of random
    cache contents, each with room for `decode_steps` decode steps."""
    engine = Engine(cfg, spin, weights=weights, device="cuda", max_batch=batch,
                    cuda_graphs=cuda_graphs, logits_backend=backend, switch=switch,
                    predictor=predictor if spin is not None else "spin",
                    overlap_update=overlap_update, overlap_select=overlap_select)
    for i in range(batch):
        engine.add_synthetic(i, context, max_new_tokens=decode_steps * cfg.next_n, seed=i)
    return engine


def measure(cfg: DsaLiteConfig, weights, indexer: str, context: int, batch: int, warmup: int,
            steps: int, rho: Optional[float] = None,
            backend: "str | logits_backends.LogitsBackend" = "native",
            state_dtype: str = "float16", spin: Optional[SpinConfig] = None,
            predictor: str = "spin", overlap_update: bool = True,
            overlap_select: bool = False,
            on_step: Optional[Callable[[], None]] = None) -> dict[str, Any]:
    """Median step and forward times of one engine (see the module docstring). SPIN runs
    `spin` when given, else SpinConfig(target_sparsity=rho, state_dtype=state_dtype).
    `on_step`: called after each step, warm-up included (progress bars)."""
    if indexer not in INDEXERS:
        raise ValueError(f"indexer must be one of {INDEXERS}, got {indexer!r}")
    if indexer not in ("spin", "auto"):
        spin = None
    elif spin is None:
        spin = SpinConfig(index_topk=cfg.index_topk, target_sparsity=rho, state_dtype=state_dtype)
    rho, state_dtype = (spin.target_sparsity, spin.state_dtype) if spin else (rho, state_dtype)
    predictor = predictor if spin is not None else "spin"
    engine = synthetic_engine(cfg, weights, spin, context, batch, warmup + steps, backend,
                              switch=indexer if spin is not None else None, predictor=predictor,
                              overlap_update=overlap_update, overlap_select=overlap_select)
    if indexer == "null":
        engine.indexer = NullIndexer(batch * cfg.next_n, cfg.index_topk, len(cfg.csa_layers),
                                     engine.device)
    torch.cuda.synchronize()
    for _ in range(warmup + steps):
        engine.step()
        if on_step is not None:
            on_step()
    hist = engine.history[warmup:]
    sel = sum(s.selected_blocks for s in hist)
    vis = sum(s.visible_blocks for s in hist)
    cache_gb = engine.caches.nbytes() / 1e9
    state_gb = engine.pool.nbytes() / 1e9 if engine.pool is not None else 0.0
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return {"indexer": indexer, "predictor": predictor, "rho": rho,
            "backend": getattr(backend, "name", backend),
            "state_dtype": state_dtype, "overlap_update": overlap_update,
            "overlap_select": overlap_select,
            "context_tokens": context, "indexer_slots": context // cfg.index_ratio,
            "batch": batch, "next_n": cfg.next_n, "steps": len(hist),
            "step_ms": 1e3 * statistics.median(s.seconds for s in hist),
            "forward_ms": 1e3 * statistics.median(s.forward_seconds for s in hist),
            # where the wall time goes on the host (medians; see StepStats)
            "prepare_ms": 1e3 * statistics.median(s.prepare_seconds for s in hist),
            "launch_ms": 1e3 * statistics.median(s.launch_seconds for s in hist),
            "wait_ms": 1e3 * statistics.median(s.wait_seconds for s in hist),
            "after_ms": 1e3 * statistics.median(
                s.seconds - s.prepare_seconds - s.launch_seconds - s.wait_seconds for s in hist),
            "advance_ms": 1e3 * statistics.median(s.advance_seconds for s in hist),
            "sync_ms": 1e3 * statistics.median(s.sync_seconds for s in hist),
            "spin_steps": sum(s.spin for s in hist),
            "realized_sparsity": (1 - sel / vis) if vis and indexer != "null" else 0.0,
            "accepted_per_step": sum(s.accepted for s in hist) / max(1, sum(s.batch for s in hist)),
            "scored_gb": 0.0 if indexer == "null"
            else indexer_bytes(sel / len(hist), vis / len(hist))[0] / 1e9,
            # bytes moved a step (costs.traffic_bytes), SPIN's state on the steps SPIN ran
            "traffic_gb": 0.0 if indexer == "null" else sum(
                traffic_bytes(s.selected_blocks, s.visible_blocks, cfg.next_n,
                              state_dtype if s.spin else None, predictor)
                for s in hist) / len(hist) / 1e9,
            "cache_gb": cache_gb, "state_gb": state_gb}


# (batch, context tokens) tried largest first; dsa-lite's V4-Flash-shaped caches take about
# 1.4 KB per token, CACHE_BYTES_PER_TOKEN leaves headroom
SIZES = ((96, 524288), (32, 524288), (32, 131072), (8, 131072), (8, 32768))
CACHE_BYTES_PER_TOKEN = 1.6e3


def fitting_size(free_bytes: int) -> Optional[tuple[int, int]]:
    """The largest of SIZES whose caches take at most 80% of `free_bytes` (None: none fits)."""
    for batch, context in SIZES:
        if batch * context * CACHE_BYTES_PER_TOKEN <= 0.8 * free_bytes:
            return batch, context
    return None
