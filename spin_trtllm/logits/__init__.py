"""Where SPIN's compact masked logits come from: a registry of logits backends.

Every backend computes the same function, the compact masked indexer logits of
`torch.ops.spin.indexer_logits` (contract in spin_trtllm/ops/_indexer_logits.py): row b*R + j, column k*64 + s
is the score of slot block_ids[b, k]*64 + s for row j. Columns past the selection, or past
the row's causal length, are -inf, or the backend returns the rows' compact lengths (which
top-K then respects). A backend may return a tensor wider than m_cap*64 (a row stride); top-K
and update read the first m_cap*64 columns.

- `native`:    spin's own masked FP8 kernel (torch.ops.spin.indexer_logits; on the CPU its
               reference). Default; the TensorRT plugins and dsa-lite use it.
- `deepgemm`:  the engine's own dense kernel (DeepGEMM fp8_paged_mqa_logits, what TensorRT-LLM
               runs) over a compacted block table (torch.ops.spin.compact): the pages of the
               selected blocks in order, with compact lengths per MTP row.
- `reference`: plain PyTorch (spin_trtllm.reference), on any device.

`resolve(name, device)` is called once when an indexer is built, so captured CUDA graphs keep
the backend they were captured with; an unavailable backend raises SpinError with its reason.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import torch

from ..errors import SpinError
from .deepgemm import DeepGemmLogits, StepCompaction
from .native import NativeLogits
from .reference import ReferenceLogits


class LogitsBackend(Protocol):
    name: str
    needs_out: bool      # run() writes into the `out` buffer it is given
    page_slots: int      # slots per K-cache page it reads

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
            context_lens: torch.Tensor, block_table: torch.Tensor, block_ids: torch.Tensor,
            counts: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(compact logits [B*R, >= m_cap*64]: `out` or a new tensor; int32 [B, R] compact
        lengths when columns past a row's causal length are not -inf, else None)."""


# name -> (availability check on a device: (ok, reason), factory taking page_slots)
BACKENDS: dict[str, tuple[Callable[[torch.device], tuple[bool, str]],
                          Callable[..., LogitsBackend]]] = {
    "native": (NativeLogits.available, NativeLogits),
    "deepgemm": (DeepGemmLogits.available, DeepGemmLogits),
    "reference": (ReferenceLogits.available, ReferenceLogits),
}


def available(name: str, device: torch.device | str) -> tuple[bool, str]:
    if name not in BACKENDS:
        return False, f"unknown logits backend {name!r} (choose from {', '.join(BACKENDS)})"
    return BACKENDS[name][0](torch.device(device))


def resolve(name: str, device: torch.device | str, page_slots: int = 64) -> LogitsBackend:
    ok, reason = available(name, device)
    if not ok:
        raise SpinError(f"logits backend {name!r} is not usable on {device}: {reason}")
    factory = BACKENDS[name][1]
    reads = getattr(factory, "reads", None)      # a page-size limit that depends on the device
    ok, reason = reads(torch.device(device), page_slots) if reads else (True, "")
    if not ok:
        raise SpinError(f"logits backend {name!r} is not usable on {device}: {reason}")
    return factory(page_slots=page_slots)


__all__ = ["BACKENDS", "LogitsBackend", "available", "resolve", "NativeLogits",
           "DeepGemmLogits", "ReferenceLogits", "StepCompaction"]
