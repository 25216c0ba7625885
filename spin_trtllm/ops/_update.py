"""spin::update and spin::reset: the EMA update of V and D after the top-K, and the reset that
restarts a state slot.

update reads compact logits fp32 [B*R, W >= m_cap*64] (first m_cap*64 columns; last dim
contiguous, rows a multiple of 4 floats apart, 16-byte aligned base: DeepGEMM's logits feed it
without a copy) and updates rows 0..accepted in order (or row 0; a negative accepted count
means 0); a non-finite score is not observed. layer -1: every layer in one launch (MTP's
deferred updates), from logits [L, B*R, W] (layers a multiple of 4 floats apart), block_ids
[B, L, m_cap] and counts [B, L] as select writes them. A request's block ids must be distinct,
as select's are (on CUDA a repeated id races on its V/D entries), and so must the requests'
state slots (checked on CPU only: on CUDA two requests on one slot race on its state).
ema False (a predictor that ranks without the V/D history: probe, gauss): only last_seen and
decode_steps change, as they would with it (the logits are not read, V and D not written): any
fp32 tensor of two or more dims stands for the logits, and layer -1 needs no logits [L, ...]
(block_ids [B, L, m_cap] give the layers). A state without history (V, D of width 0) needs it.
beside_previous (CUDA, sm_90+): the kernel may run beside the one launched just before it
(spin::topk on the same logits, or the next layer's select launched beside that top-K), which
must write none of the update's inputs nor read its outputs; the update still completes after
it. On sm_90+ topk, select and update let a kernel launched after them with programmatic
stream serialization start at once: such a kernel must wait (griddepcontrol.wait) before it
reads their outputs, as PDL requires.
reset zeroes state slots and restarts their warm-up; its slots are checked against the pool
on CPU only (reading them on CUDA would wait for the device): pass ids in [0, num_state_slots).
"""

from __future__ import annotations

import math

import torch

from .. import reference as ref
from ..config import SpinConfig
from ..limits import BLOCK_SLOTS
from ._common import (I32, I64, OpState, check_batch, check_host_bounds, check_logits,
                      check_max_context_len, check_selection, check_shape, check_slots,
                      check_state, check_tensor, fail, register, state_capacity)

SCHEMA = ("update(Tensor(a!) V, Tensor(b!) D, Tensor(c!) last_seen, Tensor(d!) decode_steps, "
          "Tensor state_slot, Tensor logits, Tensor block_ids, Tensor counts, "
          "Tensor context_lens, Tensor query_pos, Tensor accepted, Tensor step, int layer, "
          "float ema_decay, bool row0_only, int max_context_len, "
          "bool beside_previous=False, bool ema=True) -> ()")
RESET_SCHEMA = ("reset(Tensor(a!) V, Tensor(b!) D, Tensor(c!) last_seen, "
                "Tensor(d!) decode_steps, Tensor state_slots, Tensor step) -> ()")


def _validate(V, D, last_seen, decode_steps, state_slot, logits, block_ids, counts,
              context_lens, query_pos, accepted, step, layer, ema_decay, row0_only,
              max_context_len, beside_previous=False, ema=True) -> None:
    op = "update"
    dev = check_state(op, V, D, last_seen, decode_steps)
    B, R = check_batch(op, dev, state_slot, context_lens, query_pos)
    every_layer = layer == -1
    if not (every_layer or 0 <= layer < V.shape[1]):
        fail(op, f"layer {layer} is outside [0, {V.shape[1]}) (or -1: every layer)")
    m_cap = check_selection(op, dev, block_ids, counts, B, layered=every_layer)
    if every_layer and block_ids.shape[1] != V.shape[1]:
        fail(op, f"layer -1 (every layer) needs block_ids [B, {V.shape[1]}, m_cap] for the "
                 f"state's {V.shape[1]} layers, got {list(block_ids.shape)}")
    if not ema:     # not read: any fp32 tensor of 2+ dims on the device (a placeholder will do)
        check_tensor(op, "logits", logits, (torch.float32,), max(logits.dim(), 2), dev)
    elif every_layer:
        L = V.shape[1]
        check_tensor(op, "logits", logits, (torch.float32,), 3, dev, inner_contiguous=True)
        if logits.shape[0] != L or block_ids.shape[1] != L:
            fail(op, f"layer -1 (every layer) needs logits [{L}, B*R, W] and block_ids "
                     f"[B, {L}, m_cap] for the state's {L} layers, got logits "
                     f"{list(logits.shape)} and block_ids {list(block_ids.shape)}")
        if L > 1 and logits.stride(0) % 4:
            fail(op, f"logits layers must be a multiple of 4 floats apart (16-byte aligned "
                     f"layers), got layer stride {logits.stride(0)}")
        check_logits(op, logits[0], dev, B * R, m_cap)
    else:
        check_logits(op, logits, dev, B * R, m_cap)
    check_tensor(op, "accepted", accepted, I32, 1, dev, contiguous=True)
    check_shape(op, "accepted", accepted, (B,))
    check_tensor(op, "step", step, I64, 1, dev, contiguous=True)
    check_shape(op, "step", step, (B,))
    if not 0.0 <= ema_decay < 1.0:
        fail(op, f"ema_decay must satisfy 0 <= x < 1, got {ema_decay}")
    cap = state_capacity(V, last_seen)
    check_max_context_len(op, max_context_len, cap)
    check_host_bounds(op, context_lens, query_pos, max_context_len, cap, state_slot, V.shape[0])
    if ema and V.shape[2] == 0:
        fail(op, "the state holds no V/D history (V of width 0: a probe or gauss state); "
                 "update needs ema=False")


def _reference(V, D, last_seen, decode_steps, state_slot, logits, block_ids, counts,
               context_lens, query_pos, accepted, step, layer, ema_decay, row0_only,
               max_context_len, beside_previous=False, ema=True) -> None:
    if layer < 0:  # every layer, one after the other
        for each in range(V.shape[1]):
            _reference(V, D, last_seen, decode_steps, state_slot,
                       logits[each] if ema else logits, block_ids[:, each], counts[:, each],
                       context_lens, query_pos, accepted, step, each, ema_decay, row0_only,
                       max_context_len, ema=ema)
        return
    B, R = context_lens.shape
    if B == 0:
        return
    m_cap = block_ids.shape[1]
    cfg = SpinConfig(block_size=BLOCK_SLOTS, ema_decay=ema_decay,
                     mtp_update="row0" if row0_only else "prefix_valid",
                     state_dtype=str(V.dtype).replace("torch.", ""))
    idx = state_slot.long()
    state = ref.SpinState(V[idx, layer].clone(), D[idx, layer].clone(),
                          last_seen[idx, layer].clone(), decode_steps[idx, layer].clone())
    n = context_lens.long().clamp(max=max_context_len)
    width = max(int(n.max()), 1)
    nb = math.ceil(max_context_len / BLOCK_SLOTS)      # the blocks the kernels may mark as scored
    live = (torch.arange(m_cap, device=V.device) < counts.long().clamp(max=m_cap).unsqueeze(-1)) \
        & (block_ids >= 0) & (block_ids < nb)
    mask = torch.zeros(B, nb + 1, dtype=torch.bool, device=V.device)
    safe_ids = torch.where(live, block_ids.long(), nb)               # column nb: discarded
    mask.scatter_(1, safe_ids, True)
    mask = mask[:, :nb]
    if ema:
        # compact [B*R, m_cap*64] -> dense slot coordinates [B, R, nb*64]
        dense = torch.full((B, R, (nb + 1) * BLOCK_SLOTS), float("-inf"), device=V.device)
        cols = (safe_ids.unsqueeze(-1) * BLOCK_SLOTS
                + torch.arange(BLOCK_SLOTS, device=V.device)).flatten(1)
        compact = logits[:, :m_cap * BLOCK_SLOTS].reshape(B, R, -1).float()
        dense.scatter_(2, cols.unsqueeze(1).expand(B, R, -1), compact)
        ref.update_state(state, dense[:, :, :width], mask, n, query_pos.long(),
                         accepted.long(), cfg, step.long())
        V[idx, layer] = state.V
        D[idx, layer] = state.D
    else:
        ref.mark_scored(state, mask, step.long())
    last_seen[idx, layer] = state.last_seen
    decode_steps[idx, layer] = state.decode_steps


def _validate_reset(V, D, last_seen, decode_steps, state_slots, step) -> None:
    dev = check_state("reset", V, D, last_seen, decode_steps)
    check_tensor("reset", "state_slots", state_slots, I32 + I64, 1, dev)
    check_slots("reset", state_slots, V.shape[0])
    check_tensor("reset", "step", step, I64, 1, dev)
    check_shape("reset", "step", step, tuple(state_slots.shape))


def _reset(V, D, last_seen, decode_steps, state_slots, step) -> None:
    idx = state_slots.long()
    ref.state_bits(V).index_fill_(0, idx, 0)
    ref.state_bits(D).index_fill_(0, idx, 0)
    last_seen.index_copy_(0, idx, step.view(-1, 1, 1).expand(-1, *last_seen.shape[1:]).contiguous())
    decode_steps.index_fill_(0, idx, 0)


register(SCHEMA, _validate, _reference)
register(RESET_SCHEMA, _validate_reset, _reset, native=False)   # torch ops on any device


def update(state: OpState, state_slot, logits, block_ids, counts, context_lens, query_pos,
           accepted, step, layer: int, cfg: SpinConfig, max_context_len: int,
           beside_previous: bool = False, ema: bool = True) -> None:
    """layer -1: every layer in one launch (logits [L, B*R, W], block_ids [B, L, m_cap],
    counts [B, L]). ema False: last_seen and decode_steps only (a predictor that reads no V/D
    history)."""
    torch.ops.spin.update(*state.tensors(), state_slot, logits, block_ids, counts, context_lens,
                          query_pos, accepted, step, layer, cfg.ema_decay,
                          cfg.mtp_update == "row0", max_context_len, beside_previous, ema)


def reset(state: OpState, state_slots, step) -> None:
    torch.ops.spin.reset(*state.tensors(), state_slots, step)
