"""dsa-lite engine: in-flight batching, MTP draft/verify, multi-turn, CUDA graphs, SPIN state.

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
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from .. import costs
from .. import reference as ref
from ..config import SpinConfig
from ..errors import SpinConfigError, SpinError
from ..indexer import PREDICTORS, DenseIndexer, SpinIndexer
from ..replay.trace import SpinTrace
from ..state import StatePool
from .config import DsaLiteConfig
from .model import Caches, DsaLiteModel, init_weights


SWITCHES = ("auto", "spin", "dense")


class RequestError(SpinError):
    """A request that cannot be served as given (the engine and other requests carry on)."""


Prompt = str | bytes | Sequence[int]


@dataclass
class Request:
    prompt: Prompt
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    turns: Sequence[Prompt] = ()          # follow-up user turns, each continues the context
    stop_token: Optional[int] = None
    request_id: Optional[int] = None      # assigned by the engine when None
    forced: Optional[Sequence[int]] = None  # teacher forcing: emit these instead of sampling


@dataclass
class RequestOutput:
    request_id: int
    turns: list[list[int]]                # generated tokens of each turn
    finish_reason: str                    # "length", "stop" (both per last turn) or "context"
    decode_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    logprobs: list[float] = field(default_factory=list)   # natural log p of each token

    @property
    def tokens(self) -> list[int]:
        return [t for turn in self.turns for t in turn]

    def text(self) -> str:
        return bytes(t for t in self.tokens if t < 256).decode("utf-8", "replace")


@dataclass
class _Live:
    req: Request
    rid: int
    prompts: list[list[int]]
    slot: int = -1
    context: list[int] = field(default_factory=list)   # tokens in the KV cache, in order
    pending: int = -1                                   # sampled, not yet in the cache
    drafts: list[int] = field(default_factory=list)
    turn: int = 0
    out: list[list[int]] = field(default_factory=list)
    step: int = 0                                       # decode steps since admission
    hidden: Optional[torch.Tensor] = None               # MTP input: hidden of the last row
    drafted: int = 0
    accepted: int = 0
    reserved_pages: int = 0
    logprobs: list[float] = field(default_factory=list)
    spin_stale: bool = False                            # sat out SPIN steps: reset on return


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
    selected_blocks: int = 0
    visible_blocks: int = 0
    miss: list[float] = field(default_factory=list)
    accepted: int = 0
    drafted: int = 0
    graph: bool = False
    spin: bool = False                    # SPIN ran this step (not the all-keep indexer)
    _events: list = field(default_factory=list, repr=False)


def _tokens(prompt: Prompt, vocab: int, what: str) -> list[int]:
    """Token ids of a prompt: text, bytes, or a list/tuple/range (or 1-D integer tensor or
    array) of ints. Bools, floats (even integral ones) and mappings are refused, not cast."""
    if isinstance(prompt, str):
        prompt = prompt.encode("utf-8")
    if isinstance(prompt, (bytes, bytearray)):
        toks = list(prompt)
    elif isinstance(prompt, (torch.Tensor, np.ndarray)):
        integer = prompt.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8) \
            if isinstance(prompt, torch.Tensor) else np.issubdtype(prompt.dtype, np.integer)
        if not integer or prompt.ndim != 1:
            raise RequestError(f"{what}: a tensor or array prompt must be 1-D integer token ids, "
                               f"got {prompt.dtype} with {prompt.ndim} dims")
        toks = [int(t) for t in prompt.tolist()]
    elif isinstance(prompt, (list, tuple, range)):
        toks = []
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise RequestError(f"{what}: token ids must be ints, got "
                                   f"{type(t).__name__} {str(t)[:40]}")
            toks.append(int(t))
    else:
        raise RequestError(f"{what}: must be text, bytes or a list of token ids, got "
                           f"{type(prompt).__name__}")
    if not toks:
        raise RequestError(f"{what}: empty prompt")
    bad = [t for t in toks if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"{what}: token id {bad[0]} outside the vocabulary [0, {vocab})")
    return toks


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def resolve_device(name: str) -> torch.device:
    """--device: "auto" (CUDA when present), "cpu", "cuda[:i]"; a clear error without CUDA."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SpinError(f"--device {name}: this torch has no CUDA device")
    return dev


def sample(logits: torch.Tensor, temperature: float, top_k: int, seed: int,
           position: int) -> int:
    """Greedy at temperature 0; else Gumbel-max with counter-hash noise keyed by (seed,
    position): the same token whatever the batch, device or run."""
    if temperature == 0:
        return int(logits.argmax())
    x = logits.double() / temperature
    if 0 < top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    vocab = torch.arange(x.numel(), dtype=torch.int64)
    h = ref.counter_hash(seed, torch.tensor(position), torch.tensor(0), torch.tensor(0), vocab)
    u = (h.double() + 0.5) / 2.0 ** 32
    return int((x - torch.log(-torch.log(u))).argmax())


class _PrefillIndexer:
    """Dense top-K for the rows of one prefill chunk (plain PyTorch over the request's pages)."""

    def __init__(self, k: int, dtype: torch.dtype):
        self.k, self.dtype = k, dtype

    def prepare(self, context_lens: torch.Tensor, block_table: torch.Tensor) -> None:
        self.context_lens, self.block_table = context_lens, block_table
        self.blocks = math.ceil(int(context_lens.max()) / ref.PAGE_SLOTS)

    def layer(self, layer, q, weights, kv_cache) -> torch.Tensor:
        rows, nb = q.shape[0], self.blocks
        if nb == 0:
            return torch.full((rows, self.k), -1, dtype=torch.int32, device=q.device)
        pages = kv_cache[self.block_table[0, :nb].long()]
        ids = torch.arange(nb, dtype=torch.int32, device=q.device).view(1, -1)
        counts = torch.tensor([nb], dtype=torch.int32, device=q.device)
        dt = torch.float64 if self.dtype == torch.float64 else torch.float32
        logits = ref.masked_indexer_logits(q, pages, weights, self.context_lens, ids, ids,
                                           counts, dtype=dt)
        return ref.topk_slots(logits, ids, counts, rows, self.k)


class _Observed:
    """Runs the shadow dense indexer next to the real one: miss rate and trace scores."""

    def __init__(self, engine: "Engine", batch: list[_Live], stats: StepStats,
                 context_lens: torch.Tensor):
        self.e, self.batch, self.stats = engine, batch, stats
        self.visible_blocks = (context_lens.long() + ref.PAGE_SLOTS - 1) // ref.PAGE_SLOTS
        # (request id, layer) -> dense scores [R, width], q [R, H, D] and w [R, H] of its rows
        self.trace_rows: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def layer(self, layer, q, weights, kv_cache) -> torch.Tensor:
        e, R = self.e, self.e.cfg.next_n
        true = e._timed(lambda: e.shadow.layer(layer, q, weights, kv_cache), self.stats,
                        "shadow_seconds").long()
        for i, live in enumerate(self.batch):
            if live.rid in e.trace_requests:
                rows = slice(i * R, (i + 1) * R)
                # copies: the shadow's logits buffer is reused by the next layer (on the CPU
                # .float().cpu() would alias it). q: the fp8 values (exact in float16); their
                # scale is already in the weights
                self.trace_rows[(live.rid, layer)] = (
                    e.shadow.step_logits[rows, :e.shadow.m_cap * ref.PAGE_SLOTS].to(
                        "cpu", torch.float32, copy=True),
                    q[rows].float().to(torch.float16).cpu(), weights[rows].float().cpu())
        top = e._timed_layer(layer, q, weights, kv_cache, self.stats)
        if isinstance(e.indexer, SpinIndexer):
            B = len(self.batch)
            ids = e.indexer.block_ids[:B, layer].long()
            cnt = e.indexer.counts[:B, layer].long()
            live_ids = torch.where(torch.arange(ids.shape[1], device=ids.device) < cnt[:, None],
                                   ids, -1)
            blocks = true.clamp(min=0) // ref.PAGE_SLOTS                       # [B*R, K]
            sel = (blocks.view(B, R, -1, 1) == live_ids.view(B, 1, 1, -1)).any(-1)
            valid = (true >= 0).view(B, R, -1)
            n = valid.sum(-1)
            # as in replay: rows where SPIN dropped blocks (not warm-up, not all kept)
            eligible = (n > 0) & (cnt.view(B, 1) < self.visible_blocks.to(cnt.device))
            miss = ((valid & ~sel).sum(-1).double() / n.clamp(min=1))[eligible]
            self.stats.miss.extend(miss.cpu().tolist())
        return top


class Engine:
    def __init__(self, cfg: DsaLiteConfig, spin: Optional[SpinConfig] = None, *,
                 weights: Optional[dict[str, torch.Tensor]] = None,
                 device: torch.device | str = "cpu", max_batch: int = 8,
                 max_requests: Optional[int] = None, num_pages: Optional[int] = None,
                 cuda_graphs: Optional[bool] = None, measure_miss: bool = False,
                 trace_request: Optional[int | Sequence[int]] = None,
                 time_indexer: bool = False,
                 drafter: Optional[Callable[[int, list[int], int], list[int]]] = None,
                 state_initial_capacity: int = 1024, logits_backend: str = "native",
                 switch: Optional[str] = None, cost_model: Optional[costs.CostModel] = None,
                 predictor: str = "spin", overlap_update: bool = True,
                 overlap_select: bool = False):
        """spin=None runs the all-keep (dense) indexer. cuda_graphs defaults to on for CUDA;
        measuring misses, tracing or timing the indexer runs steps eagerly. `drafter`
        (request id, context + pending token, depth) -> drafts replaces the MTP head. SPIN state
        starts at state_initial_capacity indexer slots per request and grows with the longest
        context (StatePool.ensure_capacity). logits_backend: where the decode indexer's logits
        come from (spin_trtllm.logits: native, deepgemm, reference).
        switch (with SPIN): "spin" runs SPIN every step; "dense" runs the all-keep indexer;
        "auto" picks per step from `cost_model` (spin_trtllm.costs; default: H200 constants with
        the top-K priced as ops.topk runs it here) whether SPIN beats all-keep for the batch, so
        it is never the slower of the two. Steps run all-keep do not update SPIN's state; a
        request SPIN takes over again restarts warm-up. Default: "auto" on CUDA, "spin" on the
        CPU (the reference ops there).
        predictor (with SPIN): "spin" ranks blocks by SPIN's history, "probe" by each block's
        summary (mean key) scored with the current query (SpinIndexer), "hybrid" by both (the
        max of their rank shares); the summaries are built after every prefill and rebuilt
        for requests SPIN takes over again.
        overlap_update (SPIN without MTP, sm_90+): each layer's EMA update is launched to run
        beside its top-K on the same stream (SpinIndexer; ops.update's beside_previous).
        overlap_select (predictor "spin", sm_90+; off by default, see SpinIndexer): each layer's
        blocks are selected beside the previous layer's top-K instead of all layers in one
        launch (ops.select's beside_previous)."""
        self.cfg = cfg
        self.device = torch.device(device)
        if spin is not None and spin.index_topk != cfg.index_topk:
            raise SpinConfigError(f"spin index_topk {spin.index_topk} differs from the model's "
                                  f"index_topk {cfg.index_topk}")
        if max_batch < 1:
            raise SpinError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self.max_requests = max_requests or max_batch
        if self.max_requests < max_batch:
            raise SpinError(f"max_requests ({self.max_requests}) must be >= max_batch ({max_batch})")
        self.model = DsaLiteModel(cfg, weights if weights is not None else init_weights(cfg),
                                  self.device)
        pages_per_request = math.ceil(cfg.index_slots / ref.PAGE_SLOTS)
        self.caches = Caches(cfg, self.max_requests,
                             num_pages or self.max_requests * pages_per_request, self.device)
        L, R = len(cfg.csa_layers), cfg.next_n
        self.spin = spin
        if switch is None:
            switch = "auto" if self.device.type == "cuda" else "spin"
        if switch not in SWITCHES:
            raise SpinError(f"switch must be one of {', '.join(SWITCHES)}, got {switch!r}")
        self.switch = switch
        if predictor not in PREDICTORS:
            raise SpinError(f"predictor must be one of {', '.join(PREDICTORS)}, got {predictor!r}")
        if predictor != "spin" and spin is None:
            raise SpinError(f"predictor={predictor!r} needs a SpinConfig (spin=None runs all-keep)")
        self.predictor = predictor
        # the default model prices the top-K that ops.topk runs here (flashinfer's if installed)
        self.cost_model = cost_model or costs.H200.for_device(self.device)
        self._ran_spin = True
        self.spin_indexer: Optional[SpinIndexer] = None
        if spin is not None:
            self.pool: Optional[StatePool] = StatePool(
                L, self.max_requests, spin, self.device,
                initial_capacity=min(state_initial_capacity, cfg.index_slots + R),
                max_capacity=cfg.index_slots + R)
            self.spin_indexer = SpinIndexer(spin, self.pool, max_batch, R, cfg.index_slots,
                                            logits_backend=logits_backend, predictor=predictor,
                                            overlap_update=overlap_update,
                                            overlap_select=overlap_select)
        else:
            self.pool = None
        self.dense_indexer = DenseIndexer(cfg.index_topk, L, max_batch, R, cfg.index_slots,
                                          self.device, logits_backend=logits_backend) \
            if spin is None or switch != "spin" else None
        self.indexer = self.spin_indexer or self.dense_indexer
        self.trace_requests: set[int] = set() if trace_request is None else (
            {trace_request} if isinstance(trace_request, int) else set(trace_request))
        self.measure_miss = measure_miss
        self.time_indexer = time_indexer
        self.shadow = DenseIndexer(cfg.index_topk, L, max_batch, R, cfg.index_slots, self.device) \
            if (measure_miss or self.trace_requests) else None
        self.prefill_indexer = _PrefillIndexer(cfg.index_topk, self.model.dtype)
        self.drafter = drafter
        eager_only = self.shadow is not None or time_indexer
        self.cuda_graphs = (self.device.type == "cuda" and not eager_only) \
            if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and (self.device.type != "cuda" or eager_only):
            raise SpinError("cuda_graphs needs a CUDA device and no miss measuring, tracing or "
                            "indexer timing")
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor,
                                                   torch.Tensor]] = {}
        self._graph_pool = None
        self._graph_generation = self.pool.generation if self.pool is not None else 0
        self._in = {
            "tokens": torch.zeros(max_batch, R, dtype=torch.int64, device=self.device),
            "pos": torch.zeros(max_batch, R, dtype=torch.int64, device=self.device),
            "slot": torch.zeros(max_batch, dtype=torch.int64, device=self.device),
            "table": torch.zeros(max_batch, self.caches.max_pages, dtype=torch.int32,
                                 device=self.device)}
        self.waiting: deque[_Live] = deque()
        self.running: list[_Live] = []
        self._free_slots = list(range(self.max_requests - 1, -1, -1))
        self._reserved = 0
        self._ids_in_use: set[int] = set()
        self._next_id = 0
        self.history: list[StepStats] = []
        self.prefill_seconds = 0.0
        self._traces: dict[int, dict[str, list]] = {
            rid: {"scores": [], "row_len": [], "query_pos": [], "accepted": [], "turn_start": [],
                  "q": [], "w": [], "keys": [torch.zeros(0, ref.KEY_BYTES, dtype=torch.float16)
                                             for _ in range(L)], "final": [0]}
            for rid in self.trace_requests}

    # ---- requests --------------------------------------------------------------------------
    def submit(self, req: Request) -> int:
        """Validate and queue a request; returns its id. Raises RequestError, changing nothing."""
        cfg = self.cfg
        rid = req.request_id
        what = f"request {rid if rid is not None else self._next_id}"
        if rid is not None and (not _is_int(rid) or rid < 0 or rid >= 1 << 62):
            raise RequestError(f"{what}: request_id must be an int in [0, 2^62)")
        if rid is not None and rid in self._ids_in_use:
            raise RequestError(f"{what}: request_id already in use")
        if not _is_int(req.max_new_tokens) or req.max_new_tokens < 1:
            raise RequestError(f"{what}: max_new_tokens must be an int >= 1, got "
                               f"{req.max_new_tokens!r}")
        if isinstance(req.temperature, bool) or not isinstance(req.temperature, (int, float)) \
                or not 0 <= req.temperature < math.inf:
            raise RequestError(f"{what}: temperature must be a finite number >= 0, got "
                               f"{req.temperature!r}")
        if not _is_int(req.top_k) or req.top_k < 0:
            raise RequestError(f"{what}: top_k must be an int >= 0, got {req.top_k!r}")
        if not _is_int(req.seed) or not 0 <= req.seed < 1 << 32:
            raise RequestError(f"{what}: seed must be an int in [0, 2^32), got {req.seed!r}")
        if req.stop_token is not None and (not _is_int(req.stop_token) or
                                           not 0 <= req.stop_token < cfg.vocab_size):
            raise RequestError(f"{what}: stop_token must be a token id in [0, {cfg.vocab_size}), "
                               f"got {req.stop_token!r}")
        if not isinstance(req.turns, (list, tuple)):
            raise RequestError(f"{what}: turns must be a list of prompts, got "
                               f"{type(req.turns).__name__}")
        if req.forced is not None:
            forced = _tokens(req.forced, cfg.vocab_size, f"{what} forced")
            if req.turns:
                raise RequestError(f"{what}: forced tokens work with one turn only")
            if len(forced) < req.max_new_tokens:
                raise RequestError(f"{what}: {len(forced)} forced tokens, fewer than "
                                   f"max_new_tokens {req.max_new_tokens}")
        prompts = [_tokens(req.prompt, cfg.vocab_size, f"{what} prompt")]
        prompts += [_tokens(t, cfg.vocab_size, f"{what} turn {i + 1}")
                    for i, t in enumerate(req.turns)]
        worst = sum(len(p) for p in prompts) + len(prompts) * req.max_new_tokens + cfg.next_n
        if worst > cfg.max_context:
            raise RequestError(f"{what}: prompts ({sum(len(p) for p in prompts)} tokens) plus "
                               f"{len(prompts)} x max_new_tokens ({req.max_new_tokens}) need up "
                               f"to {worst} positions; max_context is {cfg.max_context}")
        if rid is None:
            while self._next_id in self._ids_in_use:
                self._next_id += 1
            rid = self._next_id
            self._next_id += 1                   # a finished request's id is not handed out again
        self._ids_in_use.add(rid)
        live = _Live(req, rid, prompts)
        live.reserved_pages = math.ceil((worst // cfg.index_ratio + 1) / ref.PAGE_SLOTS)
        if live.reserved_pages > self.caches.num_pages:
            self._ids_in_use.discard(rid)
            raise RequestError(f"{what}: needs {live.reserved_pages} indexer pages, the cache "
                               f"has {self.caches.num_pages}")
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
        live = _Live(Request([0], max_new_tokens=max_new_tokens), request_id, [[0]])
        live.reserved_pages = math.ceil(((context_tokens + max_new_tokens + R) // cfg.index_ratio + 1)
                                        / ref.PAGE_SLOTS)
        if self._reserved + live.reserved_pages > self.caches.num_pages:
            raise RequestError("synthetic request: indexer K cache out of pages")
        self._ids_in_use.add(request_id)
        live.slot = self._free_slots.pop()
        self._reserved += live.reserved_pages
        if self.pool is not None:
            self.pool.admit(request_id)
        c, slot = self.caches, live.slot
        c.ensure_pages(slot, context_tokens // cfg.index_ratio + 1)
        g = torch.Generator(self.device).manual_seed(seed)
        for t in c.ring_k + c.ring_v + list(c.ring_ik.values()) + list(c.comp.values()):
            t[slot] = torch.randn(t.shape[1:], generator=g, device=self.device).to(t.dtype)
        pages = c.block_table[slot, :math.ceil((context_tokens // cfg.index_ratio + 1) / ref.PAGE_SLOTS)]
        for kv in c.index:
            keys = torch.randn(len(pages), ref.PAGE_SLOTS * ref.KEY_BYTES, generator=g,
                               device=self.device).to(torch.float8_e4m3fn).view(torch.uint8)
            scales = (torch.rand(len(pages), ref.PAGE_SLOTS, generator=g, device=self.device)
                      * 0.01 + 0.001).view(torch.uint8)
            kv.view(kv.shape[0], -1)[pages.long()] = torch.cat([keys, scales], 1)
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
        bar = None
        total = len(self.waiting) + len(self.running)
        if progress:
            # decode steps, not requests: a bar of requests sits at 0% until the first finishes
            from tqdm import tqdm
            bar = tqdm(desc="decode steps", unit="step", leave=False)
        steps = 0
        while not self.idle:
            if steps >= max_steps:
                raise SpinError(f"engine did not finish within {max_steps} steps")
            before = len(self.history)
            finished = self.step()
            done += finished
            steps += 1
            if bar is not None:
                bar.update(len(self.history) - before)
                batch = self.history[-1].batch if self.history else 0
                bar.set_postfix_str(f"requests done {len(done)}/{total}, batch {batch}")
        if bar is not None:
            bar.close()
        return done

    # ---- one engine step ---------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        finished: list[RequestOutput] = []
        joined = []
        while self.waiting and len(self.running) + len(joined) < self.max_batch \
                and self._free_slots \
                and self._reserved + self.waiting[0].reserved_pages <= self.caches.num_pages:
            live = self.waiting.popleft()
            live.slot = self._free_slots.pop()
            self._reserved += live.reserved_pages
            if self.pool is not None:
                self.pool.admit(live.rid)
            live.out.append([])
            try:
                self._prefill(live, live.prompts[0])
            except Exception:
                self._finish(live, "error", [])    # give back its slot, pages and state
                raise
            if not self._emit(live, [live.pending], finished):
                joined.append(live)
        batch = list(self.running)
        if batch:
            self._decode(batch, finished)
        self.running = [r for r in batch if r.slot >= 0] + joined
        return finished

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _prefill(self, live: _Live, tokens: list[int]) -> None:
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
        live.context += tokens
        self._summarize([live])                   # every page: a new turn rewrote some
        live.pending = self._target(live, logits[0, -1].cpu(), 0, len(live.context))
        live.hidden = hidden[0, -1]
        if self.pool is not None and live.turn > 0:
            self.pool.reset([live.rid], live.step)
        if live.rid in self.trace_requests:
            self._traces[live.rid]["turn_start"].append(len(self._traces[live.rid]["row_len"]))
        self._draft([live])
        self._sync()
        self.prefill_seconds += time.perf_counter() - t0

    def _summarize(self, lives: list[_Live]) -> None:
        """predictor="probe"/"hybrid": the block summaries of every visible page of these
        requests, in every indexer layer (eager; decode steps keep only the newest pages up to
        date)."""
        if self.spin_indexer is None or self.predictor == "spin" or not lives:
            return
        slots = torch.tensor([live.slot for live in lives], dtype=torch.int64, device=self.device)
        table = self.caches.block_table[slots]
        n = [len(live.context) // self.cfg.index_ratio for live in lives]
        for ci, kv in enumerate(self.caches.index):
            self.spin_indexer.summarize_context(ci, kv, table, n)

    def _target(self, live: _Live, logits: torch.Tensor, ahead: int, position: int) -> int:
        """The target row's token: the forced one (teacher forcing, its log-prob recorded) or
        a sample. `ahead` counts the rows before it in this step."""
        r = live.req
        if r.forced is None:
            return sample(logits, r.temperature, r.top_k, r.seed, position)
        index = len(live.out[-1]) + ahead
        token = int(r.forced[min(index, len(r.forced) - 1)])
        live.logprobs.append(float(logits.double().log_softmax(-1)[token]))
        return token

    def _draft(self, lives: list[_Live]) -> None:
        d = self.cfg.mtp_depth
        if not d or not lives:
            return
        if self.drafter is not None:
            for live in lives:
                drafts = [int(t) for t in self.drafter(live.rid, live.context + [live.pending], d)]
                if len(drafts) != d or not all(0 <= t < self.cfg.vocab_size for t in drafts):
                    raise SpinError(f"drafter returned {drafts!r}, need {d} token ids")
                live.drafts = drafts
            return
        hidden = torch.stack([live.hidden for live in lives])
        token = torch.tensor([live.pending for live in lives], device=self.device)
        drafts = self.model.draft(hidden, token, d).cpu().tolist()
        for live, dr in zip(lives, drafts):
            live.drafts = dr

    def _emit(self, live: _Live, tokens: list[int], finished: list[RequestOutput]) -> bool:
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

    def _end_turn(self, live: _Live, reason: str, finished: list[RequestOutput]) -> bool:
        live.turn += 1
        if live.turn < len(live.prompts):
            live.out.append([])
            self._prefill(live, [live.pending] + live.prompts[live.turn])
            return self._emit(live, [live.pending], finished)
        self._finish(live, reason, finished)
        return True

    def _finish(self, live: _Live, reason: str, finished: list[RequestOutput]) -> None:
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
    def _decode(self, batch: list[_Live], finished: list[RequestOutput]) -> None:
        cfg, R, B = self.cfg, self.cfg.next_n, len(batch)
        for live in batch:
            if len(live.context) + R > cfg.max_context:          # cannot happen after submit
                self._finish(live, "context", finished)
        batch = [live for live in batch if live.slot >= 0]
        B = len(batch)
        if not B:
            return
        t0 = time.perf_counter()
        stats = StepStats(batch=B, seconds=0.0)
        start = torch.tensor([len(live.context) for live in batch], dtype=torch.int64)
        pos = start.view(-1, 1) + torch.arange(R)
        tokens = torch.tensor([[live.pending] + live.drafts for live in batch], dtype=torch.int64)
        for live, p in zip(batch, pos[:, -1].tolist()):
            self.caches.ensure_pages(live.slot, p // cfg.index_ratio + 1)
        slots = torch.tensor([live.slot for live in batch], dtype=torch.int64)
        self._in["tokens"][:B].copy_(tokens)
        self._in["pos"][:B].copy_(pos)
        self._in["slot"][:B].copy_(slots)
        self._in["table"][:B].copy_(self.caches.block_table[slots.to(self.device)])
        ctx = ((pos + 1) // cfg.index_ratio).to(torch.int32)
        qpos = (pos // cfg.index_ratio).to(torch.int32)
        ids = [live.rid for live in batch]
        steps = [live.step for live in batch]
        table = self._in["table"][:B]
        stats.spin = self._choose(batch, ctx)
        self.indexer.prepare(ids, ctx, qpos, steps, table)
        if self.pool is not None and self.pool.generation != self._graph_generation:
            self._graphs.clear()                  # the state was reallocated: capture again
            self._graph_generation = self.pool.generation
        observed = None
        if self.shadow is not None:
            self.shadow.prepare(ids, ctx, qpos, steps, table)
            observed = _Observed(self, batch, stats, ctx)
        if self.device.type == "cuda":
            f0, f1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            f0.record()
        t_launch = time.perf_counter()
        stats.prepare_seconds = t_launch - t0
        logits, hidden = self._forward(B, observed, stats)
        if self.device.type == "cuda":
            f1.record()
            stats._events.append((f0, f1, "forward_seconds"))
        t_wait = time.perf_counter()
        stats.launch_seconds = t_wait - t_launch
        greedy = logits.argmax(-1).cpu().tolist()   # Python ints: no tensor index per row
        stats.wait_seconds = time.perf_counter() - t_wait
        sampled = [b for b, live in enumerate(batch)
                   if live.req.temperature > 0 or live.req.forced is not None]
        row_logits = logits[sampled].cpu() if sampled else None
        # realized sparsity counts what was skipped: all-keep steps skip nothing
        visible = (ctx.max(1).values + ref.PAGE_SLOTS - 1) // ref.PAGE_SLOTS
        stats.visible_blocks = int(visible.sum()) * len(cfg.csa_layers)
        # summed on the device now (stream order keeps this step's counts) and read after the
        # step's final sync: no wait for the GPU before verification
        selected = self.indexer.counts[:B].sum() if stats.spin else None
        # verify the drafts against the target rows
        accepted = []
        emitted = []
        for b, live in enumerate(batch):
            r, p = live.req, int(start[b])
            targets = []
            a = 0
            for j in range(R):
                if r.temperature > 0 or r.forced is not None:
                    row = row_logits[sampled.index(b), j]
                    targets.append(self._target(live, row, j, p + j + 1))
                else:
                    targets.append(greedy[b][j])
                if j < R - 1 and live.drafts[j] == targets[j]:
                    a += 1
                else:
                    break
            accepted.append(a)
            emitted.append(live.drafts[:a] + [targets[a]])
        acc = torch.tensor(accepted, dtype=torch.int32, device=self.device)
        self._timed(lambda: self.indexer.finish(acc if R > 1 else None), stats)
        if observed is not None:
            for b, rid in enumerate(ids):
                if rid in self.trace_requests:
                    self._record_trace(observed, rid, ctx[b], qpos[b], accepted[b])
        redraft = []
        # one gather, not a copy per request: graph outputs are overwritten next replay
        kept_hidden = hidden[torch.arange(B, device=hidden.device), acc.to(torch.int64)].unbind(0)
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
        self._sync()
        stats.selected_blocks = int(selected) if selected is not None else stats.visible_blocks
        stats.seconds = time.perf_counter() - t0
        for a, b, what in stats._events:
            setattr(stats, what, getattr(stats, what) + a.elapsed_time(b) / 1e3)
        stats._events.clear()
        self.history.append(stats)

    def _choose(self, batch: list[_Live], ctx: torch.Tensor) -> bool:
        """SPIN or all-keep for this step (self.indexer is set to it). Requests that sat out
        SPIN steps restart warm-up when SPIN takes over: their state missed those steps."""
        if self.spin_indexer is None:
            return False
        if self.switch == "auto":
            use = self.cost_model.prefer_spin(ctx.max(1).values.tolist(),
                                              self.spin.target_sparsity, self.cfg.next_n,
                                              self.pool.state.V.element_size(),
                                              running_spin=self._ran_spin,
                                              predictor=self.predictor,
                                              update_beside=self.spin_indexer.update_beside,
                                              index_topk=self.spin.index_topk)
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

    def _forward(self, B: int, observed, stats: StepStats):
        i = self._in
        args = (i["tokens"][:B], i["pos"][:B], i["slot"][:B], i["table"][:B], self.caches)
        if observed is not None or not self.cuda_graphs:
            self._timed(self.indexer.select, stats)
            indexer = observed if observed is not None else (
                _TimedIndexer(self, stats) if self.time_indexer else self.indexer)
            return self.model.forward(*args, indexer)
        stats.graph = True
        key = (B, stats.spin)
        if key in self._graphs:
            graph, logits, hidden = self._graphs[key]
            graph.replay()
            return logits, hidden
        # first time at this batch size: run eagerly (the real step), then capture for later
        self.indexer.select()
        out = self.model.forward(*args, self.indexer)
        self._sync()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            self.indexer.select()
            logits, hidden = self.model.forward(*args, self.indexer)
        self._graphs[key] = (graph, logits, hidden)
        return out

    def _timed(self, fn, stats: StepStats, what: str = "indexer_seconds"):
        """Run fn, adding its time to stats.<what>: CUDA events on the GPU (no host sync inside
        the step), wall time on the CPU."""
        if not self.time_indexer:
            return fn()
        if self.device.type == "cuda":
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

    def _timed_layer(self, layer, q, weights, kv_cache, stats: StepStats) -> torch.Tensor:
        return self._timed(lambda: self.indexer.layer(layer, q, weights, kv_cache), stats)

    def _record_trace(self, observed: _Observed, rid: int, ctx: torch.Tensor,
                      qpos: torch.Tensor, accepted: int) -> None:
        if int(ctx.min()) < 1:
            return                                 # the trace format needs >= 1 slot per row
        t = self._traces[rid]
        L = len(self.cfg.csa_layers)
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
        self._record_trace_keys(t, live.slot, int(ctx.max()), int(ctx[accepted]))

    def _record_trace_keys(self, t: dict, cache_slot: int, seen: int, committed: int) -> None:
        """Dequantized keys (fp8 x scale, as float16) of the request's slots from the first one
        that may have changed since the last recorded step up to `seen`. Slots below
        `committed` (complete groups of accepted tokens) never change again; those above it
        were written by rejected draft rows, and the next step or turn rewrites them, so they
        are read again then. The pages are read now: a finished request gives them back."""
        first = t["final"][0] // ref.PAGE_SLOTS
        pages = self.caches.block_table[cache_slot, first:-(-seen // ref.PAGE_SLOTS)].long()
        lo = first * ref.PAGE_SLOTS
        for ci, buf in enumerate(t["keys"]):
            keys = ref.dequantize_pages(self.caches.index[ci][pages]).reshape(-1, ref.KEY_BYTES)
            if buf.shape[0] < seen:
                grown = torch.zeros(max(seen, 2 * buf.shape[0]), ref.KEY_BYTES,
                                    dtype=torch.float16)
                grown[:buf.shape[0]] = buf
                t["keys"][ci] = buf = grown
            buf[lo:seen] = keys[:seen - lo].to(torch.float16).cpu()
        t["final"][0] = max(t["final"][0], committed)

    def trace(self, request_id: Optional[int] = None) -> SpinTrace:
        """SPIN trace v2 of a traced request's decode steps: the dense shadow scores, the
        indexer's q (fp8 values) and w (its scales folded in) of every row, and the keys of
        every slot (dequantized from the indexer K cache as the request left it, or as it was
        when the request finished); the only traced request when request_id is None."""
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
        T, L = len(t["row_len"]), len(self.cfg.csa_layers)
        starts = sorted({s for s in t["turn_start"] if s < T})
        row_len = torch.stack(t["row_len"]).to(torch.int32)
        q = torch.stack(t["q"])                                       # [T * L, R, H, D]
        S = int(row_len.max())
        return SpinTrace(scores=torch.cat(t["scores"]).float(), row_len=row_len,
                         query_pos=torch.stack(t["query_pos"]).to(torch.int32),
                         index_topk=self.cfg.index_topk, block_size=ref.PAGE_SLOTS,
                         turn_start=torch.tensor(starts, dtype=torch.int32) if starts else None,
                         accepted=torch.tensor(t["accepted"], dtype=torch.int32),
                         compress_ratio=self.cfg.index_ratio, source="dsa-lite",
                         q=q.view(T, L, *q.shape[1:]),
                         w=torch.stack(t["w"]).view(T, L, *t["w"][0].shape),
                         keys=torch.stack([k[:S] for k in t["keys"]])).validate()


class _TimedIndexer:
    def __init__(self, engine: Engine, stats: StepStats):
        self.e, self.stats = engine, stats

    def layer(self, layer, q, weights, kv_cache):
        return self.e._timed_layer(layer, q, weights, kv_cache, self.stats)
