"""spin::summarize and spin::probe: the probe predictor's per-page key summaries and the
query-aware block scores computed from them.

summarize: kv_cache as indexer_logits reads it (or of 32-slot pages; MXFP4 pages of 68-byte
slots too), pages int32 [P], fill int32 [P] -> summaries
uint8 [num_pages, 144] (one row per page: 128 fp8 bytes, fp32 scale, padding), row pages[i] =
the mean of that page's first clamp(fill[i], 0, S) dequantized keys (S slots per page),
re-quantized e4m3 with scale amax / 448 (reference.summarize_pages; the kernel's bytes equal
the reference's). Pages outside [0, num_pages) are skipped; a page listed twice is written by
two CTAs at once on CUDA (the reference keeps the last listing): list each once. Kept beside
the K cache with the same page ids, whatever the keys' format.
probe: q, weights, context_lens, block_table as indexer_logits takes them, summaries, the
cache's page_slots -> out fp32 [B*R, columns]: sum_h w_h ReLU(q_h . summary(block_table[b, j]))
per page column j, -inf where the page has no visible slot, is past the table or is outside
the summaries. A 64-slot page is a block; with 32-slot pages reference.block_scores takes each
block's best page.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import reference as ref
from ..limits import (BLOCK_SLOTS, FP4_SLOT_BYTES, GAUSS_SUMMARY_BYTES, PAGE_SIZES, SLOT_BYTES,
                      SUMMARY_BYTES)
from ._common import (I32, check_aligned16, check_block_table, check_cache, check_context_lens,
                      check_launch_batch, check_query, check_shape, check_tensor, device_of, fail,
                      register)

SUMMARIZE_SCHEMA = ("summarize(Tensor kv_cache, Tensor pages, Tensor fill, "
                    "Tensor(a!) summaries) -> ()")
PROBE_SCHEMA = ("probe(Tensor q, Tensor summaries, Tensor weights, Tensor context_lens, "
                "Tensor block_table, int page_slots, Tensor(a!) out) -> ()")
# gauss: the same arguments over rows of GAUSS_SUMMARY_BYTES (the mean row, then the std row)
SUMMARIZE_GAUSS_SCHEMA = SUMMARIZE_SCHEMA.replace("summarize(", "summarize_gauss(")
GAUSS_SCHEMA = PROBE_SCHEMA.replace("probe(", "gauss(")
# a decode step's newest pages, found from its lengths on the device (reference.newest_pages)
SUMMARIZE_NEWEST_SCHEMA = ("summarize_newest(Tensor kv_cache, Tensor context_lens, "
                           "Tensor block_table, int max_len, Tensor(a!) summaries) -> ()")
SUMMARIZE_NEWEST_GAUSS_SCHEMA = SUMMARIZE_NEWEST_SCHEMA.replace("summarize_newest(",
                                                                "summarize_newest_gauss(")


def _check_summaries(op: str, summaries, dev, width: int) -> None:
    check_tensor(op, "summaries", summaries, (torch.uint8,), 2, dev, contiguous=True)
    if summaries.shape[0] < 1 or summaries.shape[1] != width:
        fail(op, f"summaries must be uint8 [num_pages >= 1, {width}] (one row per "
                 f"K-cache page), got shape {list(summaries.shape)}")
    check_aligned16(op, summaries=summaries)


def _check_cache_and_summaries(op: str, kv_cache, summaries, width: int):
    """The K-cache pages a summarize op reads and the summary table it writes (one row a page).
    Returns the device."""
    dev = device_of(kv_cache)
    check_cache(op, kv_cache, dev, PAGE_SIZES, (SLOT_BYTES, FP4_SLOT_BYTES))
    check_aligned16(op, kv_cache=kv_cache)
    _check_summaries(op, summaries, dev, width)
    if summaries.shape[0] != kv_cache.shape[0]:
        fail(op, f"summaries has {summaries.shape[0]} rows, the cache {kv_cache.shape[0]} pages: "
                 "one summary per page")
    return dev


def _validate_summarize(kv_cache, pages, fill, summaries, op="summarize",
                        width=SUMMARY_BYTES) -> None:
    dev = _check_cache_and_summaries(op, kv_cache, summaries, width)
    check_tensor(op, "pages", pages, I32, 1, dev, contiguous=True)
    check_tensor(op, "fill", fill, I32, 1, dev, contiguous=True)
    check_shape(op, "fill", fill, tuple(pages.shape))


def _validate_summarize_newest(kv_cache, context_lens, block_table, max_len, summaries,
                               op="summarize_newest", width=SUMMARY_BYTES) -> None:
    dev = _check_cache_and_summaries(op, kv_cache, summaries, width)
    B, _ = check_context_lens(op, context_lens, dev)
    check_launch_batch(op, B)
    check_block_table(op, block_table, B, dev)
    if not 0 <= max_len <= ref.MAX_SLOT_ID:
        fail(op, f"max_len must be in [0, {ref.MAX_SLOT_ID}], got {max_len}")


def _summarize_with(rows_of):
    """The reference of a summarize op: rows_of(kv_cache, pages, fill) -> uint8 [P, width'] into
    the leading bytes of each live page's row (pages outside the table are skipped)."""
    def run(kv_cache, pages, fill, summaries) -> None:
        live = (pages >= 0) & (pages < summaries.shape[0])
        if bool(live.any()):
            rows = rows_of(kv_cache, pages[live], fill[live])
            summaries[pages[live].long(), :rows.shape[1]] = rows
    return run


def _summarize_newest_with(rows_of):
    """The reference of a summarize_newest op: its pages (reference.newest_pages), summarized
    as the summarize op of rows_of does."""
    summarize_listed = _summarize_with(rows_of)

    def run(kv_cache, context_lens, block_table, max_len, summaries) -> None:
        pages, fill = ref.newest_pages(context_lens, block_table, ref.page_layout(kv_cache)[0],
                                       max_len)
        summarize_listed(kv_cache, pages, fill, summaries)
    return run


def _mean_rows(kv_cache, pages, fill) -> torch.Tensor:
    rows, scale = ref.summarize_pages(kv_cache, pages, fill)
    return torch.cat([rows, scale.view(-1, 1).view(torch.uint8)], 1)    # [P, 132]


def _validate_probe(q, summaries, weights, context_lens, block_table, page_slots, out,
                    op="probe", width=SUMMARY_BYTES) -> None:
    dev = device_of(q)
    if page_slots not in PAGE_SIZES:
        fail(op, f"page_slots must be one of {', '.join(map(str, PAGE_SIZES))}, got {page_slots}")
    B, R = check_query(op, q, weights, context_lens, block_table, dev)
    _check_summaries(op, summaries, dev, width)
    check_tensor(op, "out", out, (torch.float32,), 2, dev, contiguous=True)
    if out.shape[0] != B * R or out.shape[1] < 1:
        fail(op, f"out must have shape [{B * R}, num_blocks >= 1], got {list(out.shape)}")


def _probe_reference(q, summaries, weights, context_lens, block_table, page_slots, out) -> None:
    out.copy_(ref.probe_scores(q, summaries, weights, context_lens, block_table,
                               out.shape[1], page_slots=page_slots).float())


def _gauss_reference(q, summaries, weights, context_lens, block_table, page_slots, out) -> None:
    out.copy_(ref.gauss_scores(q, summaries, weights, context_lens, block_table,
                               out.shape[1], page_slots=page_slots).float())


register(SUMMARIZE_SCHEMA, _validate_summarize, _summarize_with(_mean_rows))
register(PROBE_SCHEMA, _validate_probe, _probe_reference)
register(SUMMARIZE_GAUSS_SCHEMA, functools.partial(_validate_summarize, op="summarize_gauss",
                                                   width=GAUSS_SUMMARY_BYTES),
         _summarize_with(ref.summarize_pages_gauss))
register(GAUSS_SCHEMA, functools.partial(_validate_probe, op="gauss", width=GAUSS_SUMMARY_BYTES),
         _gauss_reference)
register(SUMMARIZE_NEWEST_SCHEMA, _validate_summarize_newest, _summarize_newest_with(_mean_rows))
register(SUMMARIZE_NEWEST_GAUSS_SCHEMA,
         functools.partial(_validate_summarize_newest, op="summarize_newest_gauss",
                           width=GAUSS_SUMMARY_BYTES),
         _summarize_newest_with(ref.summarize_pages_gauss))


def summaries_like(kv_cache: torch.Tensor) -> torch.Tensor:
    """A zeroed summary table for kv_cache: one SUMMARY_BYTES row per page."""
    return torch.zeros(kv_cache.shape[0], SUMMARY_BYTES, dtype=torch.uint8,
                       device=kv_cache.device)


def gauss_summaries_like(kv_cache: torch.Tensor) -> torch.Tensor:
    """A zeroed gauss summary table for kv_cache: one GAUSS_SUMMARY_BYTES row per page."""
    return torch.zeros(kv_cache.shape[0], GAUSS_SUMMARY_BYTES, dtype=torch.uint8,
                       device=kv_cache.device)


def summarize_gauss(kv_cache, pages, fill, summaries) -> None:
    """summarize's gauss rows: each page's mean and per-dimension std
    (reference.summarize_pages_gauss)."""
    torch.ops.spin.summarize_gauss(kv_cache, pages, fill, summaries)


def gauss(q, summaries, weights, context_lens, block_table, num_blocks: int,
          out: Optional[torch.Tensor] = None, page_slots: int = BLOCK_SLOTS) -> torch.Tensor:
    """fp32 [B*R, num_blocks] expected-ReLU scores of the page columns from gauss summaries
    (reference.gauss_scores)."""
    if out is None:
        out = torch.empty(q.shape[0], num_blocks, dtype=torch.float32, device=q.device)
    torch.ops.spin.gauss(q, summaries, weights, context_lens, block_table, page_slots, out)
    return out


def summarize(kv_cache, pages, fill, summaries) -> None:
    """Write the summary of each page pages[i] (its first fill[i] slots) into
    summaries[pages[i]]. Build every page at prefill; at decode only the newest page changes."""
    torch.ops.spin.summarize(kv_cache, pages, fill, summaries)


def summarize_newest(kv_cache, context_lens, block_table, max_len: int, summaries,
                     gauss: bool = False) -> None:
    """summarize (gauss: summarize_gauss) of the pages a decode step writes: for each request
    the pages holding slots n - R .. n - 1, n its last row's length clamped to max_len, each
    up to slot n (reference.newest_pages). The kernel finds them from context_lens int32
    [B, R] and block_table int32 [B, max_pages] on the device: a CUDA graph captured with it
    follows the lengths each replay reads, with no page list made on the host."""
    op = torch.ops.spin.summarize_newest_gauss if gauss else torch.ops.spin.summarize_newest
    op(kv_cache, context_lens, block_table, int(max_len), summaries)


def probe(q, summaries, weights, context_lens, block_table, num_blocks: int,
          out: Optional[torch.Tensor] = None, page_slots: int = BLOCK_SLOTS) -> torch.Tensor:
    """fp32 [B*R, num_blocks] query-aware scores of the block table's first num_blocks page
    columns (blocks, with 64-slot pages; reference.probe_scores)."""
    if out is None:
        out = torch.empty(q.shape[0], num_blocks, dtype=torch.float32, device=q.device)
    torch.ops.spin.probe(q, summaries, weights, context_lens, block_table, page_slots, out)
    return out
