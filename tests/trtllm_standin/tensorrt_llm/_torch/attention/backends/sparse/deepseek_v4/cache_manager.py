"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/deepseek_v4/cache_manager.py.

Mirrored (from excerpts; the file was not read whole): DeepseekV4CacheManager with
compressed_block_sizes ({ratio: tokens_per_block // ratio}), get_buffers(layer_idx,
attn_type), get_indexer_k_cache_buffers(layer_idx) = get_buffers(layer,
INDEXER_COMPRESS).unsqueeze(2).view(uint8) -> [pages, tokens_per_block // 4, 1, 132 | 68],
copy_batch_indexer_compress_block_tables(dst, request_ids, beam_width, num_contexts, num_seqs),
copy_batch_sliding_block_tables, copy_batch_compress_block_tables, compute_sliding_block_tables,
get_cache_indices, index_head_dim, use_fp4, quant_block_size (32 for FP4, 128 for FP8),
layer_offsets, num_local_layers, compress_pool_ptrs / swa_pool_ptr (here: the pools).

Simplified: the V2 page manager is replaced by the stand-in allocator; every pool page shares
the request's token-block index (upstream: "INDEXER_COMPRESS uses shared page indices"), so a
request's compressed page j holds compressed positions j*P .. j*P+P-1, P = tokens_per_block //
ratio. The SWA pool is the whole primary pool (no window eviction); COMPRESS pools are float.
Ratio 128 layers get a COMPRESS pool but no stand-in attention (see backend.py).
"""
from typing import List

import torch

from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager
from tensorrt_llm._utils import standin_device
from .params import DeepseekV4AttentionType

BAD_PAGE_INDEX = -1


class DeepseekV4CacheManager(KVCacheManager):
    def __init__(self, kv_cache_config, kv_cache_type=None, *, num_layers: int,
                 num_kv_heads: int, head_dim: int, tokens_per_block: int, max_seq_len: int,
                 max_batch_size: int, mapping=None, dtype=None, compressor_dtype=None,
                 vocab_size: int = 0, max_num_tokens: int = 8192, sparse_attn_config=None,
                 spec_config=None, **kwargs):
        if tokens_per_block not in (128, 256):
            raise ValueError(f"DeepSeek-V4 needs tokens_per_block 128 or 256, got "
                             f"{tokens_per_block}")
        super().__init__(kv_cache_config, kv_cache_type, num_layers=num_layers,
                         num_kv_heads=num_kv_heads, head_dim=head_dim,
                         tokens_per_block=tokens_per_block, max_seq_len=max_seq_len,
                         max_batch_size=max_batch_size, mapping=mapping, dtype=dtype,
                         spec_config=spec_config, max_num_tokens=max_num_tokens)
        cfg = sparse_attn_config
        self.sparse_attn_config = cfg
        self.index_head_dim = cfg.index_head_dim
        self._indexer_k_dtype = cfg.indexer_k_dtype
        self.use_fp4 = cfg.indexer_k_dtype == "fp4"
        self.quant_block_size = 32 if self.use_fp4 else 128
        self.use_fp8_ds_mla = False
        self.indexer_k_cache_page_scale = 1
        ratios = list(cfg.compress_ratios)
        ratios += [1] * (self.num_local_layers - len(ratios))
        self.compress_ratios = ratios[:self.num_local_layers]
        self.compressed_block_sizes = {r: tokens_per_block // r for r in set(self.compress_ratios)
                                       if r > 1}
        width = (self.index_head_dim // 2 if self.use_fp4 else self.index_head_dim) + 4
        self._indexer_pools, self._compress_pools = {}, {}
        for layer, ratio in enumerate(self.compress_ratios):
            if ratio > 1:
                self._compress_pools[layer] = torch.zeros(
                    self.num_blocks, tokens_per_block // ratio, head_dim)
            if ratio == 4:
                self._indexer_pools[layer] = torch.zeros(
                    self.num_blocks, (tokens_per_block // 4) * width, dtype=torch.uint8,
                    device=standin_device())
        self._indexer_width = width
        self.compressor_state: dict = {}     # (layer, is_indexer) -> {request_id: rows}

    def free_resources(self, request_id: int) -> None:
        for state in self.compressor_state.values():
            state.pop(request_id, None)
        super().free_resources(request_id)

    def get_buffers(self, layer_idx: int, attn_type=DeepseekV4AttentionType.SWA) -> torch.Tensor:
        local = self.layer_offsets[layer_idx]
        if attn_type == DeepseekV4AttentionType.SWA:
            return self._primary_pool[:, local]
        if attn_type == DeepseekV4AttentionType.COMPRESS:
            return self._compress_pools[local]
        if attn_type == DeepseekV4AttentionType.INDEXER_COMPRESS:
            pool = self._indexer_pools[local]
            slots = self.tokens_per_block // 4
            return pool.view(self.num_blocks, slots, self._indexer_width)
        raise KeyError(f"stand-in: no {attn_type.name} pool")

    def get_indexer_k_cache_buffers(self, layer_idx: int) -> torch.Tensor:
        buffer = self.get_buffers(layer_idx, DeepseekV4AttentionType.INDEXER_COMPRESS).unsqueeze(2)
        return buffer.view(torch.uint8)

    def get_cache_indices(self, request_id: int, layer_idx: int = 0, role=None) -> List[int]:
        return list(self._blocks[request_id])

    def _table(self, dst: torch.Tensor, request_ids, num_seqs) -> None:
        dst[:num_seqs].fill_(BAD_PAGE_INDEX)
        for i, rid in enumerate(request_ids[:num_seqs]):
            blocks = self._blocks[rid]
            dst[i, :len(blocks)] = torch.tensor(blocks, dtype=dst.dtype)

    def copy_batch_indexer_compress_block_tables(self, dst, request_ids, beam_width=1,
                                                 num_contexts=0, num_seqs=None) -> None:
        self._table(dst, request_ids, len(request_ids) if num_seqs is None else num_seqs)

    def copy_batch_compress_block_tables(self, dst, request_ids, compress_ratio=4, beam_width=1,
                                         num_contexts=0, num_seqs=None) -> None:
        self._table(dst, request_ids, len(request_ids) if num_seqs is None else num_seqs)

    def compute_sliding_block_tables(self, request_ids, num_contexts) -> None:
        pass

    def copy_batch_sliding_block_tables(self, dst, request_ids, num_contexts, num_seqs) -> None:
        for layer in range(dst.shape[0]):
            self._table(dst[layer, DeepseekV4AttentionType.SWA.value], request_ids, num_seqs)

    @property
    def swa_pool_ptr(self):
        return self._primary_pool

    @property
    def compress_pool_ptrs(self):
        return dict(self._compress_pools)
