"""What a decode step records: its StepStats, the indexer's time (Timer), the shadow dense
indexer's miss rate (ShadowObserver) and SPIN traces of chosen requests (TraceRecorder)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ... import reference as ref
from ...errors import SpinError
from ...indexer import DenseIndexer, SpinIndexer
from ...limits import BLOCK_SLOTS, KEY_BYTES
from ...replay.trace import SpinTrace
from ..config import DsaLiteConfig
from ..model import Caches
from .requests import Live


@dataclass
class StepStats:
    batch: int
    seconds: float
    indexer_seconds: float = 0.0          # with time_indexer (eager): select + layers + finish
    shadow_seconds: float = 0.0           # with time_indexer: the shadow dense indexer
    forward_seconds: float = 0.0          # CUDA: GPU time of select + model forward
    # wall time of the step's host phases (they sum to `seconds`): before the forward (batch
    # metadata, indexer.prepare), the forward call (a graph replay: its launch), the wait for
    # the step's logits on the host, and the rest (verification, finish, drafting, final sync)
    prepare_seconds: float = 0.0
    launch_seconds: float = 0.0
    wait_seconds: float = 0.0
    # of the rest: committing the accepted rows, emitting and drafting; the final sync's wait
    advance_seconds: float = 0.0
    sync_seconds: float = 0.0
    selected_blocks: int = 0
    visible_blocks: int = 0
    miss: list[float] = field(default_factory=list)
    accepted: int = 0
    drafted: int = 0
    graph: bool = False
    spin: bool = False                    # SPIN ran this step (not the all-keep indexer)
    _events: list = field(default_factory=list, repr=False)

    def add_event_times(self) -> None:
        """Add the CUDA-event intervals recorded during the step (call after its final sync)."""
        for a, b, what in self._events:
            setattr(self, what, getattr(self, what) + a.elapsed_time(b) / 1e3)
        self._events.clear()


class Timer:
    """Runs a function, adding its time to a StepStats field when enabled (time_indexer): CUDA
    events on the GPU (no host sync inside the step), wall time on the CPU."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.cuda = enabled, device.type == "cuda"

    def __call__(self, fn: Callable, stats: StepStats, what: str = "indexer_seconds"):
        if not self.enabled:
            return fn()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            stats._events.append((start, end, what))
            return out
        t0 = time.perf_counter()
        out = fn()
        setattr(stats, what, getattr(stats, what) + time.perf_counter() - t0)
        return out


class TimedIndexer:
    """The step's indexer with each layer timed into stats.indexer_seconds."""

    def __init__(self, indexer, timer: Timer, stats: StepStats):
        self.indexer, self.timer, self.stats = indexer, timer, stats

    def layer(self, layer, q, weights, kv_cache) -> torch.Tensor:
        return self.timer(lambda: self.indexer.layer(layer, q, weights, kv_cache), self.stats)


class ShadowObserver:
    """Runs the shadow dense indexer next to the step's indexer: miss rate and trace scores."""

    def __init__(self, indexer, shadow: DenseIndexer, timer: Timer, batch: list[Live],
                 stats: StepStats, context_lens: torch.Tensor, next_n: int, traced: set[int]):
        self.indexer, self.shadow, self.timer = indexer, shadow, timer
        self.batch, self.stats, self.next_n, self.traced = batch, stats, next_n, traced
        self.visible_blocks = (context_lens.long() + BLOCK_SLOTS - 1) // BLOCK_SLOTS
        # (request id, layer) -> dense scores [R, width], q [R, H, D] and w [R, H] of its rows
        self.trace_rows: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def layer(self, layer, q, weights, kv_cache) -> torch.Tensor:
        R, shadow = self.next_n, self.shadow
        true = self.timer(lambda: shadow.layer(layer, q, weights, kv_cache), self.stats,
                          "shadow_seconds").long()
        for i, live in enumerate(self.batch):
            if live.rid in self.traced:
                rows = slice(i * R, (i + 1) * R)
                # copies: the shadow's logits buffer is reused by the next layer (on the CPU
                # .float().cpu() would alias it). q: the fp8 values (exact in float16); their
                # scale is already in the weights
                self.trace_rows[(live.rid, layer)] = (
                    shadow.step_logits[rows, :shadow.m_cap * BLOCK_SLOTS].to(
                        "cpu", torch.float32, copy=True),
                    q[rows].float().to(torch.float16).cpu(), weights[rows].float().cpu())
        top = self.timer(lambda: self.indexer.layer(layer, q, weights, kv_cache), self.stats)
        if isinstance(self.indexer, SpinIndexer):
            self.stats.miss.extend(self._miss(layer, true))
        return top

    def _miss(self, layer: int, true: torch.Tensor) -> list[float]:
        """Per row: the share of the dense top-K's slots in blocks SPIN did not select."""
        B, R, ix = len(self.batch), self.next_n, self.indexer
        ids = ix.block_ids[:B, layer].long()
        cnt = ix.counts[:B, layer].long()
        live_ids = torch.where(torch.arange(ids.shape[1], device=ids.device) < cnt[:, None],
                               ids, -1)
        blocks = true.clamp(min=0) // BLOCK_SLOTS                           # [B*R, K]
        sel = (blocks.view(B, R, -1, 1) == live_ids.view(B, 1, 1, -1)).any(-1)
        valid = (true >= 0).view(B, R, -1)
        n = valid.sum(-1)
        # as in replay: rows where SPIN dropped blocks (not warm-up, not all kept)
        eligible = (n > 0) & (cnt.view(B, 1) < self.visible_blocks.to(cnt.device))
        return ((valid & ~sel).sum(-1).double() / n.clamp(min=1))[eligible].cpu().tolist()


class TraceRecorder:
    """The decode steps of traced requests, kept on the host until trace() builds a SPIN trace
    v2 from them."""

    def __init__(self, requests: set[int], num_layers: int):
        self.requests = requests
        self._traces: dict[int, dict[str, list]] = {
            rid: {"scores": [], "row_len": [], "query_pos": [], "accepted": [], "turn_start": [],
                  "q": [], "w": [], "keys": [torch.zeros(0, KEY_BYTES, dtype=torch.float16)
                                             for _ in range(num_layers)], "final": [0]}
            for rid in requests}

    def start_turn(self, rid: int) -> None:
        """A prefill of a traced request: its next recorded step starts a turn."""
        if rid in self.requests:
            self._traces[rid]["turn_start"].append(len(self._traces[rid]["row_len"]))

    def record(self, observed: ShadowObserver, rid: int, ctx: torch.Tensor,
               qpos: torch.Tensor, accepted: int, caches: Caches) -> None:
        """One decode step of `rid`: ctx and qpos are its rows' context lengths and query
        positions (indexer slots), `accepted` its accepted drafts."""
        if int(ctx.min()) < 1:
            return                                 # the trace format needs >= 1 slot per row
        t = self._traces[rid]
        L = len(t["keys"])
        for layer in range(L):
            rows, q, w = observed.trace_rows[(rid, layer)]
            for j in range(ctx.shape[0]):
                t["scores"].append(rows[j, :int(ctx[j])].clone())
            t["q"].append(q)
            t["w"].append(w)
        t["row_len"].append(ctx.view(1, -1).expand(L, -1).clone())
        t["query_pos"].append(qpos.clone())
        t["accepted"].append(accepted)
        live = next(x for x in observed.batch if x.rid == rid)
        self._record_keys(t, caches, live.slot, int(ctx.max()), int(ctx[accepted]))

    @staticmethod
    def _record_keys(t: dict, caches: Caches, cache_slot: int, seen: int,
                     committed: int) -> None:
        """Dequantized keys (fp8 x scale, as float16) of the request's slots from the first one
        that may have changed since the last recorded step up to `seen`. Slots below
        `committed` (complete groups of accepted tokens) never change again; those above it
        were written by rejected draft rows, and the next step or turn rewrites them, so they
        are read again then. The pages are read now: a finished request gives them back."""
        S = caches.page_slots
        first = t["final"][0] // S
        pages = caches.block_table[cache_slot, first:-(-seen // S)].long()
        lo = first * S
        for ci, buf in enumerate(t["keys"]):
            keys = ref.dequantize_pages(caches.index[ci][pages]).reshape(-1, KEY_BYTES)
            if buf.shape[0] < seen:
                grown = torch.zeros(max(seen, 2 * buf.shape[0]), KEY_BYTES, dtype=torch.float16)
                grown[:buf.shape[0]] = buf
                t["keys"][ci] = buf = grown
            buf[lo:seen] = keys[:seen - lo].to(torch.float16).cpu()
        t["final"][0] = max(t["final"][0], committed)

    def trace(self, cfg: DsaLiteConfig, request_id: Optional[int] = None) -> SpinTrace:
        """See Engine.trace."""
        if request_id is None:
            if len(self._traces) != 1:
                raise SpinError(f"trace(): say which of the traced requests "
                                f"{sorted(self._traces)}")
            request_id = next(iter(self._traces))
        t = self._traces.get(request_id)
        if t is None:
            raise SpinError(f"request {request_id} was not traced (trace_request)")
        if not t["row_len"]:
            raise SpinError(f"no trace recorded for request {request_id}: it never decoded "
                            f"past its first indexer slot")
        T, L = len(t["row_len"]), len(cfg.csa_layers)
        starts = sorted({s for s in t["turn_start"] if s < T})
        row_len = torch.stack(t["row_len"]).to(torch.int32)
        q = torch.stack(t["q"])                                       # [T * L, R, H, D]
        S = int(row_len.max())
        return SpinTrace(scores=torch.cat(t["scores"]).float(), row_len=row_len,
                         query_pos=torch.stack(t["query_pos"]).to(torch.int32),
                         index_topk=cfg.index_topk, block_size=BLOCK_SLOTS,
                         turn_start=torch.tensor(starts, dtype=torch.int32) if starts else None,
                         accepted=torch.tensor(t["accepted"], dtype=torch.int32),
                         compress_ratio=cfg.index_ratio, source="dsa-lite",
                         q=q.view(T, L, *q.shape[1:]),
                         w=torch.stack(t["w"]).view(T, L, *t["w"][0].shape),
                         keys=torch.stack([k[:S] for k in t["keys"]])).validate()
