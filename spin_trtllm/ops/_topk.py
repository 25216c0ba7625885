"""spin::topk: the post-indexer top-K over compact logits, and its FlashInfer path.

logits fp32 [B*R, W >= m_cap*64] (read in the first m_cap*64 columns; last dim contiguous, rows
a multiple of 4 floats apart, 16-byte aligned base), block_ids [B, m_cap] and counts [B] of one
layer -> out int32 [B*R, K] request-local slot ids, ascending, -1 padded. Optional row_lens
int32 [B, R]: compact positions at or past a row's length take no part (logits from a dense
kernel on a compacted table, which leaves those columns unspecified). On sm_90+ the kernel is
launched with programmatic stream serialization (scheduled while the kernel before it ends; it
waits for it before reading), and then lets a kernel launched after it so start at once
(select's and update's beside_previous); such a kernel must wait (griddepcontrol.wait) before
it reads the top-K's output, and may write only memory allocated before the top-K call: the
logits, and the workspace of the filter (SPIN_TOPK_FILTER below), are still being read when the
call returns and their memory may be handed out again.

SPIN_TOPK_FILTER=auto (the default; also unset or empty) ranks a few long rows (16 to 32 rows
of at least 256K and at most 512K compact slots, the block table's width m_cap * 64; K up to
2048) through a filter: CTAs of 16K slots on every SM build each row's histogram of a coarse
digit, then keep the entries above the K-th value's bin and those in it, and one CTA a row ranks
only those (a row whose bin holds more than 4096 entries is ranked whole). =1 lowers the bounds
to 1 row and more than 16K slots and raises them to 2048 rows; 0 keeps one CTA (or a cluster) a
row everywhere. Where the row's bitmap does not fit the device's shared memory the rows are
ranked whole. It is read at every call (a CUDA graph keeps the choice it was captured with).
The TensorRT plugin runs one CTA a row.

The top-K backend (SPIN_TOPK, read once at the first top-K; set_topk_backend changes it):
auto (FlashInfer where installed, except where spin's kernel was measured faster), spin, or
flashinfer (any shape). The FlashInfer path asks for positions only (values cost more), then
one spin::remap maps them to slot ids, drops non-finite scores and sorts each row. Rows below
TOPK_RAGGED_MAX_ROWS go through top_k_ragged_transform, more through top_k_varlen
(radix_cutlass on SM90). spin's kernel was the faster for tables of at most
TOPK_SPIN_MAX_WIDTH slots (256K and a block, an engine's table for a 256K context; measured: 32
and 96 rows of 128K and 256K in one run on an H100, K 512, and 8-192 rows of 32K and 128K
against the kernel before), batches of at most TOPK_SPIN_MAX_ROWS rows, and the rows it ranks
through the filter (benchmarks/RESULTS.md, top-K): auto keeps those rows. Wider tables with more
rows go to FlashInfer unmeasured.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator, Optional

import torch

from .. import reference as ref
from ..errors import SpinError
from ..limits import (BLOCK_SLOTS, MAX_INDEX_TOPK, MAX_SORTED_K, TOPK_FILTER_AUTO_MAX_ROWS,
                      TOPK_FILTER_AUTO_MIN_ROWS, TOPK_FILTER_AUTO_MIN_SLOTS, TOPK_FILTER_MAX_K,
                      TOPK_FILTER_MAX_ROWS, TOPK_FILTER_MAX_SLOTS, TOPK_FILTER_SLICE_SLOTS)
from ._common import (I32, check_launch_rows, check_logits, check_next_n, check_selection,
                      check_shape, check_tensor, device_of, fail, register)
from ._compact import remap

SCHEMA = ("topk(Tensor logits, Tensor block_ids, Tensor counts, int next_n, Tensor(a!) out, "
          "Tensor? row_lens=None) -> ()")
TOPK_BACKENDS = ("auto", "spin", "flashinfer")
TOPK_RAGGED_MAX_ROWS = 64
TOPK_SPIN_MAX_ROWS = 16
TOPK_SPIN_MAX_WIDTH = (1 << 18) + BLOCK_SLOTS


def _validate(logits, block_ids, counts, next_n, out, row_lens=None) -> None:
    op = "topk"
    dev = device_of(logits)
    check_tensor(op, "logits", logits, (torch.float32,), 2, dev, inner_contiguous=True)
    check_tensor(op, "block_ids", block_ids, I32, 2, dev, inner_contiguous=True)
    m_cap = check_selection(op, dev, block_ids, counts, block_ids.shape[0], layered=False)
    B = block_ids.shape[0]
    check_next_n(op, next_n)
    check_logits(op, logits, dev, B * next_n, m_cap)
    check_launch_rows(op, B, next_n)
    check_tensor(op, "out", out, I32, 2, dev, contiguous=True)
    if out.shape[0] != B * next_n or not 1 <= out.shape[1] <= MAX_INDEX_TOPK:
        fail(op, f"out must have shape [{B * next_n}, 1 <= K <= {MAX_INDEX_TOPK}], got "
                 f"{list(out.shape)}")
    if row_lens is not None:
        check_tensor(op, "row_lens", row_lens, I32, 2, dev, contiguous=True)
        check_shape(op, "row_lens", row_lens, (B, next_n))


def _reference(logits, block_ids, counts, next_n, out, row_lens=None) -> None:
    width = block_ids.shape[1] * BLOCK_SLOTS
    out.copy_(ref.topk_slots(logits[:, :width], block_ids, counts, next_n, out.shape[1],
                             row_lens=row_lens))


register(SCHEMA, _validate, _reference)


# ---- backend choice ------------------------------------------------------------------------------
_backend: Optional[str] = None      # None: read SPIN_TOPK at the next top-K


def set_topk_backend(choice: Optional[str]) -> None:
    """auto, spin or flashinfer; None reads SPIN_TOPK again at the next top-K."""
    global _backend
    if choice is not None and choice not in TOPK_BACKENDS:
        raise SpinError(f"SPIN_TOPK must be auto, spin or flashinfer, got {choice!r}")
    _backend = choice


def topk_backend() -> str:
    if _backend is None:
        set_topk_backend(os.environ.get("SPIN_TOPK", "auto"))
    return _backend


@contextlib.contextmanager
def using_topk_backend(choice: str) -> Iterator[None]:
    """The top-K backend set to `choice` inside the block, then as it was (SPIN_TOPK is read
    once, so setting the variable would not switch it)."""
    before = topk_backend()
    set_topk_backend(choice)
    try:
        yield
    finally:
        set_topk_backend(before)


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


def peer_available() -> bool:
    """Whether FlashInfer's top-K can be imported here."""
    return _flashinfer_topk() is not None


def topk_filters(rows: int, width: int, k: Optional[int] = None) -> bool:
    """Whether spin's kernel ranks `rows` rows of a `width`-slot table (m_cap * 64) through the
    filter under SPIN_TOPK_FILTER now (the binding's rule, cpp/src/topk.cu filter_shapes; k
    None: within its bound). The one exception it does not see: a device whose shared memory
    cannot hold the row's bitmap beside the kernel's ranks the rows whole."""
    mode = filter_mode()
    if mode == "0" or k is not None and not 1 <= k <= TOPK_FILTER_MAX_K:
        return False
    if mode == "auto" and not (TOPK_FILTER_AUTO_MIN_ROWS <= rows <= TOPK_FILTER_AUTO_MAX_ROWS
                               and width >= TOPK_FILTER_AUTO_MIN_SLOTS):
        return False
    return TOPK_FILTER_SLICE_SLOTS < width <= TOPK_FILTER_MAX_SLOTS \
        and rows <= TOPK_FILTER_MAX_ROWS


def spin_topk_is_faster(rows: int, width: int, k: Optional[int] = None) -> bool:
    """Whether ops.topk keeps spin's kernel (one CTA, a cluster or the filter a row) rather than
    FlashInfer's path at `rows` rows of a `width`-slot table: tables of at most
    TOPK_SPIN_MAX_WIDTH slots, at most TOPK_SPIN_MAX_ROWS rows, and wherever it takes the filter
    (the auto choice; the cost model prices the same)."""
    return width <= TOPK_SPIN_MAX_WIDTH or rows <= TOPK_SPIN_MAX_ROWS or \
        topk_filters(rows, width, k)


def topk_peer(logits: torch.Tensor, block_ids: torch.Tensor, k: int) -> Optional[str]:
    """"flashinfer" when topk hands these rows to FlashInfer's top-K, else None."""
    choice = topk_backend()
    if choice == "spin" or not peer_available() or block_ids.dim() != 2 \
            or logits.dim() != 2 or logits.shape[0] == 0 or block_ids.shape[1] * BLOCK_SLOTS < k \
            or k > MAX_SORTED_K \
            or torch.compiler.is_compiling() or logits.device.type == "meta":
        return None
    if choice == "auto":
        rows, width = logits.shape[0], block_ids.shape[1] * BLOCK_SLOTS
        # rows with a stride into a tensor that is not contiguous as a whole would need a
        # copy first (a contiguous wider tensor, as DeepGEMM returns, is ranked in place)
        if not logits.is_cuda or not (logits.is_contiguous() or
                                      logits[:, :width].is_contiguous()) or \
                spin_topk_is_faster(rows, width, k):
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
    """FlashInfer's top-K over each row's compact prefix, then the spin::topk contract."""
    _validate(logits, block_ids, counts, next_n, out, row_lens)
    varlen, ragged = _flashinfer_topk()
    m_cap = block_ids.shape[1]
    # rows are ranked over their first `lens` columns only, so a contiguous tensor wider than
    # m_cap*64 (DeepGEMM's logits, width aligned up) goes as it is; a strided view is copied
    x = logits if logits.is_contiguous() else logits[:, :m_cap * BLOCK_SLOTS].contiguous()
    lens = counts.clamp(min=0, max=m_cap).mul_(BLOCK_SLOTS)
    if next_n > 1:
        lens = lens.repeat_interleave(next_n)
    if row_lens is not None:
        lens = torch.minimum(row_lens.reshape(-1).clamp(min=0), lens)   # int32, as validated
    if ragged is not None and x.shape[0] < TOPK_RAGGED_MAX_ROWS:
        pos = ragged(x, _zero_offsets(x.shape[0], x.device), lens, k)
    else:
        # SM90 has one backend, radix_cutlass; "auto" picks among SM100's
        sm90 = x.is_cuda and torch.cuda.get_device_capability(x.device)[0] == 9
        pos = varlen(x, lens, k, backend="radix_cutlass" if sm90 else "auto")[0]
    remap(pos.to(torch.int32), block_ids, counts, next_n, out=out, ascending=True, scores=x)


TOPK_FILTER_MODES = ("0", "1", "auto")


def filter_mode() -> str:
    """SPIN_TOPK_FILTER as the binding reads it at every call (unset or empty: auto); an
    unknown value raises."""
    mode = os.environ.get("SPIN_TOPK_FILTER") or "auto"
    if mode not in TOPK_FILTER_MODES:
        raise SpinError(f"SPIN_TOPK_FILTER must be 0, 1 or auto, got {mode!r}")
    return mode


def topk(logits, block_ids, counts, next_n: int, k: int,
         out: Optional[torch.Tensor] = None,
         row_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Where the FlashInfer path is chosen (topk_peer) the output contract is the same, except
    which of several entries tied at the K-th value is taken."""
    filter_mode()                   # refused on every path: routing reads it too
    if out is None:
        out = torch.empty(logits.shape[0], k, dtype=torch.int32, device=logits.device)
    elif out.dim() != 2 or out.shape[1] != k:
        raise SpinError(f"topk: out must have K = {k} columns, got {list(out.shape)}")
    if topk_peer(logits, block_ids, k) is not None:
        _peer_topk(logits, block_ids, counts, next_n, k, out, row_lens)
    else:
        torch.ops.spin.topk(logits, block_ids, counts, next_n, out, row_lens)
    return out
