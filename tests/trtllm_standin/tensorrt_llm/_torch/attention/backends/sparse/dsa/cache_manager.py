"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/dsa/cache_manager.py (12a71fe4).

Mirrored: _get_indexer_k_cache_bytes_per_token, derive_indexer_k_cache_layer_mask,
is_dsa_cache_manager, DSACacheManager(KVCacheManager) with quant_block_size (128),
index_head_dim, use_fp4, indexer_k_cache_page_scale (1), indexer_k_cache_local_layer_mask,
indexer_k_cache_pool_per_layer (None for shared-indexer layers),
get_indexer_k_cache_buffers(layer_idx) -> uint8 [num_blocks, tokens_per_block, 1, 132 | 68],
get_primary_pool_page_index_params(), get_pool_block_indices().

Simplified: one page of the indexer pool per KV block (same block ids), allocated by the
stand-in KVCacheManager; no host offload, no V2 manager.
"""
from typing import List, Optional

import torch

from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager
from tensorrt_llm._utils import standin_device
from .params import DSAParams


def _get_indexer_k_cache_bytes_per_token(index_head_dim: int, quant_block_size: int,
                                         use_fp4: bool) -> int:
    data_bytes = index_head_dim // 2 if use_fp4 else index_head_dim
    return data_bytes + index_head_dim // quant_block_size * 4


def derive_indexer_k_cache_layer_mask(sparse_attention_config, pretrained_config,
                                      num_layers: int) -> List[bool]:
    return [bool(getattr(sparse_attention_config.to_sparse_params(
        pretrained_config=pretrained_config, layer_idx=i), "is_full_indexer_layer", True))
        for i in range(num_layers)]


def is_dsa_cache_manager(manager) -> bool:
    return isinstance(manager, DSACacheManager)


class DSACacheManager(KVCacheManager):
    def __init__(self, kv_cache_config, kv_cache_type=None, *, num_layers: int,
                 num_kv_heads, head_dim: int, tokens_per_block: int, max_seq_len: int,
                 max_batch_size: int, mapping=None, dtype=None, spec_config=None,
                 layer_mask=None, max_num_tokens: int = 8192, model_config=None,
                 max_beam_width: int = 1, sparse_attention_config=None,
                 pretrained_config=None, **kwargs):
        if sparse_attention_config is None:
            sparse_attention_config = kwargs.pop("sparse_attn_config", None)
        if sparse_attention_config is None and model_config is not None:
            sparse_attention_config = model_config.sparse_attention_config
        if sparse_attention_config is None:
            raise ValueError("sparse_attention_config is required for DSA cache")
        sparse_params = sparse_attention_config.to_sparse_params(
            pretrained_config=pretrained_config)
        if not isinstance(sparse_params, DSAParams):
            raise ValueError("DSA cache requires DSA sparse parameters")
        self.quant_block_size = 128
        self.index_head_dim = sparse_params.index_head_dim
        self.use_fp4 = sparse_params.indexer_k_dtype == "fp4"
        self.use_fp8_ds_mla = False
        super().__init__(kv_cache_config, kv_cache_type, num_layers=num_layers,
                         num_kv_heads=num_kv_heads, head_dim=head_dim,
                         tokens_per_block=tokens_per_block, max_seq_len=max_seq_len,
                         max_batch_size=max_batch_size, mapping=mapping, dtype=dtype,
                         spec_config=spec_config, layer_mask=layer_mask,
                         max_num_tokens=max_num_tokens, model_config=model_config,
                         max_beam_width=max_beam_width)
        self.indexer_k_cache_local_layer_mask = derive_indexer_k_cache_layer_mask(
            sparse_attention_config, pretrained_config, self.num_local_layers)
        self.indexer_k_cache_page_scale = 1
        per_token = _get_indexer_k_cache_bytes_per_token(self.index_head_dim,
                                                         self.quant_block_size, self.use_fp4)
        self.indexer_k_cache_pool_per_layer = [
            torch.zeros(self.num_blocks, tokens_per_block * per_token, dtype=torch.uint8,
                        device=standin_device())
            if full else None for full in self.indexer_k_cache_local_layer_mask]

    def get_primary_pool_page_index_params(self, local_layer_idx: int):
        return self.num_local_layers, local_layer_idx

    def get_indexer_k_cache_buffers(self, layer_idx: int) -> torch.Tensor:
        per_token = _get_indexer_k_cache_bytes_per_token(self.index_head_dim,
                                                         self.quant_block_size, self.use_fp4)
        pool = self.indexer_k_cache_pool_per_layer[self.layer_offsets[layer_idx]]
        assert pool is not None, (f"Layer {layer_idx} is a shared-indexer layer and owns no "
                                  f"indexer k-cache")
        return pool.view(self.num_blocks, self.tokens_per_block, 1, per_token)

    def get_pool_block_indices(self, num_seqs: int, *, request_ids: Optional[List[int]] = None,
                               num_contexts: int = 0, beam_width: int = 1) -> torch.Tensor:
        return self.copy_batch_block_offsets(request_ids[:num_seqs]).clamp(min=0)

    def get_batch_indexer_k_cache_indices(self, request_ids: List[int]):
        return self.get_batch_cache_indices(request_ids, 0)
