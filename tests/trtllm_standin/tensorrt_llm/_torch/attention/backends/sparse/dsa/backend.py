"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/dsa/backend.py (version 14ac2de6).

Mirrored: DSATrtllmAttention(TrtllmAttention).__init__(layer_idx, num_heads, head_dim, ...,
sparse_params=None, dtype=None, aux_stream=None, **kwargs): derives sparse_params from
kwargs["sparse_attention_config"].to_sparse_params(layer_idx=...) when not given, and builds
`Indexer(quant_config, pos_embd_params, mla_params, skip_create_weights_in_init,
sparse_params, dtype=dtype, layer_idx=layer_idx, aux_stream=aux_stream)` on full-indexer
layers (indexer=None on shared ones); sparse_attn_predict() converts the local top-K with
transform_local_topk_and_prepare_pool_view.

Simplified: the top-K comes in through forward_args.sparse_backend_args.topk_indices (upstream:
select_dsa_topk over indexer_intermediates); `sparse_mla(...)` is a stand-in sparse MLA: it
gathers the selected latent rows of the primary pool and runs softmax attention in torch.
No grouped (cross-layer) remap, no NVFP4 KV.
"""
from typing import Optional, Tuple

import torch

from ...interface import AttentionForwardArgs, AttentionInputType
from ...trtllm import TrtllmAttention
from .indexer import Indexer, transform_local_topk_and_prepare_pool_view
from .metadata import DSAtrtllmAttentionMetadata


class DSATrtllmAttention(TrtllmAttention):
    Metadata = DSAtrtllmAttentionMetadata

    def __init__(self, layer_idx: int, num_heads: int, head_dim: int,
                 num_kv_heads: Optional[int] = None, quant_config=None, q_scaling=None,
                 pos_embd_params=None, mla_params=None, skip_create_weights_in_init=False,
                 attention_chunk_size=None, sparse_params=None, dtype=None, aux_stream=None,
                 **kwargs):
        sparse_attention_config = kwargs.pop("sparse_attention_config", None)
        self.sparse_attention_config = sparse_attention_config
        if sparse_params is None and sparse_attention_config is not None:
            sparse_params = sparse_attention_config.to_sparse_params(layer_idx=layer_idx)
        if sparse_params is None:
            raise ValueError("sparse_params is required for DSATrtllmAttention and cannot be None")
        super().__init__(layer_idx, num_heads, head_dim, sparse_params=sparse_params,
                         num_kv_heads=num_kv_heads, quant_config=quant_config,
                         pos_embd_params=pos_embd_params, mla_params=mla_params,
                         skip_create_weights_in_init=skip_create_weights_in_init)
        self.is_full_indexer_layer = getattr(sparse_params, "is_full_indexer_layer", True)
        if self.is_full_indexer_layer:
            self.indexer = Indexer(quant_config, pos_embd_params, mla_params,
                                   skip_create_weights_in_init, sparse_params, dtype=dtype,
                                   layer_idx=layer_idx, aux_stream=aux_stream)
        else:
            self.indexer = None

    def sparse_attn_predict(self, q, k, metadata, forward_args: AttentionForwardArgs
                            ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        is_generation = forward_args.attention_input_type == AttentionInputType.generation_only
        topk = forward_args.sparse_backend_args.topk_indices
        global_indices, _ = transform_local_topk_and_prepare_pool_view(
            topk, metadata, self.get_local_layer_idx(metadata), is_generation)
        return global_indices, None

    def sparse_mla(self, q: torch.Tensor, metadata, global_indices: torch.Tensor,
                   value_dim: int) -> torch.Tensor:
        """Stand-in sparse MLA: q [T, heads, D] over the selected rows of the pool view."""
        pool = metadata._cached_pool_view[:, 0]                               # [rows, D]
        valid = global_indices >= 0
        rows = pool[global_indices.clamp(min=0).long()]                        # [T, K, D]
        scores = torch.einsum("thd,tkd->thk", q, rows) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        return torch.einsum("thk,tkd->thd", probs, rows[..., :value_dim])
