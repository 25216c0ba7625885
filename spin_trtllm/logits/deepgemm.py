"""The `deepgemm` logits backend: DeepGEMM's dense paged MQA logits over a compacted table.

torch.ops.spin.compact turns SPIN's selection into a block table holding only the selected
blocks' pages, in ascending block order, and per-MTP-row compact lengths. A dense paged kernel
given that table computes SPIN's compact masked logits (compact position k*64 + s is slot
block_ids[k]*64 + s), so SPIN reads only the selected pages at the dense kernel's speed. The
schedule metadata depends on the compact lengths, so it is computed here, inside the step
(after select), not on the host. Everything stays on the device: graph-capturable.

DeepGEMM (SM90, HEAD 54e22612) leaves the columns past a row's length unspecified and scores
every MTP row of a request up to its longest row, so run() returns the compact lengths and
top-K is cut at them; update masks by slot itself.

Per layer that is two small kernels before DeepGEMM's (compact, then the schedule), 6-9 us of
launch and wait on an H100. StepCompaction has ops.compact write DeepGEMM's schedule itself: one
launch a layer, or one a step for every layer where select() chose every layer's blocks; where
the module's schedule function is found to return what reference.paged_logits_schedule does
(checked once per function, block_kv, SM count and next_n, outside CUDA-graph capture).
"""

from __future__ import annotations

import importlib
import logging
from types import ModuleType
from typing import Any, Callable, NamedTuple, Optional

import torch

from .. import ops
from .. import reference as ref
from ..limits import BLOCK_SLOTS

LOGITS_FN = "fp8_paged_mqa_logits"
SCHEDULE_FN = "get_paged_mqa_logits_metadata"
MODULES = ("deep_gemm", "tensorrt_llm.deep_gemm")
MAX_NEXT_N = 2          # DeepGEMM's SM90 paged MQA logits take next_n 1 or 2
log = logging.getLogger("spin_trtllm")


def find_module() -> tuple[Optional[ModuleType], str]:
    """DeepGEMM's Python module (standalone, or the copy TensorRT-LLM ships), or why not."""
    errors = []
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - any import failure means "not usable"
            errors.append(f"{name}: {type(err).__name__}: {err}")
            continue
        missing = [f for f in (LOGITS_FN, SCHEDULE_FN) if not callable(getattr(module, f, None))]
        if missing:
            errors.append(f"{name} lacks {', '.join(missing)}")
            continue
        return module, name
    return None, "; ".join(errors)


class LayerInputs(NamedTuple):
    """One layer's compacted block table [B, T], compact lengths [B, R] and DeepGEMM schedule
    [num_sms + 1, 2], as StepCompaction made them."""
    table: torch.Tensor
    lens: torch.Tensor
    schedule: torch.Tensor


def compact_paged_logits(logits_fn: Callable, schedule_fn: Callable, num_sms: int,
                         schedule_block_kv: int, q: Any, kv_cache: torch.Tensor,
                         weights: torch.Tensor, context_lens: torch.Tensor,
                         block_table: torch.Tensor, block_ids: torch.Tensor,
                         counts: torch.Tensor, page_slots: int, expanded: bool,
                         *extra: Any, one_dim_lens: bool = False,
                         prepared: Optional[LayerInputs] = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense paged-logits call (DeepGEMM's signature) over SPIN's selection. q is passed
    through as the caller shaped it: [B, R, H, D], or [B*R, 1, H, D] when `expanded` (every
    MTP row its own request), or an (FP4 q, scales) pair. one_dim_lens: an older DeepGEMM
    that takes one length per request (its rows end at len - R + j + 1; top-K is cut at each
    row's own compact length anyway). prepared: the layer's inputs from StepCompaction (not
    with expanded or one_dim_lens), which skips compact and the schedule. Returns (logits
    [B*R, >= m_cap*64], compact lengths int32 [B, R])."""
    B, R = context_lens.shape
    if prepared is not None:
        table, lens, schedule = prepared
        logits = logits_fn(q, kv_cache, weights, lens, table, schedule,
                           block_ids.shape[-1] * BLOCK_SLOTS, *extra)
        return logits, lens
    if expanded:
        block_ids = block_ids.repeat_interleave(R, 0)
        counts = counts.repeat_interleave(R, 0)
        block_table = block_table.repeat_interleave(R, 0)
        context_lens = context_lens.reshape(B * R, 1)
    table, lens = ops.compact(block_ids, counts, context_lens, block_table, page_slots)
    kernel_lens = lens[:, -1].contiguous() if one_dim_lens else lens
    schedule = schedule_fn(kernel_lens, schedule_block_kv, num_sms)
    logits = logits_fn(q, kv_cache, weights, kernel_lens, table, schedule,
                       block_ids.shape[-1] * BLOCK_SLOTS, *extra)
    return logits, lens.view(B, R)


class ScheduleSource(NamedTuple):
    """The schedule a paged-logits call would build per layer: schedule_fn(lens, block_kv,
    num_sms)."""
    schedule_fn: Callable
    block_kv: int
    num_sms: int


_SCHEDULE_CHECKS: dict[tuple, bool] = {}


def schedule_matches(source: ScheduleSource, next_n: int, device: torch.device) -> Optional[bool]:
    """Whether source.schedule_fn returns reference.paged_logits_schedule's schedule (what
    ops.compact writes) for next_n rows a request: once per function, block_kv, SM count and
    next_n, on lengths that cover empty requests, ragged runs and more runs than SMs. None
    while a CUDA graph is being captured on `device` (the check reads its result on the
    host): not known yet."""
    key = (source.schedule_fn, source.block_kv, source.num_sms, next_n, str(device))
    if key in _SCHEDULE_CHECKS:
        return _SCHEDULE_CHECKS[key]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    gen = torch.Generator().manual_seed(next_n * 7919 + source.num_sms)
    matches = True
    # batches of at most 32: DeepGEMM compiles its schedule kernel once per 32 requests
    for batch, longest in ((1, 0), (3, 200), (29, 70000), (32, 9000)):
        lens = torch.randint(0, longest + 1, (batch, next_n), generator=gen, dtype=torch.int32)
        lens[::5] = 0
        want = ref.paged_logits_schedule(lens, source.num_sms)
        try:
            got = source.schedule_fn(lens.to(device), source.block_kv, source.num_sms)
            same = torch.equal(torch.as_tensor(got).to("cpu", torch.int32).reshape(want.shape),
                               want)
        except Exception as err:  # noqa: BLE001 - any failure: use the module's own schedule
            log.info("spin_trtllm: the paged-logits schedule function failed the check (%s: %s)",
                     type(err).__name__, err)
            same = False
        matches = matches and same
    if not matches:
        log.info("spin_trtllm: %s's schedule differs from the one ops.compact writes; each "
                 "layer builds its own", getattr(source.schedule_fn, "__qualname__", "?"))
    _SCHEDULE_CHECKS[key] = matches
    return matches


class StepCompaction:
    """The compacted tables, compact lengths and DeepGEMM schedules of a step's layers, each
    made by ops.compact with the schedule: one launch for every layer at the step's first
    layer call where select() chose every layer's blocks, else one launch a layer (a
    query-aware or overlapped select chooses a layer's blocks at its call), in place of a
    compact and a schedule kernel a layer. Memory: the tables take what the selection's block
    ids do, times the pages per block."""

    def __init__(self, num_layers: int, max_batch: int, next_n: int, m_cap: int,
                 page_slots: int, device: torch.device):
        ppb = BLOCK_SLOTS // page_slots
        self.shape = (num_layers, max_batch, next_n, m_cap * ppb)
        self.page_slots, self.device = page_slots, device
        self._tables: Optional[torch.Tensor] = None
        self._lens: Optional[torch.Tensor] = None
        self._schedules: dict[int, torch.Tensor] = {}
        self._workspace: Optional[torch.Tensor] = None
        self._made: Optional[tuple] = None     # (source, batch, captured) of the step's launch
        self.every_layer = False

    def clear(self, every_layer: bool = False) -> None:
        """A new step or selection: the next layer call makes the inputs again. every_layer:
        every layer's blocks are selected (made for all by the step's first call), else each
        layer's are selected at its call (made for it then)."""
        self._made, self.every_layer = None, every_layer

    def layer(self, layer: int, source: ScheduleSource, block_ids: torch.Tensor,
              counts: torch.Tensor, context_lens: torch.Tensor,
              block_table: torch.Tensor) -> Optional[LayerInputs]:
        """Layer `layer`'s inputs, from block_ids [B, L, m_cap] and counts [B, L]. None where
        the call must build its own: the
        schedule function differs from ops.compact's or is not checked yet (first met inside
        a CUDA-graph capture), or the step's inputs were made for another schedule source or
        batch."""
        L, max_batch, R, width = self.shape
        B = block_ids.shape[0]
        # made in a graph's capture and called eagerly (or the other way round) with no
        # select() between: make them again here, where this call's kernels run
        captured = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if self.every_layer and self._made is not None and self._made[2] == captured:
            return self._slice(layer, source.num_sms, B) if self._made == (source, B, captured) \
                else None
        if not schedule_matches(source, R, self.device):
            return None
        if captured and (self._tables is None or source.num_sms not in self._schedules):
            return None     # buffers (and their zeroed counters) are made outside capture
        if self._tables is None:
            self._tables = torch.zeros(L * max_batch * width, dtype=torch.int32,
                                       device=self.device)
            self._lens = torch.zeros(L * max_batch * R, dtype=torch.int32, device=self.device)
            self._workspace = torch.zeros(L, dtype=torch.int32, device=self.device)
        if source.num_sms not in self._schedules:
            self._schedules[source.num_sms] = torch.zeros(L, source.num_sms + 1, 2,
                                                          dtype=torch.int32, device=self.device)
        mine = self._slice(layer, source.num_sms, B)
        if self.every_layer:
            ops.compact(block_ids, counts, context_lens, block_table, self.page_slots,
                        self._tables[:L * B * width].view(L, B, width),
                        self._lens[:L * B * R].view(L, B, R), self._schedules[source.num_sms],
                        self._workspace)
            self._made = (source, B, captured)
        else:
            ops.compact(block_ids[:, layer], counts[:, layer], context_lens, block_table,
                        self.page_slots, mine.table, mine.lens, mine.schedule,
                        self._workspace[layer:layer + 1])
        return mine

    def _slice(self, layer: int, num_sms: int, B: int) -> LayerInputs:
        L, _, R, width = self.shape
        return LayerInputs(self._tables[:L * B * width].view(L, B, width)[layer],
                           self._lens[:L * B * R].view(L, B, R)[layer],
                           self._schedules[num_sms][layer])


class DeepGemmLogits:
    """`module` overrides the import (tests pass a CPU stand-in with DeepGEMM's signatures);
    `page_slots` is the K cache's page size (64, or 32: one SPIN block = two pages)."""

    name = "deepgemm"
    needs_out = False

    def __init__(self, module: Optional[ModuleType] = None, page_slots: int = BLOCK_SLOTS):
        if module is None:
            module, why = find_module()
            if module is None:
                raise ImportError(f"DeepGEMM not importable ({why})")
        self.dg, self.page_slots = module, page_slots
        self._num_sms: Optional[int] = None

    @staticmethod
    def available(device: torch.device) -> tuple[bool, str]:
        if device.type != "cuda":
            return False, "DeepGEMM runs on CUDA devices only"
        if not torch.cuda.is_available():
            return False, "no CUDA device"
        major, _ = torch.cuda.get_device_capability(device)
        if major < 9:
            return False, f"DeepGEMM needs SM90 or newer, this GPU is SM{major}x"
        module, why = find_module()
        return (module is not None), (module.__name__ if module is not None else why)

    @staticmethod
    def reads(device: torch.device, page_slots: int) -> tuple[bool, str]:
        """Whether DeepGEMM on `device` reads `page_slots`-slot pages: its SM90 paged-logits
        kernel takes block_kv 64 only (SM100 also 32)."""
        if page_slots != BLOCK_SLOTS and device.type == "cuda" and torch.cuda.is_available() \
                and torch.cuda.get_device_capability(device)[0] == 9:
            return False, (f"DeepGEMM's SM90 paged-logits kernel reads {BLOCK_SLOTS}-slot pages "
                           f"only, not {page_slots}-slot ones (V4's compressed pages with "
                           f"tokens_per_block {4 * page_slots}; SM100 reads both)")
        return True, ""

    def num_sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            get = getattr(self.dg, "get_num_sms", None)
            self._num_sms = int(get()) if callable(get) else \
                torch.cuda.get_device_properties(device).multi_processor_count
        return self._num_sms

    def schedule_source(self, context_lens: torch.Tensor) -> Optional[ScheduleSource]:
        """The schedule run() builds per layer for these lengths, or None where StepCompaction
        cannot stand in (next_n past DeepGEMM's two rows: one request per MTP row)."""
        if context_lens.shape[1] > MAX_NEXT_N:
            return None
        return ScheduleSource(getattr(self.dg, SCHEDULE_FN), self.page_slots,
                              self.num_sms(context_lens.device))

    def run(self, q, kv_cache, weights, context_lens, block_table, block_ids, counts, out=None,
            prepared: Optional[LayerInputs] = None):
        B, R = context_lens.shape
        expanded = R > MAX_NEXT_N       # SM90 takes next_n <= 2: one request per MTP row
        rows, per_row = (B * R, 1) if expanded else (B, R)
        pages = kv_cache.view(kv_cache.shape[0], self.page_slots, 1, -1)
        return compact_paged_logits(
            getattr(self.dg, LOGITS_FN), getattr(self.dg, SCHEDULE_FN), self.num_sms(q.device),
            self.page_slots, q.view(rows, per_row, q.shape[-2], q.shape[-1]), pages, weights,
            context_lens, block_table, block_ids, counts, self.page_slots, expanded,
            prepared=prepared)
