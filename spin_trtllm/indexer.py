"""SpinIndexer: the decode-indexer step of a batch with SPIN, backend-agnostic.

Per decode step:
    prepare(request_ids, ...)   host side: batch metadata into preallocated device buffers
    select()                    one launch: the blocks of every request and indexer layer
                                (with overlap_select: layer 0's; each layer's top-K is then
                                followed by the next layer's select, which runs beside it; the
                                probe, hybrid and gauss select in layer(), so only a dense
                                step's select runs here)
    layer(l, q, weights, kv)    per indexer layer: masked logits + top-K (TensorRT-LLM's
                                topk_indices format); without MTP the update follows (the EMAs
                                for spin and hybrid, the blocks' last step for probe and gauss)
    finish(accepted)            with MTP: the deferred updates, rows 0..accepted per request
Everything after prepare() writes into buffers allocated once, so select/layer/finish can be
captured in a CUDA graph per batch size. It takes the metadata TensorRT-LLM's indexer has:
indexer-slot lengths per MTP row, query positions, the indexer K-cache block table, request ids
and accepted draft counts.

predictor="probe" ranks each layer's blocks by their summaries (mean key per page, one 144-byte
row per page beside the K cache; a block of two 32-slot pages scores as its best page) scored
with the current query, instead of SPIN's V/D history: layer() then summarizes the pages of this
step's newest slots, probes and selects that layer itself; select() only acts for keep_all
steps. The update keeps only the warm-up step counts and exploration ages (ema=False): V and
D, which no rule of the probe reads, are neither read nor written. The caller
builds the summaries of prompt pages with summarize_context() after prefill (see its
docstring). predictor="hybrid" does the same and ranks by the max of the rank shares of the
probe's scores and of SPIN's history prediction (reference.hybrid_scores;
select(merge_history=True), contexts up to 512K slots). predictor="gauss" keeps each page's
mean and per-dimension std (two rows, 288 bytes a page) and ranks by the expected ReLU score
(reference.gauss_scores, the replay's gauss).
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import torch

from . import logits as logits_backends
from . import ops
from . import reference as ref
from .config import SpinConfig
from .errors import SpinError
from .limits import BLOCK_SLOTS, MAX_NEXT_N, PAGE_SIZES
from .options import IndexerOptions
from .state import StatePool




def _backend(backend, device, page_slots: int = BLOCK_SLOTS) -> "logits_backends.LogitsBackend":
    if isinstance(backend, str):
        return logits_backends.resolve(backend, device, page_slots)
    if backend.page_slots != page_slots:
        raise SpinError(f"logits backend {backend.name!r} was made for {backend.page_slots}-slot "
                        f"pages, the K cache has {page_slots}-slot pages")
    return backend


def logits_buffer_shape(layers: int, rows: int, m_cap: int, every_layer: bool) -> tuple:
    """SpinIndexer's compact-logits buffer: every layer's (MTP with a predictor that reads the
    V/D history: finish() updates the EMAs from them) or one, reused by every layer."""
    return (layers if every_layer else 1, rows, m_cap * BLOCK_SLOTS)


def _copy_table(buffer: torch.Tensor, block_table: torch.Tensor, B: int) -> None:
    """The batch's block table into the static buffer; pages past max_context_len are never used."""
    cols = min(block_table.shape[1], buffer.shape[1])
    buffer[:B, :cols].copy_(block_table[:, :cols])
    buffer[:B, cols:] = -1


class _BatchMetadata:
    """A step's per-request metadata (request ids, steps, state slots, row lengths and query
    positions) as views of one device buffer at fixed offsets, so CUDA graphs keep their
    addresses. On a GPU the host fills a pinned staging buffer of the same layout and one
    asynchronous copy uploads it: one transfer a step instead of one per field (each a
    pageable copy and a launch). Sources already on the device are copied after it."""

    FIELDS = (("slot", torch.int32, 1), ("request", torch.int64, 1), ("step", torch.int64, 1),
              ("context_lens", torch.int32, 0), ("query_pos", torch.int32, 0))  # 0: next_n wide

    def __init__(self, max_batch: int, next_n: int, device: torch.device):
        offsets, at = {}, 0
        for name, dtype, width in self.FIELDS:
            shape = (max_batch,) if width else (max_batch, next_n)
            nbytes = math.prod(shape) * dtype.itemsize
            offsets[name] = (at, nbytes, dtype, shape)
            at += -(-nbytes // 8) * 8                    # every view 8-byte aligned
        self.buffer = torch.zeros(at, dtype=torch.uint8, device=device)
        self.staged = device.type == "cuda"
        self.staging = (torch.zeros(at, dtype=torch.uint8, pin_memory=True) if self.staged
                        else self.buffer)
        views = lambda buf: {name: buf[o:o + n].view(dtype).view(shape)
                             for name, (o, n, dtype, shape) in offsets.items()}
        self.device, self.host = views(self.buffer), views(self.staging)
        # recorded after each upload: once it completes the staging buffer may be rewritten
        self._uploaded = torch.cuda.Event() if self.staged else None

    def upload(self, B: int, **values) -> None:
        """values: name -> tensor (any device) or sequence, its first B rows set."""
        if self.staged:
            self._uploaded.synchronize()          # returns at once before the first record
        late = []
        for name, value in values.items():
            if not torch.is_tensor(value):
                value = torch.as_tensor(value, dtype=self.host[name].dtype)
            if value.device.type != "cpu" and self.staged:
                late.append((self.device[name][:B], value))
            else:
                self.host[name][:B].copy_(value)
        if self.staged:
            self.buffer.copy_(self.staging, non_blocking=True)
            # the copy runs on the buffer's device's stream, whatever device is current
            self._uploaded.record(torch.cuda.current_stream(self.buffer.device))
        for dst, value in late:
            dst.copy_(value)


class SpinIndexer:
    def __init__(self, cfg: SpinConfig, pool: StatePool, max_batch: int, next_n: int,
                 max_context_len: int, options: IndexerOptions = IndexerOptions(), *,
                 logits_backend: "Optional[logits_backends.LogitsBackend]" = None,
                 logits_storage: Optional[torch.Tensor] = None,
                 summaries_of: "Optional[SpinIndexer]" = None):
        """options (spin_trtllm.options.IndexerOptions, validated when made): the logits
        backend, predictor, overlaps and page size. logits_backend: that backend already
        resolved by the caller (an engine resolves it once for all its indexers), else
        options.logits_backend is resolved here.
        logits_storage: fp32 memory the compact-logits buffer is carved from (indexers of
        several draft lengths share one allocation).
        summaries_of: an indexer over the same K caches whose summary tables this one shares
        (indexers of several draft lengths: a page summarized by one is current for all).
        predictor: "spin" ranks blocks by the V/D history; "probe" by block summaries scored
        with the current query (summary tables kept in self.summaries; with 32-slot pages a
        block scores as its best page);
        "hybrid" by both (the max of their rank shares; max_context_len <= 512K slots).
        overlap_update: without MTP, let a layer's update run beside its top-K (both only
        read the logits; CUDA sm_90+, ops.update's beside_previous): the update fills the SMs
        that a top-K of few rows leaves idle, and what follows still waits for both.
        overlap_select: with predictor "spin", select each layer's blocks right after the
        previous layer's top-K, beside it (CUDA sm_90+, ops.select's beside_previous), instead
        of every layer in select()'s one launch. Off by default: a one-layer select takes
        13-48 us (one CTA a request), so it hides under the top-K only where that is longer
        and leaves SMs free: faster at 32 requests x 32K-128K slots, slower at 8 x 128K and at
        96 requests (H200, benchmarks/bench_update_overlap.py). A layer reached without it
        (called out of order, or again without a select() in between) is selected on its own
        before its logits: each pass through a layer's logits uses blocks selected from the
        state as it is then. select(keep_all) then selects layer 0 at once and the others where
        their selects run: a CUDA graph that holds those replays the keep_all of its capture, so
        call select() inside the same graph (as the harness engine does), not before it."""
        ops.require_supported(cfg)
        if not isinstance(options, IndexerOptions):
            raise SpinError(f"SpinIndexer: options must be an IndexerOptions, got "
                            f"{type(options).__name__}")
        if max_batch < 1 or not 1 <= next_n <= MAX_NEXT_N or max_context_len < 1:
            raise SpinError(f"SpinIndexer: need max_batch >= 1, 1 <= next_n <= {MAX_NEXT_N}, "
                            f"max_context_len >= 1; got {max_batch}, {next_n}, {max_context_len}")
        chosen, page_slots = options.block_predictor, options.page_slots
        if chosen.max_context_len is not None and max_context_len > chosen.max_context_len:
            raise SpinError(f"SpinIndexer: predictor={chosen.name!r} ranks at most "
                            f"{chosen.max_context_len} slots, got max_context_len="
                            f"{max_context_len} (use 'probe')")
        if chosen.history and not pool.history:
            raise SpinError(f"SpinIndexer: predictor={chosen.name!r} ranks by the V/D history, "
                            f"but the pool keeps none (StatePool(history=False))")
        self.options = options
        self.predictor = chosen
        # the summary ops of a query-aware predictor: gauss rows hold the mean and the std
        gauss = chosen.name == "gauss"
        self._summaries_like = ops.gauss_summaries_like if gauss else ops.summaries_like
        self._summarize = ops.summarize_gauss if gauss else ops.summarize
        self._summarize_newest = functools.partial(ops.summarize_newest, gauss=gauss)
        self._score_pages = ops.gauss if gauss else ops.probe
        self.cfg, self.pool = cfg, pool
        # where the update really runs beside the top-K (the cost model prices it so)
        sm90 = pool.device.type == "cuda" and torch.cuda.get_device_capability(pool.device)[0] >= 9
        self.update_beside = options.overlap_update and next_n == 1 and sm90
        # each layer selected beside the previous layer's top-K; since select(): _selected, the
        # layers selected (in the config select() chose) whose logits have not run yet, and
        # _used, those whose logits have
        self.select_beside = options.overlap_select and not chosen.query and sm90
        self._selected = [False] * pool.num_layers
        self._used = [False] * pool.num_layers
        self._select_cfg = cfg
        self.max_batch, self.next_n, self.max_context_len = max_batch, next_n, max_context_len
        if pool.max_capacity < max_context_len + next_n:
            raise SpinError(f"SpinIndexer: the state pool's max_capacity {pool.max_capacity} is "
                            f"below max_context_len + next_n = {max_context_len + next_n}")
        dev = pool.device
        L = pool.num_layers
        self.backend = _backend(options.logits_backend if logits_backend is None
                                else logits_backend, dev, page_slots)
        # m_cap covers every block: warm-up steps select them all
        self.m_cap = math.ceil(max_context_len / BLOCK_SLOTS)
        rows = max_batch * next_n
        self.block_ids = torch.full((max_batch, L, self.m_cap), -1, dtype=torch.int32, device=dev)
        self.counts = torch.zeros(max_batch, L, dtype=torch.int32, device=dev)
        # with MTP every layer keeps its logits until acceptance is known (for finish()'s EMAs),
        # in a buffer that outlives the step (a backend's own output may live in one CUDA
        # graph's pool); a predictor without history keeps none
        self._keeps_logits = next_n > 1 and chosen.history
        shape = logits_buffer_shape(L, rows, self.m_cap, self._keeps_logits)
        self.logits = None
        if self.backend.needs_out or self._keeps_logits:
            size = math.prod(shape)
            if logits_storage is None:
                self.logits = torch.empty(shape, device=dev)
            elif logits_storage.numel() < size or logits_storage.dtype != torch.float32:
                raise SpinError(f"SpinIndexer: logits_storage must be float32 with >= {size} "
                                f"elements, got {logits_storage.dtype} {logits_storage.numel()}")
            else:
                self.logits = logits_storage.view(-1)[:size].view(shape)
        self.topk = torch.full((L, rows, cfg.index_topk), -1, dtype=torch.int32, device=dev)
        # the batch metadata of a step: views of one device buffer, uploaded by one copy
        self._meta = _BatchMetadata(max_batch, next_n, dev)
        self.slot, self.request, self.step, self.context_lens, self.query_pos = (
            self._meta.device[name] for name, _, _ in _BatchMetadata.FIELDS)
        self.page_slots = page_slots
        self.block_table = torch.full((max_batch, self.m_cap * (BLOCK_SLOTS // page_slots)), -1,
                                      dtype=torch.int32, device=dev)
        self.accepted_zero = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        # with MTP: the counts each layer scored this step, zeroed in prepare() and written by
        # the layer (inside a captured graph too), so a layer the engine skipped learns nothing
        self.ran_counts = torch.zeros(max_batch, L, dtype=torch.int32, device=dev)
        # finish()'s logits when none are kept: update(ema=False) reads none
        self._no_logits = torch.zeros(1, 1, 4, device=dev)
        self.batch = 0
        self.keep_all = False
        # a DeepGEMM-style backend's compacted inputs: every layer's from one launch a step where
        # select() chose every layer's blocks, else one launch a layer
        self._step_inputs = logits_backends.StepCompaction(L, max_batch, next_n, self.m_cap,
                                                           page_slots, dev)
        # probe: layer -> uint8 [num_pages, 144] summary table of that layer's K cache, and the
        # cache it belongs to; the block scores of one layer
        self.summaries: dict[int, torch.Tensor] = {}
        self._summary_cache: dict[int, tuple] = {}
        if summaries_of is not None:
            self.summaries = summaries_of.summaries
            self._summary_cache = summaries_of._summary_cache
        if self.query_aware:
            self.block_scores = torch.full((rows, self.m_cap), float("-inf"), device=dev)
            # the probe scores page columns: the blocks themselves with 64-slot pages; with
            # 32-slot ones a block then takes its best page's score
            self.page_scores = self.block_scores if page_slots == BLOCK_SLOTS else torch.full(
                (rows, self.block_table.shape[1]), float("-inf"), device=dev)

    @property
    def query_aware(self) -> bool:
        """Block summaries scored with the current query rank the blocks (probe, hybrid)."""
        return self.predictor.query

    def prepare(self, request_ids: Sequence[int], context_lens: torch.Tensor,
                query_pos: torch.Tensor, steps: Sequence[int] | torch.Tensor,
                block_table: torch.Tensor, state_slots: Optional[torch.Tensor] = None) -> None:
        """Host side, before the step: copy the batch metadata into the device buffers, and grow
        the state pool when a query position outgrows it (pool.generation changes: CUDA graphs
        captured before must be captured again). Pass CPU tensors to avoid a device sync.
        state_slots overrides the pool's request -> slot map (padding rows of a CUDA-graph
        batch run on free slots with empty contexts)."""
        B = len(request_ids)
        if not 1 <= B <= self.max_batch:
            raise SpinError(f"SpinIndexer: batch of {B} requests, allowed 1..{self.max_batch}")
        if tuple(context_lens.shape) != (B, self.next_n) or tuple(query_pos.shape) != (B, self.next_n):
            raise SpinError(f"SpinIndexer: context_lens and query_pos must be [{B}, "
                            f"{self.next_n}], got {list(context_lens.shape)} and "
                            f"{list(query_pos.shape)}")
        if block_table.dim() != 2 or block_table.shape[0] != B or block_table.dtype != torch.int32:
            raise SpinError(f"SpinIndexer: block_table must be int32 [{B}, max_pages], got "
                            f"{block_table.dtype} {list(block_table.shape)}")
        if query_pos.numel():
            self.pool.ensure_capacity(int(query_pos.max()) + 1)
        self.batch = B
        slots = self.pool.slots(request_ids, device="cpu") if state_slots is None else state_slots
        self._meta.upload(B, slot=slots, step=steps, context_lens=context_lens,
                          query_pos=query_pos,
                          request=[int(r) & ((1 << 63) - 1) for r in request_ids])
        _copy_table(self.block_table, block_table, B)
        self._step_inputs.clear()       # until select(): last step's compacted tables are stale
        if self.next_n > 1:
            self.ran_counts[:B] = 0

    def summary_table(self, layer: int, kv_cache: torch.Tensor) -> torch.Tensor:
        """The summary table of indexer layer `layer`, made (zeroed) the first time its K cache
        is seen (summarize_context or an eager step, before any CUDA-graph capture); the
        layer's K cache may not change afterwards (the rows describe its pages)."""
        key = (kv_cache.data_ptr(), kv_cache.shape[0], kv_cache.device)
        table = self.summaries.get(layer)
        if table is None:
            if not 0 <= layer < self.pool.num_layers:
                raise SpinError(f"SpinIndexer: layer {layer} outside [0, "
                                f"{self.pool.num_layers})")
            table = self.summaries[layer] = self._summaries_like(kv_cache)
            self._summary_cache[layer] = key
        elif self._summary_cache[layer] != key:
            raise SpinError(f"SpinIndexer: layer {layer}'s K cache changed (pointer or page "
                            f"count) since its summaries were made")
        return table

    def summarize_context(self, layer: int, kv_cache: torch.Tensor, block_table: torch.Tensor,
                          context_lens, start=None) -> None:
        """predictor="probe" or "hybrid": build the summaries of the visible pages of some
        requests in layer `layer`'s table, from their keys in kv_cache. block_table int32
        [N, pages] (or one request's row [pages]); context_lens [N] visible indexer slots per
        request; start [N] (default 0): the first slot whose page is summarized again (the
        pages below it are summarized already). Call it after prefill writes a request's keys, and
        whenever a request's cache was written while this indexer did not run (dense steps, a
        restart): decode steps only re-summarize the pages of their newest slots. Eager,
        outside CUDA graphs (the lengths are read on the host). Does nothing with
        predictor="spin"."""
        if not self.query_aware:
            return
        table = self.summary_table(layer, kv_cache)
        S = self.page_slots
        rows = block_table.view(1, -1) if block_table.dim() == 1 else block_table
        n = torch.as_tensor(context_lens).to("cpu", torch.int64).view(-1).clamp(min=0)
        if n.numel() != rows.shape[0]:
            raise SpinError(f"SpinIndexer.summarize_context: {rows.shape[0]} block-table rows "
                            f"but {n.numel()} context lengths")
        first = torch.zeros_like(n) if start is None else \
            torch.as_tensor(start).to("cpu", torch.int64).view(-1).clamp(min=0) // S
        if first.numel() != n.numel():
            raise SpinError(f"SpinIndexer.summarize_context: {n.numel()} context lengths but "
                            f"{first.numel()} start slots")
        last = torch.minimum(-(-n // S), torch.full_like(n, rows.shape[1]))          # excl.
        width = int((last - first).max()) if n.numel() else 0
        if width <= 0:
            return
        cols = first.unsqueeze(1) + torch.arange(width)                              # [N, W]
        fill = (n.unsqueeze(1) - cols * S).clamp(0, S)
        fill = torch.where(cols < last.unsqueeze(1), fill, 0)
        dev = kv_cache.device
        page_of = rows.to(dev, torch.int64).gather(1, cols.clamp(max=rows.shape[1] - 1).to(dev))
        fill = fill.to(dev, torch.int32)
        pages = torch.where(fill > 0, page_of, -1).to(torch.int32)
        self._summarize(kv_cache, pages.reshape(-1).contiguous(), fill.reshape(-1).contiguous(),
                      table)

    def select(self, keep_all: bool = False) -> None:
        """keep_all: every visible block (a step the engine runs dense: a CUDA graph captured
        with SPIN still computes the dense indexer's rows on replay). With predictor="probe"
        or "hybrid" each layer() selects its own layer, so this does nothing unless keep_all
        (a host flag: a graph captured with it replays that choice)."""
        self.keep_all = keep_all
        self._step_inputs.clear()
        if self.query_aware and not keep_all:
            return
        cfg = self.cfg.with_overrides(target_sparsity=0.0, exploration=0.0) if keep_all \
            else self.cfg
        if not self.pool.history:   # no V/D to rank by: every block from flat scores
            B, R = self.batch, self.next_n
            flat = self.block_scores[:B * R].zero_().view(B, R, self.m_cap)
            for layer in range(self.block_ids.shape[1]):
                self._select(cfg, layer, block_scores=flat)
            self._step_inputs.clear(every_layer=True)
            return
        if self.select_beside:
            self._select_cfg = cfg
            self._selected = [False] * len(self._selected)
            self._used = [False] * len(self._used)
            self._select_layer(0)
            return
        self._select(cfg)
        self._step_inputs.clear(every_layer=True)

    def _select(self, cfg: SpinConfig, layer: Optional[int] = None, **options) -> None:
        """ops.select on this step's batch into the indexer's buffers (options: block_scores,
        merge_history, beside_previous)."""
        B = self.batch
        ops.select(self.pool.state, self.slot[:B], self.context_lens[:B], self.query_pos[:B],
                   self.request[:B], self.step[:B], cfg, self.m_cap, self._max_len(),
                   self.block_ids[:B], self.counts[:B], layer=layer, **options)

    def _select_layer(self, layer: int, beside_previous: bool = False) -> None:
        self._select(self._select_cfg, layer, beside_previous=beside_previous)
        self._selected[layer] = True

    def layer(self, layer: int, q: torch.Tensor, weights: torch.Tensor,
              kv_cache: torch.Tensor) -> torch.Tensor:
        """int32 [B * next_n, K]: request-local slot ids, -1 padded, for indexer layer `layer`."""
        logits, row_lens = self.layer_logits(layer, q, weights, kv_cache)
        return self.layer_topk(layer, logits, row_lens)

    def layer_logits(self, layer: int, q, weights: torch.Tensor, kv_cache: torch.Tensor,
                     backend: "Optional[logits_backends.LogitsBackend]" = None):
        """The compact logits of the selected blocks (and the rows' compact lengths, or None).
        `backend` overrides the indexer's for this call (TensorRT-LLM: the engine's own
        kernel call, with its q layout)."""
        B, R = self.batch, self.next_n
        if self.query_aware:
            # TensorRT-LLM's fp8_fp4 query: (FP8 q, None), or MXFP4 (packed, exponents), which
            # the probe reads as e4m3 rows
            probe_q, probe_w = (q, weights) if not isinstance(q, tuple) else \
                (q[0], weights) if q[1] is None else ref.e4m3_query_of_mxfp4(*q, weights)
            self._probe_select(layer, probe_q, probe_w, kv_cache)
        elif self.select_beside:
            if not self._selected[layer]:
                self._select_layer(layer)
            self._selected[layer], self._used[layer] = False, True
        out = self.logits[layer if self._keeps_logits else 0, :B * R] \
            if self.logits is not None else None
        backend = backend or self.backend
        args = (q, kv_cache, weights, self.context_lens[:B], self.block_table[:B],
                self.block_ids[:B, layer], self.counts[:B, layer], out)
        source_of = getattr(backend, "schedule_source", None)
        source = source_of(self.context_lens[:B]) if source_of is not None else None
        prepared = None if source is None else self._step_inputs.layer(
            layer, source, self.block_ids[:B], self.counts[:B], self.context_lens[:B],
            self.block_table[:B])
        return backend.run(*args) if prepared is None else backend.run(*args, prepared=prepared)

    def _probe_select(self, layer: int, q, weights: torch.Tensor, kv_cache: torch.Tensor) -> None:
        """Summaries of this step's newest pages (written by this layer's forward just before;
        found on the device from the lengths the step runs with), then the layer's blocks
        ranked by their probe scores (keep_all: select() chose all)."""
        B, R = self.batch, self.next_n
        table = self.summary_table(layer, kv_cache)
        self._summarize_newest(kv_cache, self.context_lens[:B], self.block_table[:B],
                               self.max_context_len, table)
        if self.keep_all:
            return
        scores = self.block_scores[:B * R]
        if q.dim() == 4:        # TensorRT-LLM's decode q: [B, R, H, D] or [B * R, 1, H, D]
            q = q.reshape(-1, *q.shape[2:])
        pages = self.page_scores[:B * R]
        self._score_pages(q, table, weights, self.context_lens[:B], self.block_table[:B],
                          pages.shape[1], out=pages, page_slots=self.page_slots)
        if self.page_scores is not self.block_scores:
            ref.block_scores(pages, self.page_slots, out=scores)
        self._select(self.cfg, layer, block_scores=scores.view(B, R, self.m_cap),
                     merge_history=self.predictor.merges)

    def layer_topk(self, layer: int, logits: torch.Tensor, row_lens: Optional[torch.Tensor],
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Top-K slot ids of the compact logits into `out` (default: the indexer's buffer);
        with overlap_select the next layer's select follows at once, and without MTP the EMA
        update (both beside the top-K)."""
        B, R = self.batch, self.next_n
        ids, cnt = self.block_ids[:B, layer], self.counts[:B, layer]
        top = self.topk[layer, :B * R] if out is None else out
        ops.topk(logits, ids, cnt, R, self.cfg.index_topk, top, row_lens=row_lens)
        # nothing may be launched in between: the kernel launched beside the top-K must follow it
        following = layer + 1
        if self.select_beside and following < len(self._selected) \
                and not (self._selected[following] or self._used[following]):
            self._select_layer(following, beside_previous=True)
        if R == 1:
            self._update(layer, logits, ids, cnt, self.accepted_zero[:B],
                         beside_previous=self.update_beside)
            return top
        if self._keeps_logits:
            kept = self.logits[layer, :B * R]      # until finish(): outlives this step's graph
            if logits.data_ptr() != kept.data_ptr():
                kept.copy_(logits[:, :kept.shape[1]])
        self.ran_counts[:B, layer].copy_(cnt)
        return top

    def finish(self, accepted: Optional[torch.Tensor] = None) -> None:
        """With MTP: replay the deferred updates of every layer, rows 0..accepted[b] (the EMAs
        for spin and hybrid, the blocks' last step alone for probe and gauss)."""
        if self.next_n == 1:
            return
        B = self.batch
        if accepted is None or tuple(accepted.shape) != (B,) or accepted.dtype != torch.int32:
            raise SpinError(f"SpinIndexer.finish: accepted must be int32 [{B}] with MTP")
        # every layer in one launch (layer -1): one op call's host cost instead of one a layer
        logits = self.logits[:, :B * self.next_n] if self._keeps_logits else self._no_logits
        self._update(-1, logits, self.block_ids[:B], self.ran_counts[:B], accepted)

    def _update(self, layer: int, logits: torch.Tensor, block_ids: torch.Tensor,
                counts: torch.Tensor, accepted: torch.Tensor,
                beside_previous: bool = False) -> None:
        B = self.batch
        # a predictor that reads no V/D history keeps only the blocks' last step and the count
        ops.update(self.pool.state, self.slot[:B], logits, block_ids, counts,
                   self.context_lens[:B], self.query_pos[:B], accepted, self.step[:B], layer,
                   self.cfg, self._max_len(), beside_previous=beside_previous,
                   ema=self.predictor.history)

    def _max_len(self) -> int:
        # the ops clamp context lengths to this; it may not exceed the state's capacity
        return min(self.max_context_len, self.pool.capacity)


class DenseIndexer:
    """The all-keep indexer over the same ops: every block of every request is scored (SPIN's
    baseline, and the shadow that measures what SPIN misses). Same interface as SpinIndexer."""

    def __init__(self, index_topk: int, num_layers: int, max_batch: int, next_n: int,
                 max_context_len: int, device: torch.device | str = "cpu",
                 logits_backend: "str | logits_backends.LogitsBackend" = "native",
                 page_slots: int = BLOCK_SLOTS):
        if max_batch < 1 or not 1 <= next_n <= MAX_NEXT_N or max_context_len < 1 \
                or num_layers < 1:
            raise SpinError(f"DenseIndexer: need num_layers, max_batch >= 1, 1 <= next_n <= "
                            f"{MAX_NEXT_N}, max_context_len >= 1; got {num_layers}, {max_batch}, "
                            f"{next_n}, {max_context_len}")
        if page_slots not in PAGE_SIZES:
            raise SpinError(f"DenseIndexer: page_slots must be one of "
                            f"{', '.join(map(str, PAGE_SIZES))}, got {page_slots!r}")
        self.max_batch, self.next_n, self.max_context_len = max_batch, next_n, max_context_len
        self.num_layers, self.index_topk = num_layers, index_topk
        self.m_cap = math.ceil(max_context_len / BLOCK_SLOTS)
        dev = torch.device(device)
        rows = max_batch * next_n
        self.block_ids = torch.arange(self.m_cap, dtype=torch.int32, device=dev).repeat(max_batch, 1)
        self.counts = torch.zeros(max_batch, dtype=torch.int32, device=dev)
        self.backend = _backend(logits_backend, dev, page_slots)
        self.logits = torch.empty(rows, self.m_cap * BLOCK_SLOTS, device=dev) \
            if self.backend.needs_out else None
        self.topk = torch.full((num_layers, rows, index_topk), -1, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(max_batch, next_n, dtype=torch.int32, device=dev)
        # a block is BLOCK_SLOTS // page_slots pages
        self.block_table = torch.full((max_batch, self.m_cap * (BLOCK_SLOTS // page_slots)), -1,
                                      dtype=torch.int32, device=dev)
        self.step_logits: Optional[torch.Tensor] = None
        self.batch = 0

    def prepare(self, request_ids: Sequence[int], context_lens: torch.Tensor,
                query_pos: torch.Tensor, steps, block_table: torch.Tensor) -> None:
        B = len(request_ids)
        if not 1 <= B <= self.max_batch or tuple(context_lens.shape) != (B, self.next_n):
            raise SpinError(f"DenseIndexer: batch of {B} (allowed 1..{self.max_batch}) with "
                            f"context_lens [{B}, {self.next_n}], got {list(context_lens.shape)}")
        self.batch = B
        self.context_lens[:B].copy_(context_lens)
        blocks = (context_lens.max(1).values.to(torch.int64) + BLOCK_SLOTS - 1) // BLOCK_SLOTS
        self.counts[:B].copy_(blocks.clamp(max=self.m_cap).to(torch.int32))
        _copy_table(self.block_table, block_table, B)

    def select(self) -> None:
        pass

    def layer(self, layer: int, q: torch.Tensor, weights: torch.Tensor,
              kv_cache: torch.Tensor) -> torch.Tensor:
        B, R = self.batch, self.next_n
        logits, row_lens = self.backend.run(q, kv_cache, weights, self.context_lens[:B],
                                            self.block_table[:B], self.block_ids[:B],
                                            self.counts[:B],
                                            None if self.logits is None else self.logits[:B * R])
        self.step_logits = logits
        top = self.topk[layer, :B * R]
        ops.topk(logits, self.block_ids[:B], self.counts[:B], R, self.index_topk, top,
                 row_lens=row_lens)
        return top

    def finish(self, accepted: Optional[torch.Tensor] = None) -> None:
        pass
