"""SPIN decode ops: torch.ops.spin.{select, indexer_logits, topk, update, reset, compact, remap,
summarize, probe}.

The schemas live here (one place). Every op validates its arguments in Python (shapes,
dtypes, devices, contiguity, config ranges: clear errors before any launch), then runs:
- on CUDA tensors, the native kernels of cpp/ (libspin_native, built by build.sh) when the
  library is present, else the reference;
- on CPU tensors, the reference (spin_trtllm.reference), which is the specification.
All ops write into caller-provided buffers and return nothing, so a decode step made of them
can be captured in a CUDA graph; fake (meta) implementations let torch.compile trace them.

Contracts (DESIGN.md):
- state: V, D float32/float16/float8_e4m3fn [num_state_slots, L, cap]; last_seen int64
  [.., L, ceil(cap/64)]; decode_steps int64 [num_state_slots, L]. Request b uses state slot
  state_slot[b] (distinct per batch). cap must cover every context length and query position.
- context_lens int32 [B, R] (row j of a request with length N sees N - R + j + 1 slots),
  query_pos int32 [B, R] (slot coordinates), request_id/step int64 [B], accepted int32 [B].
- select -> block_ids int32 [B, L, m_cap] ascending, -1 padded; counts int32 [B, L] = the
  union size. A union larger than m_cap keeps its m_cap lowest ids (counts still say how many):
  size m_cap for the largest union you allow (every block in warm-up).
- indexer_logits -> fp32 [B*R, m_cap*64] compact scores, -inf past a row's causal length,
  past the selected count, and for block-table entries outside the cache (never read). On
  sm_90a the q.k sums come from FP8 tensor cores (wgmma) as in DeepGEMM's FP8 MQA logits:
  about 1.4e-4 of the row norm from exact (random data); elsewhere they are summed in fp32.
  q, kv_cache and weights start at 16-byte aligned addresses (topk/update logits too).
- topk/update read logits fp32 [B*R, W >= m_cap*64]: the first m_cap*64 columns of each row;
  last dim contiguous, rows a multiple of 4 floats apart (16-byte rows), base 16-byte aligned
  (DeepGEMM's logits, of a width aligned up from max_context_len, feed them without a copy).
- topk -> int32 [B*R, K] request-local slot ids, ascending, -1 padded. Optional row_lens int32
  [B, R]: compact positions at or past a row's length take no part (logits from a dense
  kernel on a compacted table, which leaves those columns unspecified). On sm_90+ its kernel
  lets a kernel launched after it with programmatic stream serialization start at once (the
  beside_previous of select and update); such a kernel must wait (griddepcontrol.wait) before
  it reads the top-K's output, as PDL requires.
- update: EMA of V and D from the compact logits (rows 0..accepted in order, or row 0; a
  negative accepted count means 0); a non-finite score is not observed. layer -1: every layer
  in one launch (MTP's deferred updates), from logits [L, B*R, W] (layers a multiple of 4
  floats apart), block_ids [B, L, m_cap] and counts [B, L] as select writes them. A request's
  block ids must be distinct, as select's are (on CUDA a repeated id races on its V/D entries).
  beside_previous (CUDA, sm_90+): the kernel may run beside the one launched just before it on
  the stream, which must write none of the update's inputs nor read its outputs, and the inputs
  must have been complete before it began: ops.topk on the same logits, which lets it start
  early (most SMs sit idle in a top-K of few rows), or the next layer's select launched beside
  that top-K (select and update let their dependents start at once too). The update still
  completes after that kernel, and so after everything it ran beside. Elsewhere, and on the
  reference, it is a plain update. select's beside_previous is the same contract: one layer's
  select right after the previous layer's ops.topk (it reads and writes nothing the top-K
  touches). On sm_90+ the kernels of topk, select and update all let a kernel launched after
  them with programmatic stream serialization start at once, on every launch: such a kernel
  must wait (griddepcontrol.wait) before it reads their outputs, as PDL requires.
  reset zeroes state slots and restarts their warm-up.
- compact (to drive an external paged indexer-logits kernel, e.g. DeepGEMM's
  fp8_paged_mqa_logits as TensorRT-LLM uses it, over the selected blocks only): block_ids
  [B, m_cap] and counts [B] as select writes them (a strided layer view ids[:, l] is fine; the
  first min(count, m_cap) ids are used), context_lens [B, R], block_table int32 [B, max_pages]
  of pages of page_slots = 64 or 32 slots (ppb = 64 / page_slots pages per SPIN block) ->
  compact_table int32 [B, T >= m_cap*ppb]: entry k*ppb + p = block_table[b, ids[k]*ppb + p]
  for each used k with ids[k] >= 0 and that column < max_pages, 0 everywhere else (0 keeps a
  reader inside the cache; page ids are copied as they are); compact_lens int32 [B, R]: row j =
  sum over used k of clamp(context_lens[b, j] - 64 ids[k], 0, 64). Ids ascending, a row's
  visible slots are a prefix of the compact order, so a kernel given (compact_table,
  compact_lens) as (block table, context lengths) computes indexer_logits' compact masked
  logits (compact position k*64 + s is slot ids[k]*64 + s; -inf from compact_lens on), provided
  the block table covers the context.
- remap: positions int32 [B*next_n, K] (compact positions as a top-K over compact logits gives
  them, e.g. TensorRT-LLM's indexer_topk_decode: request-local, -1 padded; row stride allowed)
  -> out int32 [B*next_n, K]: ids[pos // 64]*64 + pos % 64 for 0 <= pos < min(count, m_cap)*64
  with that id >= 0, else -1, order kept (row r is request r // next_n). Optional values fp32
  [B*next_n, K] (the top-K's scores) or scores fp32 [B*next_n, >= m_cap*64] (the logits the
  positions index; last dim contiguous): a non-finite value makes its entry -1. ascending (K <=
  4096): each row's ids sorted ascending, -1 last, which turns a peer's unordered top-K
  (flashinfer's) into topk's output in one launch. out may be positions itself (in place),
  otherwise it must not overlap it.
- summarize (the probe predictor's block summaries, kept beside the K cache with the same page
  ids): kv_cache as indexer_logits reads it, pages int32 [P], fill int32 [P] -> summaries uint8
  [num_pages, 144] (one row per page: 128 fp8 bytes, fp32 scale, padding) row pages[i] = the
  mean of that page's first clamp(fill[i], 0, 64) dequantized keys, re-quantized e4m3 with scale
  amax / 448 (reference.summarize_pages; the kernel's bytes equal the reference's). Pages
  outside [0, num_pages) are skipped.
- probe: q, weights, context_lens, block_table as indexer_logits takes them, summaries ->
  out fp32 [B*R, num_blocks]: sum_h w_h ReLU(q_h . summary(block_table[b, j])) per block j, -inf
  where the block has no visible slot, is past the table or its page is outside the summaries.
- select with layer: that layer alone, the blocks the all-layer call selects for it; other
  layers are not written. With block_scores fp32 [B, R, >= 1] (last dim contiguous) too: ranked
  by the given scores instead of V/D (columns past the scores count as -inf); budget, forced
  blocks, exploration, warm-up and MTP rules as for V/D.
- Device values are checked on CPU (state slots in range and distinct, context lengths within
  max_context_len). On CUDA the kernels clamp context lengths to max_context_len and skip a
  request whose state slot is out of range (counts 0, ids -1), so no check needs a sync.
The ops implement reduction A1 (A0/A2 are replay ablations of the reference) and block size 64.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from . import reference as ref
from .config import SpinConfig
from .errors import SpinError

log = logging.getLogger("spin_trtllm")

BLOCK = ref.PAGE_SLOTS
MAX_SORTED_K = 4096          # remap(ascending=True): one CTA sorts a row (cpp kMaxSortedK)
MAX_HYBRID_BLOCKS = 8192     # select(merge_history=True) sorts a row's blocks (kMaxHybridBlocks)
HEADS, HEAD_DIM = 64, 128
POOLING = {"max": 0, "mean": 1, "top4": 2}
POLICY = {"random": 0, "staleness": 1, "age": 2}
OPS = ("select", "indexer_logits", "topk", "update", "compact", "remap", "summarize", "probe")

_SCHEMAS = {
    "select": "select(Tensor V, Tensor D, Tensor last_seen, Tensor decode_steps, Tensor state_slot, "
              "Tensor context_lens, Tensor query_pos, Tensor request_id, Tensor step, "
              "Tensor(a!) block_ids, Tensor(b!) counts, float target_sparsity, float exploration, "
              "int policy, int index_topk, int warmup_steps, bool keep_sink, bool keep_newest, "
              "int pooling, bool mtp_union, int seed, int max_context_len, "
              "Tensor? block_scores=None, int layer=-1, bool merge_history=False, "
              "bool beside_previous=False) -> ()",
    "indexer_logits": "indexer_logits(Tensor q, Tensor kv_cache, Tensor weights, "
                      "Tensor context_lens, Tensor block_table, Tensor block_ids, Tensor counts, "
                      "Tensor(a!) out) -> ()",
    "topk": "topk(Tensor logits, Tensor block_ids, Tensor counts, int next_n, Tensor(a!) out, "
            "Tensor? row_lens=None) -> ()",
    "update": "update(Tensor(a!) V, Tensor(b!) D, Tensor(c!) last_seen, Tensor(d!) decode_steps, "
              "Tensor state_slot, Tensor logits, Tensor block_ids, Tensor counts, "
              "Tensor context_lens, Tensor query_pos, Tensor accepted, Tensor step, int layer, "
              "float ema_decay, bool row0_only, int max_context_len, "
              "bool beside_previous=False) -> ()",
    "reset": "reset(Tensor(a!) V, Tensor(b!) D, Tensor(c!) last_seen, Tensor(d!) decode_steps, "
             "Tensor state_slots, Tensor step) -> ()",
    "compact": "compact(Tensor block_ids, Tensor counts, Tensor context_lens, Tensor block_table, "
               "int page_slots, Tensor(a!) compact_table, Tensor(b!) compact_lens) -> ()",
    "remap": "remap(Tensor positions, Tensor block_ids, Tensor counts, int next_n, "
             "Tensor(a!) out, Tensor? values=None, bool ascending=False, "
             "Tensor? scores=None) -> ()",
    "summarize": "summarize(Tensor kv_cache, Tensor pages, Tensor fill, Tensor(a!) summaries) -> ()",
    "probe": "probe(Tensor q, Tensor summaries, Tensor weights, Tensor context_lens, "
             "Tensor block_table, Tensor(a!) out) -> ()",
}


# ---- native library -----------------------------------------------------------------------------
# spin_native::abi_version of the kernels these wrappers drive (csrc/native_ops.cpp kAbiVersion):
# a library built before an op's meaning changed (update's layer -1) would misread the call.
NATIVE_ABI = 4


def _native_abi() -> int:
    try:
        return int(torch.ops.spin_native.abi_version())
    except (AttributeError, RuntimeError):      # built before the version existed
        return 1


def _load_native(here: Optional[Path] = None) -> bool:
    here = here or Path(__file__).parent
    for lib in sorted(here.glob("libspin_native*.so")):
        try:
            torch.ops.load_library(str(lib))
        except (OSError, RuntimeError) as err:
            log.warning("spin_trtllm: cannot load %s (%s)", lib.name, err)
            continue
        abi = _native_abi()
        if abi != NATIVE_ABI:
            log.warning("spin_trtllm: %s is stale (kernel ABI %d, these ops need %d); spin ops "
                        "run the reference until ./build.sh rebuilds it", lib.name, abi,
                        NATIVE_ABI)
            return False
        return True
    return False


NATIVE = _load_native()
if not NATIVE and torch.cuda.is_available():   # CPU-only torch: the reference is the only path
    log.warning("spin_trtllm: native library not built or not usable; spin::%s run through the "
                "reference implementation (./build.sh builds it where torch has CUDA and nvcc "
                "exists)",
                ", spin::".join(OPS))
elif not NATIVE:
    log.info("spin_trtllm: no CUDA; spin ops run the reference implementation")


# ---- validation ---------------------------------------------------------------------------------
def _fail(op: str, msg: str) -> None:
    raise SpinError(f"spin::{op}: {msg}")


def _dt(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def _tensor(op: str, name: str, t, dtypes, ndim: int, device: torch.device,
            contiguous: bool = False, inner_contiguous: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        _fail(op, f"{name} must be {'/'.join(_dt(torch.empty(0, dtype=d)) for d in dtypes)}, "
                  f"got {_dt(t)}")
    if t.dim() != ndim:
        _fail(op, f"{name} must have {ndim} dims, got shape {list(t.shape)}")
    if t.device != device:
        _fail(op, f"{name} is on {t.device}, expected {device} like the other inputs")
    if contiguous and not t.is_contiguous():
        _fail(op, f"{name} must be contiguous")
    if inner_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(op, f"{name} must be contiguous in its last dim")
    return t


def _shape(op: str, name: str, t: torch.Tensor, expected: tuple) -> None:
    if tuple(t.shape) != tuple(expected):
        _fail(op, f"{name} must have shape {list(expected)}, got {list(t.shape)}")


I32, I64 = (torch.int32,), (torch.int64,)
STATE_DTYPES = (torch.float32, torch.float16, torch.float8_e4m3fn)


def _check_state(op: str, V, D, last_seen, decode_steps) -> torch.device:
    dev = V.device if isinstance(V, torch.Tensor) else torch.device("cpu")
    _tensor(op, "V", V, STATE_DTYPES, 3, dev, contiguous=True)
    _tensor(op, "D", D, (V.dtype,), 3, dev, contiguous=True)
    _shape(op, "D", D, V.shape)
    S, L, cap = V.shape
    _tensor(op, "last_seen", last_seen, I64, 3, dev, contiguous=True)
    _shape(op, "last_seen", last_seen, (S, L, math.ceil(cap / BLOCK)))
    _tensor(op, "decode_steps", decode_steps, I64, 2, dev, contiguous=True)
    _shape(op, "decode_steps", decode_steps, (S, L))
    return dev


def _check_batch(op: str, dev, state_slot, context_lens, query_pos, B_expected=None):
    _tensor(op, "context_lens", context_lens, I32, 2, dev, contiguous=True)
    B, R = context_lens.shape
    if not 1 <= R <= 8:
        _fail(op, f"next_n (context_lens.shape[1]) must be 1..8, got {R}")
    if B_expected is not None and B != B_expected:
        _fail(op, f"context_lens has {B} requests, expected {B_expected}")
    _tensor(op, "query_pos", query_pos, I32, 2, dev, contiguous=True)
    _shape(op, "query_pos", query_pos, (B, R))
    _tensor(op, "state_slot", state_slot, I32, 1, dev, contiguous=True)
    _shape(op, "state_slot", state_slot, (B,))
    return B, R


def _check_selection(op: str, dev, block_ids, counts, B: int, layered: bool) -> int:
    _tensor(op, "block_ids", block_ids, I32, 3 if layered else 2, dev,
            contiguous=layered, inner_contiguous=True)
    _tensor(op, "counts", counts, I32, 2 if layered else 1, dev, contiguous=layered)
    if block_ids.shape[0] != B or counts.shape[0] != B:
        _fail(op, f"block_ids {list(block_ids.shape)} and counts {list(counts.shape)} must "
                  f"have {B} requests")
    if layered and tuple(counts.shape) != tuple(block_ids.shape[:2]):
        _fail(op, f"counts must have shape {list(block_ids.shape[:2])}, got {list(counts.shape)}")
    return block_ids.shape[-1]


def _check_slots(op: str, slots: torch.Tensor, num_slots: int) -> None:
    if slots.device.type != "cpu" or slots.numel() == 0:
        return
    if int(slots.min()) < 0 or int(slots.max()) >= num_slots:
        _fail(op, f"state slots must be in [0, {num_slots}), got [{int(slots.min())}, "
                  f"{int(slots.max())}]")
    if slots.unique().numel() != slots.numel():
        _fail(op, "state slots of one batch must be distinct")


def _check_max_context(op: str, max_context_len: int, cap: int) -> None:
    if not 1 <= max_context_len <= cap:
        _fail(op, f"max_context_len {max_context_len} must be in [1, state capacity {cap}]")


def _host_bounds(op: str, context_lens, query_pos, max_context_len: int, cap: int,
                 state_slot=None, num_slots: int = 0) -> None:
    """Device-value checks; only on CPU, where they cost no synchronization. (On CUDA the
    kernels clamp context lengths to max_context_len and skip out-of-range state slots.)"""
    if context_lens.device.type != "cpu" or context_lens.numel() == 0:
        return
    if state_slot is not None:
        _check_slots(op, state_slot, num_slots)
    if int(context_lens.min()) < 0 or int(context_lens.max()) > max_context_len:
        _fail(op, f"context_lens must be in [0, max_context_len={max_context_len}], got "
                  f"[{int(context_lens.min())}, {int(context_lens.max())}]")
    if int(query_pos.max()) >= cap or bool((query_pos < context_lens - 1).any()):
        _fail(op, f"query_pos must satisfy context_len - 1 <= q < state capacity {cap}")


# ---- reference implementations (CPU, and CUDA without the native library) ------------------------
def _streams(state_slot: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """[S, L, ...] -> [B * L, ...] rows of the batch's state slots."""
    idx = state_slot.long()
    return [t[idx].reshape(idx.numel() * t.shape[1], *t.shape[2:]) for t in tensors]


def _select_ref(V, D, last_seen, decode_steps, state_slot, context_lens, query_pos, request_id,
                step, block_ids, counts, target_sparsity, exploration, policy, index_topk,
                warmup_steps, keep_sink, keep_newest, pooling, mtp_union, seed,
                max_context_len, block_scores=None, layer=-1, merge_history=False,
                beside_previous=False) -> None:
    B, R = context_lens.shape
    L = V.shape[1]
    if B == 0:
        return
    cfg = SpinConfig(block_size=BLOCK, target_sparsity=target_sparsity, exploration=exploration,
                     exploration_policy={v: k for k, v in POLICY.items()}[policy],
                     index_topk=index_topk, warmup_steps=warmup_steps, keep_sink=keep_sink,
                     keep_newest=keep_newest, pooling={v: k for k, v in POOLING.items()}[pooling],
                     mtp_mask="union" if mtp_union else "row0")
    if block_scores is not None:       # one layer, ranked by the given block scores
        idx = state_slot.long()
        state = ref.SpinState(V[idx, layer], D[idx, layer], last_seen[idx, layer],
                              decode_steps[idx, layer])
        n = context_lens.long().clamp(max=max_context_len)
        nb = max(math.ceil(int(n.max()) / BLOCK), 1)
        scores = torch.full((B, R, nb), float("-inf"), device=V.device)
        have = min(nb, block_scores.shape[2])
        scores[:, :, :have] = block_scores[:, :, :have].float()
        if merge_history:
            history, _ = ref.predict_blocks(state, n, query_pos.long(), cfg, max(int(n.max()), 1))
            scores = ref.hybrid_scores(scores, history[:, :, :nb], ref.block_count(n, BLOCK))
        sel = ref.select_blocks(scores, None, n, state, cfg,
                                torch.full((B,), float(target_sparsity), dtype=torch.float64,
                                           device=V.device),
                                request_id, torch.full((B,), layer, device=V.device), step)
        ids, cnt = ref.block_list(sel.mask, block_ids.shape[-1], truncate=True)
        block_ids[:, layer] = ids
        counts[:, layer] = cnt
        return
    lo, L = (0, L) if layer < 0 else (layer, 1)        # layer >= 0: that one alone
    Vg, Dg, ls, ds = _streams(state_slot, *(t[:, lo:lo + L] for t in
                                            (V, D, last_seen, decode_steps)))
    state = ref.SpinState(Vg, Dg, ls, ds)
    n = context_lens.long().repeat_interleave(L, 0).clamp(max=max_context_len)
    q = query_pos.long().repeat_interleave(L, 0)
    width = max(int(n.max()), 1)
    scores, slot_pred = ref.predict_blocks(state, n, q, cfg, width)
    layer_ids = torch.arange(lo, lo + L, device=V.device).repeat(B)
    sel = ref.select_blocks(scores, slot_pred, n, state, cfg,
                            torch.full((B * L,), float(target_sparsity), dtype=torch.float64,
                                       device=V.device),
                            request_id.repeat_interleave(L), layer_ids, step.repeat_interleave(L))
    m_cap = block_ids.shape[-1]
    ids, cnt = ref.block_list(sel.mask, m_cap, truncate=True)
    block_ids[:, lo:lo + L] = ids.view(B, L, m_cap)
    counts[:, lo:lo + L] = cnt.view(B, L)


def _logits_ref(q, kv_cache, weights, context_lens, block_table, block_ids, counts, out) -> None:
    out.copy_(ref.masked_indexer_logits(q, kv_cache, weights, context_lens, block_table,
                                        block_ids, counts).float())


def _topk_ref(logits, block_ids, counts, next_n, out, row_lens=None) -> None:
    width = block_ids.shape[1] * BLOCK
    out.copy_(ref.topk_slots(logits[:, :width], block_ids, counts, next_n, out.shape[1],
                             row_lens=row_lens))


def _update_ref(V, D, last_seen, decode_steps, state_slot, logits, block_ids, counts,
                context_lens, query_pos, accepted, step, layer, ema_decay, row0_only,
                max_context_len, beside_previous=False) -> None:
    if layer < 0:  # every layer, one after the other
        for l in range(V.shape[1]):
            _update_ref(V, D, last_seen, decode_steps, state_slot, logits[l], block_ids[:, l],
                        counts[:, l], context_lens, query_pos, accepted, step, l, ema_decay,
                        row0_only, max_context_len)
        return
    B, R = context_lens.shape
    if B == 0:
        return
    m_cap = block_ids.shape[1]
    cfg = SpinConfig(block_size=BLOCK, ema_decay=ema_decay,
                     mtp_update="row0" if row0_only else "prefix_valid",
                     state_dtype=str(V.dtype).replace("torch.", ""))
    idx = state_slot.long()
    state = ref.SpinState(V[idx, layer].clone(), D[idx, layer].clone(),
                          last_seen[idx, layer].clone(), decode_steps[idx, layer].clone())
    n = context_lens.long().clamp(max=max_context_len)
    width = max(int(n.max()), 1)
    nb = math.ceil(max_context_len / BLOCK)      # the blocks the kernels may mark as scored
    live = (torch.arange(m_cap, device=V.device) < counts.long().clamp(max=m_cap).unsqueeze(-1)) \
        & (block_ids >= 0) & (block_ids < nb)
    mask = torch.zeros(B, nb + 1, dtype=torch.bool, device=V.device)
    safe_ids = torch.where(live, block_ids.long(), nb)               # column nb: discarded
    mask.scatter_(1, safe_ids, True)
    mask = mask[:, :nb]
    # compact [B*R, m_cap*64] -> dense slot coordinates [B, R, nb*64]
    dense = torch.full((B, R, (nb + 1) * BLOCK), float("-inf"), device=V.device)
    cols = (safe_ids.unsqueeze(-1) * BLOCK + torch.arange(BLOCK, device=V.device)).flatten(1)
    compact = logits[:, :m_cap * BLOCK].reshape(B, R, -1).float()
    dense.scatter_(2, cols.unsqueeze(1).expand(B, R, -1), compact)
    ref.update_state(state, dense[:, :, :width], mask, n, query_pos.long(),
                     accepted.long(), cfg, step.long())
    V[idx, layer] = state.V
    D[idx, layer] = state.D
    last_seen[idx, layer] = state.last_seen
    decode_steps[idx, layer] = state.decode_steps


def _compact_ref(block_ids, counts, context_lens, block_table, page_slots, compact_table,
                 compact_lens) -> None:
    table, lens = ref.compact_block_table(block_ids, counts, context_lens, block_table,
                                          page_slots, compact_table.shape[1])
    compact_table.copy_(table)
    compact_lens.copy_(lens)


def _remap_ref(positions, block_ids, counts, next_n, out, values=None, ascending=False,
               scores=None) -> None:
    out.copy_(ref.remap_positions(positions, block_ids, counts, next_n, values, ascending,
                                  scores))


def _summarize_ref(kv_cache, pages, fill, summaries) -> None:
    live = (pages >= 0) & (pages < summaries.shape[0])
    if not bool(live.any()):
        return
    rows, scale = ref.summarize_pages(kv_cache, pages[live], fill[live])
    at = pages[live].long()
    summaries[at, :ref.KEY_BYTES] = rows
    summaries[at, ref.KEY_BYTES:ref.KEY_BYTES + 4] = scale.view(-1, 1).view(torch.uint8)


def _probe_ref(q, summaries, weights, context_lens, block_table, out) -> None:
    out.copy_(ref.probe_scores(q, summaries, weights, context_lens, block_table,
                               out.shape[1]).float())


# ---- op registration ------------------------------------------------------------------------------
def _validate_select(V, D, last_seen, decode_steps, state_slot, context_lens, query_pos,
                     request_id, step, block_ids, counts, target_sparsity, exploration, policy,
                     index_topk, warmup_steps, keep_sink, keep_newest, pooling, mtp_union, seed,
                     max_context_len, block_scores=None, layer=-1, merge_history=False,
                     beside_previous=False) -> None:
    op = "select"
    dev = _check_state(op, V, D, last_seen, decode_steps)
    B, R = _check_batch(op, dev, state_slot, context_lens, query_pos)
    for name, t in (("request_id", request_id), ("step", step)):
        _tensor(op, name, t, I64, 1, dev, contiguous=True)
        _shape(op, name, t, (B,))
    _check_selection(op, dev, block_ids, counts, B, layered=True)
    if block_ids.shape[1] != V.shape[1]:
        _fail(op, f"block_ids has {block_ids.shape[1]} layers, the state has {V.shape[1]}")
    if not 0.0 <= target_sparsity < 1.0:
        _fail(op, f"target_sparsity must satisfy 0 <= x < 1, got {target_sparsity}")
    if not 0.0 <= exploration < 1.0:
        _fail(op, f"exploration must satisfy 0 <= x < 1, got {exploration}")
    if policy not in POLICY.values() or pooling not in POOLING.values():
        _fail(op, f"policy must be in {POLICY} and pooling in {POOLING}, got {policy}, {pooling}")
    if not (1 <= index_topk < 1 << 31 and 1 <= warmup_steps < 1 << 31 and 0 <= seed < 1 << 32):
        _fail(op, f"need 1 <= index_topk < 2^31, 1 <= warmup_steps < 2^31, 0 <= seed < 2^32; "
                  f"got {index_topk}, {warmup_steps}, {seed}")
    _check_max_context(op, max_context_len, V.shape[2])
    _host_bounds(op, context_lens, query_pos, max_context_len, V.shape[2], state_slot, V.shape[0])
    if block_scores is not None:
        _tensor(op, "block_scores", block_scores, (torch.float32,), 3, dev, inner_contiguous=True)
        if block_scores.shape[:2] != (B, R) or block_scores.shape[2] < 1:
            _fail(op, f"block_scores must have shape [{B}, {R}, num_blocks >= 1], got "
                      f"{list(block_scores.shape)}")
        if not 0 <= layer < V.shape[1]:
            _fail(op, f"layer must be in [0, {V.shape[1]}) with block_scores, got {layer}")
        if merge_history and math.ceil(max_context_len / BLOCK) > MAX_HYBRID_BLOCKS:
            _fail(op, f"merge_history ranks at most {MAX_HYBRID_BLOCKS} blocks "
                      f"({MAX_HYBRID_BLOCKS * BLOCK} slots), got max_context_len={max_context_len}")
    elif merge_history:
        _fail(op, "merge_history goes with block_scores")
    elif not -1 <= layer < V.shape[1]:
        _fail(op, f"layer {layer} is outside [0, {V.shape[1]}) (or -1: every layer)")


def _aligned16(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if t.data_ptr() % 16:
            _fail(op, f"{name} must start at a 16-byte aligned address (the kernels load 16 B)")


def _check_logits(op: str, logits, dev, rows: int, m_cap: int) -> None:
    """fp32 [rows, W >= m_cap*64] read in its first m_cap*64 columns; 16-byte aligned rows."""
    _tensor(op, "logits", logits, (torch.float32,), 2, dev, inner_contiguous=True)
    width = m_cap * BLOCK
    if logits.shape[0] != rows or logits.shape[1] < width:
        _fail(op, f"logits must have shape [{rows}, W >= {width}] (B*R rows, at least m_cap*64 "
                  f"columns), got {list(logits.shape)}")
    _aligned16(op, logits=logits)
    if rows > 1 and logits.stride(0) % 4:
        _fail(op, f"logits rows must be a multiple of 4 floats apart (16-byte rows: the kernels "
                  f"load 16 B), got row stride {logits.stride(0)}")


def _check_query(op: str, q, weights, context_lens, block_table, dev) -> tuple[int, int]:
    """What indexer_logits and probe both read: q fp8 [B*R, 64, 128], weights fp32 [B*R, 64],
    context_lens int32 [B, R], block_table int32 [B, max_pages]. Returns (B, R)."""
    _tensor(op, "q", q, (torch.float8_e4m3fn,), 3, dev, contiguous=True)
    _tensor(op, "context_lens", context_lens, I32, 2, dev, contiguous=True)
    B, R = context_lens.shape
    if not 1 <= R <= 8:
        _fail(op, f"next_n (context_lens.shape[1]) must be 1..8, got {R}")
    _shape(op, "q", q, (B * R, HEADS, HEAD_DIM))
    _tensor(op, "weights", weights, (torch.float32,), 2, dev, contiguous=True)
    _shape(op, "weights", weights, (B * R, HEADS))
    _aligned16(op, q=q, weights=weights)
    _tensor(op, "block_table", block_table, I32, 2, dev, inner_contiguous=True)
    if block_table.shape[0] != B:
        _fail(op, f"block_table has {block_table.shape[0]} rows, expected {B}")
    return B, R


def _validate_logits(q, kv_cache, weights, context_lens, block_table, block_ids, counts, out):
    op = "indexer_logits"
    dev = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    B, R = _check_query(op, q, weights, context_lens, block_table, dev)
    _check_cache(op, kv_cache, dev)
    _aligned16(op, kv_cache=kv_cache)
    m_cap = _check_selection(op, dev, block_ids, counts, B, layered=False)
    _tensor(op, "out", out, (torch.float32,), 2, dev, contiguous=True)
    _shape(op, "out", out, (B * R, m_cap * BLOCK))


def _check_cache(op: str, kv_cache, dev) -> None:
    _tensor(op, "kv_cache", kv_cache, (torch.uint8,), kv_cache.dim() if isinstance(kv_cache, torch.Tensor) else 2,
            dev, contiguous=True)
    if kv_cache.dim() < 2 or kv_cache.shape[0] < 1 or \
            kv_cache[0].numel() != BLOCK * ref.SLOT_BYTES:
        _fail(op, f"kv_cache must be uint8 pages of {BLOCK} x {ref.SLOT_BYTES} bytes "
                  f"(e.g. [num_pages >= 1, 64, 1, 132]), got shape {list(kv_cache.shape)}")


def _check_summaries(op: str, summaries, dev) -> None:
    _tensor(op, "summaries", summaries, (torch.uint8,), 2, dev, contiguous=True)
    if summaries.shape[0] < 1 or summaries.shape[1] != ref.SUMMARY_BYTES:
        _fail(op, f"summaries must be uint8 [num_pages >= 1, {ref.SUMMARY_BYTES}] (one row per "
                  f"K-cache page), got shape {list(summaries.shape)}")
    _aligned16(op, summaries=summaries)


def _validate_summarize(kv_cache, pages, fill, summaries) -> None:
    op = "summarize"
    dev = kv_cache.device if isinstance(kv_cache, torch.Tensor) else torch.device("cpu")
    _check_cache(op, kv_cache, dev)
    _aligned16(op, kv_cache=kv_cache)
    _tensor(op, "pages", pages, I32, 1, dev, contiguous=True)
    _tensor(op, "fill", fill, I32, 1, dev, contiguous=True)
    _shape(op, "fill", fill, tuple(pages.shape))
    _check_summaries(op, summaries, dev)
    if summaries.shape[0] != kv_cache.shape[0]:
        _fail(op, f"summaries has {summaries.shape[0]} rows, the cache {kv_cache.shape[0]} pages: "
                  "one summary per page")


def _validate_probe(q, summaries, weights, context_lens, block_table, out) -> None:
    op = "probe"
    dev = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    B, R = _check_query(op, q, weights, context_lens, block_table, dev)
    _check_summaries(op, summaries, dev)
    _tensor(op, "out", out, (torch.float32,), 2, dev, contiguous=True)
    if out.shape[0] != B * R or out.shape[1] < 1:
        _fail(op, f"out must have shape [{B * R}, num_blocks >= 1], got {list(out.shape)}")


def _validate_topk(logits, block_ids, counts, next_n, out, row_lens=None):
    op = "topk"
    dev = logits.device if isinstance(logits, torch.Tensor) else torch.device("cpu")
    _tensor(op, "logits", logits, (torch.float32,), 2, dev, inner_contiguous=True)
    _tensor(op, "block_ids", block_ids, I32, 2, dev, inner_contiguous=True)
    m_cap = _check_selection(op, dev, block_ids, counts, block_ids.shape[0], layered=False)
    B = block_ids.shape[0]
    if not 1 <= next_n <= 8:
        _fail(op, f"next_n must be 1..8, got {next_n}")
    _check_logits(op, logits, dev, B * next_n, m_cap)
    _tensor(op, "out", out, I32, 2, dev, contiguous=True)
    if out.shape[0] != B * next_n or out.shape[1] < 1:
        _fail(op, f"out must have shape [{B * next_n}, K >= 1], got {list(out.shape)}")
    if row_lens is not None:
        _tensor(op, "row_lens", row_lens, I32, 2, dev, contiguous=True)
        _shape(op, "row_lens", row_lens, (B, next_n))


def _validate_update(V, D, last_seen, decode_steps, state_slot, logits, block_ids, counts,
                     context_lens, query_pos, accepted, step, layer, ema_decay, row0_only,
                     max_context_len, beside_previous=False) -> None:
    op = "update"
    dev = _check_state(op, V, D, last_seen, decode_steps)
    B, R = _check_batch(op, dev, state_slot, context_lens, query_pos)
    every_layer = layer == -1
    if not (every_layer or 0 <= layer < V.shape[1]):
        _fail(op, f"layer {layer} is outside [0, {V.shape[1]}) (or -1: every layer)")
    m_cap = _check_selection(op, dev, block_ids, counts, B, layered=every_layer)
    if every_layer:
        L = V.shape[1]
        _tensor(op, "logits", logits, (torch.float32,), 3, dev, inner_contiguous=True)
        if logits.shape[0] != L or block_ids.shape[1] != L:
            _fail(op, f"layer -1 (every layer) needs logits [{L}, B*R, W] and block_ids "
                      f"[B, {L}, m_cap] for the state's {L} layers, got logits "
                      f"{list(logits.shape)} and block_ids {list(block_ids.shape)}")
        if L > 1 and logits.stride(0) % 4:
            _fail(op, f"logits layers must be a multiple of 4 floats apart (16-byte aligned "
                      f"layers), got layer stride {logits.stride(0)}")
        _check_logits(op, logits[0], dev, B * R, m_cap)
    else:
        _check_logits(op, logits, dev, B * R, m_cap)
    _tensor(op, "accepted", accepted, I32, 1, dev, contiguous=True)
    _shape(op, "accepted", accepted, (B,))
    _tensor(op, "step", step, I64, 1, dev, contiguous=True)
    _shape(op, "step", step, (B,))
    if not 0.0 <= ema_decay < 1.0:
        _fail(op, f"ema_decay must satisfy 0 <= x < 1, got {ema_decay}")
    _check_max_context(op, max_context_len, V.shape[2])
    _host_bounds(op, context_lens, query_pos, max_context_len, V.shape[2], state_slot, V.shape[0])


def _validate_compact(block_ids, counts, context_lens, block_table, page_slots, compact_table,
                      compact_lens) -> None:
    op = "compact"
    dev = block_ids.device if isinstance(block_ids, torch.Tensor) else torch.device("cpu")
    _tensor(op, "context_lens", context_lens, I32, 2, dev, contiguous=True)
    B, R = context_lens.shape
    if not 1 <= R <= 8:
        _fail(op, f"next_n (context_lens.shape[1]) must be 1..8, got {R}")
    m_cap = _check_selection(op, dev, block_ids, counts, B, layered=False)
    _tensor(op, "block_table", block_table, I32, 2, dev, inner_contiguous=True)
    if block_table.shape[0] != B:
        _fail(op, f"block_table has {block_table.shape[0]} rows, expected {B}")
    if page_slots not in (32, BLOCK):
        _fail(op, f"page_slots must be 64 or 32 (slots per KV page; a SPIN block is 64 slots), "
                  f"got {page_slots}")
    ppb = BLOCK // page_slots
    _tensor(op, "compact_table", compact_table, I32, 2, dev, inner_contiguous=True)
    if compact_table.shape[0] != B or compact_table.shape[1] < m_cap * ppb:
        _fail(op, f"compact_table must have shape [{B}, T >= m_cap * {ppb} = {m_cap * ppb}], "
                  f"got {list(compact_table.shape)}")
    _tensor(op, "compact_lens", compact_lens, I32, 2, dev, contiguous=True)
    _shape(op, "compact_lens", compact_lens, (B, R))


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    span = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _validate_remap(positions, block_ids, counts, next_n, out, values=None,
                    ascending=False, scores=None) -> None:
    op = "remap"
    dev = positions.device if isinstance(positions, torch.Tensor) else torch.device("cpu")
    _tensor(op, "positions", positions, I32, 2, dev, inner_contiguous=True)
    B = block_ids.shape[0] if isinstance(block_ids, torch.Tensor) else 0
    _check_selection(op, dev, block_ids, counts, B, layered=False)
    if not 1 <= next_n <= 8:
        _fail(op, f"next_n must be 1..8, got {next_n}")
    if positions.shape[0] != B * next_n:
        _fail(op, f"positions must have shape [B*next_n = {B * next_n}, K], got "
                  f"{list(positions.shape)}")
    _tensor(op, "out", out, I32, 2, dev, contiguous=True)
    _shape(op, "out", out, tuple(positions.shape))
    if values is not None:
        _tensor(op, "values", values, (torch.float32,), 2, dev, inner_contiguous=True)
        _shape(op, "values", values, tuple(positions.shape))
    if scores is not None:
        m_cap = block_ids.shape[1]
        _tensor(op, "scores", scores, (torch.float32,), 2, dev, inner_contiguous=True)
        if scores.shape[0] != positions.shape[0] or scores.shape[1] < m_cap * BLOCK:
            _fail(op, f"scores must have shape [{positions.shape[0]}, W >= {m_cap * BLOCK}] (the "
                      f"rows the positions index), got {list(scores.shape)}")
    if ascending and positions.shape[1] > MAX_SORTED_K:
        _fail(op, f"ascending sorts rows of at most {MAX_SORTED_K} entries, got K = "
                  f"{positions.shape[1]}")
    same = out.data_ptr() == positions.data_ptr() and out.stride() == positions.stride()
    (a0, a1), (b0, b1) = _byte_range(out), _byte_range(positions)
    if not same and a0 < b1 and b0 < a1:
        _fail(op, "out must be positions itself (in place) or not overlap it")


def _dispatch(name: str, validate, reference):
    """Validate, then run the native kernel on CUDA tensors (when built), else the reference."""
    def impl(*args, **kwargs) -> None:
        validate(*args, **kwargs)
        if NATIVE and args[0].is_cuda:
            getattr(torch.ops.spin_native, name)(*args, **kwargs)
        else:
            reference(*args, **kwargs)
    return impl


def _reset_impl(V, D, last_seen, decode_steps, state_slots, step) -> None:
    dev = _check_state("reset", V, D, last_seen, decode_steps)
    _tensor("reset", "state_slots", state_slots, I32 + I64, 1, dev)
    _check_slots("reset", state_slots, V.shape[0])
    _tensor("reset", "step", step, I64, 1, dev)
    _shape("reset", "step", step, tuple(state_slots.shape))
    idx = state_slots.long()
    ref.state_bits(V).index_fill_(0, idx, 0)
    ref.state_bits(D).index_fill_(0, idx, 0)
    last_seen.index_copy_(0, idx, step.view(-1, 1, 1).expand(-1, *last_seen.shape[1:]).contiguous())
    decode_steps.index_fill_(0, idx, 0)


def _fake(op: str, *args, **kwargs) -> None:
    """Meta/fake impl: nothing to compute (the ops write into their arguments). A call that
    mixes devices, e.g. one meta tensor among CPU or CUDA ones, lands here instead of in the
    real kernel: refuse it rather than silently doing nothing."""
    devices = {a.device for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)}
    if len(devices) > 1:
        _fail(op, f"tensors on different devices: {sorted(str(d) for d in devices)}")


_LIB = torch.library.Library("spin", "DEF")
_IMPLS = {"select": _dispatch("select", _validate_select, _select_ref),
          "indexer_logits": _dispatch("indexer_logits", _validate_logits, _logits_ref),
          "topk": _dispatch("topk", _validate_topk, _topk_ref),
          "update": _dispatch("update", _validate_update, _update_ref),
          "reset": _reset_impl,
          "compact": _dispatch("compact", _validate_compact, _compact_ref),
          "remap": _dispatch("remap", _validate_remap, _remap_ref),
          "summarize": _dispatch("summarize", _validate_summarize, _summarize_ref),
          "probe": _dispatch("probe", _validate_probe, _probe_ref)}
for _name, _schema in _SCHEMAS.items():
    _LIB.define(_schema)
    _LIB.impl(_name, _IMPLS[_name], "CPU")
    _LIB.impl(_name, _IMPLS[_name], "CUDA")
    torch.library.register_fake(f"spin::{_name}", functools.partial(_fake, _name), lib=_LIB)


# ---- friendly wrappers ----------------------------------------------------------------------------
@dataclass
class OpState:
    """V/D/last_seen/decode_steps for num_slots state slots x num_layers indexer layers."""

    V: torch.Tensor
    D: torch.Tensor
    last_seen: torch.Tensor
    decode_steps: torch.Tensor

    @classmethod
    def zeros(cls, num_slots: int, num_layers: int, capacity: int, cfg: SpinConfig,
              device: torch.device | str = "cpu") -> "OpState":
        if min(num_slots, num_layers, capacity) < 1:
            raise SpinError(f"OpState: num_slots ({num_slots}), num_layers ({num_layers}) and "
                            f"capacity ({capacity}) must be >= 1")
        dtype = getattr(torch, cfg.state_dtype)
        blocks = math.ceil(capacity / BLOCK)
        return cls(torch.zeros(num_slots, num_layers, capacity, dtype=dtype, device=device),
                   torch.zeros(num_slots, num_layers, capacity, dtype=dtype, device=device),
                   torch.zeros(num_slots, num_layers, blocks, dtype=torch.int64, device=device),
                   torch.zeros(num_slots, num_layers, dtype=torch.int64, device=device))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.V, self.D, self.last_seen, self.decode_steps


def require_supported(cfg: SpinConfig) -> None:
    """The ops implement reduction A1 with 64-slot blocks."""
    if cfg.reduction != "A1" or cfg.block_size != BLOCK:
        raise SpinError(f"the spin ops implement reduction A1 with block_size {BLOCK}; got "
                        f"reduction={cfg.reduction}, block_size={cfg.block_size} (A0/A2 are "
                        f"replay ablations: use spin_trtllm.reference)")


def select(state: OpState, state_slot, context_lens, query_pos, request_id, step,
           cfg: SpinConfig, m_cap: int, max_context_len: int,
           block_ids: Optional[torch.Tensor] = None, counts: Optional[torch.Tensor] = None,
           block_scores: Optional[torch.Tensor] = None, layer: Optional[int] = None,
           merge_history: bool = False, beside_previous: bool = False):
    """Every layer from SPIN's V/D prediction, or with layer that layer alone (its slice of
    block_ids and counts written, the same blocks as the all-layer call). With block_scores
    fp32 [B, R, >= blocks] (e.g. probe's) and layer: that layer ranked by them instead (budget,
    forced blocks, exploration and MTP rules unchanged). merge_history: ranked by the hybrid,
    max of the rank shares of block_scores and of the V/D prediction
    (reference.hybrid_scores; max_context_len <= MAX_HYBRID_BLOCKS * 64). beside_previous: see
    the module docstring (the next layer's select right after this layer's ops.topk)."""
    require_supported(cfg)
    if block_scores is not None and layer is None:
        raise SpinError("select: block_scores rank one layer; pass its layer")
    if merge_history and block_scores is None:
        raise SpinError("select: merge_history merges the V/D history into given block_scores; "
                        "pass block_scores and layer")
    B, L = context_lens.shape[0], state.V.shape[1]
    dev = state.V.device
    # one layer fills its slice only: the others read as nothing selected
    if block_ids is None:
        block_ids = torch.full((B, L, m_cap), -1, dtype=torch.int32, device=dev)
    if counts is None:
        counts = torch.zeros(B, L, dtype=torch.int32, device=dev)
    torch.ops.spin.select(*state.tensors(), state_slot, context_lens, query_pos, request_id,
                          step, block_ids, counts, cfg.target_sparsity, cfg.exploration,
                          POLICY[cfg.exploration_policy], cfg.index_topk, cfg.warmup_steps,
                          cfg.keep_sink, cfg.keep_newest, POOLING[cfg.pooling],
                          cfg.mtp_mask == "union", cfg.seed, max_context_len, block_scores,
                          -1 if layer is None else layer, merge_history, beside_previous)
    return block_ids, counts


def summaries_like(kv_cache: torch.Tensor) -> torch.Tensor:
    """A zeroed summary table for kv_cache: one 144-byte row per page (reference.SUMMARY_BYTES)."""
    return torch.zeros(kv_cache.shape[0], ref.SUMMARY_BYTES, dtype=torch.uint8,
                       device=kv_cache.device)


def summarize(kv_cache, pages, fill, summaries) -> None:
    """Write the summary (mean key of its first fill[i] slots, as reference.summarize_pages)
    of each page pages[i] into summaries[pages[i]]; entries outside the cache are skipped.
    Build every page at prefill; at decode only the page of the newest slots changes."""
    torch.ops.spin.summarize(kv_cache, pages, fill, summaries)


def probe(q, summaries, weights, context_lens, block_table, num_blocks: int,
          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 [B*R, num_blocks] query-aware block scores (reference.probe_scores): each block's
    summary scored with the current q and weights like a slot; -inf where nothing is visible."""
    if out is None:
        out = torch.empty(q.shape[0], num_blocks, dtype=torch.float32, device=q.device)
    torch.ops.spin.probe(q, summaries, weights, context_lens, block_table, out)
    return out


def indexer_logits(q, kv_cache, weights, context_lens, block_table, block_ids, counts,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    if out is None:
        out = torch.empty(q.shape[0], block_ids.shape[-1] * BLOCK, dtype=torch.float32,
                          device=q.device)
    torch.ops.spin.indexer_logits(q, kv_cache, weights, context_lens, block_table, block_ids,
                                  counts, out)
    return out


def topk(logits, block_ids, counts, next_n: int, k: int,
         out: Optional[torch.Tensor] = None,
         row_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """row_lens int32 [B, next_n]: the rows' compact lengths (positions past them take no
    part), for logits whose columns past a row's causal length are not -inf. Where
    flashinfer is installed and its top-K is the faster (topk_peer), it ranks the rows and
    spin.remap maps its positions to slot ids; the output contract is the same, except which
    of several entries tied at the K-th value is taken."""
    if out is None:
        out = torch.empty(logits.shape[0], k, dtype=torch.int32, device=logits.device)
    if topk_peer(logits, block_ids, k) is not None:
        _peer_topk(logits, block_ids, counts, next_n, k, out, row_lens)
    else:
        torch.ops.spin.topk(logits, block_ids, counts, next_n, out, row_lens)
    return out


# SPIN_TOPK: auto (flashinfer where installed and measured faster), spin, or flashinfer (where
# installed, any shape). The flashinfer path: its top-K's positions only (asking for the values
# costs 11-16 us more), then one remap launch that maps them to slot ids, drops non-finite
# scores (read from the logits) and sorts the row (about 6 us at K 512). Rows below
# TOPK_RAGGED_MAX_ROWS go through top_k_ragged_transform (flashinfer picks CUB's batched top-K or
# its radix kernel), more rows through top_k_varlen (radix_cutlass on SM90), which was the
# faster at 96 rows of 32K and 128K slots (at 64 and 192 rows of 32K the ragged entry was).
# H200, K 512, same process (benchmarks/RESULTS.md, seventeenth session), spin's kernel against
# the whole flashinfer path, us, all blocks then half: 8 x 32K slots 16.4 / 20.6, 14.6 / 20.3;
# 96 x 32K 24.4 / 32.0, 16.4 / 26.4; 16 rows x 128K 27.2 / 31.5; 32 x 128K 59.4 / 40.1,
# 35.0 / 30.3; 64 rows x 128K 62.0 / 63.3; 96 x 128K 121.0 / 71.7, 58.4 / 45.2. So spin's kernel
# keeps rows narrower than TOPK_SPIN_MAX_WIDTH and batches of at most TOPK_SPIN_MAX_ROWS rows.
TOPK_RAGGED_MAX_ROWS = 64
TOPK_SPIN_MAX_ROWS = 16
TOPK_SPIN_MAX_WIDTH = 1 << 16


def spin_topk_is_faster(rows: int, width: int) -> bool:
    """Whether spin's top-K kernel was measured faster than flashinfer's path at `rows` rows
    of `width` compact slots (the auto choice of ops.topk; the cost model prices the same)."""
    return width < TOPK_SPIN_MAX_WIDTH or rows <= TOPK_SPIN_MAX_ROWS


@functools.lru_cache(maxsize=None)
def _flashinfer_topk():
    """flashinfer's (top_k_varlen, top_k_ragged_transform or None), or None without it."""
    try:
        from flashinfer import top_k_varlen
    except Exception:  # noqa: BLE001 - absent or unusable: spin's kernel
        return None
    try:
        from flashinfer import top_k_ragged_transform
    except Exception:  # noqa: BLE001 - an older flashinfer: top_k_varlen for every shape
        top_k_ragged_transform = None
    return top_k_varlen, top_k_ragged_transform


def topk_peer(logits: torch.Tensor, block_ids: torch.Tensor, k: int) -> Optional[str]:
    """"flashinfer" when spin.topk hands these rows to flashinfer's top-K, else None."""
    choice = os.environ.get("SPIN_TOPK", "auto")
    if choice not in ("auto", "spin", "flashinfer"):
        raise SpinError(f"SPIN_TOPK must be auto, spin or flashinfer, got {choice!r}")
    if choice == "spin" or _flashinfer_topk() is None or block_ids.dim() != 2 \
            or logits.dim() != 2 or logits.shape[0] == 0 or block_ids.shape[1] * BLOCK < k \
            or k > MAX_SORTED_K \
            or torch.compiler.is_compiling() or logits.device.type == "meta":
        return None
    if choice == "auto":
        rows, width = logits.shape[0], block_ids.shape[1] * BLOCK
        # rows with a stride into a tensor that is not contiguous as a whole would need a
        # copy first (a contiguous wider tensor, as DeepGEMM returns, is ranked in place)
        if not logits.is_cuda or not (logits.is_contiguous() or
                                      logits[:, :width].is_contiguous()) or \
                spin_topk_is_faster(rows, width):
            return None
    return "flashinfer"


_ZERO_OFFSETS: dict = {}


def _zero_offsets(rows: int, device: torch.device) -> torch.Tensor:
    """int32 zeros [rows], kept: top_k_ragged_transform's per-row offsets (positions wanted)."""
    key = (rows, str(device))
    if key not in _ZERO_OFFSETS:
        zeros = torch.zeros(rows, dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return zeros          # filled only when the graph replays: not kept for eager calls
        _ZERO_OFFSETS[key] = zeros
    return _ZERO_OFFSETS[key]


def _peer_topk(logits, block_ids, counts, next_n, k, out, row_lens) -> None:
    """flashinfer's top-K over each row's compact prefix, then the spin.topk contract:
    request-local slot ids ascending, -1 for entries past a row or with a non-finite score."""
    _validate_topk(logits, block_ids, counts, next_n, out, row_lens)
    varlen, ragged = _flashinfer_topk()
    m_cap = block_ids.shape[1]
    # the rows are ranked over their first `lens` columns only, so a contiguous tensor wider
    # than m_cap*64 (DeepGEMM's logits, width aligned up) goes as it is; a strided view is copied
    x = logits if logits.is_contiguous() else logits[:, :m_cap * BLOCK].contiguous()
    lens = counts.clamp(min=0, max=m_cap).mul_(BLOCK)
    if next_n > 1:
        lens = lens.repeat_interleave(next_n)
    if row_lens is not None:
        lens = torch.minimum(row_lens.reshape(-1).clamp(min=0), lens)   # int32, as validated
    if ragged is not None and x.shape[0] < TOPK_RAGGED_MAX_ROWS:
        pos = ragged(x, _zero_offsets(x.shape[0], x.device), lens, k)
    else:
        # SM90 has one backend, radix_cutlass (flashinfer 0.7.4); "auto" picks among SM100's
        sm90 = x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9
        pos = varlen(x, lens, k, backend="radix_cutlass" if sm90 else "auto")[0]
    remap(pos.to(torch.int32), block_ids, counts, next_n, out=out, ascending=True, scores=x)


def update(state: OpState, state_slot, logits, block_ids, counts, context_lens, query_pos,
           accepted, step, layer: int, cfg: SpinConfig, max_context_len: int,
           beside_previous: bool = False) -> None:
    """layer -1: every layer in one launch (logits [L, B*R, W], block_ids [B, L, m_cap],
    counts [B, L]). beside_previous: see the module docstring (right after ops.topk on the same
    logits)."""
    torch.ops.spin.update(*state.tensors(), state_slot, logits, block_ids, counts, context_lens,
                          query_pos, accepted, step, layer, cfg.ema_decay,
                          cfg.mtp_update == "row0", max_context_len, beside_previous)


def reset(state: OpState, state_slots, step) -> None:
    torch.ops.spin.reset(*state.tensors(), state_slots, step)


def compact(block_ids, counts, context_lens, block_table, page_slots: int = BLOCK,
            compact_table: Optional[torch.Tensor] = None,
            compact_lens: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(compact_table int32 [B, m_cap * 64 / page_slots], compact_lens int32 [B, R]) of the
    selected blocks (see the module docstring); buffers are allocated when not given."""
    B, m_cap = block_ids.shape[0], block_ids.shape[-1]
    if compact_table is None:
        ppb = BLOCK // page_slots if page_slots in (32, BLOCK) else 1   # the op rejects others
        compact_table = torch.empty(B, m_cap * ppb, dtype=torch.int32, device=block_ids.device)
    if compact_lens is None:
        compact_lens = torch.empty(tuple(context_lens.shape), dtype=torch.int32,
                                   device=block_ids.device)
    torch.ops.spin.compact(block_ids, counts, context_lens, block_table, page_slots,
                           compact_table, compact_lens)
    return compact_table, compact_lens


def remap(positions, block_ids, counts, next_n: int,
          out: Optional[torch.Tensor] = None, values: Optional[torch.Tensor] = None,
          ascending: bool = False, scores: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Compact positions -> request-local slot ids (out may be positions: in place); with
    values (aligned with the positions) or scores (the logits rows they index), entries of
    non-finite value become -1; ascending sorts each row, -1 last."""
    if out is None:
        out = torch.empty(tuple(positions.shape), dtype=torch.int32, device=positions.device)
    torch.ops.spin.remap(positions, block_ids, counts, next_n, out, values, ascending, scores)
    return out
