"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/deepseek_v4/compressor.py.

Mirrored: Compressor(mla_params, layer_idx, compress_ratio, rms_norm_eps,
skip_create_weights_in_init, pos_embd_params, dtype=None, kv_cache_dtype=..., is_indexer=False,
rotate_activation=...), called as `compressor(hidden_states, metadata)` once per layer forward;
for the indexer (is_indexer=True) it writes the completed compressed keys of this step into the
INDEXER_COMPRESS pool itself and returns (k, k_scale) of those keys, or (None, None) when no
window of compress_ratio tokens completed in a step without generation requests;
KVCacheDtype and resolve_kv_cache_dtype.

Simplified (the compressor file, de85b98a, was not read): a compressed entry is the MEAN of
its compress_ratio token projections (upstream: gated pooling with learned position biases,
overlapping windows for ratio 4, RMSNorm, RoPE, optional Hadamard). Partial windows are kept
in the cache manager's per-request `compressor_state` (upstream: COMPRESSOR_KV/SCORE pools).
UNVERIFIED: upstream reserves ceil(next_n / ratio) padded slots per generation request
(compressed_mask); the stand-in returns only completed entries (possibly none).
The main-attention compressor (is_indexer=False) writes float rows into the COMPRESS pool.
"""
import enum
from typing import Optional, Tuple

import torch
import torch.nn as nn

from tensorrt_llm.deep_gemm._layout import quantize_fp4, quantize_fp8
from .params import DeepseekV4AttentionType


class KVCacheDtype(enum.Enum):
    DEFAULT = "default"
    FP8_BLOCKWISE = "fp8_blockwise"
    MXFP4_BLOCKWISE = "mxfp4"


def resolve_kv_cache_dtype(preset: str) -> KVCacheDtype:
    return {"mxfp4": KVCacheDtype.MXFP4_BLOCKWISE,
            "fp8_blockwise": KVCacheDtype.FP8_BLOCKWISE}.get(preset, KVCacheDtype.DEFAULT)


class Compressor(nn.Module):
    def __init__(self, mla_params, layer_idx: int, compress_ratio: int, rms_norm_eps: float,
                 skip_create_weights_in_init: bool, pos_embd_params, dtype=None,
                 kv_cache_dtype: str = "default", is_indexer: bool = False,
                 rotate_activation: bool = False, **kwargs):
        super().__init__()
        self.layer_idx = layer_idx
        self.compress_ratio = compress_ratio
        self.is_indexer = is_indexer
        self.head_dim = mla_params.qk_nope_head_dim + mla_params.qk_rope_head_dim
        self.kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype)
        self.wkv = nn.Linear(mla_params.hidden_size, self.head_dim, bias=False)

    def _pool(self, hidden_states: torch.Tensor, metadata) -> Tuple[torch.Tensor, list]:
        """Complete windows of this step: (entries [n, head_dim], [(request, position)])."""
        proj = self.wkv(hidden_states.float())
        manager = metadata.kv_cache_manager
        state = manager.compressor_state.setdefault((self.layer_idx, self.is_indexer), {})
        cached = metadata.kv_cache_params.num_cached_tokens_per_seq
        entries, where, offset = [], [], 0
        ratio = self.compress_ratio
        for i, rid in enumerate(metadata.request_ids[:metadata.num_seqs]):
            n = int(metadata.seq_lens[i])
            rows = proj[offset:offset + n]
            offset += n
            past = int(cached[i])
            pending = state.get(rid) if past % ratio else None
            if past % ratio and (pending is None or pending.shape[0] != past % ratio):
                raise RuntimeError(f"compressor layer {self.layer_idx}: no state for the "
                                   f"partial window of request {rid}")
            window = rows if pending is None else torch.cat([pending, rows])
            first = past - (past % ratio)                   # token position of window[0]
            for w in range(window.shape[0] // ratio):
                entries.append(window[w * ratio:(w + 1) * ratio].mean(dim=0))
                where.append((i, first // ratio + w))
            state[rid] = window[(window.shape[0] // ratio) * ratio:].clone()
        if not entries:
            return torch.empty(0, self.head_dim), where
        return torch.stack(entries), where

    def forward(self, hidden_states: torch.Tensor, metadata) -> Tuple[Optional[torch.Tensor],
                                                                       Optional[torch.Tensor]]:
        entries, where = self._pool(hidden_states, metadata)
        if not where and metadata.num_generations == 0:
            return None, None          # no compressed token at all this step
        manager = metadata.kv_cache_manager
        if not where:
            width = (self.head_dim // 2) if self.kv_cache_dtype == KVCacheDtype.MXFP4_BLOCKWISE \
                else self.head_dim
            return (torch.empty(0, width, dtype=torch.int8),
                    torch.empty(0, 1, dtype=torch.float32))
        if not self.is_indexer:
            pool = manager.get_buffers(self.layer_idx, DeepseekV4AttentionType.COMPRESS)
            slots = manager.compressed_block_sizes[self.compress_ratio]
            for (i, pos), row in zip(where, entries):
                page = int(metadata.compress_block_tables[self.compress_ratio][i, pos // slots])
                pool[page, pos % slots] = row
            return entries, None
        if self.kv_cache_dtype == KVCacheDtype.MXFP4_BLOCKWISE:
            k, k_scale = quantize_fp4(entries)
            data, scale = k.view(torch.int8), k_scale.view(-1, 1)
        else:
            k, k_scale = quantize_fp8(entries)
            data, scale = k, k_scale.view(-1, 1)
        pages = manager.get_indexer_k_cache_buffers(self.layer_idx)         # [P, S, 1, W]
        slots, width = pages.shape[1], pages.shape[3]
        flat = pages.view(pages.shape[0], -1)
        data_bytes = data.contiguous().view(torch.uint8).reshape(len(where), -1)
        scale_bytes = scale.contiguous().view(torch.uint8).reshape(len(where), 4)
        table = metadata.host_indexer_k_cache_block_offsets
        for n, (i, pos) in enumerate(where):
            page, slot = int(table[i, pos // slots]), pos % slots
            db = width - 4
            flat[page, slot * db:(slot + 1) * db] = data_bytes[n]
            flat[page, slots * db + slot * 4:slots * db + slot * 4 + 4] = scale_bytes[n]
        return data, scale
