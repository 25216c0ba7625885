"""SpinDecodeAdapter: TensorRT-LLM's decode-indexer metadata -> SpinIndexer, per step.

Framework-free (no tensorrt_llm import), so it is tested against dsa-lite on any machine; the
patch in `patch.py` only gathers TensorRT-LLM's tensors into a DecodeBatch and calls it.

Per decode step, in TensorRT-LLM's order:
    begin_step(batch)   host side, in the attention metadata's prepare(): replays the previous
                        step's deferred MTP updates with the acceptance now known, realigns the
                        per-request state with the batch (new requests get zeroed state,
                        requests that left give theirs back), copies metadata, and selects the
                        blocks of every indexer layer (one launch)
    layer(l, q, w, kv)  inside the layer's forward (CUDA-graph capturable): masked logits and
                        top-K into the caller's topk_indices buffer
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from ...config import SpinConfig
from ...errors import SpinError
from ...indexer import SpinIndexer
from ...ops import BLOCK
from ...state import StatePool


@dataclass
class DecodeBatch:
    """One decode step of the generation requests, in TensorRT-LLM's terms.

    request_ids   the generation requests, in batch order
    kv_lens       int [B]: tokens in each request's KV cache once this step's next_n tokens are
                  written (TensorRT-LLM's kv lens); MTP row j of a request sees
                  kv_len - next_n + j + 1 tokens
    block_table   int32 [B, max_pages]: the indexer K-cache pages of each request (its block
                  offsets), 64 indexer slots per page
    accepted      accepted draft tokens of the previous step, by request id (MTP only);
                  requests missing from it replay row 0 only. None: derived from the kv lens,
                  which grow by accepted + 1 from one step to the next
    """

    request_ids: Sequence[int]
    kv_lens: torch.Tensor
    block_table: torch.Tensor
    accepted: Optional[Mapping[int, int]] = None


class SpinDecodeAdapter:
    def __init__(self, cfg: SpinConfig, num_layers: int, max_batch: int, next_n: int,
                 max_tokens: int, compress_ratio: int = 1,
                 device: torch.device | str = "cuda", max_requests: Optional[int] = None,
                 initial_capacity: int = 4096):
        """num_layers: indexer layers (V3.2: every layer; V4: the ratio-4 layers).
        max_tokens: the longest sequence (max_seq_len); compress_ratio: tokens per indexer slot
        (1 for DeepSeek-V3.2, 4 for DeepSeek-V4's C4A layers)."""
        if compress_ratio < 1 or max_tokens < 1:
            raise SpinError(f"SpinDecodeAdapter: compress_ratio ({compress_ratio}) and max_tokens "
                            f"({max_tokens}) must be >= 1")
        self.cfg, self.next_n, self.ratio = cfg, next_n, compress_ratio
        self.max_slots = max_tokens // compress_ratio + 1
        self.pool = StatePool(num_layers, max_requests or max_batch, cfg, device,
                              initial_capacity=min(initial_capacity, self.max_slots + next_n),
                              max_capacity=self.max_slots + next_n)
        self.indexer = SpinIndexer(cfg, self.pool, max_batch, next_n, self.max_slots)
        self._steps: dict[int, int] = {}
        self._last_ids: Optional[list[int]] = None     # the step whose MTP updates are pending
        self._last_pad: list[bool] = []
        self._last_kv: dict[int, int] = {}

    @property
    def generation(self) -> int:
        """Changes when the state is reallocated: CUDA graphs must be captured again."""
        return self.pool.generation

    def begin_step(self, batch: DecodeBatch) -> None:
        ids = [int(r) for r in batch.request_ids]
        B, R = len(ids), self.next_n
        kv = torch.as_tensor(batch.kv_lens).to("cpu", torch.int64).view(-1)
        if kv.numel() != B:
            raise SpinError(f"SpinDecodeAdapter: {B} request ids but {kv.numel()} kv lens")
        # padding rows of a CUDA-graph batch (TensorRT-LLM repeats a dummy id, 2^64 - 1): they
        # run on free state slots with empty contexts and produce -1 rows
        seen: set[int] = set()
        pad = []
        for rid in ids:
            pad.append(rid in seen or not 0 <= rid < 1 << 63)
            seen.add(rid)
        real = [rid for rid, p in zip(ids, pad) if not p]
        real_kv = kv[[i for i, p in enumerate(pad) if not p]]
        if real and int(real_kv.min()) < R:
            raise SpinError(f"SpinDecodeAdapter: kv lens must be >= next_n ({R}), got "
                            f"{int(real_kv.min())}")
        accepted = batch.accepted
        if accepted is None and self._last_ids is not None:
            now = dict(zip(real, real_kv.tolist()))
            accepted = {rid: now[rid] - self._last_kv[rid] - 1 for rid in self._last_ids
                        if rid in now and rid in self._last_kv}
        self._replay_deferred(accepted)
        self._last_kv = dict(zip(real, real_kv.tolist()))
        # realign with the batch: requests that left give their state back, new ones start at 0
        for rid in self.pool.request_ids():
            if rid not in seen:
                self.release(rid)
        for rid in real:
            if self.pool.slot_of(rid) is None:
                self.pool.admit(rid)
                self._steps[rid] = 0
        spare = iter(self.pool.free_slots(sum(pad)))
        slots = torch.tensor([next(spare) if p else self.pool.slot_of(rid)
                              for rid, p in zip(ids, pad)], dtype=torch.int32)
        padded = torch.tensor(pad).view(-1, 1)
        tokens = kv.view(-1, 1) - R + 1 + torch.arange(R)          # tokens seen by each row
        context = torch.where(padded, 0, tokens // self.ratio).to(torch.int32)
        query = torch.where(padded, 0, (tokens - 1) // self.ratio).to(torch.int32)
        steps = [0 if p else self._steps[rid] for rid, p in zip(ids, pad)]
        self.indexer.prepare(ids, context, query, steps, batch.block_table,
                             state_slots=slots.to(self.pool.device))
        self.indexer.select()
        for rid in real:
            self._steps[rid] += 1
        self._last_ids = ids if R > 1 else None
        self._last_pad = pad

    def layer(self, layer: int, q: torch.Tensor, weights: torch.Tensor, kv_cache: torch.Tensor,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Top-K local slot ids [B * next_n, K] (-1 padded) of indexer layer `layer`; also copied
        into `out` (e.g. TensorRT-LLM's topk_indices_buffer rows) when given."""
        top = self.indexer.layer(layer, q, weights, kv_cache)
        if out is not None:
            if out.shape != top.shape or out.dtype != top.dtype:
                raise SpinError(f"SpinDecodeAdapter.layer: out must be {top.dtype} "
                                f"{list(top.shape)}, got {out.dtype} {list(out.shape)}")
            out.copy_(top)
            return out
        return top

    def release(self, request_id: int) -> None:
        """A finished (or preempted) request gives its state back."""
        if self.pool.slot_of(request_id) is not None:
            self.pool.release(request_id)
        self._steps.pop(request_id, None)

    def _replay_deferred(self, accepted: Optional[Mapping[int, int]]) -> None:
        if self._last_ids is None:
            return
        pad = getattr(self, "_last_pad", [False] * len(self._last_ids))
        acc = [0 if p else max(0, min(int((accepted or {}).get(rid, 0)), self.next_n - 1))
               for rid, p in zip(self._last_ids, pad)]
        self.indexer.finish(torch.tensor(acc, dtype=torch.int32, device=self.pool.device))
        self._last_ids = None

    @staticmethod
    def pages_for(tokens: int, compress_ratio: int) -> int:
        """Indexer K-cache pages a sequence of `tokens` tokens needs."""
        return math.ceil((tokens // compress_ratio + 1) / BLOCK)
