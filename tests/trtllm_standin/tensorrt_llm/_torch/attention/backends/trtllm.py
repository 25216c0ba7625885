"""Upstream: tensorrt_llm/_torch/attention/backends/trtllm.py (not read; names from
dsa/metadata.py @186080bb and deepseek_v4/metadata.py @0b03b6af).
Stand-in for tensorrt_llm/_torch/attention/backends/trtllm.py.

Mirrored names: TrtllmAttentionMetadata (prepare() derives kv_lens, kv_lens_cuda,
kv_lens_cuda_runtime, block offsets; update_spec_dec_param()), TrtllmAttention (the backend
base the sparse backends derive from).

Simplified: no attention op. prepare() copies the request's block ids from the cache manager
(upstream: copy_batch_block_offsets into kv_cache_block_offsets); TrtllmAttention only stores
its construction arguments.
"""
from dataclasses import dataclass
from typing import Optional

import torch

from .interface import AttentionMetadata


@dataclass(kw_only=True)
class TrtllmAttentionMetadata(AttentionMetadata):
    is_spec_decoding_enabled: bool = False

    def prepare(self) -> None:
        super().prepare()
        assert self.request_ids is not None and len(self.request_ids) == self.num_seqs
        cached = torch.tensor(self.kv_cache_params.num_cached_tokens_per_seq[:self.num_seqs],
                              dtype=torch.int32)
        self.kv_lens = cached + torch.as_tensor(self.seq_lens_kv, dtype=torch.int32)
        # one device buffer for the model's life: CUDA graphs and in-forward updates (the
        # overlap scheduler's corrections, the MTP worker's rewinds) address it
        if getattr(self, "_kv_lens_cuda_buffer", None) is None:
            self._kv_lens_cuda_buffer = self.get_empty(
                self.cuda_graph_buffers, (self.max_num_sequences,), cache_name="kv_lens_cuda",
                dtype=torch.int32, capture_graph=self.is_cuda_graph)
        self.kv_lens_cuda = self._kv_lens_cuda_buffer
        self.kv_lens_cuda[:self.num_seqs].copy_(self.kv_lens)
        self.kv_lens_cuda_runtime = self.kv_lens_cuda[:self.num_seqs]
        self.prompt_lens_cpu = torch.as_tensor(self.prompt_lens or self.kv_lens.tolist())
        if self.kv_cache_manager is not None:
            self.kv_cache_block_offsets = self.kv_cache_manager.copy_batch_block_offsets(
                self.request_ids)

    def update_spec_dec_param(self, batch_size, is_spec_decoding_enabled, is_spec_dec_tree,
                              is_spec_dec_dynamic_tree, max_draft_len, max_total_draft_tokens,
                              spec_metadata=None, spec_tree_manager=None, num_contexts=0):
        self.is_spec_decoding_enabled = is_spec_decoding_enabled

    def update_for_spec_dec(self) -> None:
        pass


class TrtllmAttention:
    Metadata = TrtllmAttentionMetadata

    def __init__(self, layer_idx: int, num_heads: int, head_dim: int,
                 num_kv_heads: Optional[int] = None, quant_config=None, q_scaling=None,
                 pos_embd_params=None, mla_params=None, skip_create_weights_in_init=False,
                 attention_chunk_size=None, sparse_params=None, **kwargs):
        self.layer_idx = layer_idx
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads or num_heads
        self.quant_config = quant_config
        self.pos_embd_params = pos_embd_params
        self.mla_params = mla_params
        self.sparse_params = sparse_params

    def get_local_layer_idx(self, metadata) -> int:
        return metadata.kv_cache_manager.layer_offsets[self.layer_idx]
