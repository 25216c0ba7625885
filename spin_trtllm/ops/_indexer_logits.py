"""spin::indexer_logits: the indexer's scores over the selected blocks only.

q fp8 [B*R, 64, 128], kv_cache uint8 pages of 64 x 132 bytes (64 fp8 keys, then 64 fp32
scales), weights fp32 [B*R, 64], context_lens int32 [B, R], block_table int32 [B, max_pages],
block_ids [B, m_cap] and counts [B] as select writes them for one layer
-> out fp32 [B*R, m_cap*64]: compact scores (position k*64 + s is slot block_ids[k]*64 + s),
-inf past a row's causal length, past the selected count, and for block-table entries outside
the cache (never read). On sm_90a the q.k sums come from FP8 tensor cores (wgmma) as in
DeepGEMM's FP8 MQA logits: about 1.4e-4 of the row norm from exact (random data); elsewhere
they are summed in fp32. q, kv_cache and weights start at 16-byte aligned addresses.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import reference as ref
from ..limits import BLOCK_SLOTS
from ._common import (check_aligned16, check_cache, check_query, check_selection, check_shape,
                      check_tensor, device_of, register)

SCHEMA = ("indexer_logits(Tensor q, Tensor kv_cache, Tensor weights, Tensor context_lens, "
          "Tensor block_table, Tensor block_ids, Tensor counts, Tensor(a!) out) -> ()")


def _validate(q, kv_cache, weights, context_lens, block_table, block_ids, counts, out) -> None:
    op = "indexer_logits"
    dev = device_of(q)
    B, R = check_query(op, q, weights, context_lens, block_table, dev)
    check_cache(op, kv_cache, dev)
    check_aligned16(op, kv_cache=kv_cache)
    m_cap = check_selection(op, dev, block_ids, counts, B, layered=False)
    check_tensor(op, "out", out, (torch.float32,), 2, dev, contiguous=True)
    check_shape(op, "out", out, (B * R, m_cap * BLOCK_SLOTS))


def _reference(q, kv_cache, weights, context_lens, block_table, block_ids, counts, out) -> None:
    out.copy_(ref.masked_indexer_logits(q, kv_cache, weights, context_lens, block_table,
                                        block_ids, counts).float())


register(SCHEMA, _validate, _reference)


def indexer_logits(q, kv_cache, weights, context_lens, block_table, block_ids, counts,
                   out: Optional[torch.Tensor] = None) -> torch.Tensor:
    if out is None:
        out = torch.empty(q.shape[0], block_ids.shape[-1] * BLOCK_SLOTS, dtype=torch.float32,
                          device=q.device)
    torch.ops.spin.indexer_logits(q, kv_cache, weights, context_lens, block_table, block_ids,
                                  counts, out)
    return out
