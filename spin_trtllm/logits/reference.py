"""The `reference` logits backend: plain PyTorch on any device (slow; the specification)."""

from __future__ import annotations

import torch

from .. import reference as ref
from ._paged64 import Paged64


class ReferenceLogits(Paged64):
    name = "reference"

    @staticmethod
    def available(device: torch.device) -> tuple[bool, str]:
        return True, "spin_trtllm.reference"

    def run(self, q, kv_cache, weights, context_lens, block_table, block_ids, counts, out):
        out.copy_(ref.masked_indexer_logits(q, kv_cache, weights, context_lens, block_table,
                                            block_ids, counts))
        return out, None
