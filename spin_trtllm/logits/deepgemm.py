"""The `deepgemm` logits backend: DeepGEMM's dense paged MQA logits over a compacted table.

torch.ops.spin.compact turns SPIN's selection into a block table holding only the selected
blocks' pages, in ascending block order, and per-MTP-row compact lengths. A dense paged kernel
given that table computes exactly SPIN's compact masked logits (compact position k*64 + s is
slot block_ids[k]*64 + s), so SPIN reads only the selected pages at the dense kernel's speed.
The schedule metadata depends on the compact lengths, so it is computed here, inside the step
(after select), not on the host. Everything stays on the device: graph-capturable.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

import torch

from .. import ops

LOGITS_FN = "fp8_paged_mqa_logits"
SCHEDULE_FN = "get_paged_mqa_logits_metadata"
MODULES = ("deep_gemm", "tensorrt_llm.deep_gemm")


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


class DeepGemmLogits:
    """`module` overrides the import (tests pass a CPU stand-in with DeepGEMM's signatures);
    `page_slots` is the K cache's page size (64, or 32: one SPIN block = two pages)."""

    name = "deepgemm"

    def __init__(self, module: Optional[ModuleType] = None, page_slots: int = ops.BLOCK):
        if module is None:
            module, why = find_module()
            if module is None:
                raise ImportError(f"DeepGEMM not importable ({why})")
        self.dg, self.page_slots = module, page_slots
        self._num_sms: dict[torch.device, int] = {}

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
        return (module is not None), (f"{module.__name__}" if module is not None else why)

    def num_sms(self, device: torch.device) -> int:
        if device not in self._num_sms:
            self._num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count \
                if device.type == "cuda" else 1
        return self._num_sms[device]

    def run(self, q, kv_cache, weights, context_lens, block_table, block_ids, counts, out=None):
        B, R = context_lens.shape
        m_cap = block_ids.shape[-1]
        table, lens = ops.compact(block_ids, counts, context_lens, block_table, self.page_slots)
        schedule = getattr(self.dg, SCHEDULE_FN)(lens, self.page_slots, self.num_sms(q.device))
        pages = kv_cache.view(kv_cache.shape[0], self.page_slots, 1, -1)
        return getattr(self.dg, LOGITS_FN)(
            q.view(B, R, q.shape[-2], q.shape[-1]), pages, weights, lens, table, schedule,
            m_cap * ops.BLOCK, True)
