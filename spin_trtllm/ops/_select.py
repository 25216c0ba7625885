"""spin::select: which 64-slot blocks each request's indexer scores this step.

state: V, D float32/float16/float8_e4m3fn [num_state_slots, L, cap]; last_seen int64
[.., L, ceil(cap/64)]; decode_steps int64 [num_state_slots, L]. Request b uses state slot
state_slot[b] (distinct per batch); cap covers every context length and query position. A
state without history (V, D of width 0: the probe's and gauss's) has cap = 64 x last_seen's
blocks and is selected by block_scores alone, without merge_history.
context_lens int32 [B, R] (row j of a request with length N sees N - R + j + 1 slots),
query_pos int32 [B, R] (slot coordinates), request_id/step int64 [B].
-> block_ids int32 [B, L, m_cap] ascending, -1 padded; counts int32 [B, L] = the union size. A
union larger than m_cap keeps its m_cap lowest ids (counts still say how many): size m_cap for
the largest union you allow (every block in warm-up).
With layer: that layer alone (its slice written, the blocks the all-layer call selects for it).
With block_scores fp32 [B, R, >= 1] (last dim contiguous) too: ranked by the given scores
instead of V/D (columns past the scores count as -inf); budget, forced blocks, exploration,
warm-up and MTP rules as for V/D. merge_history ranks by the hybrid of both
(reference.hybrid_scores; at most MAX_HYBRID_BLOCKS blocks).
beside_previous (CUDA, sm_90+): right after the previous layer's spin::topk, which reads and
writes nothing select touches; select may start beside it (programmatic dependent launch) and
completes after it. Device values are checked on CPU only; on CUDA the kernel clamps context
lengths to max_context_len and skips a request whose state slot is out of range (counts 0).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .. import reference as ref
from ..config import SpinConfig
from ..errors import SpinError
from ..limits import BLOCK_SLOTS, EXPLORATION_POLICY, MAX_HYBRID_BLOCKS, POOLING
from ._common import (I64, OpState, check_batch, check_host_bounds, check_max_context_len,
                      check_selection, check_shape, check_state, check_tensor, fail, register,
                      require_supported, state_capacity, streams)

SCHEMA = ("select(Tensor V, Tensor D, Tensor last_seen, Tensor decode_steps, Tensor state_slot, "
          "Tensor context_lens, Tensor query_pos, Tensor request_id, Tensor step, "
          "Tensor(a!) block_ids, Tensor(b!) counts, float target_sparsity, float exploration, "
          "int policy, int index_topk, int warmup_steps, bool keep_sink, bool keep_newest, "
          "int pooling, bool mtp_union, int seed, int max_context_len, "
          "Tensor? block_scores=None, int layer=-1, bool merge_history=False, "
          "bool beside_previous=False) -> ()")


def _validate(V, D, last_seen, decode_steps, state_slot, context_lens, query_pos, request_id,
              step, block_ids, counts, target_sparsity, exploration, policy, index_topk,
              warmup_steps, keep_sink, keep_newest, pooling, mtp_union, seed, max_context_len,
              block_scores=None, layer=-1, merge_history=False, beside_previous=False) -> None:
    op = "select"
    dev = check_state(op, V, D, last_seen, decode_steps)
    B, R = check_batch(op, dev, state_slot, context_lens, query_pos)
    for name, t in (("request_id", request_id), ("step", step)):
        check_tensor(op, name, t, I64, 1, dev, contiguous=True)
        check_shape(op, name, t, (B,))
    check_selection(op, dev, block_ids, counts, B, layered=True)
    if block_ids.shape[1] != V.shape[1]:
        fail(op, f"block_ids has {block_ids.shape[1]} layers, the state has {V.shape[1]}")
    if not 0.0 <= target_sparsity < 1.0:
        fail(op, f"target_sparsity must satisfy 0 <= x < 1, got {target_sparsity}")
    if not 0.0 <= exploration < 1.0:
        fail(op, f"exploration must satisfy 0 <= x < 1, got {exploration}")
    if policy not in EXPLORATION_POLICY.values() or pooling not in POOLING.values():
        fail(op, f"policy must be in {EXPLORATION_POLICY} and pooling in {POOLING}, got "
                 f"{policy}, {pooling}")
    if not (1 <= index_topk < 1 << 31 and 1 <= warmup_steps < 1 << 31 and 0 <= seed < 1 << 32):
        fail(op, f"need 1 <= index_topk < 2^31, 1 <= warmup_steps < 2^31, 0 <= seed < 2^32; "
                 f"got {index_topk}, {warmup_steps}, {seed}")
    cap = state_capacity(V, last_seen)
    check_max_context_len(op, max_context_len, cap)
    check_host_bounds(op, context_lens, query_pos, max_context_len, cap, state_slot, V.shape[0])
    if V.shape[2] == 0 and (block_scores is None or merge_history):
        fail(op, "the state holds no V/D history (V of width 0: a probe or gauss state); "
                 "select needs block_scores without merge_history")
    if block_scores is not None:
        check_tensor(op, "block_scores", block_scores, (torch.float32,), 3, dev,
                     inner_contiguous=True)
        if block_scores.shape[:2] != (B, R) or block_scores.shape[2] < 1:
            fail(op, f"block_scores must have shape [{B}, {R}, num_blocks >= 1], got "
                     f"{list(block_scores.shape)}")
        if not 0 <= layer < V.shape[1]:
            fail(op, f"layer must be in [0, {V.shape[1]}) with block_scores, got {layer}")
        if merge_history and math.ceil(max_context_len / BLOCK_SLOTS) > MAX_HYBRID_BLOCKS:
            fail(op, f"merge_history ranks at most {MAX_HYBRID_BLOCKS} blocks "
                     f"({MAX_HYBRID_BLOCKS * BLOCK_SLOTS} slots), got "
                     f"max_context_len={max_context_len}")
    elif merge_history:
        fail(op, "merge_history goes with block_scores")
    elif not -1 <= layer < V.shape[1]:
        fail(op, f"layer {layer} is outside [0, {V.shape[1]}) (or -1: every layer)")


def _reference(V, D, last_seen, decode_steps, state_slot, context_lens, query_pos, request_id,
               step, block_ids, counts, target_sparsity, exploration, policy, index_topk,
               warmup_steps, keep_sink, keep_newest, pooling, mtp_union, seed,
               max_context_len, block_scores=None, layer=-1, merge_history=False,
               beside_previous=False) -> None:
    B, R = context_lens.shape
    L = V.shape[1]
    if B == 0:
        return
    cfg = SpinConfig(block_size=BLOCK_SLOTS, target_sparsity=target_sparsity,
                     exploration=exploration,
                     exploration_policy={v: k for k, v in EXPLORATION_POLICY.items()}[policy],
                     index_topk=index_topk, warmup_steps=warmup_steps, keep_sink=keep_sink,
                     keep_newest=keep_newest, pooling={v: k for k, v in POOLING.items()}[pooling],
                     mtp_mask="union" if mtp_union else "row0")
    if block_scores is not None:       # one layer, ranked by the given block scores
        idx = state_slot.long()
        state = ref.SpinState(V[idx, layer], D[idx, layer], last_seen[idx, layer],
                              decode_steps[idx, layer])
        n = context_lens.long().clamp(max=max_context_len)
        nb = max(math.ceil(int(n.max()) / BLOCK_SLOTS), 1)
        scores = torch.full((B, R, nb), float("-inf"), device=V.device)
        have = min(nb, block_scores.shape[2])
        scores[:, :, :have] = block_scores[:, :, :have].float()
        if merge_history:
            history, _ = ref.predict_blocks(state, n, query_pos.long(), cfg, max(int(n.max()), 1))
            scores = ref.hybrid_scores(scores, history[:, :, :nb], ref.block_count(n, BLOCK_SLOTS))
        sel = ref.select_blocks(scores, None, n, state, cfg,
                                torch.full((B,), float(target_sparsity), dtype=torch.float64,
                                           device=V.device),
                                request_id, torch.full((B,), layer, device=V.device), step)
        ids, cnt = ref.block_list(sel.mask, block_ids.shape[-1], truncate=True)
        block_ids[:, layer] = ids
        counts[:, layer] = cnt
        return
    lo, L = (0, L) if layer < 0 else (layer, 1)        # layer >= 0: that one alone
    Vg, Dg, ls, ds = streams(state_slot, *(t[:, lo:lo + L] for t in
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


register(SCHEMA, _validate, _reference)


def select(state: OpState, state_slot, context_lens, query_pos, request_id, step,
           cfg: SpinConfig, m_cap: int, max_context_len: int,
           block_ids: Optional[torch.Tensor] = None, counts: Optional[torch.Tensor] = None,
           block_scores: Optional[torch.Tensor] = None, layer: Optional[int] = None,
           merge_history: bool = False, beside_previous: bool = False):
    """Every layer from SPIN's V/D prediction, or with layer that layer alone. Buffers are
    allocated when not given (one layer fills its slice only: the others read as nothing
    selected). Returns (block_ids, counts)."""
    require_supported(cfg)
    if block_scores is not None and layer is None:
        raise SpinError("select: block_scores rank one layer; pass its layer")
    if merge_history and block_scores is None:
        raise SpinError("select: merge_history merges the V/D history into given block_scores; "
                        "pass block_scores and layer")
    B, L = context_lens.shape[0], state.V.shape[1]
    dev = state.V.device
    if beside_previous and (block_ids is None or counts is None):
        raise SpinError("select: beside_previous writes block_ids and counts while the previous "
                        "kernel may still read memory freed before this call; pass buffers "
                        "allocated before that kernel")
    if block_ids is None:
        block_ids = torch.full((B, L, m_cap), -1, dtype=torch.int32, device=dev)
    if counts is None:
        counts = torch.zeros(B, L, dtype=torch.int32, device=dev)
    torch.ops.spin.select(*state.tensors(), state_slot, context_lens, query_pos, request_id,
                          step, block_ids, counts, cfg.target_sparsity, cfg.exploration,
                          EXPLORATION_POLICY[cfg.exploration_policy], cfg.index_topk,
                          cfg.warmup_steps, cfg.keep_sink, cfg.keep_newest, POOLING[cfg.pooling],
                          cfg.mtp_mask == "union", cfg.seed, max_context_len, block_scores,
                          -1 if layer is None else layer, merge_history, beside_previous)
    return block_ids, counts
