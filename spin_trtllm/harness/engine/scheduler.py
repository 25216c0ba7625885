"""The Engine: admission, prefill, the batched decode step, turns and finishing.

Each step() admits waiting requests (prefill, first token), then runs one batched decode step
for every request that was already running: SPIN selects blocks for all indexer layers, the
model runs with the SPIN (or all-keep) indexer, the target rows verify the MTP drafts, the
deferred EMA updates replay the accepted rows, and the MTP head drafts the next tokens.
Requests finish, start new turns (state reset) and leave the batch between steps.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

import torch

from ...config import SpinConfig
from ...errors import SpinConfigError, SpinError
from ...indexer import DenseIndexer, SpinIndexer
from ...limits import BLOCK_SLOTS
from ...state import StatePool
from ..config import DsaLiteConfig
from ..model import Caches, DsaLiteModel, PrefillIndexer, check_memory, check_weights, init_weights
from . import requests as rq
from . import sampling
from .graphs import GraphCache, Outputs
from .memory import engine_bytes
from .options import EngineOptions
from .requests import Live, Request, RequestError, RequestOutput
from .tracing import ShadowObserver, StepStats, TimedIndexer, Timer, TraceRecorder


@dataclass
class _StepInputs:
    """A decode step's batch as the indexers see it (host tensors, [B, next_n] per row)."""
    start: torch.Tensor                   # position of each request's first row
    ctx: torch.Tensor                     # indexer slots each row sees (its causal length)
    qpos: torch.Tensor                    # indexer slot of each row's query
    # ctx of each request's last row, its longest (rows are consecutive positions), as ints:
    # a row-wise max of a small CPU tensor costs ~30 us with torch's intra-op threads
    longest: list[int]


class Engine:
    """dsa-lite's serving loop: submit() requests, then step() until idle (or run() them);
    each decode step's StepStats go to `history`."""

    def __init__(self, cfg: DsaLiteConfig, spin: Optional[SpinConfig] = None, *,
                 weights: Optional[dict[str, torch.Tensor]] = None,
                 device: torch.device | str = "cpu", options: Optional[EngineOptions] = None,
                 **overrides):
        """spin=None runs the all-keep (dense) indexer. `options` (EngineOptions, which
        documents each) or its fields as keywords (over `options` where both are given), e.g.
        Engine(cfg, spin, max_batch=4, switch="auto")."""
        opts = replace(options, **overrides) if options is not None else \
            EngineOptions(**overrides)
        if spin is not None and spin.index_topk != cfg.index_topk:
            raise SpinConfigError(f"spin index_topk {spin.index_topk} differs from the model's "
                                  f"index_topk {cfg.index_topk}")
        self.cfg, self.spin = cfg, spin
        self.device = torch.device(device)
        self.options = opts = opts.resolve(spin, self.device)
        self.max_batch, self.max_requests = opts.max_batch, opts.max_requests
        self.switch, self.predictor, self.cost_model = opts.switch, opts.predictor, opts.cost_model
        self.measure_miss, self.time_indexer = opts.measure_miss, opts.time_indexer
        self.cuda_graphs, self.drafter = opts.cuda_graphs, opts.drafter
        self.logits_backend = opts.logits_backend
        self.trace_requests = opts.trace_requests
        # weights and memory are checked before anything is allocated
        if weights is not None:
            check_weights(cfg, weights)
        check_memory(engine_bytes(cfg, spin, opts, random_weights=weights is None), self.device,
                     f"an engine for {opts.max_requests} requests ({cfg.sizes()})")
        self.model = DsaLiteModel(cfg, weights if weights is not None else init_weights(cfg),
                                  self.device)
        self.page_slots = opts.page_slots
        pages_per_request = math.ceil(cfg.index_slots / self.page_slots)
        self.caches = Caches(cfg, self.max_requests,
                             opts.num_pages or self.max_requests * pages_per_request, self.device,
                             self.page_slots)
        self._build_indexers(opts)
        self.prefill_indexer = PrefillIndexer(cfg.index_topk, self.model.dtype, self.page_slots)
        self.graphs = GraphCache(self.pool.generation if self.pool is not None else 0)
        self._timed = Timer(self.time_indexer, self.device)
        R = cfg.next_n
        self._in = {
            "tokens": torch.zeros(self.max_batch, R, dtype=torch.int64, device=self.device),
            "pos": torch.zeros(self.max_batch, R, dtype=torch.int64, device=self.device),
            "slot": torch.zeros(self.max_batch, dtype=torch.int64, device=self.device),
            "table": torch.zeros(self.max_batch, self.caches.max_pages, dtype=torch.int32,
                                 device=self.device)}
        self.waiting: deque[Live] = deque()
        self.running: list[Live] = []
        self._free_slots = list(range(self.max_requests - 1, -1, -1))
        self._reserved = 0
        self._ids_in_use: set[int] = set()
        self._next_id = 0
        self.history: list[StepStats] = []
        self.prefill_seconds = 0.0
        # progress bars: called with each prefill chunk's token count (EngineProgress)
        self.on_prefill: Optional[Callable[[int], None]] = None
        self.traces = TraceRecorder(self.trace_requests, len(cfg.csa_layers))

    def _build_indexers(self, opts: EngineOptions) -> None:
        """The SPIN state and indexer (with SPIN), the all-keep indexer (without SPIN, or where
        the switch may pick it) and the shadow dense indexer (misses, traces)."""
        cfg, spin, R = self.cfg, self.spin, self.cfg.next_n
        L = len(cfg.csa_layers)
        self._ran_spin = True
        self.pool: Optional[StatePool] = None
        self.spin_indexer: Optional[SpinIndexer] = None
        if spin is not None:
            self.pool = StatePool(L, self.max_requests, spin, self.device,
                                  initial_capacity=min(opts.state_initial_capacity,
                                                       cfg.index_slots + R),
                                  max_capacity=cfg.index_slots + R,
                                  history=opts.indexer.block_predictor.history)
            self.spin_indexer = SpinIndexer(spin, self.pool, self.max_batch, R, cfg.index_slots,
                                            opts.indexer, logits_backend=self.logits_backend)
        def dense(backend):
            return DenseIndexer(cfg.index_topk, L, self.max_batch, R, cfg.index_slots,
                                self.device, logits_backend=backend, page_slots=opts.page_slots)

        self.dense_indexer = dense(self.logits_backend) \
            if spin is None or opts.switch != "spin" else None
        self.indexer = self.spin_indexer or self.dense_indexer
        # the shadow runs the native kernel where it reads the pages, else the engine's backend
        shadow = "native" if opts.page_slots == BLOCK_SLOTS else self.logits_backend
        self.shadow = dense(shadow) if (opts.measure_miss or self.trace_requests) else None

    # the capture cache's graphs and state generation (tests and benchmarks/profile_step.py)
    # ---- requests --------------------------------------------------------------------------
    def submit(self, req: Request) -> int:
        """Validate and queue a request; returns its id. Raises RequestError, changing nothing."""
        rid = req.request_id
        what = f"request {rid if rid is not None else self._next_id}"
        rq.check_id(rid, what, self._ids_in_use)
        prompts, worst = rq.parse(req, self.cfg, what)
        if rid is None:
            while self._next_id in self._ids_in_use:
                self._next_id += 1
            rid = self._next_id
            self._next_id += 1                   # a finished request's id is not handed out again
        live = Live(req, rid, prompts)
        live.reserved_pages = rq.pages_for(worst, self.cfg.index_ratio, self.page_slots)
        if live.reserved_pages > self.caches.num_pages:
            raise RequestError(f"{what}: needs {live.reserved_pages} indexer pages, the cache "
                               f"has {self.caches.num_pages}")
        self._ids_in_use.add(rid)
        self.waiting.append(live)
        return rid

    def add_synthetic(self, request_id: int, context_tokens: int, max_new_tokens: int,
                      seed: int = 0) -> None:
        """Benchmarks: a request that is decoding already, its `context_tokens` of context filled
        with random cache contents instead of a prefill (step times do not depend on them)."""
        cfg, R = self.cfg, self.cfg.next_n
        if not isinstance(request_id, int) or not 0 <= request_id < 1 << 62:
            raise RequestError(f"synthetic request: request_id must be an int in [0, 2^62), got "
                               f"{request_id!r}")
        if max_new_tokens < 1:
            raise RequestError(f"synthetic request: max_new_tokens must be >= 1, got "
                               f"{max_new_tokens}")
        if context_tokens + max_new_tokens + R > cfg.max_context or context_tokens < 1:
            raise RequestError(f"synthetic request: {context_tokens} context + {max_new_tokens} "
                               f"new tokens do not fit max_context {cfg.max_context}")
        if not self._free_slots or len(self.running) >= self.max_batch:
            raise RequestError("synthetic request: the batch is full")
        if request_id in self._ids_in_use:
            raise RequestError(f"request {request_id}: request_id already in use")
        live = Live(Request([0], max_new_tokens=max_new_tokens), request_id, [[0]])
        live.reserved_pages = rq.pages_for(context_tokens + max_new_tokens + R, cfg.index_ratio,
                                           self.page_slots)
        if self._reserved + live.reserved_pages > self.caches.num_pages:
            raise RequestError("synthetic request: indexer K cache out of pages")
        self._ids_in_use.add(request_id)
        self._take_slot(live)
        self.caches.ensure_pages(live.slot, context_tokens // cfg.index_ratio + 1)
        self.caches.fill_random(live.slot, context_tokens, seed)
        live.context = [0] * context_tokens
        self._summarize([live])
        live.pending = 1
        live.drafts = [0] * cfg.mtp_depth
        live.hidden = torch.zeros(cfg.hidden, dtype=self.model.dtype, device=self.device)
        live.out.append([])
        self.running.append(live)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def run(self, requests: Sequence[Request] = (), progress: bool = False,
            max_steps: int = 1_000_000) -> list[RequestOutput]:
        for r in requests:
            self.submit(r)
        done: list[RequestOutput] = []
        bars = None
        if progress:
            lives = list(self.waiting) + self.running
            left = [tokens_left(live) for live in lives]
            bars = EngineProgress(self, "", sum(p for p, _ in left), sum(d for _, d in left),
                                  len(lives))
        steps = 0
        try:
            while not self.idle:
                if steps >= max_steps:
                    raise SpinError(f"engine did not finish within {max_steps} steps")
                before = len(self.history)
                finished = self.step()
                done += finished
                steps += 1
                if bars is not None:
                    bars.stepped(self.history[before:], len(done))
        finally:
            if bars is not None:
                bars.close()
        return done

    def trace(self, request_id: Optional[int] = None):
        """SPIN trace v2 of a traced request's decode steps: the dense shadow scores, the
        indexer's q (fp8 values) and w (its scales folded in) of every row, and the keys of
        every slot (dequantized from the indexer K cache as the request left it, or as it was
        when the request finished); the only traced request when request_id is None."""
        return self.traces.trace(self.cfg, request_id)

    # ---- one engine step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        finished: list[RequestOutput] = []
        joined = self._admit(finished)
        batch = list(self.running)
        if batch:
            self._decode(batch, finished)
        self.running = [r for r in batch if r.slot >= 0] + joined
        return finished

    def _admit(self, finished: list[RequestOutput]) -> list[Live]:
        """Prefill waiting requests while the batch, the slots and the pages allow; returns
        those that go on decoding."""
        joined = []
        while self.waiting and len(self.running) + len(joined) < self.max_batch \
                and self._free_slots \
                and self._reserved + self.waiting[0].reserved_pages <= self.caches.num_pages:
            live = self.waiting.popleft()
            self._take_slot(live)
            live.out.append([])
            try:
                self._prefill(live, live.prompts[0])
            except Exception:
                self._finish(live, "error", [])    # give back its slot, pages and state
                raise
            if not self._emit(live, [live.pending], finished):
                joined.append(live)
        return joined

    def _take_slot(self, live: Live) -> None:
        live.slot = self._free_slots.pop()
        self._reserved += live.reserved_pages
        if self.pool is not None:
            self.pool.admit(live.rid)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _prefill(self, live: Live, tokens: list[int]) -> None:
        """Run `tokens` (continuing live.context) through the model in chunks; sample the next
        token, reset SPIN (a new prompt or turn starts from zero state) and draft."""
        cfg, dev = self.cfg, self.device
        t0 = time.perf_counter()
        slot = torch.tensor([live.slot], dtype=torch.int64, device=dev)
        start = len(live.context)
        logits = hidden = None
        for c in range(0, len(tokens), cfg.prefill_chunk):
            chunk = tokens[c:c + cfg.prefill_chunk]
            pos = torch.arange(start + c, start + c + len(chunk), device=dev).view(1, -1)
            self.caches.ensure_pages(live.slot, int(pos[0, -1]) // cfg.index_ratio + 1)
            table = self.caches.block_table[live.slot:live.slot + 1]
            self.prefill_indexer.prepare(((pos + 1) // cfg.index_ratio).to(torch.int32), table)
            logits, hidden = self.model.forward(torch.tensor([chunk], device=dev), pos, slot,
                                                table, self.caches, self.prefill_indexer)
            if self.on_prefill is not None:
                self.on_prefill(len(chunk))
        live.context += tokens
        self._summarize([live])                   # every page: a new turn rewrote some
        last = logits[0, -1].cpu()
        if not bool(torch.isfinite(last).all()) or bool(last.max() == last.min()):
            # finite weights can still overflow the activations (an overflowed RMS norm
            # zeroes them): every argmax would be token 0
            raise SpinError(f"request {live.rid}: the model's logits after the prompt are NaN, "
                            f"infinite or all equal (weights all zero, or too large for "
                            f"{cfg.dtype})")
        live.pending = sampling.target(live, last, 0, len(live.context))
        live.hidden = hidden[0, -1]
        if self.pool is not None and live.turn > 0:
            self.pool.reset([live.rid], live.step)
        self.traces.start_turn(live.rid)
        self._draft([live])
        self._sync()
        self.prefill_seconds += time.perf_counter() - t0

    def _summarize(self, lives: list[Live]) -> None:
        """predictor="probe"/"hybrid": the block summaries of every visible page of these
        requests, in every indexer layer (eager; decode steps keep only the newest pages up to
        date)."""
        if self.spin_indexer is None or not self.spin_indexer.query_aware or not lives:
            return
        slots = torch.tensor([live.slot for live in lives], dtype=torch.int64, device=self.device)
        table = self.caches.block_table[slots]
        n = [len(live.context) // self.cfg.index_ratio for live in lives]
        for ci, kv in enumerate(self.caches.index):
            self.spin_indexer.summarize_context(ci, kv, table, n)

    def _draft(self, lives: list[Live]) -> None:
        d = self.cfg.mtp_depth
        if not d or not lives:
            return
        if self.drafter is not None:
            head = []
            for live in lives:
                drafts = self.drafter(live.rid, live.context + [live.pending], d)
                if drafts is None:                  # this one drafts with the MTP head
                    head.append(live)
                    continue
                drafts = [int(t) for t in drafts]
                if len(drafts) != d or not all(0 <= t < self.cfg.vocab_size for t in drafts):
                    raise SpinError(f"drafter returned {drafts!r}, need {d} token ids")
                live.drafts = drafts
            lives = head
            if not lives:
                return
        hidden = torch.stack([live.hidden for live in lives])
        token = torch.tensor([live.pending for live in lives], device=self.device)
        drafts = self.model.draft(hidden, token, d).cpu().tolist()
        for live, dr in zip(lives, drafts):
            live.drafts = dr

    def _emit(self, live: Live, tokens: list[int], finished: list[RequestOutput]) -> bool:
        """Append generated tokens to the current turn; on the turn's end, start the next turn
        or finish. Returns True when the request finished. live.pending must be tokens[-1]."""
        r = live.req
        turn = live.out[-1]
        for k, tok in enumerate(tokens):
            turn.append(tok)
            stop = r.stop_token is not None and tok == r.stop_token
            if stop or len(turn) >= r.max_new_tokens:
                # tokens after the stop are dropped; the cache past the context is rewritten
                extra = len(tokens) - 1 - k
                if extra:
                    live.context = live.context[:len(live.context) - extra]
                live.pending = tok
                return self._end_turn(live, "stop" if stop else "length", finished)
        return False

    def _end_turn(self, live: Live, reason: str, finished: list[RequestOutput]) -> bool:
        live.turn += 1
        if live.turn < len(live.prompts):
            live.out.append([])
            self._prefill(live, [live.pending] + live.prompts[live.turn])
            return self._emit(live, [live.pending], finished)
        self._finish(live, reason, finished)
        return True

    def _finish(self, live: Live, reason: str, finished: list[RequestOutput]) -> None:
        finished.append(RequestOutput(live.rid, live.out, reason, live.step, live.drafted,
                                      live.accepted, live.logprobs[:len(live.out[-1])]))
        if self.pool is not None:
            self.pool.release(live.rid)
        self.caches.release(live.slot)
        self._free_slots.append(live.slot)
        self._reserved -= live.reserved_pages
        self._ids_in_use.discard(live.rid)
        live.slot = -1

    # ---- decode ------------------------------------------------------------------------------
    def _decode(self, batch: list[Live], finished: list[RequestOutput]) -> None:
        """One batched decode step of the running requests (see the module docstring)."""
        batch = self._drop_full(batch, finished)
        if not batch:
            return
        t0 = time.perf_counter()
        stats = StepStats(batch=len(batch), seconds=0.0)
        step = self._upload(batch)
        stats.spin = self._choose(batch, step.longest)
        observed = self._prepare_indexers(batch, step, stats)
        logits, hidden, greedy = self._launch(len(batch), observed, stats, t0)
        sampled = [b for b, live in enumerate(batch) if rq.needs_logits(live.req)]
        row_logits = logits[sampled].cpu() if sampled else None
        # realized sparsity counts what was skipped: all-keep steps skip nothing
        visible = sum(-(-n // BLOCK_SLOTS) for n in step.longest)
        stats.visible_blocks = visible * len(self.cfg.csa_layers)
        # summed on the device now (stream order keeps this step's counts) and read after the
        # step's final sync: no wait for the GPU before verification
        selected = self.indexer.counts[:len(batch)].sum() if stats.spin else None
        accepted, emitted = sampling.verify(batch, step.start.tolist(), greedy, row_logits,
                                            sampled, self.cfg.next_n)
        acc = torch.tensor(accepted, dtype=torch.int32, device=self.device)
        self._timed(lambda: self.indexer.finish(acc if self.cfg.next_n > 1 else None), stats)
        if observed is not None:
            for b, live in enumerate(batch):
                if live.rid in self.trace_requests:
                    self.traces.record(observed, live.rid, step.ctx[b], step.qpos[b],
                                       accepted[b], self.caches)
        t_advance = time.perf_counter()
        self._advance(batch, accepted, emitted, hidden, acc, stats, finished)
        t_sync = time.perf_counter()
        stats.advance_seconds = t_sync - t_advance
        self._sync()
        stats.sync_seconds = time.perf_counter() - t_sync
        stats.selected_blocks = int(selected) if selected is not None else stats.visible_blocks
        stats.seconds = time.perf_counter() - t0
        stats.add_event_times()
        self.history.append(stats)

    def _drop_full(self, batch: list[Live], finished: list[RequestOutput]) -> list[Live]:
        """Finish requests whose next step would pass max_context (submit rules it out)."""
        for live in batch:
            if len(live.context) + self.cfg.next_n > self.cfg.max_context:
                self._finish(live, "context", finished)
        return [live for live in batch if live.slot >= 0]

    def _upload(self, batch: list[Live]) -> _StepInputs:
        """The step's tokens, positions, cache slots and block tables into the device input
        buffers (the graphs read them there); pages for the new rows."""
        cfg, R, B = self.cfg, self.cfg.next_n, len(batch)
        start = torch.tensor([len(live.context) for live in batch], dtype=torch.int64)
        pos = start.view(-1, 1) + torch.arange(R)
        tokens = torch.tensor([[live.pending] + live.drafts for live in batch], dtype=torch.int64)
        last = pos[:, -1].tolist()
        for live, p in zip(batch, last):
            self.caches.ensure_pages(live.slot, p // cfg.index_ratio + 1)
        slots = torch.tensor([live.slot for live in batch], dtype=torch.int64)
        self._in["tokens"][:B].copy_(tokens)
        self._in["pos"][:B].copy_(pos)
        self._in["slot"][:B].copy_(slots)
        self._in["table"][:B].copy_(self.caches.block_table[slots.to(self.device)])
        return _StepInputs(start=start, ctx=((pos + 1) // cfg.index_ratio).to(torch.int32),
                           qpos=(pos // cfg.index_ratio).to(torch.int32),
                           longest=[(p + 1) // cfg.index_ratio for p in last])

    def _prepare_indexers(self, batch: list[Live], step: _StepInputs,
                          stats: StepStats) -> Optional[ShadowObserver]:
        """indexer.prepare for the step (and the shadow's, returning its observer); graphs
        captured over an older SPIN state are dropped."""
        B = len(batch)
        ids, steps = [live.rid for live in batch], [live.step for live in batch]
        table = self._in["table"][:B]
        self.indexer.prepare(ids, step.ctx, step.qpos, steps, table)
        if self.pool is not None:
            self.graphs.invalidate(self.pool.generation)
        if self.shadow is None:
            return None
        self.shadow.prepare(ids, step.ctx, step.qpos, steps, table)
        return ShadowObserver(self.indexer, self.shadow, self._timed, batch, stats, step.ctx,
                              self.cfg.next_n, self.trace_requests)

    def _launch(self, B: int, observed: Optional[ShadowObserver], stats: StepStats,
                t0: float) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
        """Run the forward and wait for its argmax rows on the host: (logits, hidden, greedy
        tokens), with the step's prepare / launch / wait phases and its GPU time in stats."""
        cuda = self.device.type == "cuda"
        if cuda:
            f0, f1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            f0.record()
        t_launch = time.perf_counter()
        stats.prepare_seconds = t_launch - t0
        logits, hidden = self._forward(B, observed, stats)
        if cuda:
            f1.record()
            stats._events.append((f0, f1, "forward_seconds"))
        t_wait = time.perf_counter()
        stats.launch_seconds = t_wait - t_launch
        greedy = logits.argmax(-1).cpu().tolist()   # Python ints: no tensor index per row
        stats.wait_seconds = time.perf_counter() - t_wait
        return logits, hidden, greedy

    def _advance(self, batch: list[Live], accepted: list[int], emitted: list[list[int]],
                 hidden: torch.Tensor, acc: torch.Tensor, stats: StepStats,
                 finished: list[RequestOutput]) -> None:
        """Commit each request's accepted rows, emit its tokens (ending turns and requests) and
        draft the next step for those still in the same turn."""
        R = self.cfg.next_n
        redraft = []
        # one gather, not a copy per request: graph outputs are overwritten next replay
        kept_hidden = hidden[torch.arange(len(batch), device=hidden.device),
                             acc.to(torch.int64)].unbind(0)
        for b, live in enumerate(batch):
            a = accepted[b]
            live.context += [live.pending] + live.drafts[:a]
            live.pending = emitted[b][-1]
            live.hidden = kept_hidden[b]
            turn = live.turn
            live.step += 1
            live.drafted += R - 1
            stats.drafted += R - 1
            before = len(live.out[-1])
            done = self._emit(live, emitted[b], finished)
            # drafts dropped after a stop token or max_new_tokens do not count as accepted
            kept = a if live.turn == turn and not done else min(a, len(live.out[turn]) - before)
            live.accepted += kept
            stats.accepted += kept
            if done:
                finished[-1].accepted = live.accepted
            if not done and live.turn == turn:
                redraft.append(live)                 # a new turn drafted in its prefill
        self._draft(redraft)

    def _choose(self, batch: list[Live], longest: list[int]) -> bool:
        """SPIN or all-keep for this step (self.indexer is set to it). Requests that sat out
        SPIN steps restart warm-up when SPIN takes over: their state missed those steps."""
        if self.spin_indexer is None:
            return False
        if self.switch == "auto":
            use = self.cost_model.prefer_spin(longest,
                                              self.spin.target_sparsity, self.cfg.next_n,
                                              self.pool.state.V.element_size(),
                                              running_spin=self._ran_spin,
                                              predictor=self.predictor,
                                              update_beside=self.spin_indexer.update_beside,
                                              index_topk=self.spin.index_topk,
                                              table_slots=self.spin_indexer.m_cap * BLOCK_SLOTS)
        else:
            use = self.switch == "spin"
        self._ran_spin = use
        if use:
            stale = [live for live in batch if live.spin_stale]
            if stale:
                self.pool.reset([live.rid for live in stale],
                                torch.tensor([live.step for live in stale], dtype=torch.int64))
                self._summarize(stale)             # their newest pages went unsummarized
                for live in stale:
                    live.spin_stale = False
            self.indexer = self.spin_indexer
        else:
            for live in batch:
                live.spin_stale = True
            self.indexer = self.dense_indexer
        return use

    def _forward(self, B: int, observed: Optional[ShadowObserver], stats: StepStats) -> Outputs:
        """select + the model's forward over the step's rows: eager (observed, timed, or
        without graphs), else through the capture cache."""
        i = self._in
        args = (i["tokens"][:B], i["pos"][:B], i["slot"][:B], i["table"][:B], self.caches)
        if observed is not None or not self.cuda_graphs:
            self._timed(self.indexer.select, stats)
            indexer = observed if observed is not None else (
                TimedIndexer(self.indexer, self._timed, stats) if self.time_indexer
                else self.indexer)
            return self.model.forward(*args, indexer)
        stats.graph = True
        indexer = self.indexer

        def step() -> Outputs:
            indexer.select()
            return self.model.forward(*args, indexer)

        return self.graphs.run((B, stats.spin), step, self._sync)


# ---- progress ------------------------------------------------------------------------------------
def planned_tokens(prompts: Sequence[Sequence[int]], max_new_tokens: int) -> tuple[int, int]:
    """(prefill tokens, decode tokens) the engine runs for a queued request with these turn
    prompts: each later turn's prefill also runs the previous turn's last token, and each
    turn's first token comes from its prefill. Progress totals: a stop token or the context
    limit ends a request sooner."""
    return (sum(len(p) for p in prompts) + len(prompts) - 1,
            len(prompts) * (max_new_tokens - 1))


def tokens_left(live: Live) -> tuple[int, int]:
    """planned_tokens of what a queued or running request has left."""
    if not live.out:
        return planned_tokens(live.prompts, live.req.max_new_tokens)
    later = live.prompts[live.turn + 1:]
    return (sum(len(p) + 1 for p in later),
            live.req.max_new_tokens - len(live.out[-1])
            + len(later) * (live.req.max_new_tokens - 1))


class EngineProgress:
    """Two bars for an engine's work: prompt tokens prefilled and tokens decoded, each against
    its total; the decode bar's postfix has the step, the batch and the requests done. It hooks
    the engine's on_prefill until close()."""

    def __init__(self, engine: Engine, label: str, prefill_total: int, decode_total: int,
                 requests: int):
        from tqdm import tqdm
        name = f"{label} " if label else ""
        self.engine, self.requests, self.steps = engine, requests, 0
        self.prefill = tqdm(total=prefill_total, desc=f"{name}prefill", unit="tok",
                            leave=False, position=0)
        self.decode = tqdm(total=decode_total, desc=f"{name}decode", unit="tok", leave=False,
                           position=1)
        self._hooked = engine.on_prefill
        engine.on_prefill = self.prefilled

    def prefilled(self, tokens: int) -> None:
        self.prefill.update(min(tokens, self.prefill.total - self.prefill.n))
        if self._hooked is not None:
            self._hooked(tokens)

    def stepped(self, new: Sequence[StepStats], requests_done: int) -> None:
        """After engine.step(): `new` its decode steps' stats (none or one)."""
        for s in new:
            self.steps += 1
            # each request emits its accepted drafts and one token (a turn ending on a draft
            # emits fewer: the bar stops at its total)
            self.decode.update(min(s.batch + s.accepted, self.decode.total - self.decode.n))
        batch = new[-1].batch if new else 0
        self.decode.set_postfix_str(f"step {self.steps}, batch {batch}, requests done "
                                    f"{requests_done}/{self.requests}")

    def close(self) -> None:
        self.engine.on_prefill = self._hooked
        self.decode.close()
        self.prefill.close()
