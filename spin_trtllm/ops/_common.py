"""What every spin op shares: argument checks that name the problem, the per-request state
tensors, and registration (schema, CPU/CUDA dispatch, fake impl) in the `spin` namespace."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..config import SpinConfig
from ..errors import SpinError
from ..limits import (BLOCK_SLOTS, HEAD_DIM, INDEX_HEADS, INT32_MAX, MAX_LAUNCH_BATCH, MAX_M_CAP,
                      MAX_NEXT_N, SLOT_BYTES, STATE_DTYPES)
from ..reference.paged import page_layout
from . import _native

I32, I64 = (torch.int32,), (torch.int64,)
STATE_TORCH_DTYPES = tuple(getattr(torch, name) for name in STATE_DTYPES)


# ---- checks --------------------------------------------------------------------------------------
def fail(op: str, msg: str) -> None:
    raise SpinError(f"spin::{op}: {msg}")


def device_of(t) -> torch.device:
    return t.device if isinstance(t, torch.Tensor) else torch.device("cpu")


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).replace("torch.", "")


def check_tensor(op: str, name: str, t, dtypes, ndim: int, device: torch.device,
                 contiguous: bool = False, inner_contiguous: bool = False) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(op, f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        fail(op, f"{name} must be "
                 f"{'/'.join(_dtype_name(torch.empty(0, dtype=d)) for d in dtypes)}, "
                 f"got {_dtype_name(t)}")
    if t.dim() != ndim:
        fail(op, f"{name} must have {ndim} dims, got shape {list(t.shape)}")
    if t.device != device:
        fail(op, f"{name} is on {t.device}, expected {device} like the other inputs")
    if any(n > INT32_MAX for n in t.shape):     # an expand view costs nothing to make so wide
        fail(op, f"{name} has shape {list(t.shape)}: the kernels take sizes of at most "
                 f"{INT32_MAX} (int32)")
    if contiguous and not t.is_contiguous():
        fail(op, f"{name} must be contiguous")
    if inner_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(op, f"{name} must be contiguous in its last dim")
    return t


def check_shape(op: str, name: str, t: torch.Tensor, expected: tuple) -> None:
    if tuple(t.shape) != tuple(expected):
        fail(op, f"{name} must have shape {list(expected)}, got {list(t.shape)}")


def check_next_n(op: str, next_n: int, what: str = "next_n") -> None:
    if not 1 <= next_n <= MAX_NEXT_N:
        fail(op, f"{what} must be 1..{MAX_NEXT_N}, got {next_n}")


def state_capacity(V, last_seen) -> int:
    """Context slots (and query positions) a state slot holds: V's width, or, in a state
    without the V/D history (width 0: the probe's and gauss's), its blocks' slots."""
    return V.shape[2] if V.shape[2] else last_seen.shape[2] * BLOCK_SLOTS


def check_state(op: str, V, D, last_seen, decode_steps) -> torch.device:
    dev = device_of(V)
    check_tensor(op, "V", V, STATE_TORCH_DTYPES, 3, dev, contiguous=True)
    check_tensor(op, "D", D, (V.dtype,), 3, dev, contiguous=True)
    check_shape(op, "D", D, V.shape)
    S, L, cap = V.shape
    if L < 1:
        fail(op, f"the state has no indexer layers (V {list(V.shape)}: [slots, layers >= 1, "
                 f"capacity])")
    check_tensor(op, "last_seen", last_seen, I64, 3, dev, contiguous=True)
    if cap:
        check_shape(op, "last_seen", last_seen, (S, L, math.ceil(cap / BLOCK_SLOTS)))
    elif last_seen.shape[:2] != (S, L) or last_seen.shape[2] < 1:
        fail(op, f"a state without V/D history (V of width 0) needs last_seen [{S}, {L}, "
                 f"blocks >= 1], got {list(last_seen.shape)}")
    check_tensor(op, "decode_steps", decode_steps, I64, 2, dev, contiguous=True)
    check_shape(op, "decode_steps", decode_steps, (S, L))
    return dev


def check_context_lens(op: str, context_lens, dev) -> tuple[int, int]:
    check_tensor(op, "context_lens", context_lens, I32, 2, dev, contiguous=True)
    B, R = context_lens.shape
    check_next_n(op, R, "next_n (context_lens.shape[1])")
    return B, R


def check_launch_batch(op: str, B: int) -> None:
    """Kernels with the requests on the grid's y dimension (select, update, logits, probe)."""
    if B > MAX_LAUNCH_BATCH:
        fail(op, f"context_lens has {B} requests; one launch takes at most {MAX_LAUNCH_BATCH}")


def check_launch_rows(op: str, B: int, rows: int) -> None:
    """Kernels with a CTA (or a cluster) a row, rows counted in int32 (compact, topk, remap):
    as many rows as the largest launch batch of MTP requests."""
    if B * rows > MAX_LAUNCH_BATCH * MAX_NEXT_N:
        fail(op, f"{B} requests x {rows} rows; one launch takes at most "
                 f"{MAX_LAUNCH_BATCH * MAX_NEXT_N} rows")


def check_batch(op: str, dev, state_slot, context_lens, query_pos) -> tuple[int, int]:
    B, R = check_context_lens(op, context_lens, dev)
    check_launch_batch(op, B)
    check_tensor(op, "query_pos", query_pos, I32, 2, dev, contiguous=True)
    check_shape(op, "query_pos", query_pos, (B, R))
    check_tensor(op, "state_slot", state_slot, I32, 1, dev, contiguous=True)
    check_shape(op, "state_slot", state_slot, (B,))
    return B, R


def check_selection(op: str, dev, block_ids, counts, B: int, layered: bool) -> int:
    """block_ids/counts as select writes them ([B, L, m_cap]/[B, L]) or one layer's view of
    them ([B, m_cap]/[B]). Returns m_cap."""
    check_tensor(op, "block_ids", block_ids, I32, 3 if layered else 2, dev,
                 contiguous=layered, inner_contiguous=True)
    check_tensor(op, "counts", counts, I32, 2 if layered else 1, dev, contiguous=layered)
    if block_ids.shape[0] != B or counts.shape[0] != B:
        fail(op, f"block_ids {list(block_ids.shape)} and counts {list(counts.shape)} must "
                 f"have {B} requests")
    if layered and tuple(counts.shape) != tuple(block_ids.shape[:2]):
        fail(op, f"counts must have shape {list(block_ids.shape[:2])}, got {list(counts.shape)}")
    if block_ids.shape[-1] > MAX_M_CAP:
        fail(op, f"block_ids has m_cap {block_ids.shape[-1]} (last dim); at most {MAX_M_CAP} "
                 f"(m_cap * 64 slots and the top-K's 512-slot load step must fit int32)")
    return block_ids.shape[-1]


def check_slots(op: str, slots: torch.Tensor, num_slots: int) -> None:
    if slots.device.type != "cpu" or slots.numel() == 0:
        return
    if int(slots.min()) < 0 or int(slots.max()) >= num_slots:
        fail(op, f"state slots must be in [0, {num_slots}), got [{int(slots.min())}, "
                 f"{int(slots.max())}]")
    if slots.unique().numel() != slots.numel():
        fail(op, "state slots of one batch must be distinct")


def check_max_context_len(op: str, max_context_len: int, cap: int) -> None:
    if not 1 <= max_context_len <= cap:
        fail(op, f"max_context_len {max_context_len} must be in [1, state capacity {cap}]")


def check_host_bounds(op: str, context_lens, query_pos, max_context_len: int, cap: int,
                      state_slot=None, num_slots: int = 0) -> None:
    """Device-value checks; only on CPU, where they cost no synchronization. (On CUDA the
    kernels clamp context lengths to max_context_len and skip out-of-range state slots.)"""
    if context_lens.device.type != "cpu" or context_lens.numel() == 0:
        return
    if state_slot is not None:
        check_slots(op, state_slot, num_slots)
    if int(context_lens.min()) < 0 or int(context_lens.max()) > max_context_len:
        fail(op, f"context_lens must be in [0, max_context_len={max_context_len}], got "
                 f"[{int(context_lens.min())}, {int(context_lens.max())}]")
    if int(query_pos.max()) >= cap or bool((query_pos < context_lens - 1).any()):
        fail(op, f"query_pos must satisfy context_len - 1 <= q < state capacity {cap}")


def check_aligned16(op: str, **tensors) -> None:
    for name, t in tensors.items():
        if t.data_ptr() % 16:
            fail(op, f"{name} must start at a 16-byte aligned address (the kernels load 16 B)")


def check_logits(op: str, logits, dev, rows: int, m_cap: int) -> None:
    """fp32 [rows, W >= m_cap*64] read in its first m_cap*64 columns; 16-byte aligned rows."""
    check_tensor(op, "logits", logits, (torch.float32,), 2, dev, inner_contiguous=True)
    width = m_cap * BLOCK_SLOTS
    if logits.shape[0] != rows or logits.shape[1] < width:
        fail(op, f"logits must have shape [{rows}, W >= {width}] (B*R rows, at least m_cap*64 "
                 f"columns), got {list(logits.shape)}")
    check_aligned16(op, logits=logits)
    if rows > 1 and logits.stride(0) % 4:
        fail(op, f"logits rows must be a multiple of 4 floats apart (16-byte rows: the kernels "
                 f"load 16 B), got row stride {logits.stride(0)}")


def check_query(op: str, q, weights, context_lens, block_table, dev) -> tuple[int, int]:
    """What indexer_logits and probe both read: q fp8 [B*R, 64, 128], weights fp32 [B*R, 64],
    context_lens int32 [B, R], block_table int32 [B, max_pages]. Returns (B, R)."""
    check_tensor(op, "q", q, (torch.float8_e4m3fn,), 3, dev, contiguous=True)
    B, R = check_context_lens(op, context_lens, dev)
    check_launch_batch(op, B)
    check_shape(op, "q", q, (B * R, INDEX_HEADS, HEAD_DIM))
    check_tensor(op, "weights", weights, (torch.float32,), 2, dev, contiguous=True)
    check_shape(op, "weights", weights, (B * R, INDEX_HEADS))
    check_aligned16(op, q=q, weights=weights)
    check_block_table(op, block_table, B, dev)
    return B, R


def check_block_table(op: str, block_table, B: int, dev) -> None:
    """int32 [B, max_pages], rows of unit stride."""
    check_tensor(op, "block_table", block_table, I32, 2, dev, inner_contiguous=True)
    if block_table.shape[0] != B:
        fail(op, f"block_table has {block_table.shape[0]} rows, expected {B}")


def check_cache(op: str, kv_cache, dev, page_slots: tuple[int, ...] = (BLOCK_SLOTS,),
                widths: tuple[int, ...] = (SLOT_BYTES,)) -> None:
    """uint8 pages [num_pages >= 1, S, 1, W] with S in page_slots and W (bytes per slot: FP8
    keys 132, MXFP4 68) in widths (or [P, S * W])."""
    ndim = kv_cache.dim() if isinstance(kv_cache, torch.Tensor) else 2
    check_tensor(op, "kv_cache", kv_cache, (torch.uint8,), ndim, dev, contiguous=True)
    S, W = page_layout(kv_cache) if kv_cache.dim() >= 2 else (0, 0)
    if kv_cache.dim() < 2 or kv_cache.shape[0] < 1 or S not in page_slots or W not in widths \
            or kv_cache[0].numel() != S * W:
        sizes = " or ".join(str(n) for n in page_slots)
        rows = " or ".join(str(n) for n in widths)
        fail(op, f"kv_cache must be uint8 pages of {sizes} x {rows} bytes "
                 f"(e.g. [num_pages >= 1, {page_slots[0]}, 1, {widths[0]}]), got shape "
                 f"{list(kv_cache.shape)}")


# ---- state ---------------------------------------------------------------------------------
@dataclass
class OpState:
    """V/D/last_seen/decode_steps for num_slots state slots x num_layers indexer layers."""

    V: torch.Tensor
    D: torch.Tensor
    last_seen: torch.Tensor
    decode_steps: torch.Tensor

    @classmethod
    def zeros(cls, num_slots: int, num_layers: int, capacity: int, cfg: SpinConfig,
              device: torch.device | str = "cpu", history: bool = True) -> "OpState":
        """history False: V and D of width 0, for a predictor that reads no V/D history (the
        ops then take block scores and update the counters alone); capacity in whole blocks."""
        if min(num_slots, num_layers, capacity) < 1:
            raise SpinError(f"OpState: num_slots ({num_slots}), num_layers ({num_layers}) and "
                            f"capacity ({capacity}) must be >= 1")
        dtype = getattr(torch, cfg.state_dtype)
        blocks = math.ceil(capacity / BLOCK_SLOTS)
        width = capacity if history else 0
        return cls(torch.zeros(num_slots, num_layers, width, dtype=dtype, device=device),
                   torch.zeros(num_slots, num_layers, width, dtype=dtype, device=device),
                   torch.zeros(num_slots, num_layers, blocks, dtype=torch.int64, device=device),
                   torch.zeros(num_slots, num_layers, dtype=torch.int64, device=device))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.V, self.D, self.last_seen, self.decode_steps

    @property
    def history(self) -> bool:
        """Holds the V/D EMAs (False: the counters alone)."""
        return self.V.shape[2] > 0

    @property
    def capacity(self) -> int:
        return state_capacity(self.V, self.last_seen)


def require_supported(cfg: SpinConfig) -> None:
    """The ops implement reduction A1 with 64-slot blocks."""
    if cfg.reduction != "A1" or cfg.block_size != BLOCK_SLOTS:
        raise SpinError(f"the spin ops implement reduction A1 with block_size {BLOCK_SLOTS}; got "
                        f"reduction={cfg.reduction}, block_size={cfg.block_size} (A0/A2 are "
                        f"replay ablations: use spin_trtllm.reference)")


# ---- registration --------------------------------------------------------------------------
LIBRARY = torch.library.Library("spin", "DEF")
SCHEMAS: dict[str, str] = {}        # op name -> schema, in registration order
REFERENCE_ONLY: set[str] = set()     # ops without a kernel: the reference on every device


def _fake(op: str, *args, **kwargs) -> None:
    """Meta/fake impl: nothing to compute (the ops write into their arguments). A call that
    mixes devices, e.g. one meta tensor among CPU or CUDA ones, lands here instead of in the
    real kernel: refuse it rather than silently doing nothing."""
    devices = {a.device for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)}
    if len(devices) > 1:
        fail(op, f"tensors on different devices: {sorted(str(d) for d in devices)}")


def register(schema: str, validate, reference, native: bool = True) -> None:
    """Define spin::<op>: validate, then the native kernel on CUDA tensors (when built and
    `native`), else the reference."""
    name = schema.split("(", 1)[0]

    def impl(*args, **kwargs) -> None:
        validate(*args, **kwargs)
        if native and _native.NATIVE and args[0].is_cuda:
            getattr(torch.ops.spin_native, name)(*args, **kwargs)
        else:
            reference(*args, **kwargs)

    SCHEMAS[name] = schema
    if not native:
        REFERENCE_ONLY.add(name)
    LIBRARY.define(schema)
    LIBRARY.impl(name, impl, "CPU")
    LIBRARY.impl(name, impl, "CUDA")
    torch.library.register_fake(f"spin::{name}", functools.partial(_fake, name), lib=LIBRARY)


def streams(state_slot: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """[S, L, ...] -> [B * L, ...] rows of the batch's state slots."""
    idx = state_slot.long()
    return [t[idx].reshape(idx.numel() * t.shape[1], *t.shape[2:]) for t in tensors]
