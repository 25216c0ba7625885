"""The `native` logits backend: spin's masked FP8 kernel (torch.ops.spin.indexer_logits)."""

from __future__ import annotations

import torch

from .. import ops
from ._paged64 import Paged64


class NativeLogits(Paged64):
    name = "native"

    @staticmethod
    def available(device: torch.device) -> tuple[bool, str]:
        return True, "spin.indexer_logits (the reference where the native library is absent)"

    def run(self, q, kv_cache, weights, context_lens, block_table, block_ids, counts, out):
        ops.indexer_logits(q, kv_cache, weights, context_lens, block_table, block_ids, counts, out)
        return out, None
