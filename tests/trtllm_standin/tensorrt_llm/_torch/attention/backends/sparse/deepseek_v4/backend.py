"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/deepseek_v4/backend.py (1a681e4c).

Mirrored: DeepseekV4TrtllmAttention(TrtllmAttention).__init__(layer_idx, num_heads, head_dim,
..., sparse_attention_config=None, sparse_params=None, dtype=None, aux_stream=None):
compress_ratio = sparse_attention_config.compress_ratios[layer_idx]; a DeepseekV4Indexer
(positional: quant_config, pos_embd_params, mla_params, skip_create_weights_in_init,
sparse_params, dtype, compress_ratio, layer_idx, aux_stream) ONLY when compress_ratio == 4; a
Compressor for every compress_ratio > 1; sparse_attn_predict() ->
deepseek_v4_local_to_global_indices
with the SWA local indices and, for ratio 4, forward_args.sparse_backend_args.topk_indices.

Simplified: `sparse_mla(...)` is a stand-in for the dual-pool sparse MLA. Per token it reads
the first sparse_mla_topk_lens[ratio][t] entries of the global-index row (the 128 SWA slots,
then the compressed ones), as upstream's kernel does, and checks that no compressed entry it
reads is -1.
"""
from typing import Optional

import torch

from ...interface import AttentionForwardArgs, AttentionInputType
from ...trtllm import TrtllmAttention
from .compressor import Compressor
from .indexer import DeepseekV4Indexer
from .kernels import deepseek_v4_local_to_global_indices
from .metadata import DeepseekV4TrtllmAttentionMetadata
from .params import DeepseekV4AttentionType


class DeepseekV4TrtllmAttention(TrtllmAttention):
    Metadata = DeepseekV4TrtllmAttentionMetadata

    def __init__(self, layer_idx: int, num_heads: int, head_dim: int,
                 num_kv_heads: Optional[int] = None, quant_config=None, q_scaling=None,
                 pos_embd_params=None, mla_params=None, skip_create_weights_in_init=False,
                 attention_chunk_size=None, sparse_attention_config=None, sparse_params=None,
                 dtype=None, aux_stream=None, **kwargs):
        if sparse_attention_config is None:
            sparse_attention_config = sparse_params
        assert sparse_attention_config is not None
        if sparse_params is None:
            sparse_params = sparse_attention_config.to_sparse_params()
        super().__init__(layer_idx, num_heads, head_dim, num_kv_heads=num_kv_heads,
                         quant_config=quant_config, pos_embd_params=pos_embd_params,
                         mla_params=mla_params, sparse_params=sparse_params)
        self.sparse_attention_config = sparse_attention_config
        self.compress_ratio = sparse_attention_config.compress_ratios[layer_idx]
        self.indexer = None
        if self.compress_ratio == 4:
            self.indexer = DeepseekV4Indexer(quant_config, pos_embd_params, mla_params,
                                             skip_create_weights_in_init, sparse_params, dtype,
                                             self.compress_ratio, layer_idx, aux_stream)
        self.compressor = None
        if self.compress_ratio > 1:
            self.compressor = Compressor(mla_params, layer_idx, self.compress_ratio, 1e-6,
                                         skip_create_weights_in_init, pos_embd_params,
                                         kv_cache_dtype="default", dtype=dtype,
                                         rotate_activation=False)

    @staticmethod
    def _phase(metadata, forward_args):
        kind = forward_args.attention_input_type
        if kind == AttentionInputType.context_only:
            return 0, metadata.num_ctx_tokens
        if kind == AttentionInputType.generation_only:
            return metadata.num_ctx_tokens, metadata.num_tokens
        return 0, metadata.num_tokens

    def sparse_attn_predict(self, q, k, metadata: DeepseekV4TrtllmAttentionMetadata,
                            forward_args: AttentionForwardArgs):
        start, end = self._phase(metadata, forward_args)
        manager = metadata.kv_cache_manager
        local_layer = manager.layer_offsets[self.layer_idx]
        compressed, table = None, None
        if self.compress_ratio > 1:
            table = metadata.compress_block_tables[self.compress_ratio]
            if self.compress_ratio == 4:
                compressed = forward_args.sparse_backend_args.topk_indices
                assert compressed is not None, "topk_indices is required when compress_ratio=4"
            else:
                compressed = metadata.compressed_local_indices_cuda[start:end]
        result = deepseek_v4_local_to_global_indices(
            req_id=metadata.req_idx_per_token[start:end],
            block_table_swa=metadata.sliding_block_tables[local_layer,
                                                          DeepseekV4AttentionType.SWA.value],
            swa_local_indices=metadata.swa_local_indices_cuda[start:end],
            tokens_per_block=manager.tokens_per_block, block_table_compressed=table,
            compressed_local_indices=compressed, compress_ratio=self.compress_ratio,
            num_compressed_indices=metadata.max_compressed_indices[self.compress_ratio])
        return result, None

    def sparse_mla(self, q: torch.Tensor, metadata, global_indices: torch.Tensor,
                   forward_args: AttentionForwardArgs, value_dim: int) -> torch.Tensor:
        start, end = self._phase(metadata, forward_args)
        manager = metadata.kv_cache_manager
        window = metadata.window_size
        lens = metadata.sparse_mla_topk_lens[self.compress_ratio][start:end].long()
        swa_rows = manager.get_buffers(self.layer_idx).reshape(-1, manager.head_dim)
        pools = [swa_rows]
        if self.compress_ratio > 1:
            pools.append(manager.get_buffers(self.layer_idx, DeepseekV4AttentionType.COMPRESS)
                         .reshape(-1, manager.head_dim))
        cols = torch.arange(global_indices.shape[1])
        read = cols[None, :] < lens[:, None]
        if self.compress_ratio > 1:
            bad = read[:, window:] & (global_indices[:, window:] < 0)
            if bool(bad.any()):
                raise RuntimeError(f"layer {self.layer_idx}: sparse MLA reads a -1 compressed "
                                   f"index inside sparse_mla_topk_lens")
        valid = read & (global_indices >= 0)
        idx = global_indices.clamp(min=0).long()
        rows = swa_rows[idx[:, :window]]
        if self.compress_ratio > 1:
            rows = torch.cat([rows, pools[1][idx[:, window:]]], dim=1)
        scores = torch.einsum("thd,tkd->thk", q, rows) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        return torch.einsum("thk,tkd->thd", probs, rows[..., :value_dim])
