"""SpinDecodeAdapter: TensorRT-LLM's decode-indexer metadata -> SpinIndexer, per step.

Framework-free (no tensorrt_llm import), so it is tested against dsa-lite on any machine; the
patch in `patch.py` only gathers TensorRT-LLM's tensors into a DecodeBatch and calls it.

Per decode step, in TensorRT-LLM's order:
    begin_step(batch)   host side, in the attention metadata's prepare(): replays the previous
                        step's deferred MTP updates if they did not run inside it, realigns the
                        per-request state with the batch (new requests get zeroed state,
                        requests that left give theirs back), copies metadata, and selects the
                        blocks of every indexer layer (one launch), or leaves the selection to
                        select_on_device (select=False)
    select_on_device(kv) inside the step, before the first indexer layer (CUDA-graph
                        capturable): the rows' lengths from the engine's device kv lens, which
                        the overlap scheduler corrects after prepare(), then the selection
    layer(l, q, w, kv)  inside the layer's forward (CUDA-graph capturable): masked logits and
                        top-K into the caller's topk_indices buffer
    finish_on_device(a) with MTP, once acceptance is known on the device inside the step (the
                        MTP worker's): the deferred updates, rows 0..a (capturable)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from ...config import SpinConfig
from ...errors import SpinError
from ...indexer import SpinIndexer, logits_buffer_shape
from ...limits import BLOCK_SLOTS, MAX_NEXT_N
from ...options import IndexerOptions
from ...state import StatePool



class EngineKernel:
    """The logits backend of an adapter whose indexers drive the engine's own kernel: that
    kernel is only known inside the engine's call (its q layout, FP8 or FP4), so each
    layer_logits call passes the call itself as its backend."""

    name, needs_out = "engine", False

    def __init__(self, page_slots: int):
        self.page_slots = page_slots

    def run(self, *args):
        raise SpinError("SpinDecodeAdapter: the engine's indexer kernel runs only inside the "
                        "engine's indexer call")


@dataclass
class DecodeBatch:
    """One decode step of the generation requests, in TensorRT-LLM's terms.

    request_ids   the generation requests, in batch order
    kv_lens       int [B]: tokens in each request's KV cache once this step's next_n tokens are
                  written (TensorRT-LLM's kv lens); MTP row j of a request sees
                  kv_len - next_n + j + 1 tokens
    block_table   int32 [B, max_pages]: the indexer K-cache pages of each request (its block
                  offsets), 64 indexer slots per page
    accepted      accepted draft tokens of the previous step, by request id (MTP only);
                  requests missing from it replay row 0 only. None: derived from the kv lens,
                  which grow by accepted + 1 from one step to the next
    prefill_ids   requests (re)starting their context in this step (context phase: a new
                  request, a new turn, a resume after preemption): their state starts over
    kv_caches     each SPIN layer's indexer K cache, in SPIN's layer order (predictor probe,
                  hybrid or gauss: the pages written since a request's last step, its
                  prompt's at its first, are summarized from them before the step)
    """

    request_ids: Sequence[int]
    kv_lens: torch.Tensor
    block_table: torch.Tensor
    accepted: Optional[Mapping[int, int]] = None
    prefill_ids: Sequence[int] = ()
    kv_caches: Optional[Sequence[torch.Tensor]] = None


class SpinDecodeAdapter:
    def __init__(self, cfg: SpinConfig, num_layers: int, max_batch: int, next_n: int,
                 max_tokens: int, compress_ratio: int = 1,
                 device: torch.device | str = "cuda", max_requests: Optional[int] = None,
                 initial_capacity: int = 4096, logits_backend: Any = "native",
                 page_slots: int = BLOCK_SLOTS, max_next_n: Optional[int] = None,
                 predictor: str = "spin"):
        """num_layers: indexer layers (V3.2: every layer; V4: the ratio-4 layers).
        max_tokens: the longest sequence (max_seq_len); compress_ratio: tokens per indexer slot
        (1 for DeepSeek-V3.2, 4 for DeepSeek-V4's C4A layers). next_n: the first step's draft
        length + 1; a step may use another (begin_step's next_n): each length gets its own
        step buffers over the one per-request state, its MTP logits carved from one allocation
        sized for max_next_n (the largest draft length + 1; default next_n), made up front so
        a new draft length mid-serving allocates no large buffer. page_slots: slots per
        K-cache page. predictor: what ranks the blocks (spin_trtllm.predictors: spin, probe,
        hybrid, gauss); the query-aware ones summarize pages from DecodeBatch.kv_caches.

        A request keeps its state while it sits out steps (pipeline micro-batches, partial
        scheduling); it starts over when it (re)starts its context (prefill_ids), when its
        cached length shrinks (recomputed after preemption), or when its slot goes to a new
        request because the pool is full (least recently seen first)."""
        if compress_ratio < 1 or max_tokens < 1:
            raise SpinError(f"SpinDecodeAdapter: compress_ratio ({compress_ratio}) and max_tokens "
                            f"({max_tokens}) must be >= 1")
        self.cfg, self.next_n, self.ratio = cfg, next_n, compress_ratio
        self.max_batch, self.page_slots = max_batch, page_slots
        # a backend name is checked here and resolved by each indexer; an object is used as is
        named = isinstance(logits_backend, str)
        self.options = IndexerOptions(page_slots=page_slots, predictor=predictor, **(
            {"logits_backend": logits_backend} if named else {}))
        self.logits_backend = None if named else logits_backend
        self.max_slots = max_tokens // compress_ratio + 1
        capacity = self.max_slots + MAX_NEXT_N               # room for any draft length
        self.pool = StatePool(num_layers, max_requests or max_batch, cfg, device,
                              initial_capacity=min(initial_capacity, capacity),
                              max_capacity=capacity,
                              history=self.options.block_predictor.history)
        self._indexers: dict[int, SpinIndexer] = {}
        top = max(next_n, max_next_n or next_n)
        # select_on_device / finish_on_device scratch: allocated once, so capture allocates none
        self._row_offsets = torch.arange(1 - MAX_NEXT_N, 1, dtype=torch.int32, device=device)
        self._device_kv = torch.zeros(max_batch, 1, dtype=torch.int32, device=device)
        self._device_rows = torch.zeros(max_batch, 2 * MAX_NEXT_N, dtype=torch.int32, device=device)
        self._device_accepted = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self._logits_storage = torch.empty(self._logits_elements(top), device=device) \
            if top > 1 and self.options.block_predictor.history else None
        self.indexer = self.indexer_for(next_n)
        self._steps: dict[int, int] = {}
        self._pending: Optional[tuple[SpinIndexer, list[int], list[bool]]] = None  # MTP updates
        self._pending_open = False
        self._last_cached: dict[int, int] = {}
        self._last_seen: dict[int, int] = {}           # request -> step it was last in a batch
        self._summarized: dict[int, int] = {}          # request -> slots summarized (probe)
        self.trust_layers = True        # each step's SPIN layers summarize its newest pages
        self._clock = 0

    @classmethod
    def for_engine(cls, cfg: SpinConfig, num_layers: int, max_batch: int, max_tokens: int,
                   compress_ratio: int, page_slots: int, max_next_n: int,
                   device: torch.device | str, logits_backend: Any,
                   predictor: str = "spin") -> "SpinDecodeAdapter":
        """Sized once for an engine's limits (max batch, max sequence length, largest draft
        length + 1): the state never grows, so captured CUDA graphs stay valid."""
        return cls(cfg, num_layers, max_batch, max_next_n, max_tokens, compress_ratio,
                   device=device, logits_backend=logits_backend, page_slots=page_slots,
                   max_next_n=max_next_n, initial_capacity=max_tokens // compress_ratio + 9,
                   predictor=predictor)

    @classmethod
    def planned_bytes(cls, cfg: SpinConfig, num_layers: int, max_batch: int, max_tokens: int,
                      compress_ratio: int, page_slots: int = BLOCK_SLOTS,
                      max_next_n: int = 1, predictor: str = "spin") -> tuple[int, int]:
        """(state bytes, all bytes) that for_engine allocates, counted without allocating
        (built on the meta device)."""
        plan = cls.for_engine(cfg, num_layers, max_batch, max_tokens, compress_ratio,
                              page_slots, max_next_n, "meta", EngineKernel(page_slots),
                              predictor=predictor)
        return plan.pool.nbytes(), plan.nbytes()

    def indexer_for(self, next_n: int) -> SpinIndexer:
        """The step buffers of one draft length (made on first use)."""
        if next_n not in self._indexers:
            storage = self._logits_storage
            if storage is not None and storage.numel() < self._logits_elements(next_n):
                storage = None          # longer than planned: its own buffer
            first = next(iter(self._indexers.values()), None)
            self._indexers[next_n] = SpinIndexer(self.cfg, self.pool, self.max_batch, next_n,
                                                 self.max_slots, self.options,
                                                 logits_backend=self.logits_backend,
                                                 logits_storage=storage, summaries_of=first)
        return self._indexers[next_n]

    def _logits_elements(self, next_n: int) -> int:
        """The MTP logits buffer of one draft length (every layer's, a history predictor)."""
        return math.prod(logits_buffer_shape(self.pool.num_layers, self.max_batch * next_n,
                                             math.ceil(self.max_slots / BLOCK_SLOTS), True))

    @property
    def query_aware(self) -> bool:
        """The predictor scores block summaries (probe, hybrid, gauss): DecodeBatch.kv_caches
        needed."""
        return self.options.block_predictor.query

    @property
    def generation(self) -> int:
        """Changes when the state is reallocated: CUDA graphs must be captured again."""
        return self.pool.generation

    def begin_step(self, batch: DecodeBatch, next_n: Optional[int] = None,
                   dense: bool = False, select: bool = True) -> None:
        """next_n: this step's draft length + 1 (default: the adapter's current one).
        dense=True: the engine runs its own dense indexer this step; SPIN's buffers still get
        this step's batch with every block selected, so a CUDA graph captured with SPIN
        computes the dense rows on replay. select=False: the caller selects inside the step
        with select_on_device (batch.kv_lens are then an upper bound of the device's)."""
        R = self.next_n if next_n is None else int(next_n)
        if not 1 <= R <= MAX_NEXT_N:
            raise SpinError(f"SpinDecodeAdapter: next_n must be 1..{MAX_NEXT_N}, got {R}")
        ids = [int(r) for r in batch.request_ids]
        B = len(ids)
        kv = torch.as_tensor(batch.kv_lens).to("cpu", torch.int64).view(-1)
        if kv.numel() != B:
            raise SpinError(f"SpinDecodeAdapter: {B} request ids but {kv.numel()} kv lens")
        # padding rows of a CUDA-graph batch (TensorRT-LLM repeats a dummy id, 2^64 - 1): they
        # run on free state slots with empty contexts and produce -1 rows
        seen: set[int] = set()
        pad = []
        for rid in ids:
            pad.append(rid in seen or not 0 <= rid < 1 << 63)
            seen.add(rid)
        real = [rid for rid, p in zip(ids, pad) if not p]
        real_kv = kv[[i for i, p in enumerate(pad) if not p]]
        if real and int(real_kv.min()) < R:
            raise SpinError(f"SpinDecodeAdapter: kv lens must be >= next_n ({R}), got "
                            f"{int(real_kv.min())}")
        # tokens before this step's rows
        self.follow(real, dict(zip(real, (real_kv - R).tolist())), batch.prefill_ids,
                    batch.accepted)
        new = [rid for rid in real if self.pool.slot_of(rid) is None]
        self._make_room(len(new) + sum(pad), keep=seen)
        for rid in new:
            self.pool.admit(rid)
            self._steps[rid] = 0
        self.next_n, self.indexer = R, self.indexer_for(R)
        spare = iter(self.pool.free_slots(sum(pad)))
        slots = torch.tensor([next(spare) if p else self.pool.slot_of(rid)
                              for rid, p in zip(ids, pad)], dtype=torch.int32)
        padded = torch.tensor(pad).view(-1, 1)
        tokens = kv.view(-1, 1) - R + 1 + torch.arange(R)          # tokens seen by each row
        context = torch.where(padded, 0, tokens // self.ratio).to(torch.int32)
        query = torch.where(padded, 0, (tokens - 1) // self.ratio).to(torch.int32)
        steps = [0 if p else self._steps[rid] for rid, p in zip(ids, pad)]
        self.indexer.prepare(ids, context, query, steps, batch.block_table, state_slots=slots)
        if self.query_aware:
            self._summarize_written(batch, ids, pad, kv, R)
        if select:
            self.indexer.select(keep_all=dense)
        for rid in real:
            self._steps[rid] += 1
        self._pending = (self.indexer, ids, pad) if R > 1 else None
        self._pending_open = self._pending is not None

    def make_summaries(self, caches: Sequence[torch.Tensor]) -> int:
        """Probe: the summary table of each SPIN layer's K cache (SPIN's layer order), made now
        (zeroed; a table made inside CUDA-graph capture would be zeroed again at every
        replay). Returns their bytes."""
        if len(caches) != self.pool.num_layers:
            raise SpinError(f"SpinDecodeAdapter.make_summaries: {len(caches)} K caches for "
                            f"{self.pool.num_layers} SPIN layers")
        return sum(self.indexer.summary_table(layer, kv).nbytes for layer, kv in enumerate(caches))

    def _summarize_written(self, batch: DecodeBatch, ids: list[int], pad: list[bool],
                           kv: torch.Tensor, R: int) -> None:
        """Probe: summarize, in every layer, the pages written since each request's last step
        (the prompt's at its first), up to the slots of its tokens before this step's R rows
        (kv - R tokens). The step's own newest pages are summarized by each layer as it runs, so a
        request is then summarized through its last row's slots; once a SPIN layer has run
        dense (layers_skipped), the newest page is summarized here again at every step."""
        caches = batch.kv_caches
        if caches is None or len(caches) != self.pool.num_layers:
            raise SpinError(f"SpinDecodeAdapter: predictor {self.options.predictor!r} needs "
                            f"DecodeBatch.kv_caches, one K cache per SPIN layer "
                            f"({self.pool.num_layers}), got "
                            f"{'none' if caches is None else len(caches)}")
        self.make_summaries(caches)
        upto = ((kv - R) // self.ratio).tolist()
        rows = [b for b, (rid, p) in enumerate(zip(ids, pad))
                if not p and self._summarized.get(rid, 0) < upto[b]]
        if rows:
            start = [self._summarized.get(ids[b], 0) for b in rows]
            n = [upto[b] for b in rows]
            table = torch.as_tensor(batch.block_table)[rows]
            for layer, kv_cache in enumerate(caches):
                self.indexer.summarize_context(layer, kv_cache, table, n, start=start)
        last = (kv // self.ratio).tolist()                         # the last row's slots
        for b, (rid, p) in enumerate(zip(ids, pad)):
            if not p:
                self._summarized[rid] = last[b] if self.trust_layers else upto[b]

    def layers_skipped(self) -> None:
        """A SPIN layer ran the dense indexer in a step (its newest pages were not summarized):
        from now on prepare() summarizes each request's newest page itself at every step."""
        self.trust_layers = False
        for rid in self._summarized:
            self._summarized[rid] = min(self._summarized[rid], self._last_cached.get(rid, 0)
                                        // self.ratio)

    def select_on_device(self, kv_lens: torch.Tensor) -> None:
        """Inside the step (CUDA-graph capturable: no host read, no allocation): each row's
        lengths from the engine's device kv lens (int [>= B] tokens, this step's batch order),
        capped at what begin_step uploaded (padding rows stay empty), then every layer's
        selection. TensorRT-LLM's overlap scheduler prepares MTP steps as if every draft was
        accepted and corrects kv_lens_cuda on the device inside the step: SPIN selects for the
        corrected lengths, which upstream's own kernels then attend to."""
        ix = self.indexer
        B, R = ix.batch, ix.next_n
        if kv_lens.dim() != 1 or kv_lens.shape[0] < B or kv_lens.device != self._device_kv.device:
            raise SpinError(f"SpinDecodeAdapter.select_on_device: kv_lens must be a 1-D tensor of "
                            f">= {B} lengths on {self._device_kv.device}, got "
                            f"{list(kv_lens.shape)} on {kv_lens.device}")
        offsets = self._row_offsets[MAX_NEXT_N - R:]      # row j sees kv - R + 1 + j tokens
        kv = self._device_kv[:B]
        kv.copy_(kv_lens[:B].view(B, 1))
        tokens, derived = self._device_rows[:B, :R], self._device_rows[:B, R:2 * R]
        torch.add(kv, offsets, out=tokens)
        tokens.clamp_(min=1)                  # padding rows may carry any length
        for target, shift in ((ix.context_lens[:B], 0), (ix.query_pos[:B], 1)):
            torch.sub(tokens, shift, out=derived)
            derived.floor_divide_(self.ratio)
            torch.minimum(derived, target, out=target)
        ix.select()

    def finish_on_device(self, accepted: torch.Tensor, includes_bonus: bool = False) -> None:
        """With MTP, inside the step once the engine knows acceptance on the device (CUDA-graph
        capturable): the deferred updates of this step, rows 0..accepted[b] (int [>= B] in this
        step's batch order: accepted drafts, or accepted tokens with includes_bonus, as
        TensorRT-LLM's MTP worker counts them; clamped to 0..next_n - 1)."""
        if not self.pending:
            return
        indexer = self._pending[0]
        B, R = indexer.batch, indexer.next_n
        if accepted.dim() != 1 or accepted.shape[0] < B:
            raise SpinError(f"SpinDecodeAdapter.finish_on_device: accepted must be a 1-D tensor "
                            f"of >= {B} counts, got {list(accepted.shape)}")
        acc = self._device_accepted[:B]
        acc.copy_(accepted[:B])
        if includes_bonus:
            acc.sub_(1)
        acc.clamp_(0, R - 1)
        indexer.finish(acc)
        self._pending_open = False

    def drop_pending(self) -> None:
        """The last step's deferred MTP updates ran inside it (finish_on_device in a CUDA graph,
        which the host does not see run)."""
        self._pending_open = False

    def reopen_pending(self) -> None:
        """The step runs its forward again (an engine's warm-up, then its CUDA-graph capture,
        for one prepare): its deferred updates wait again."""
        self._pending_open = self._pending is not None

    @property
    def pending(self) -> bool:
        """This step's MTP updates wait for its acceptance."""
        return self._pending is not None and self._pending_open

    def reset(self, new_cache: bool = False) -> None:
        """Every request gives its state back (new_cache: the engine rebuilt its KV cache, so
        the probe's summary tables are made again for the new one)."""
        for rid in list(self.pool.request_ids()):
            self.release(rid)
        self._pending, self._pending_open = None, False
        self._last_cached.clear()
        self._summarized.clear()
        if new_cache:
            self.indexer.summaries.clear()
            self.indexer._summary_cache.clear()

    def follow(self, request_ids: Sequence[int], cached: Mapping[int, int],
               prefill_ids: Sequence[int] = (), accepted: Optional[Mapping[int, int]] = None
               ) -> None:
        """A step's bookkeeping without selecting (begin_step runs it; alone, for a step SPIN
        does not take part in): replay the last step's deferred MTP updates, with acceptance
        from how far each request's cached length (tokens before this step's rows) grew, and
        restart the state of requests whose context restarts or whose cache shrank."""
        if accepted is None and self.pending:
            # the cache grows by the accepted drafts + 1 from one step to the next
            accepted = {rid: cached[rid] - self._last_cached[rid] - 1 for rid in self._pending[1]
                        if rid in cached and rid in self._last_cached}
        self._replay_deferred(accepted)
        for rid in request_ids:
            if cached[rid] < self._last_cached.get(rid, 0):
                self.release(rid)
        for rid in prefill_ids:
            self.release(int(rid))
        self._last_cached.update(cached)
        self._clock += 1
        for rid in request_ids:
            self._last_seen[rid] = self._clock

    def _make_room(self, count: int, keep: set[int]) -> None:
        """Free state slots for `count` new holders: the requests not seen for the longest
        give theirs back (the pool holds max_requests, every request in flight)."""
        held = [rid for rid in self.pool.request_ids() if rid not in keep]
        held.sort(key=lambda rid: self._last_seen.get(rid, 0))
        free = self.pool.max_requests - len(self.pool.request_ids())
        for rid in held[:max(0, count - free)]:
            self.release(rid)

    def layer(self, layer: int, q: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Top-K local slot ids [B * next_n, K] (-1 padded) of indexer layer `layer`; also copied
        into `out` (e.g. TensorRT-LLM's topk_indices_buffer rows) when given."""
        top = self.indexer.layer(layer, q, weights, kv_cache)
        if out is not None:
            if out.shape != top.shape or out.dtype != top.dtype:
                raise SpinError(f"SpinDecodeAdapter.layer: out must be {top.dtype} "
                                f"{list(top.shape)}, got {out.dtype} {list(out.shape)}")
            out.copy_(top)
            return out
        return top

    def release(self, request_id: int) -> None:
        """A finished (or preempted) request gives its state back."""
        if self.pool.slot_of(request_id) is not None:
            self.pool.release(request_id)
        for book in (self._steps, self._last_seen, self._last_cached, self._summarized):
            book.pop(request_id, None)

    def _replay_deferred(self, accepted: Optional[Mapping[int, int]]) -> None:
        if not self.pending:
            self._pending = None
            return
        indexer, ids, pad = self._pending
        acc = [0 if p else max(0, min(int((accepted or {}).get(rid, 0)), indexer.next_n - 1))
               for rid, p in zip(ids, pad)]
        indexer.finish(torch.tensor(acc, dtype=torch.int32, device=self.pool.device))
        self._pending = None

    def nbytes(self) -> int:
        """Device bytes SPIN holds: the state pool, the MTP logits, every draft length's step
        buffers and the probe's summary tables (each allocation counted once)."""
        seen, total = set(), 0
        tensors = list(self.pool.state.tensors()) + [
            t for t in vars(self).values() if torch.is_tensor(t)]
        for ix in self._indexers.values():
            tensors += [t for t in vars(ix).values() if torch.is_tensor(t)]
            tensors += [ix._meta.buffer] + list(ix.summaries.values())
        for t in tensors:
            storage = t.untyped_storage()
            # meta storages have no address: their C++ handle tells views apart
            key = (t.device, storage.data_ptr() if t.device.type != "meta" else storage._cdata)
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        return total
