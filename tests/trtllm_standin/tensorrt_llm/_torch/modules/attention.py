"""Stand-in for tensorrt_llm/_torch/modules/attention.py: the MLA module, DSA / V4 paths.

Mirrored shape of the call graph: MLA builds its sparse attention backend (`self.mqa`, a
DSATrtllmAttention or DeepseekV4TrtllmAttention) with the layer's sparse_params; per forward
it appends this step's latent KV to the cache, runs the indexer (Indexer.forward /
DeepseekV4Indexer.forward) for the top-K, converts it with sparse_attn_predict (context and
generation rows separately for DSA, as the attention op runs them) and runs the sparse MLA.

Simplified (UNVERIFIED against modules/attention.py, not read): dimensions are tiny, no RoPE,
no norms, no quantized weights; the latent KV is written in float into the stand-in pools;
`self.last_topk` keeps each step's local top-K for tests.
"""
from typing import Optional

import torch
import torch.nn as nn

from ..attention.backends.interface import (AttentionForwardArgs, AttentionInputType, MLAParams,
                                            PositionalEmbeddingParams)
from ..attention.backends.sparse.params import SparseBackendForwardArgs


class MLA(nn.Module):
    def __init__(self, *, hidden_size: int, num_attention_heads: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int, kv_lora_rank: int,
                 layer_idx: int, model_config, sparse_params, aux_stream=None):
        super().__init__()
        from ..attention.backends.utils import get_attention_backend
        self.layer_idx = layer_idx
        self.num_heads = num_attention_heads
        self.kv_lora_rank = kv_lora_rank
        self.latent_dim = kv_lora_rank + qk_rope_head_dim
        self.mla_params = MLAParams(hidden_size=hidden_size, q_lora_rank=q_lora_rank,
                                    kv_lora_rank=kv_lora_rank, qk_rope_head_dim=qk_rope_head_dim,
                                    qk_nope_head_dim=kv_lora_rank, v_head_dim=v_head_dim)
        self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
        self.q_b_proj = nn.Linear(q_lora_rank, num_attention_heads * self.latent_dim, bias=False)
        self.kv_a_proj = nn.Linear(hidden_size, self.latent_dim, bias=False)
        self.o_proj = nn.Linear(num_attention_heads * kv_lora_rank, hidden_size, bias=False)
        backend = get_attention_backend("TRTLLM", model_config.sparse_attention_config)
        self.mqa = backend(layer_idx, num_attention_heads, self.latent_dim, num_kv_heads=1,
                           pos_embd_params=PositionalEmbeddingParams(),
                           mla_params=self.mla_params,
                           sparse_attention_config=model_config.sparse_attention_config,
                           sparse_params=sparse_params, dtype=torch.float32,
                           aux_stream=aux_stream)
        self.last_topk: Optional[torch.Tensor] = None

    @property
    def indexer(self):
        return self.mqa.indexer

    def _append_latent(self, latent: torch.Tensor, metadata) -> None:
        manager = metadata.kv_cache_manager
        pool = manager.get_buffers(self.layer_idx)             # [blocks, 1, tpb, D]
        tpb = manager.tokens_per_block
        cached = metadata.kv_cache_params.num_cached_tokens_per_seq
        offset = 0
        for i in range(metadata.num_seqs):
            n = int(metadata.seq_lens[i])
            pos = int(cached[i]) + torch.arange(n)
            blocks = metadata.kv_cache_block_offsets[i, pos // tpb].long()
            pool[blocks, 0, pos % tpb] = latent[offset:offset + n]
            offset += n

    def forward(self, position_ids, hidden_states, attn_metadata):
        md = attn_metadata
        hidden = hidden_states.float()
        qr = self.q_a_proj(hidden)
        self._append_latent(self.kv_a_proj(hidden), md)
        q = self.q_b_proj(qr).view(-1, self.num_heads, self.latent_dim)
        if getattr(self.mqa, "compressor", None) is not None:
            self.mqa.compressor(hidden, md)                     # V4: main compressed KV
        topk = None
        if self.mqa.indexer is not None:
            topk = self.mqa.indexer(qr, hidden, md, position_ids)
            self.last_topk = topk.clone()
        out = torch.zeros(hidden.shape[0], self.num_heads, self.kv_lora_rank)
        if hasattr(self.mqa, "compress_ratio"):                   # DeepSeek-V4 dual pool
            args = AttentionForwardArgs(AttentionInputType.mixed,
                                        sparse_backend_args=SparseBackendForwardArgs(
                                            topk_indices=topk))
            global_indices, _ = self.mqa.sparse_attn_predict(q, None, md, args)
            out = self.mqa.sparse_mla(q, md, global_indices, args, self.kv_lora_rank)
        else:
            nct = md.num_ctx_tokens
            for kind, rows in ((AttentionInputType.context_only, slice(0, nct)),
                               (AttentionInputType.generation_only, slice(nct, md.num_tokens))):
                if rows.stop <= rows.start:
                    continue
                args = AttentionForwardArgs(kind, sparse_backend_args=SparseBackendForwardArgs(
                    topk_indices=topk[rows]))
                global_indices, _ = self.mqa.sparse_attn_predict(q[rows], None, md, args)
                out[rows] = self.mqa.sparse_mla(q[rows], md, global_indices, self.kv_lora_rank)
        return self.o_proj(out.reshape(out.shape[0], -1))
