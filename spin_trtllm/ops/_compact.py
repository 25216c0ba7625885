"""spin::compact and spin::remap: drive an external paged indexer-logits kernel (DeepGEMM's
fp8_paged_mqa_logits, as TensorRT-LLM runs it) over the selected blocks only, and map its
top-K back to slot ids.

compact: block_ids [B, m_cap] and counts [B] as select writes them (a strided layer view is
fine; the first min(count, m_cap) ids are used), or every layer at once ([B, L, m_cap] and
[B, L] -> compact_table [L, B, T] and compact_lens [L, B, R], one launch), context_lens
[B, R], block_table int32 [B, max_pages] of pages of page_slots = 64 or 32 slots (ppb = 64 /
page_slots pages per block) -> compact_table int32 [B, T >= m_cap*ppb]: entry k*ppb + p =
block_table[b, ids[k]*ppb + p] for each used k with ids[k] >= 0 and that column < max_pages, 0
elsewhere (keeps a reader inside the cache); compact_lens int32 [B, R]: row j = sum over used k of
clamp(context_lens[b, j] - 64 ids[k], 0, 64). Ids ascend, so a row's visible slots are a prefix
of the compact order: a kernel given (compact_table, compact_lens) as (block table, context
lengths) computes indexer_logits' compact masked logits. schedule int32 [num_sms + 1, 2] ([L,
num_sms + 1, 2] for every layer): also DeepGEMM's SM90 paged-logits schedule of each layer's
compact_lens (reference.paged_logits_schedule; what get_paged_mqa_logits_metadata returns for
them), so that one launch prepares every layer's DeepGEMM call; workspace int32 [L] (1 for
one layer) must then be zero, and is left zero.
remap: positions int32 [B*next_n, K] (compact positions, request-local, -1 padded; row stride
allowed) -> out int32 [B*next_n, K]: ids[pos // 64]*64 + pos % 64 for 0 <= pos <
min(count, m_cap)*64 with that id in [0, 2^25 - 1] (a slot id within int32), else -1, order
kept. Optional values fp32
[B*next_n, K] (the top-K's scores) or scores fp32 [B*next_n, >= m_cap*64] (the logits the
positions index): a non-finite value makes its entry -1. ascending (K <= MAX_SORTED_K): each
row sorted, -1 last, which turns a peer's unordered top-K into topk's output in one launch.
out may be positions itself (in place), otherwise it must not overlap it.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import reference as ref
from ..limits import BLOCK_SLOTS, MAX_LAUNCH_BATCH, MAX_M_CAP, MAX_SORTED_K, PAGE_SIZES
from ._common import (I32, check_context_lens, check_launch_rows, check_next_n, check_selection,
                      check_shape, check_tensor, device_of, fail, register)

SCHEMA = ("compact(Tensor block_ids, Tensor counts, Tensor context_lens, Tensor block_table, "
          "int page_slots, Tensor(a!) compact_table, Tensor(b!) compact_lens, "
          "Tensor(c!)? schedule=None, Tensor(d!)? workspace=None) -> ()")
REMAP_SCHEMA = ("remap(Tensor positions, Tensor block_ids, Tensor counts, int next_n, "
                "Tensor(a!) out, Tensor? values=None, bool ascending=False, "
                "Tensor? scores=None) -> ()")


def _validate(block_ids, counts, context_lens, block_table, page_slots, compact_table,
              compact_lens, schedule=None, workspace=None) -> None:
    op = "compact"
    dev = device_of(block_ids)
    B, R = check_context_lens(op, context_lens, dev)
    check_launch_rows(op, B, R)
    layered = isinstance(block_ids, torch.Tensor) and block_ids.dim() == 3
    m_cap = check_selection(op, dev, block_ids, counts, B, layered=layered)
    L = block_ids.shape[1] if layered else 1
    if not 1 <= L <= MAX_LAUNCH_BATCH:
        fail(op, f"{L} layers; one launch takes 1 to {MAX_LAUNCH_BATCH}")
    lead = (L,) if layered else ()
    check_tensor(op, "block_table", block_table, I32, 2, dev, inner_contiguous=True)
    if block_table.shape[0] != B:
        fail(op, f"block_table has {block_table.shape[0]} rows, expected {B}")
    if page_slots not in PAGE_SIZES:
        fail(op, f"page_slots must be 64 or 32 (slots per KV page; a SPIN block is 64 slots), "
                 f"got {page_slots}")
    ppb = BLOCK_SLOTS // page_slots
    check_tensor(op, "compact_table", compact_table, I32, 2 + layered, dev, inner_contiguous=True)
    if tuple(compact_table.shape[:-1]) != lead + (B,) or not m_cap * ppb <= \
            compact_table.shape[-1] <= MAX_M_CAP * ppb:
        dims = ", ".join(map(str, lead + (B,)))
        fail(op, f"compact_table must have shape [{dims}, m_cap * {ppb} = {m_cap * ppb} <= T <= "
                 f"{MAX_M_CAP * ppb}], got {list(compact_table.shape)}")
    check_tensor(op, "compact_lens", compact_lens, I32, 2 + layered, dev, contiguous=True)
    check_shape(op, "compact_lens", compact_lens, lead + (B, R))
    # each CTA writes its own row while others read theirs: rows that share memory, or a table
    # written over what is read, would race
    rows_apart = compact_table.stride(-2) >= compact_table.shape[-1] or B == 1
    layers_apart = not layered or L == 1 or \
        compact_table.stride(0) >= (B - 1) * compact_table.stride(1) + compact_table.shape[-1]
    if not (rows_apart and layers_apart):
        fail(op, f"compact_table rows overlap (strides {list(compact_table.stride())}, shape "
                 f"{list(compact_table.shape)}): each row needs its own memory")
    # every output apart from every input: with several layers (or a schedule) some CTAs still
    # read the inputs while others write
    inputs = (("block_table", block_table), ("block_ids", block_ids), ("counts", counts),
              ("context_lens", context_lens))
    for out_name, out in (("compact_table", compact_table), ("compact_lens", compact_lens),
                          ("schedule", schedule), ("workspace", workspace)):
        for name, read in inputs if out is not None else ():
            if overlaps(out, read):
                fail(op, f"{out_name} must not overlap {name}: the kernel reads it while it "
                         f"writes {out_name}")
    if overlaps(compact_lens, compact_table):
        fail(op, "compact_lens must not overlap compact_table")
    if schedule is None:
        if workspace is not None:
            fail(op, "workspace counts the CTAs that write a schedule; pass schedule with it")
        return
    check_tensor(op, "schedule", schedule, I32, 3 if layered else 2, dev, contiguous=True)
    if tuple(schedule.shape[:-2]) != lead or schedule.shape[-1] != 2 or schedule.shape[-2] < 2:
        fail(op, f"schedule must have shape {list(lead)} + [num_sms + 1, 2] with num_sms >= 1, "
                 f"got {list(schedule.shape)}")
    if workspace is None:
        fail(op, f"schedule needs a workspace: int32 [{L}] of zeros (left zero)")
    check_tensor(op, "workspace", workspace, I32, 1, dev, contiguous=True)
    check_shape(op, "workspace", workspace, (L,))
    for name, other in (("compact_table", compact_table), ("compact_lens", compact_lens),
                        ("workspace", workspace)):
        if overlaps(schedule, other):
            fail(op, f"schedule must not overlap {name}")
    if overlaps(workspace, compact_table) or overlaps(workspace, compact_lens):
        fail(op, "workspace must not overlap compact_table or compact_lens")
    if workspace.device.type == "cpu" and bool((workspace != 0).any()):
        fail(op, "workspace must be zero (the kernel counts each layer's finished CTAs in it and "
                 "leaves it zero)")


def _reference(block_ids, counts, context_lens, block_table, page_slots, compact_table,
               compact_lens, schedule=None, workspace=None) -> None:
    layered = block_ids.dim() == 3
    for layer in range(block_ids.shape[1] if layered else 1):
        ids, cnt = (block_ids[:, layer], counts[:, layer]) if layered else (block_ids, counts)
        table, lens = ref.compact_block_table(ids, cnt, context_lens, block_table, page_slots,
                                              compact_table.shape[-1])
        (compact_table[layer] if layered else compact_table).copy_(table)
        (compact_lens[layer] if layered else compact_lens).copy_(lens)
        if schedule is not None:
            (schedule[layer] if layered else schedule).copy_(
                ref.paged_logits_schedule(lens, schedule.shape[-2] - 1))


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    span = sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) + 1 if t.numel() else 0
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of two tensors (first to last element) intersect."""
    (a0, a1), (b0, b1) = _byte_range(a), _byte_range(b)
    return a0 < b1 and b0 < a1


def _validate_remap(positions, block_ids, counts, next_n, out, values=None,
                    ascending=False, scores=None) -> None:
    op = "remap"
    dev = device_of(positions)
    check_tensor(op, "positions", positions, I32, 2, dev, inner_contiguous=True)
    B = block_ids.shape[0] if isinstance(block_ids, torch.Tensor) else 0
    check_selection(op, dev, block_ids, counts, B, layered=False)
    check_next_n(op, next_n)
    if positions.shape[0] != B * next_n:
        fail(op, f"positions must have shape [B*next_n = {B * next_n}, K], got "
                 f"{list(positions.shape)}")
    check_launch_rows(op, B, next_n)
    check_tensor(op, "out", out, I32, 2, dev, contiguous=True)
    check_shape(op, "out", out, tuple(positions.shape))
    if values is not None:
        check_tensor(op, "values", values, (torch.float32,), 2, dev, inner_contiguous=True)
        check_shape(op, "values", values, tuple(positions.shape))
    if scores is not None:
        m_cap = block_ids.shape[1]
        check_tensor(op, "scores", scores, (torch.float32,), 2, dev, inner_contiguous=True)
        if scores.shape[0] != positions.shape[0] or scores.shape[1] < m_cap * BLOCK_SLOTS:
            fail(op, f"scores must have shape [{positions.shape[0]}, W >= "
                     f"{m_cap * BLOCK_SLOTS}] (the rows the positions index), got "
                     f"{list(scores.shape)}")
    if ascending and positions.shape[1] > MAX_SORTED_K:
        fail(op, f"ascending sorts rows of at most {MAX_SORTED_K} entries, got K = "
                 f"{positions.shape[1]}")
    same = out.data_ptr() == positions.data_ptr() and out.stride() == positions.stride()
    if not same and overlaps(out, positions):
        fail(op, "out must be positions itself (in place) or not overlap it")


def _remap_reference(positions, block_ids, counts, next_n, out, values=None, ascending=False,
                     scores=None) -> None:
    out.copy_(ref.remap_positions(positions, block_ids, counts, next_n, values, ascending,
                                  scores))


register(SCHEMA, _validate, _reference)
register(REMAP_SCHEMA, _validate_remap, _remap_reference)


def compact(block_ids, counts, context_lens, block_table, page_slots: int = BLOCK_SLOTS,
            compact_table: Optional[torch.Tensor] = None,
            compact_lens: Optional[torch.Tensor] = None, schedule: Optional[torch.Tensor] = None,
            workspace: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(compact_table int32 [B, m_cap * 64 / page_slots], compact_lens int32 [B, R]) of the
    selected blocks, each with a leading [L] for layered block_ids [B, L, m_cap]; buffers are
    allocated when not given (a zero workspace too, where schedule is given without one)."""
    B, m_cap = block_ids.shape[0], block_ids.shape[-1]
    lead = (block_ids.shape[1],) if block_ids.dim() == 3 else ()
    if compact_table is None:
        ppb = BLOCK_SLOTS // page_slots if page_slots in PAGE_SIZES else 1  # op refuses
        compact_table = torch.empty(lead + (B, m_cap * ppb), dtype=torch.int32,
                                    device=block_ids.device)
    if compact_lens is None:
        compact_lens = torch.empty(lead + tuple(context_lens.shape), dtype=torch.int32,
                                   device=block_ids.device)
    if schedule is not None and workspace is None:
        workspace = torch.zeros(lead[0] if lead else 1, dtype=torch.int32,
                                device=block_ids.device)
    torch.ops.spin.compact(block_ids, counts, context_lens, block_table, page_slots,
                           compact_table, compact_lens, schedule, workspace)
    return compact_table, compact_lens


def remap(positions, block_ids, counts, next_n: int,
          out: Optional[torch.Tensor] = None, values: Optional[torch.Tensor] = None,
          ascending: bool = False, scores: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Compact positions -> request-local slot ids (out may be positions: in place)."""
    if out is None:
        out = torch.empty(tuple(positions.shape), dtype=torch.int32, device=positions.device)
    torch.ops.spin.remap(positions, block_ids, counts, next_n, out, values, ascending, scores)
    return out
