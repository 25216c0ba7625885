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
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Callable, Optional

import torch

from .. import ops
from ..limits import BLOCK_SLOTS

LOGITS_FN = "fp8_paged_mqa_logits"
SCHEDULE_FN = "get_paged_mqa_logits_metadata"
MODULES = ("deep_gemm", "tensorrt_llm.deep_gemm")
MAX_NEXT_N = 2          # DeepGEMM's SM90 paged MQA logits take next_n 1 or 2


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


def compact_paged_logits(logits_fn: Callable, schedule_fn: Callable, num_sms: int,
                         schedule_block_kv: int, q: Any, kv_cache: torch.Tensor,
                         weights: torch.Tensor, context_lens: torch.Tensor,
                         block_table: torch.Tensor, block_ids: torch.Tensor,
                         counts: torch.Tensor, page_slots: int, expanded: bool,
                         *extra: Any, one_dim_lens: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense paged-logits call (DeepGEMM's signature) over SPIN's selection. q is passed
    through as the caller shaped it: [B, R, H, D], or [B*R, 1, H, D] when `expanded` (every
    MTP row its own request), or an (FP4 q, scales) pair. one_dim_lens: an older DeepGEMM
    that takes one length per request (its rows end at len - R + j + 1; top-K is cut at each
    row's own compact length anyway). Returns (logits [B*R, >= m_cap*64], compact lengths
    int32 [B, R])."""
    B, R = context_lens.shape
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

    def run(self, q, kv_cache, weights, context_lens, block_table, block_ids, counts, out=None):
        B, R = context_lens.shape
        expanded = R > MAX_NEXT_N       # SM90 takes next_n <= 2: one request per MTP row
        rows, per_row = (B * R, 1) if expanded else (B, R)
        pages = kv_cache.view(kv_cache.shape[0], self.page_slots, 1, -1)
        return compact_paged_logits(
            getattr(self.dg, LOGITS_FN), getattr(self.dg, SCHEDULE_FN), self.num_sms(q.device),
            self.page_slots, q.view(rows, per_row, q.shape[-2], q.shape[-1]), pages, weights,
            context_lens, block_table, block_ids, counts, self.page_slots, expanded)
