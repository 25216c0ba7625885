"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/deepseek_v4/indexer.py (4fd977cc).

Mirrored: DeepseekV4Indexer(Indexer) with the same __init__ signature; it overrides
weights_proj, sets indexer_k_dtype / indexer_cache_dtype (resolve_kv_cache_dtype("mxfp4" |
"fp8_blockwise")) and builds `self.compressor = Compressor(indexer_mla_params, layer_idx,
compress_ratio, rms_norm_eps, skip_create_weights_in_init, pos_embd_params, dtype=dtype,
kv_cache_dtype=preset, is_indexer=True, rotate_activation=...)`; _update_k_cache is a no-op
(the compressor writes INDEXER_COMPRESS); post_load_weights is a no-op; forward(qr,
hidden_states, metadata, position_ids, pre_aux=None) runs the serial prepare (q project +
quantize, weights_proj + scale, compressor) and returns metadata.empty_topk_indices_buffer[:T]
when the compressor produced nothing, else self.sparse_attn_indexer(..., q_scale=q_scale)
(full batch: is_generation left None).

Simplified: no RoPE, Hadamard rotation, fused CuTe DSL Q path or aux-stream overlap.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn as nn

from ...interface import MLAParams
from ..dsa.indexer import Indexer
from .compressor import Compressor, KVCacheDtype, resolve_kv_cache_dtype


class DeepseekV4Indexer(Indexer):
    def __init__(self, quant_config, pos_embd_params, mla_params, skip_create_weights_in_init,
                 sparse_params, dtype, compress_ratio: int = 1, layer_idx: int = 0,
                 aux_stream=None):
        super().__init__(quant_config, pos_embd_params, mla_params, skip_create_weights_in_init,
                         sparse_params, dtype, compress_ratio, layer_idx, aux_stream)
        self.weights_proj = nn.Linear(self.hidden_size, self.n_heads, bias=False)
        index_head_dim = sparse_params.index_head_dim
        rope = mla_params.qk_rope_head_dim
        indexer_mla_params = MLAParams(hidden_size=mla_params.hidden_size, qk_rope_head_dim=rope,
                                       qk_nope_head_dim=index_head_dim - rope)
        self.indexer_k_dtype = sparse_params.indexer_k_dtype
        preset = "mxfp4" if self.indexer_k_dtype == "fp4" else "fp8_blockwise"
        self.indexer_cache_dtype = resolve_kv_cache_dtype(preset)
        self.compressor = Compressor(indexer_mla_params, layer_idx, compress_ratio, 1e-6,
                                     skip_create_weights_in_init, pos_embd_params, dtype=dtype,
                                     kv_cache_dtype=preset, is_indexer=True,
                                     rotate_activation=False)

    def post_load_weights(self):
        return

    def _quantize_q(self, q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        q = q.reshape(-1, self.head_dim)
        nope = self.head_dim - self.rope_dim
        if self.indexer_cache_dtype == KVCacheDtype.MXFP4_BLOCKWISE:
            q_fp8, q_scale = torch.ops.trtllm.fused_cat_fp4(q[:, :nope], q[:, nope:])
            return (q_fp8.view(-1, self.n_heads, self.head_dim // 2),
                    q_scale.view(-1, self.n_heads, 1))
        q_fp8, q_scale = torch.ops.trtllm.fused_cat_fp8(q[:, :nope], q[:, nope:], True)
        return q_fp8.view(-1, self.n_heads, self.head_dim), q_scale.view(-1, self.n_heads, 1)

    def _project_and_quantize_q(self, qr, position_ids):
        q = self.wq_b(qr.float()).view(-1, self.n_heads, self.head_dim)
        return self._quantize_q(q)

    def _apply_weight_scale(self, weights, q_scale):
        if self.indexer_cache_dtype == KVCacheDtype.MXFP4_BLOCKWISE:
            return weights.float() * self.weight_scale_factor
        return self._weight_scale(weights, q_scale)

    def _update_k_cache(self, k_fp8, k_scale, metadata) -> None:
        return      # the indexer compressor already scattered INDEXER_COMPRESS

    def _run_serial_indexer_prepare(self, qr, hidden_states, metadata, position_ids):
        q_fp8, q_scale = self._project_and_quantize_q(qr, position_ids)
        weights = self._apply_weight_scale(self.weights_proj(hidden_states.float()), q_scale)
        k_fp8, k_scale = self.compressor(hidden_states, metadata)
        return q_fp8, q_scale, k_fp8, k_scale, weights

    def forward(self, qr, hidden_states, metadata, position_ids, pre_aux=None):
        assert pre_aux is None, "pre_aux requires the overlapped indexer prepare path"
        q_fp8, q_scale, k_fp8, k_scale, weights = self._run_serial_indexer_prepare(
            qr, hidden_states, metadata, position_ids)
        if k_fp8 is None:
            return metadata.empty_topk_indices_buffer[:hidden_states.shape[0]]
        return self.sparse_attn_indexer(metadata, hidden_states, q_fp8, k_fp8, k_scale, weights,
                                        q_scale=q_scale)
