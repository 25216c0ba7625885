"""The paged FP8 indexer, its top-K over compact logits, the compacted block table and the
probe's page summaries, in plain PyTorch: the specification of the native ops that read the
indexer K cache (uint8 pages of S fp8 keys of 128 B, then S fp32 scales; S = 64, or 32 where
a SPIN block spans two pages). The summaries also read MXFP4 pages (S keys of 64 B, then S x 4
UE8M0 exponents: DeepSeek-V4's format on SM100)."""

from __future__ import annotations

import bisect
import math
from typing import Optional

import torch

from ..errors import SpinError
from ..limits import (BLOCK_SLOTS, DEEPGEMM_SPLIT_KV, FP4_BLOCK, FP4_SLOT_BYTES, HEAD_DIM,
                      KEY_BYTES, PAGE_SIZES, SLOT_BYTES)
from ..limits import SUMMARY_BYTES as SUMMARY_ROW


# ---- the paged FP8 indexer and top-K over compact logits (spec of the native ops) ------------
MAX_SLOT_ID = 2**31 - 1          # slot ids are int32


def page_layout(kv_cache: torch.Tensor) -> tuple[int, int]:
    """(slots per page, bytes per slot: SLOT_BYTES for FP8 keys, FP4_SLOT_BYTES for MXFP4) of
    uint8 pages [P, S, 1, bytes] or [P, S * bytes] (the 2-D widths of the four layouts differ)."""
    if kv_cache.dim() > 2:
        return kv_cache.shape[1], kv_cache.shape[-1]
    for width in (SLOT_BYTES, FP4_SLOT_BYTES):
        for S in PAGE_SIZES:
            if kv_cache.shape[1] == S * width:
                return S, width
    return kv_cache.shape[1] // SLOT_BYTES, SLOT_BYTES   # not a layout: the callers' checks say so


def page_slots_of(kv_cache: torch.Tensor) -> int:
    """Slots per page of uint8 pages [P, S, 1, 132 or 68] (or [P, S * 132 or 68])."""
    return page_layout(kv_cache)[0]


def _e2m1(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit E2M1 codes (sign, 2 exponent bits, 1 mantissa bit)."""
    exp, man = ((codes >> 1) & 0x3).float(), (codes & 0x1).float()
    mag = torch.where(exp == 0, man * 0.5, torch.exp2(exp - 1) * (1 + man * 0.5))
    return torch.where((codes & 0x8) > 0, -mag, mag)


def dequantize_pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """uint8 pages -> float32 keys [P, S, 128]: FP8 (S e4m3 rows of 128 B, then S fp32 scales)
    or MXFP4 (S rows of 64 B, two E2M1 codes a byte with the even element in the low nibble,
    then S x 4 UE8M0 exponents, byte i scaling values 32 i .. 32 i + 31 by 2^(e - 127))."""
    S, width = page_layout(kv_cache)
    P = kv_cache.shape[0]
    pages = kv_cache.reshape(P, S * width)
    if width == FP4_SLOT_BYTES:
        packed = pages[:, :S * HEAD_DIM // 2].reshape(P, S, HEAD_DIM // 2)
        codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(P, S, HEAD_DIM)
        exps = pages[:, S * HEAD_DIM // 2:].reshape(P, S, HEAD_DIM // FP4_BLOCK).float()
        scale = torch.exp2(exps - 127.0).repeat_interleave(FP4_BLOCK, dim=-1)
        return _e2m1(codes) * scale
    rows = pages[:, :S * KEY_BYTES].contiguous().view(torch.float8_e4m3fn).float()
    scales = pages[:, S * KEY_BYTES:].contiguous().view(torch.float32)
    return rows.view(-1, S, KEY_BYTES) * scales.unsqueeze(-1)


# ---- block summaries and the probe (query-aware block scores) ----------------------------------
# One summary row per K-cache page, kept beside the cache and addressed by the same page ids:
# the mean of the page's first `fill` dequantized keys, re-quantized like a key (e4m3, scale =
# amax / 448), in a 144-byte row (128 fp8 bytes, the fp32 scale, 12 bytes of padding, so rows
# stay 16-byte aligned).
FP8_MAX = 448.0


def e4m3_query_of_mxfp4(q_packed: torch.Tensor, q_scales: torch.Tensor,
                        weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's query from an MXFP4 one (DeepGEMM's fp8_fp4 layout: E2M1 pairs uint8
    [..., H, 64], the even element in the low nibble, and one int32 of 4 UE8M0 exponents per
    head [..., H]) and its head weights fp32 [rows, H]: (e4m3 q [..., H, 128] with one scale
    per row and head, amax / 448, and the weights times those scales). relu(s x) = s relu(x)
    for s > 0, so the probe scores the dequantized query within e4m3 rounding."""
    packed = q_packed.contiguous().view(torch.uint8)
    lead = packed.shape[:-1]
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*lead, HEAD_DIM)
    exps = q_scales.contiguous().view(torch.uint8).reshape(*lead, HEAD_DIM // FP4_BLOCK)
    values = _e2m1(codes) * torch.exp2(exps.float() - 127.0).repeat_interleave(FP4_BLOCK, -1)
    rows, scale = _quantized(values.reshape(-1, HEAD_DIM))
    q = rows.view(torch.float8_e4m3fn).reshape(*lead, HEAD_DIM)
    return q, weights.float() * scale.reshape(weights.shape)


def table_pages(block_table: torch.Tensor, ids: torch.Tensor,
                num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages of block ids [B, J] through block_table int32 [B, max_pages]: (int64 [B, J] page,
    0 where not live; bool [B, J] live: the id is a table column and its page lies in
    [0, num_pages), so it may be read)."""
    table = block_table.to(torch.int64)
    if table.shape[1] == 0:                        # no pages at all: nothing is read
        table = torch.full((ids.shape[0], 1), -1, dtype=torch.int64, device=ids.device)
    pages = table.gather(1, ids.clamp(0, table.shape[1] - 1))
    live = (ids >= 0) & (ids < block_table.shape[1]) & (pages >= 0) & (pages < num_pages)
    return torch.where(live, pages, 0), live


def _visible_keys(kv_cache: torch.Tensor, pages: torch.Tensor,
                  fill: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys float32 [P, S, 128], visible bool [P, S], count int64 [P]) of pages[i]'s first
    clamp(fill[i], 0, S) slots."""
    S = page_slots_of(kv_cache)
    keys = dequantize_pages(kv_cache[pages.long().clamp(0, kv_cache.shape[0] - 1)])
    f = fill.long().clamp(0, S)
    return keys, torch.arange(S, device=keys.device) < f.unsqueeze(-1), f


def _quantized(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 rows [P, 128] -> (e4m3 as uint8 [P, 128], fp32 scale [P]): scale =
    max(amax / 448, 1e-12), round-to-nearest."""
    scale = (rows.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
    return (rows / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8), scale


def summarize_pages(kv_cache: torch.Tensor, pages: torch.Tensor,
                    fill: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summaries of K-cache pages: (fp8 e4m3 keys as uint8 [P, 128], fp32 scales [P]).

    Page pages[i]'s summary is mean_{s < f} k_s over its first f = clamp(fill[i], 0, S)
    dequantized keys (S slots per page: 64 or 32; the products fp8 * scale in fp32, summed in
    fp64, the mean cast to fp32), quantized with scale = max(amax / 448, 1e-12) (fp32) and
    round-to-nearest e4m3; f = 0 gives a zero key."""
    keys, valid, f = _visible_keys(kv_cache, pages, fill)
    total = torch.where(valid.unsqueeze(-1), keys.double(), 0.0).sum(1)
    mean = (total / f.clamp(min=1).unsqueeze(-1).double()).float()
    return _quantized(mean)


def summarize_pages_gauss(kv_cache: torch.Tensor, pages: torch.Tensor,
                          fill: torch.Tensor) -> torch.Tensor:
    """gauss summaries of K-cache pages: uint8 [P, 288], the mean row of summarize_pages, then
    the per-dimension standard deviation of the same keys (population: sqrt of the mean
    squared deviation, fp64, cast to fp32) in the same row format."""
    keys, valid, f = _visible_keys(kv_cache, pages, fill)
    k = torch.where(valid.unsqueeze(-1), keys.double(), 0.0)
    count = f.clamp(min=1).unsqueeze(-1).double()
    mean = k.sum(1) / count
    dev = torch.where(valid.unsqueeze(-1), k - mean.unsqueeze(1), 0.0)
    std = (dev.square().sum(1) / count).sqrt().float()
    out = torch.zeros(len(f), 2 * SUMMARY_ROW, dtype=torch.uint8, device=keys.device)
    for at, part in ((0, mean.float()), (SUMMARY_ROW, std)):
        rows, scale = _quantized(part)
        out[:, at:at + KEY_BYTES] = rows
        out[:, at + KEY_BYTES:at + KEY_BYTES + 4] = scale.view(-1, 1).view(torch.uint8)
    return out


def newest_pages(context_lens: torch.Tensor, block_table: torch.Tensor, page_slots: int,
                 max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages a decode step of R = context_lens.shape[1] rows writes, two listings a request
    (summarize_newest's pages): (pages int32 [2B], -1 where not listed; fill int32 [2B]).

    With n = clamp(context_lens[b, R - 1], 0, max_len), the step writes slots n - R .. n - 1
    (at most two pages for R <= page_slots); listing 2b + j is page column
    c = max(n - R, 0) // page_slots + j of block_table row b, with fill n - c * page_slots
    (at most page_slots), listed where that fill is positive and c < block_table.shape[1].
    (With a compress ratio the last row may also write slot n, a partial group no row sees
    yet: it is summarized once it is visible.)"""
    B, R = context_lens.shape
    n = context_lens[:, R - 1].to(torch.int64).clamp(0, max_len)
    first = (n - R).clamp(min=0) // page_slots
    columns = torch.stack([first, first + 1], 1)                      # [B, 2]
    written = n.unsqueeze(1) - columns * page_slots
    width = block_table.shape[1]
    listed = (written > 0) & (columns < width)
    pages = torch.full_like(columns, -1)
    if width:
        pages = block_table.to(torch.int64).gather(1, columns.clamp(max=width - 1))
    pages = torch.where(listed, pages, -1)
    fill = torch.where(listed, written.clamp(max=page_slots), 0)
    return pages.view(-1).to(torch.int32), fill.view(-1).to(torch.int32)


def dequantize_summaries(summaries: torch.Tensor) -> torch.Tensor:
    """uint8 [P, 144] summary rows -> float32 keys [P, 128]."""
    rows = summaries[:, :KEY_BYTES].contiguous().view(torch.float8_e4m3fn).float()
    scales = summaries[:, KEY_BYTES:KEY_BYTES + 4].contiguous().view(torch.float32)
    return rows * scales


def _page_columns(q, weights, context_lens, block_table, num_pages: int, num_blocks: int,
                  dtype: torch.dtype, page_slots: int):
    """What probe_scores and gauss_scores share: (q [B, R, H, D] and weights [B, R, H] in
    dtype, int64 pages [B, J] of the first num_blocks table columns, bool visible [B, R, J]:
    the column's page is live and holds a slot the row sees)."""
    B, R = context_lens.shape
    qf = q.float().to(dtype).view(B, R, q.shape[-2], q.shape[-1])
    w = weights.to(dtype).view(B, R, -1)
    j = torch.arange(num_blocks, device=q.device)
    pages, live = table_pages(block_table, j.expand(B, -1), num_pages)
    visible = live.unsqueeze(1) & (j * page_slots < context_lens.to(torch.int64).unsqueeze(-1))
    return qf, w, pages, visible


def _masked_columns(z: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Scores [B, R, J] -> [B*R, J], -inf where the column is not visible."""
    return z.masked_fill(~visible, float("-inf")).reshape(-1, z.shape[-1])


def probe_scores(q: torch.Tensor, summaries: torch.Tensor, weights: torch.Tensor,
                 context_lens: torch.Tensor, block_table: torch.Tensor, num_blocks: int,
                 dtype: torch.dtype = torch.float64, page_slots: int = BLOCK_SLOTS) -> torch.Tensor:
    """P[b*R + r, j] = sum_h w_h ReLU(q_h . s_j) for page columns j < num_blocks of the block
    table (blocks, with 64-slot pages), s_j the summary of page block_table[b, j] (its mean
    key, scored like a slot). -inf where column j has no visible slot (page_slots * j >=
    context_lens[b, r]), is past the block table, or its page is outside the summaries (never
    read). [B*R, num_blocks]. With 32-slot pages a block's score is the max of its two
    columns' (block_scores)."""
    qf, w, pages, visible = _page_columns(q, weights, context_lens, block_table,
                                          summaries.shape[0], num_blocks, dtype, page_slots)
    keys = dequantize_summaries(summaries)[pages].to(dtype)                        # [B, J, 128]
    z = (torch.relu(torch.einsum("brhd,bjd->brjh", qf, keys)) * w[:, :, None, :]).sum(-1)
    return _masked_columns(z, visible)


def gauss_scores(q: torch.Tensor, summaries: torch.Tensor, weights: torch.Tensor,
                 context_lens: torch.Tensor, block_table: torch.Tensor, num_blocks: int,
                 dtype: torch.dtype = torch.float64, page_slots: int = BLOCK_SLOTS) -> torch.Tensor:
    """G[b*R + r, j] = sum_h w_h E[relu(X_h)], X_h ~ N(mu_h, sd_h^2) with mu_h = q_h . m_j and
    sd_h^2 = sum_d q_hd^2 s_jd^2 (m_j, s_j the mean and std rows of page block_table[b, j]'s
    gauss summary, uint8 [num_pages, 288]); E[relu(X)] = mu Phi(mu / sd) + sd phi(mu / sd),
    relu(mu) where sd = 0. The replay's gauss (replay.probe.gauss_scores) on summary rows;
    columns and -inf as probe_scores. [B*R, num_blocks]."""
    qf, w, pages, visible = _page_columns(q, weights, context_lens, block_table,
                                          summaries.shape[0], num_blocks, dtype, page_slots)
    mean = dequantize_summaries(summaries[:, :SUMMARY_ROW])[pages].to(dtype)      # [B, J, 128]
    std = dequantize_summaries(summaries[:, SUMMARY_ROW:])[pages].to(dtype)
    mu = torch.einsum("brhd,bjd->brjh", qf, mean)
    sd = torch.einsum("brhd,bjd->brjh", qf * qf, std * std).clamp(min=0).sqrt()
    a = mu / sd.clamp(min=1e-30)
    expected = mu * torch.special.ndtr(a) + sd * torch.exp(-0.5 * a * a) / math.sqrt(2 * math.pi)
    expected = torch.where(sd > 0, expected, mu.relu())
    return _masked_columns((expected * w[:, :, None, :]).sum(-1), visible)


def block_scores(page_scores: torch.Tensor, page_slots: int,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Block scores [rows, blocks] from the probe's page-column scores [rows, blocks * (64 /
    page_slots)]: each block's best page (the max over its pages' summaries); into `out` when
    given (no allocation: CUDA-graph capturable)."""
    per = BLOCK_SLOTS // page_slots
    pages = page_scores.view(page_scores.shape[0], -1, per)
    return pages.amax(-1) if out is None else torch.amax(pages, -1, out=out)


def masked_indexer_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                          context_lens: torch.Tensor, block_table: torch.Tensor,
                          block_ids: torch.Tensor, counts: torch.Tensor,
                          dtype: torch.dtype = torch.float64, chunk: int = 256) -> torch.Tensor:
    """z[i] = sum_h w_h ReLU(q_h . k_i) over the selected blocks, compact [B*R, m_cap*64].

    Slot (c, s) is block block_ids[b, c], slot s. The cache's pages hold S = 64 or 32 slots
    (page_slots_of); with per = 64 / S pages a block, block id j's slots s lie in page
    block_table[b, per*j + s // S], slot s % S. -inf where c >= min(count, m_cap), the block
    id is negative, the slot's page column is outside the block table or its page outside
    the cache (never read), or the slot is past the row's causal length context_lens[b, r]."""
    S = page_slots_of(kv_cache)
    if S not in PAGE_SIZES:
        raise SpinError(f"masked_indexer_logits: K-cache pages of {S} slots; pages hold "
                        f"{' or '.join(map(str, PAGE_SIZES))} slots")
    per = BLOCK_SLOTS // S
    B, R = context_lens.shape
    m_cap = block_ids.shape[1]
    num_pages = kv_cache.shape[0]
    qf = q.float().to(dtype).view(B, R, q.shape[-2], q.shape[-1])
    w = weights.to(dtype).view(B, R, -1)
    c = torch.arange(m_cap, device=q.device)
    ids = block_ids.to(torch.int64)
    # the page columns of each block (per = 1: the block ids themselves), [B, m_cap * per]
    cols = ids if per == 1 else \
        (ids.unsqueeze(-1) * per + torch.arange(per, device=q.device)).flatten(1)
    pages, page_live = table_pages(block_table, cols, num_pages)
    page_live &= (c < counts.to(torch.int64).clamp(max=m_cap).unsqueeze(-1)).repeat_interleave(
        per, 1)
    pages = torch.where(page_live, pages, 0)
    live = page_live.view(B, m_cap, per).any(-1)                       # a block with a page
    out = torch.zeros(B, R, m_cap, BLOCK_SLOTS, dtype=dtype, device=q.device)
    # only the pages of live blocks are read and dequantized, chunk by chunk (on the CPU the
    # live range is known without a sync; on CUDA, where graphs may capture this, all chunks)
    last = m_cap
    if q.device.type == "cpu":
        any_live = live.any(0)
        last = int(torch.nonzero(any_live).max()) + 1 if bool(any_live.any()) else 0
    for start in range(0, last, chunk):
        sub = pages[:, start * per:(start + chunk) * per]
        k = dequantize_pages(kv_cache[sub.reshape(-1)]).to(dtype).view(
            B, sub.shape[1] // per, BLOCK_SLOTS, -1)                    # [B, c, 64, 128]
        dots = torch.einsum("brhd,bcsd->brcsh", qf, k)
        out[:, :, start:start + chunk] = (torch.relu(dots) * w[:, :, None, None, :]).sum(-1)
    slot = ids.unsqueeze(-1) * BLOCK_SLOTS + torch.arange(BLOCK_SLOTS, device=q.device)
    visible = slot.unsqueeze(1) < context_lens.to(torch.int64)[:, :, None, None]
    # a slot counts where its own page is live (a block of two pages may miss one)
    slot_live = page_live.view(B, m_cap, per).repeat_interleave(S, -1)   # [B, m_cap, 64]
    out = out.masked_fill(~(slot_live.unsqueeze(1) & visible), float("-inf"))
    return out.reshape(B * R, m_cap * BLOCK_SLOTS)


def topk_slots(logits: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor, next_n: int,
               k: int, row_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int32 [B*R, k]: top-k request-local slot ids of the compact logits, ascending, -1
    padded. Only finite scores of selected blocks (and, with row_lens [B, R], positions below
    the row's compact length) compete; ties go to the lower slot id."""
    rows, width = logits.shape
    if width == 0 or k == 0:
        return torch.full((rows, k), -1, dtype=torch.int32, device=logits.device)
    pos = torch.arange(width, device=logits.device)
    scored = (counts.to(torch.int64).clamp(max=block_ids.shape[1]) * BLOCK_SLOTS)
    valid = (pos < scored.repeat_interleave(next_n).unsqueeze(-1)) & torch.isfinite(logits)
    if row_lens is not None:
        valid &= pos < row_lens.reshape(-1, 1).to(torch.int64)
    key = torch.where(valid, logits.float(), float("-inf"))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :k]
    take = torch.arange(order.shape[1], device=logits.device) < valid.sum(-1, keepdim=True)
    chosen = torch.where(take, order, width).sort(-1).values           # ascending positions
    ids = block_ids.to(torch.int64).repeat_interleave(next_n, 0)
    blk = ids.gather(1, (chosen // BLOCK_SLOTS).clamp(max=block_ids.shape[1] - 1))
    slots = blk * BLOCK_SLOTS + chosen % BLOCK_SLOTS
    # a block id that is negative, or whose slots do not fit int32, gives -1
    slots = torch.where((chosen < width) & (blk >= 0) & (slots <= MAX_SLOT_ID), slots, -1)
    out = torch.full((rows, k), -1, dtype=torch.int32, device=logits.device)
    out[:, :slots.shape[1]] = slots.to(torch.int32)
    return out


# ---- a compacted block table for an external paged logits kernel (spec of compact/remap) ------
def compact_block_table(block_ids: torch.Tensor, counts: torch.Tensor, context_lens: torch.Tensor,
                        block_table: torch.Tensor, page_slots: int,
                        width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 [B, width] compact table, int32 [B, R] compact lengths) of the selected blocks.

    With ppb = 64 // page_slots pages per block, entry k*ppb + p is block_table[b, ids[k]*ppb + p]
    for the used blocks k < min(count, m_cap) with ids[k] >= 0 and that column < max_pages; any
    other entry is 0. Row j's length is the sum over the used blocks of
    clamp(context_lens[b, j] - 64 ids[k], 0, 64): with ascending ids the visible slots of a row
    are a prefix of the compact order, compact position k*64 + s being slot ids[k]*64 + s."""
    B, m_cap = block_ids.shape
    ppb = BLOCK_SLOTS // page_slots
    dev = block_ids.device
    ids = block_ids.to(torch.int64)
    used = (torch.arange(m_cap, device=dev) < counts.to(torch.int64).clamp(max=m_cap)[:, None]) \
        & (ids >= 0)                                                   # [B, m_cap]
    cols = (ids[:, :, None] * ppb + torch.arange(ppb, device=dev)).flatten(1)   # [B, m_cap*ppb]
    max_pages = block_table.shape[1]
    live = used.repeat_interleave(ppb, 1) & (cols < max_pages)
    pages = torch.zeros_like(cols)
    if max_pages:
        pages = block_table.to(torch.int64).gather(1, cols.clamp(0, max_pages - 1))
    table = torch.zeros(B, width, dtype=torch.int32, device=dev)
    table[:, :m_cap * ppb] = torch.where(live, pages, 0).to(torch.int32)
    first = ids[:, None, :] * BLOCK_SLOTS
    seen = (context_lens.to(torch.int64)[:, :, None] - first).clamp(0, BLOCK_SLOTS)
    lens = (seen * used[:, None, :]).sum(-1)
    return table, lens.to(torch.int32)


def paged_logits_schedule(lens: torch.Tensor, num_sms: int) -> torch.Tensor:
    """int32 [num_sms + 1, 2]: DeepGEMM's SM90 paged-logits schedule of lens int32 [B, R] (what
    its get_paged_mqa_logits_metadata returns for 2D lengths, as of HEAD 54e22612).

    Request b is ceil(lens[b, R-1] / DEEPGEMM_SPLIT_KV) runs for each of its row pairs
    (ceil(R / 2), 1 for one row), the runs taken in request order and dealt out to num_sms SMs:
    q = total // num_sms each, the last total % num_sms one more. Entry s is (request pair,
    run) where SM s starts; entry num_sms is (B * pairs, 0), as is every entry when there are
    no runs. (DeepGEMM sums in 32 bits: totals past 2^32 are not modelled.)"""
    B, R = lens.shape
    pairs = (R + 1) // 2 if R >= 2 else 1
    runs = (lens[:, -1].to(torch.int64) + DEEPGEMM_SPLIT_KV - 1) // DEEPGEMM_SPLIT_KV
    prefix = runs.cumsum(0).tolist()
    total = prefix[-1] * pairs if B else 0
    q, pivot = total // num_sms, num_sms - total % num_sms
    meta = [[B * pairs, 0] for _ in range(num_sms + 1)]
    starts = [p * pairs for p in prefix]
    for s in range(num_sms if total else 0):
        seg = s * q + (s - pivot if s > pivot else 0)
        b = bisect.bisect_right(starts, seg)        # the first request whose runs pass seg
        before = prefix[b - 1] if b else 0
        offset, own = seg - before * pairs, prefix[b] - before
        meta[s] = [b * pairs + offset // own, offset % own]
    return torch.tensor(meta, dtype=torch.int32, device=lens.device)


def remap_positions(positions: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor,
                    next_n: int, values: Optional[torch.Tensor] = None,
                    ascending: bool = False,
                    scores: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int32 [B*next_n, K]: compact positions (-1 padded) -> request-local slot ids.

    Position pos of row r (request r // next_n) becomes ids[pos // 64] * 64 + pos % 64 when
    0 <= pos < min(count, m_cap) * 64, that id is >= 0 and the slot id within int32
    (MAX_SLOT_ID), (values given) values[r, i] is finite
    and (scores given: [B*next_n, >= m_cap * 64], the rows the positions index) scores[r, pos]
    is finite, else -1. The order is kept, or with ascending each row is sorted, -1 last."""
    slots = _remap(positions, block_ids, counts, next_n)
    if values is not None:
        slots = torch.where(torch.isfinite(values), slots, -1)
    if scores is not None and scores.shape[1] > 0:   # no columns: every slot is -1 already
        at = torch.where(slots >= 0, positions.long(), 0)
        slots = torch.where(torch.isfinite(scores.gather(1, at)), slots, -1)
    if ascending:   # -1 sorts last: past every int32 id (MAX_SLOT_ID included)
        last = MAX_SLOT_ID + 1
        slots = torch.where(slots < 0, last, slots.to(torch.int64)).sort(-1).values
        slots = torch.where(slots == last, -1, slots).to(torch.int32)
    return slots


def _remap(positions: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor,
           next_n: int) -> torch.Tensor:
    rows, _ = positions.shape
    m_cap = block_ids.shape[1]
    pos = positions.to(torch.int64)
    scored = counts.to(torch.int64).clamp(max=m_cap).repeat_interleave(next_n) * BLOCK_SLOTS
    inside = (pos >= 0) & (pos < scored[:, None])
    if m_cap == 0:
        return torch.full_like(positions, -1, dtype=torch.int32)
    ids = block_ids.to(torch.int64).repeat_interleave(next_n, 0)
    block = ids.gather(1, torch.where(inside, pos // BLOCK_SLOTS, 0))
    slots = block * BLOCK_SLOTS + pos % BLOCK_SLOTS
    return torch.where(inside & (block >= 0) & (slots <= MAX_SLOT_ID), slots, -1).to(torch.int32)
