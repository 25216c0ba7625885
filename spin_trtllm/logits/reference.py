"""The `reference` logits backend: plain PyTorch on any device (slow; the specification). It
reads 64- and 32-slot K-cache pages."""

from __future__ import annotations

import torch

from .. import reference as ref
from ..errors import SpinError
from ..limits import PAGE_SIZES
from ..reference.paged import page_slots_of
from ._paged64 import Paged64


class ReferenceLogits(Paged64):
    name = "reference"
    page_sizes = PAGE_SIZES

    @staticmethod
    def available(device: torch.device) -> tuple[bool, str]:
        return True, "spin_trtllm.reference"

    def run(self, q, kv_cache, weights, context_lens, block_table, block_ids, counts, out):
        # the table's columns are pages of page_slots slots: a cache of another size would be
        # read through the wrong columns
        if kv_cache.dim() < 2 or page_slots_of(kv_cache) != self.page_slots:
            raise SpinError(f"logits backend 'reference' was made for {self.page_slots}-slot "
                            f"pages, the K cache has shape {list(kv_cache.shape)}")
        out.copy_(ref.masked_indexer_logits(q, kv_cache, weights, context_lens, block_table,
                                            block_ids, counts))
        return out, None
