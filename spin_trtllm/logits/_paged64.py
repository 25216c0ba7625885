"""Shared by the backends that read spin's own K-cache layout: 64-slot FP8 pages."""

from __future__ import annotations

from ..errors import SpinError


class Paged64:
    name: str
    needs_out = True      # they write into the indexer's buffer
    page_slots = 64       # the masked kernel's page layout (spin_trtllm.reference)

    def __init__(self, page_slots: int = 64):
        if page_slots != self.page_slots:
            raise SpinError(f"logits backend {self.name!r} reads 64-slot K-cache pages, "
                            f"not {page_slots}-slot ones (the deepgemm backend reads both)")
