"""Shared by the backends that read spin's own K-cache layout: FP8 pages of 64 slots (native:
its kernel's TMA layout) or, for the reference, 64 or 32 slots (a SPIN block = two pages)."""

from __future__ import annotations

from ..errors import SpinError
from ..limits import BLOCK_SLOTS, PAGE_SIZES


class Paged64:
    name: str
    needs_out = True      # they write into the indexer's buffer
    page_sizes: tuple[int, ...] = (BLOCK_SLOTS,)   # the page sizes run() reads
    page_slots = BLOCK_SLOTS                       # this instance's (the masked kernel's)

    def __init__(self, page_slots: int = BLOCK_SLOTS):
        if page_slots not in self.page_sizes:
            sizes = "- or ".join(map(str, self.page_sizes))
            others = " (the reference backend reads 32-slot pages too, and deepgemm on SM100)" \
                if page_slots in PAGE_SIZES else ""
            raise SpinError(f"logits backend {self.name!r} reads {sizes}-slot K-cache pages, "
                            f"not {page_slots!r}-slot ones{others}")
        self.page_slots = page_slots
