"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/deepseek_v4/metadata.py (0b03b6af).

Mirrored: DeepseekV4TrtllmAttentionMetadata(DSAtrtllmAttentionMetadata): __post_init__
(window_size == 128, compress ratios in {1, 4, 128}, empty_topk_indices_buffer filled with
-1, swa_local_indices_cuda, max_compressed_indices {1: 0, 4: sparse_mla_topk, 128: pow2},
compressed_local_indices_cuda, sliding_block_tables, compress_block_tables,
sparse_mla_topk_lens per ratio); prepare() in upstream's order - note it does NOT run
DSAtrtllmAttentionMetadata.prepare (no skip-indexer step): compute_sliding_block_tables,
TrtllmAttentionMetadata.prepare, cached lens, cu_seq_lens, prepare_for_indices_conversion,
prepare_for_block_tables, prepare_for_indexer_k_cache (the shared compressed page table
through copy_batch_indexer_compress_block_tables, clamped to >= 0), prepare_for_spec_decode,
prepare_for_deepseek_v4_indices (sparse_mla_topk_lens: ratio 4 -> 128 + min(kv // 4, K)),
DeepseekV4Indexer.prepare(metadata=self).

Also mirrored: on_update_kv_lens() overridden (the DSA one through super(), then the V4
index tables from the device kv lens), so an MTP rewind refreshes sparse_mla_topk_lens.

Simplified: no offload, draft KV caches, pool pointers or per-ratio compressor metadata; the
override's per-ratio compressed lengths and masks are not mirrored.
"""
from __future__ import annotations

import math

import torch

from ...trtllm import TrtllmAttentionMetadata
from ..dsa.metadata import DSAtrtllmAttentionMetadata
from .indexer import DeepseekV4Indexer
from .params import (DEEPSEEK_V4_SLIDING_ATTENTION, DEEPSEEK_V4_SPARSE_RATIO,
                     DeepSeekV4MetadataParams, is_compress_layer)


class DeepseekV4TrtllmAttentionMetadata(DSAtrtllmAttentionMetadata):
    def __post_init__(self):
        super().__post_init__()
        params = self.sparse_metadata_params
        if not isinstance(params, DeepSeekV4MetadataParams):
            raise ValueError("DeepSeek-V4 sparse attention metadata params are not set")
        self.window_size = params.window_size
        assert self.window_size == 128, "Dual-pool sparse MLA requires window_size == 128"
        self.compress_ratio_set = set(self.compress_ratios)
        self._compress_ratios_sorted = sorted(self.compress_ratio_set)
        unsupported = self.compress_ratio_set - {1, 4, 128}
        assert not unsupported, f"Unsupported compress ratios {unsupported}"
        capture = self.is_cuda_graph
        toks, seqs = self.max_num_tokens, self.max_num_sequences
        self.cu_seq_lens = torch.zeros(seqs + 1, dtype=torch.int32)
        self.empty_topk_indices_buffer = self._empty((toks, self.sparse_mla_topk),
                                                     "empty_topk_indices_buffer", torch.int32,
                                                     capture)
        self.empty_topk_indices_buffer.fill_(-1)
        self.swa_local_indices_cuda = self._empty((toks, self.window_size),
                                                  "swa_local_indices_cuda", torch.int32, capture)
        raw_128 = math.ceil(self.kv_cache_manager.max_seq_len / 128)
        self.max_compressed_indices = {1: 0, 4: self.sparse_mla_topk,
                                       128: 1 << (raw_128 - 1).bit_length() if raw_128 else 1}
        self.compressed_local_indices_cuda = self._empty(
            (toks, self.max_compressed_indices[128]), "compressed_local_indices_cuda",
            torch.int32, capture)
        blocks = self.kv_cache_manager.max_blocks_per_seq
        self.sliding_block_tables = self._empty(
            (self.kv_cache_manager.num_local_layers, len(DEEPSEEK_V4_SLIDING_ATTENTION), seqs,
             blocks), "sliding_block_tables", torch.int32, capture)
        self.compress_block_tables = {
            r: self._empty((seqs, blocks), f"compress_block_tables_{r}", torch.int32, capture)
            for r in self._compress_ratios_sorted if is_compress_layer(r)}
        self.sparse_mla_topk_lens = {
            r: self._empty((toks,), f"sparse_mla_topk_lens_{r}", torch.int32, capture)
            for r in self.compress_ratio_set}
        self.cached_token_lens_cuda = self._empty((seqs,), "cached_token_lens_cuda", torch.int32,
                                                  capture)

    def prepare_for_indexer_k_cache(self):
        self.kv_cache_manager.copy_batch_indexer_compress_block_tables(
            self.host_indexer_k_cache_block_offsets, self.request_ids,
            beam_width=self.beam_width, num_contexts=self.num_contexts, num_seqs=self.num_seqs)
        self.indexer_k_cache_block_offsets[:self.num_seqs].copy_(
            self.host_indexer_k_cache_block_offsets[:self.num_seqs])
        self.indexer_k_cache_block_offsets.clamp_(min=0)

    def prepare_for_block_tables(self):
        self.kv_cache_manager.copy_batch_sliding_block_tables(
            self.sliding_block_tables, self.request_ids, self.num_contexts, self.num_seqs)
        for ratio, table in self.compress_block_tables.items():
            self.kv_cache_manager.copy_batch_compress_block_tables(
                table, self.request_ids, compress_ratio=ratio, beam_width=self.beam_width,
                num_contexts=self.num_contexts, num_seqs=self.num_seqs)

    def prepare_for_deepseek_v4_indices(self, token_positions=None):
        if token_positions is None:
            nt, nr = self.num_tokens, self.num_seqs
            cu = self.cu_seq_lens[:nr + 1]
            token_idx = torch.arange(nt, dtype=torch.int32)
            req = torch.searchsorted(cu[1:], token_idx, right=True)
            token_positions = (self.cached_token_lens_cuda[:nr].cpu()[req] + token_idx
                               - cu[req]).to(self.cached_token_lens_cuda.device)
        n = token_positions.shape[0]
        dev = token_positions.device
        pos = token_positions.long()[:, None]
        swa = (pos - self.window_size + 1).clamp(min=0) + torch.arange(self.window_size,
                                                                       device=dev)
        self.swa_local_indices_cuda[:n] = torch.where(swa > pos, -1, swa).int()
        cols = torch.arange(self.max_compressed_indices[128], device=dev)
        valid = cols[None, :] < (token_positions.long() + 1)[:, None] // 128
        self.compressed_local_indices_cuda[:n] = torch.where(valid, cols, -1).int()
        kv = token_positions.long() + 1
        for ratio in self._compress_ratios_sorted:
            if ratio == 1:
                total = kv.clamp(max=self.window_size)
            elif ratio == 4:
                total = self.window_size + (kv // 4).clamp(max=self.sparse_mla_topk)
            else:
                total = self.window_size + kv // ratio
            self.sparse_mla_topk_lens[ratio][:n] = total.int()

    def on_update_kv_lens(self) -> None:
        """Upstream overrides it: the DSA refresh (super()), then the per-token positions and
        the V4 index tables (sparse_mla_topk_lens among them) from the device kv lens. Device
        work only, as it runs inside capture."""
        super().on_update_kv_lens()
        nt, ns = self.num_tokens, self.num_seqs
        if nt == 0:
            return
        seq_lens = self.seq_lens_cuda[:ns].long()
        ends = torch.cumsum(seq_lens, 0)
        token = torch.arange(nt, device=ends.device)
        req = torch.searchsorted(ends, token, right=True)
        start = self.kv_lens_cuda[:ns].long() - seq_lens
        self.prepare_for_deepseek_v4_indices(start[req] + token - (ends - seq_lens)[req])

    def prepare(self):
        assert self.kv_cache_manager is not None and self.request_ids is not None
        self.kv_cache_manager.compute_sliding_block_tables(self.request_ids, self.num_contexts)
        TrtllmAttentionMetadata.prepare(self)
        self._invalidate_pool_view_cache()
        nr = self.num_seqs
        cached = torch.tensor(self.kv_cache_params.num_cached_tokens_per_seq[:nr],
                              dtype=torch.int32)
        kv_lens = cached + torch.as_tensor(self.seq_lens_kv, dtype=torch.int32)
        self.cached_token_lens_cuda[:nr].copy_(cached)
        self.cu_seq_lens[1:nr + 1] = torch.cumsum(self.seq_lens, 0)
        self.prepare_for_indices_conversion()
        has_sparse = DEEPSEEK_V4_SPARSE_RATIO in self.compress_ratio_set
        self.prepare_for_block_tables()
        if has_sparse:
            self.prepare_for_indexer_k_cache()
        self.prepare_for_spec_decode(kv_lens)
        self.prepare_for_deepseek_v4_indices()
        if has_sparse:
            DeepseekV4Indexer.prepare(metadata=self)
