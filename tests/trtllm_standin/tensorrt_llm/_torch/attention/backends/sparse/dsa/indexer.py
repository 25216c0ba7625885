"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/dsa/indexer.py (version 0b228a79).

Mirrored, in upstream's order and with upstream's names and signatures:
- `_DG_SCHEDULE_BLOCK_KV`, `_compute_slot_mappings`, `_select_indexer_compress_ratio`,
  `_effective_compress_ratio_divisor`, `compute_cu_seqlen_kv_bounds_with_cache`,
  `transform_local_topk_and_prepare_pool_view` (-> torch.ops.trtllm.convert_req_index_to_global),
  `IndexerParams`;
- `Indexer.__init__(quant_config, pos_embd_params, mla_params, skip_create_weights_in_init,
  sparse_params, dtype, compress_ratio=1, layer_idx=0, aux_stream=None)` and its attributes
  (n_heads, head_dim, index_topk, layer_idx, compress_ratio, use_fp4, mtp_index_share,
  weight_scale_factor, top_k = TopK(...));
- static `prepare(metadata)`, `prepare_scheduler_metadata`, `recompute_slot_mappings`;
- `sparse_attn_indexer(metadata, hidden_states, q_fp8, k_fp8, k_scale, weights,
  q_scale=None, is_generation=None)`: topk buffer from metadata.get_empty, prefill, MTP index
  reuse, decode (2D kv_lens_cuda_2d context lens, schedule buffer chosen by next_n,
  get_indexer_k_cache_buffers, fp8_paged_mqa_logits / fp8_fp4_paged_mqa_logits, TopK with
  token-space sequence_lengths and index-space scan_lengths), the skip-indexer copy from
  metadata.topk_indices_buffer, the GVR prior write-back, MTP shared_topk_indices;
- `pre_indexer_proj`, `forward_from_projected`, `forward`, `_update_k_cache`
  (-> torch.ops.trtllm.indexer_k_cache_scatter_op).

Simplified: projections are plain nn.Linear without RoPE, Hadamard rotation, LayerNorm fusion
or streams; prefill runs the single-pass path only (no chunking, no cached context tokens, no
q split); GVR emission is omitted and the CuTe DSL paged-logits branch (SM100 only:
use_cute_dsl_paged_mqa_logits and IS_CUTLASS_DSL_AVAILABLE and is_sm_100f()) raises.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

import torch
import torch.nn as nn

from tensorrt_llm._torch.modules.top_k import TopK, TopKImplementation
from tensorrt_llm._utils import get_sm_version, is_sm_100f
from tensorrt_llm.deep_gemm import (fp8_fp4_mqa_logits, fp8_fp4_paged_mqa_logits,
                                    fp8_mqa_logits, fp8_paged_mqa_logits,
                                    get_paged_mqa_logits_metadata)

from .params import DSAParams, use_self_sampling_gvr

if TYPE_CHECKING:
    from .metadata import DSAtrtllmAttentionMetadata

IS_CUTLASS_DSL_AVAILABLE = False
_DG_SCHEDULE_BLOCK_KV = 64


def _compute_slot_mappings(global_positions, block_offsets, req_indices, head_dim,
                           tokens_per_block, quant_block_size, data_bytes_per_token=None):
    """Flat byte offsets of each key's data and scale in the paged indexer pool."""
    if data_bytes_per_token is None:
        data_bytes_per_token = head_dim
    scale_size = head_dim // quant_block_size * 4
    block_stride = tokens_per_block * (data_bytes_per_token + scale_size)
    block_in_seq = global_positions // tokens_per_block
    pos_in_block = global_positions % tokens_per_block
    if not (block_in_seq.is_cuda and torch.cuda.is_current_stream_capturing()):
        assert bool((block_in_seq < block_offsets.shape[1]).all()), "block index out of bounds"
    block_ids = block_offsets[req_indices, block_in_seq].to(torch.int64)
    fp8_indices = block_ids * block_stride + pos_in_block * data_bytes_per_token
    scale_indices = (block_ids * block_stride + tokens_per_block * data_bytes_per_token
                     + pos_in_block * scale_size)
    return fp8_indices, scale_indices


def _select_indexer_compress_ratio(compress_ratios: List[int]) -> int:
    if 4 in compress_ratios:
        return 4
    if 1 in compress_ratios:
        return 1
    return 0


def _effective_compress_ratio_divisor(compress_ratio: int) -> int:
    return compress_ratio if compress_ratio > 1 else 1


def compute_cu_seqlen_kv_bounds_with_cache(seq_lens, num_contexts, num_ctx_tokens,
                                           cached_token_lens=None, kv_lens=None,
                                           compress_ratio=1):
    """Per context token: [start, end) of the keys it may see in the batch's ragged keys."""
    if kv_lens is None:
        kv_lens = seq_lens if cached_token_lens is None else cached_token_lens + seq_lens
        kv_lens = kv_lens // compress_ratio
    cu_kv = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(kv_lens, 0).int()])
    batch_ids = torch.repeat_interleave(torch.arange(num_contexts), seq_lens.long())
    ks = cu_kv[batch_ids]
    cu_q = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(seq_lens, 0).int()])
    local = torch.arange(num_ctx_tokens, dtype=torch.int32) - torch.repeat_interleave(
        cu_q[:-1], seq_lens.long())
    cached = 0 if cached_token_lens is None else torch.repeat_interleave(cached_token_lens,
                                                                         seq_lens.long())
    ke = ks + (cached + local + 1) // compress_ratio
    return ks.int(), ke.int()


def transform_local_topk_and_prepare_pool_view(topk_indices, attn_metadata, layer_idx: int,
                                               is_generation: bool = False):
    """Local top-K (token positions of each request) -> rows of the primary-pool view."""
    assert topk_indices.dtype == torch.int32
    attn_metadata._ensure_pool_view_cached()
    page_index_scale, layer_offset = \
        attn_metadata.kv_cache_manager.get_primary_pool_page_index_params(layer_idx)
    if is_generation:
        block_table = attn_metadata._cached_block_table_gen
        req_idx = attn_metadata._cached_req_idx_gen
    else:
        block_table = attn_metadata._cached_block_table_ctx
        req_idx = attn_metadata._cached_req_idx_ctx
    tpb = attn_metadata._cached_tokens_per_block
    global_indices = torch.ops.trtllm.convert_req_index_to_global(
        req_idx, block_table, topk_indices, tpb, topk_indices.shape[1],
        page_index_scale * tpb, layer_offset)
    return global_indices, attn_metadata._cached_pool_view


@dataclass
class IndexerParams:
    num_contexts: int
    num_generations: int
    num_ctx_tokens: int
    head_dim: int
    quant_block_size: int
    tokens_per_block: int
    compress_ratio: int
    request_ids: List[int]
    num_past_tokens: List[int]
    seq_lens: torch.Tensor
    data_bytes_per_token: Optional[int] = None

    def __post_init__(self):
        past = torch.tensor(self.num_past_tokens, dtype=torch.int32)
        self._num_past_tokens_tensor = past
        self.cached_kv_tokens = past // self.compress_ratio
        self.all_kv_tokens = (self.seq_lens + past) // self.compress_ratio
        self.new_kv_tokens = self.all_kv_tokens - self.cached_kv_tokens
        self.kv_lens = self.all_kv_tokens
        if self.data_bytes_per_token is None:
            self.data_bytes_per_token = self.head_dim


@dataclass
class IndexerPrefillChunkMetadata:
    cu_seqlen_ks: torch.Tensor
    cu_seqlen_ke: torch.Tensor
    token_start: int
    token_end: int
    k_token_start: int
    k_token_end: int


class Indexer(nn.Module):
    """DSA sparse-attention indexer: selects the top-K KV positions per query token."""

    def __init__(self, quant_config, pos_embd_params, mla_params, skip_create_weights_in_init,
                 sparse_params: DSAParams, dtype: Optional[torch.dtype], compress_ratio: int = 1,
                 layer_idx: int = 0, aux_stream=None):
        super().__init__()
        self.hidden_size = mla_params.hidden_size
        self.q_lora_rank = mla_params.q_lora_rank
        self.rope_dim = mla_params.qk_rope_head_dim
        self.n_heads = sparse_params.index_n_heads
        self.head_dim = sparse_params.index_head_dim
        self.index_topk = sparse_params.index_topk
        self.layer_idx = layer_idx
        self.compress_ratio = compress_ratio
        self.wq_b = nn.Linear(self.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(self.hidden_size, self.head_dim, bias=False)
        self.weights_proj = nn.Linear(self.hidden_size, self.n_heads, bias=False)
        self.softmax_scale = self.head_dim ** -0.5
        self.scale_fmt = "ue8m0"
        self.use_fp4 = sparse_params.indexer_k_dtype == "fp4"
        self.aux_stream = aux_stream
        self.use_cute_dsl_topk = sparse_params.use_cute_dsl_topk and IS_CUTLASS_DSL_AVAILABLE
        self.use_cute_dsl_paged_mqa_logits = (sparse_params.use_cute_dsl_paged_mqa_logits
                                              and IS_CUTLASS_DSL_AVAILABLE and is_sm_100f())
        self.weight_scale_factor = self.softmax_scale * self.n_heads ** -0.5
        self._enable_heuristic_topk = sparse_params.enable_heuristic_topk and \
            get_sm_version() >= 100
        self._use_self_sampling_topk = use_self_sampling_gvr(
            enable_heuristic_topk=self._enable_heuristic_topk,
            use_self_sampling_topk=sparse_params.use_self_sampling_topk,
            index_topk=sparse_params.index_topk, compress_ratio=compress_ratio,
            is_cute_dsl_available=IS_CUTLASS_DSL_AVAILABLE, sm_version=get_sm_version())
        self.mtp_index_share = sparse_params.mtp_index_share
        if self._enable_heuristic_topk and IS_CUTLASS_DSL_AVAILABLE \
                and get_sm_version() in (100, 103):
            decode_impl = TopKImplementation.CUTE_DSL_GVR
        else:
            decode_impl = (TopKImplementation.CUTE_DSL_RADIX if self.use_cute_dsl_topk
                           else TopKImplementation.CUDA_RADIX)
        # the self-sampling engine keeps no prior: model it as the (exact) radix path
        if decode_impl == TopKImplementation.CUTE_DSL_GVR and self._use_self_sampling_topk:
            decode_impl = TopKImplementation.CUTE_DSL_GVR_V2
        self.top_k = TopK(self.index_topk, prefill_implementation=TopKImplementation.CUDA_RADIX,
                          decode_implementation=decode_impl, compress_ratio=self.compress_ratio,
                          gvr_self_sampling=self._use_self_sampling_topk)
        self.use_gvr_emission = False

    # ---- metadata preparation (called from the attention metadata's prepare) ----------------
    @staticmethod
    def build_indexer_params(metadata: DSAtrtllmAttentionMetadata) -> Optional[IndexerParams]:
        manager = metadata.kv_cache_manager
        if manager is None or not hasattr(manager, "index_head_dim"):
            return None
        head_dim = metadata.indexer_head_dim
        data_bytes = head_dim // 2 if getattr(manager, "use_fp4", False) else head_dim
        ratio = _effective_compress_ratio_divisor(
            _select_indexer_compress_ratio(metadata.compress_ratios))
        return IndexerParams(
            num_contexts=metadata.num_contexts, num_generations=metadata.num_generations,
            num_ctx_tokens=metadata.num_ctx_tokens, head_dim=head_dim,
            quant_block_size=metadata.indexer_quant_block_size,
            tokens_per_block=metadata._tokens_per_block, compress_ratio=ratio,
            request_ids=metadata.request_ids,
            num_past_tokens=metadata.kv_cache_params.num_cached_tokens_per_seq[
                :metadata.num_seqs],
            seq_lens=metadata.seq_lens, data_bytes_per_token=data_bytes)

    @staticmethod
    def recompute_slot_mappings(metadata, indexer_params: Optional[IndexerParams] = None):
        if indexer_params is None:
            indexer_params = Indexer.build_indexer_params(metadata)
            if indexer_params is None:
                return
        new = indexer_params.new_kv_tokens
        total = int(new.sum())
        batch = indexer_params.num_contexts + indexer_params.num_generations
        req_indices = torch.repeat_interleave(torch.arange(batch), new.long())
        cu = torch.zeros(batch + 1, dtype=torch.int64)
        cu[1:] = new.long().cumsum(0)
        offsets = torch.arange(total) - cu[:-1].repeat_interleave(new.long())
        positions = indexer_params.cached_kv_tokens.long()[req_indices] + offsets
        fp8_idx, scale_idx = _compute_slot_mappings(
            positions, metadata.host_indexer_k_cache_block_offsets, req_indices,
            indexer_params.head_dim, indexer_params.tokens_per_block,
            indexer_params.quant_block_size, indexer_params.data_bytes_per_token)
        metadata.host_slot_mapping_fp8[:total] = fp8_idx
        metadata.host_slot_mapping_scale[:total] = scale_idx
        metadata.slot_mapping_fp8[:total].copy_(metadata.host_slot_mapping_fp8[:total])
        metadata.slot_mapping_scale[:total].copy_(metadata.host_slot_mapping_scale[:total])

    @staticmethod
    def prepare_scheduler_metadata(metadata: DSAtrtllmAttentionMetadata):
        nc, ng = metadata.num_contexts, metadata.num_generations
        gen_seq_lens = metadata.get_indexer_kv_lens(metadata.kv_lens_cuda_runtime[nc:nc + ng])
        metadata.gen_indexer_kv_lens_cuda_runtime = gen_seq_lens
        if metadata.use_expanded_buffers_for_mtp:
            metadata.refresh_expanded_buffers(gen_seq_lens)
        else:
            cap = metadata.kv_lens_cuda_2d.shape[1]
            metadata.kv_lens_cuda_2d[:ng, :cap].copy_(gen_seq_lens.unsqueeze(-1).expand(-1, cap))
            metadata.scheduler_metadata_buffer.copy_(get_paged_mqa_logits_metadata(
                gen_seq_lens.view(-1, 1).int().contiguous(), _DG_SCHEDULE_BLOCK_KV,
                metadata.num_sms))
            if metadata.max_draft_tokens > 0:
                metadata.scheduler_metadata_buffer_full_next_n.copy_(
                    get_paged_mqa_logits_metadata(metadata.kv_lens_cuda_2d[:ng, :cap].contiguous(),
                                                  _DG_SCHEDULE_BLOCK_KV, metadata.num_sms))

    @staticmethod
    def prepare(metadata: DSAtrtllmAttentionMetadata) -> None:
        params = Indexer.build_indexer_params(metadata)
        if params is None:
            return
        nc, ng = metadata.num_contexts, metadata.num_generations
        ratio = _effective_compress_ratio_divisor(
            _select_indexer_compress_ratio(metadata.compress_ratios))
        metadata.num_ctx_kv_tokens = int(params.new_kv_tokens[:nc].sum())
        Indexer.recompute_slot_mappings(metadata, params)          # prepare_for_update_k_cache
        if nc > 0:
            cached = params._num_past_tokens_tensor[:nc]
            if int(cached.sum()) != 0:
                raise NotImplementedError("stand-in: context requests with cached tokens "
                                          "(chunked prefill / KV reuse) are not mirrored")
            ks, ke = compute_cu_seqlen_kv_bounds_with_cache(
                metadata.seq_lens[:nc], nc, metadata.num_ctx_tokens, cached,
                params.kv_lens[:nc], ratio)
            metadata.cu_seqlen_ks[:metadata.num_ctx_tokens].copy_(ks)
            metadata.cu_seqlen_ke[:metadata.num_ctx_tokens].copy_(ke)
            metadata.indexer_prefill_chunks = None            # single-pass prefill
        if ng > 0:
            Indexer.prepare_scheduler_metadata(metadata)

    # ---- forward --------------------------------------------------------------------------
    def _update_k_cache(self, k_fp8, k_scale, metadata) -> None:
        if metadata.kv_cache_manager is None or metadata.slot_mapping_fp8 is None:
            return
        k_cache = metadata.kv_cache_manager.get_indexer_k_cache_buffers(self.layer_idx)
        if k_scale.element_size() == 1:
            k_scale = k_scale.view(torch.int32)
        torch.ops.trtllm.indexer_k_cache_scatter_op(k_fp8, k_scale, k_cache,
                                                    metadata.slot_mapping_fp8,
                                                    metadata.slot_mapping_scale, k_fp8.shape[0])

    def _call_mqa_logits(self, q_fp8, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke,
                         q_scale, clean_logits=True):
        if self.use_fp4:
            kv = (k_fp8.view(torch.int8), k_scale.view(torch.int32).reshape(-1))
            return fp8_fp4_mqa_logits((q_fp8, q_scale.reshape(-1, self.n_heads)), kv, weights,
                                      cu_seqlen_ks, cu_seqlen_ke, clean_logits=clean_logits)
        return fp8_mqa_logits(q_fp8, (k_fp8, k_scale.reshape(-1)), weights, cu_seqlen_ks,
                              cu_seqlen_ke, clean_logits=clean_logits)

    def _call_paged_mqa_logits(self, q_decode, k_cache, weights_decode, context_lens,
                               block_table, scheduler_metadata_buffer, max_seq_len, q_scale):
        if self.use_fp4:
            return fp8_fp4_paged_mqa_logits((q_decode, q_scale), k_cache, weights_decode,
                                            context_lens, block_table, scheduler_metadata_buffer,
                                            max_seq_len)
        return fp8_paged_mqa_logits(q_decode, k_cache, weights_decode, context_lens, block_table,
                                    scheduler_metadata_buffer, max_seq_len)

    def sparse_attn_indexer(self, metadata: DSAtrtllmAttentionMetadata,
                            hidden_states: torch.Tensor, q_fp8: torch.Tensor,
                            k_fp8: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
                            q_scale: Optional[torch.Tensor] = None,
                            is_generation: Optional[bool] = None) -> torch.Tensor:
        assert metadata.kv_cache_manager is None or \
            metadata.kv_cache_manager.quant_block_size in (32, 128)
        nc, ng = metadata.num_contexts, metadata.num_generations
        num_ctx_tokens, num_tokens = metadata.num_ctx_tokens, metadata.num_tokens
        num_gen_tokens = num_tokens - num_ctx_tokens
        gvr_prior_indices = None
        if self.top_k.needs_gvr_prior:
            assert metadata.gvr_prior_indices is not None
            local_layer = metadata.kv_cache_manager.layer_offsets[self.layer_idx]
            gvr_prior_indices = metadata.gvr_prior_indices[local_layer]
        if is_generation is None:
            has_prefill, has_decode = nc > 0, ng > 0
            token_offset = num_ctx_tokens
            cache_name = "indexer_topk_out_buffer"
        else:
            has_prefill = not is_generation and nc > 0
            has_decode = is_generation and ng > 0
            token_offset = 0
            expected = num_gen_tokens if is_generation else num_ctx_tokens
            assert hidden_states.shape[0] == expected, (
                f"Phase-specific DSA prediction received {hidden_states.shape[0]} tokens, "
                f"expected {expected}.")
            cache_name = ("indexer_topk_out_buffer_gen" if is_generation
                          else "indexer_topk_out_buffer_ctx")
        topk_indices_buffer = metadata.get_empty(
            metadata.cuda_graph_buffers, (hidden_states.shape[0], self.index_topk),
            cache_name=cache_name, dtype=torch.int32, capture_graph=metadata.is_cuda_graph)

        if has_prefill and not metadata.skip_indexer_for_ctx_reqs:
            if metadata.indexer_prefill_chunks is not None:
                raise NotImplementedError("stand-in: chunked indexer prefill")
            if metadata.num_ctx_kv_tokens == 0:
                topk_indices_buffer[:num_ctx_tokens, :].fill_(-1)
            else:
                n_kv = metadata.num_ctx_kv_tokens
                ks = metadata.cu_seqlen_ks[:num_ctx_tokens]
                ke = metadata.cu_seqlen_ke[:num_ctx_tokens]
                logits = self._call_mqa_logits(
                    q_fp8[:num_ctx_tokens], k_fp8[:n_kv], k_scale[:n_kv],
                    weights[:num_ctx_tokens], ks, ke,
                    q_scale[:num_ctx_tokens] if self.use_fp4 else None, clean_logits=False)
                self.top_k(logits, topk_indices_buffer[:num_ctx_tokens, :], is_prefill=True,
                           row_starts=ks, row_ends=ke)
        elif has_prefill and metadata.skip_indexer_for_ctx_reqs:
            topk_indices_buffer[:num_ctx_tokens, :] = \
                metadata.topk_indices_buffer[:num_ctx_tokens, :]
        if has_prefill:
            self.top_k.update_gvr_prior_from_prefill(
                topk_indices_buffer[:num_ctx_tokens], metadata.seq_lens_cuda[:nc],
                gvr_prior_indices, request_offset=ng)

        reuse_topk = (self.mtp_index_share and metadata.in_mtp_draft_loop
                      and metadata.indexer_skip_topk and metadata.shared_topk_indices is not None)
        gen = slice(token_offset, token_offset + num_gen_tokens)
        if has_decode and not metadata.skip_indexer_for_gen_reqs and reuse_topk:
            topk_indices_buffer[gen, :] = metadata.shared_topk_indices[:ng, :]
        elif has_decode and not metadata.skip_indexer_for_gen_reqs:
            gen_seq_lens = metadata.seq_lens[nc:nc + ng]
            assert int(gen_seq_lens.max()) == int(gen_seq_lens.min()), \
                "max_decode_len != min_decode_len, we need padding"
            q_decode = q_fp8[gen]
            next_n = num_gen_tokens // ng
            if self.use_cute_dsl_paged_mqa_logits:
                raise NotImplementedError("stand-in: the CuTe DSL paged logits "
                                          "(torch.ops.trtllm.cute_dsl_fp8_paged_mqa_logits)")
            if not metadata.use_expanded_buffers_for_mtp or next_n == 1:
                q_decode = q_decode.view(ng, -1, *q_fp8.shape[1:])
                context_lens = metadata.kv_lens_cuda_2d[:ng, :next_n].contiguous()
                block_table = metadata.indexer_k_cache_block_offsets[nc:nc + ng]
                scheduler_metadata_buffer = (metadata.scheduler_metadata_buffer if next_n == 1
                                             else metadata.scheduler_metadata_buffer_full_next_n)
            else:
                rows = ng * next_n                      # every MTP row its own request
                q_decode = q_decode.view(rows, 1, *q_fp8.shape[1:])
                context_lens = metadata.kv_lens_expanded_cuda[:rows].view(-1, 1)
                block_table = metadata.block_table_expanded[:rows]
                scheduler_metadata_buffer = metadata.scheduler_metadata_buffer_expanded
            assert num_gen_tokens == ng * next_n
            weights_decode = weights[gen]
            k_cache = metadata.kv_cache_manager.get_indexer_k_cache_buffers(self.layer_idx)
            indexer_max_seq_len = metadata.get_indexer_max_seq_len()
            decode_q_scale = q_scale[gen] if self.use_fp4 else None
            if self.use_fp4:
                decode_q_scale = decode_q_scale.reshape(q_decode.shape[0], q_decode.shape[1],
                                                        self.n_heads)
            logits_decode = self._call_paged_mqa_logits(
                q_decode, k_cache, weights_decode, context_lens, block_table,
                scheduler_metadata_buffer, indexer_max_seq_len, decode_q_scale)
            gen_kv_lens_cuda = metadata.kv_lens_cuda_runtime[nc:nc + ng]
            scan_lengths = metadata.gen_indexer_kv_lens_cuda_runtime
            assert scan_lengths is not None
            gvr_ext_kwargs = ({"gvr_prior_indices": gvr_prior_indices[:ng],
                               "gvr_row_order": metadata.kv_lens_row_reorder}
                              if gvr_prior_indices is not None else None)
            assert metadata.radix_aux_indices is not None
            assert metadata.radix_aux_logits is not None
            self.top_k(logits_decode, topk_indices_buffer[gen, :], is_prefill=False,
                       sequence_lengths=gen_kv_lens_cuda, scan_lengths=scan_lengths,
                       next_n=next_n, max_seq_len=indexer_max_seq_len,
                       gvr_ext_kwargs=gvr_ext_kwargs,
                       radix_aux_indices=metadata.radix_aux_indices,
                       radix_aux_logits=metadata.radix_aux_logits)
        elif has_decode and metadata.skip_indexer_for_gen_reqs:
            topk_indices_buffer[gen, :] = metadata.topk_indices_buffer[num_ctx_tokens:num_tokens, :]

        if gvr_prior_indices is not None and has_decode:
            next_n = num_gen_tokens // ng
            decode_topk = topk_indices_buffer[gen]
            gvr_prior_indices[:ng].copy_(decode_topk[next_n - 1::next_n])

        if self.mtp_index_share and metadata.in_mtp_draft_loop and not reuse_topk:
            rows = None
            if has_decode:
                next_n = num_gen_tokens // ng
                rows = self._mtp_last_accepted_rows(topk_indices_buffer[gen], metadata, nc, ng,
                                                    next_n)
            if has_prefill:
                ctx_last = torch.cumsum(metadata.seq_lens_cuda[:nc].long(), 0) - 1
                ctx_rows = topk_indices_buffer[ctx_last]
                rows = ctx_rows if rows is None else torch.cat([ctx_rows, rows])
            if rows is not None:
                if metadata.shared_topk_indices is None:
                    metadata.shared_topk_indices = rows.contiguous()
                else:
                    start = nc if is_generation else 0
                    metadata.shared_topk_indices[start:start + rows.shape[0],
                                                 :rows.shape[1]].copy_(rows)
        return topk_indices_buffer

    def _mtp_last_accepted_rows(self, gen_topk, metadata, num_contexts, num_generations, next_n):
        num_accepted = metadata.mtp_num_accepted
        if num_accepted is None:
            return gen_topk[next_n - 1::next_n]
        accepted = num_accepted[num_contexts:num_contexts + num_generations]
        base = torch.arange(num_generations, dtype=torch.long) * next_n
        return gen_topk[base + (accepted.long() - 1).clamp(0, next_n - 1)]

    def _weight_scale(self, weights, q_scale):
        return weights * q_scale.squeeze(-1) * self.weight_scale_factor

    def _prep_q_or_k(self, qk_pe, qk_nope):
        if self.use_fp4:
            return torch.ops.trtllm.fused_cat_fp4(qk_pe, qk_nope)
        return torch.ops.trtllm.fused_cat_fp8(qk_pe, qk_nope, self.scale_fmt == "ue8m0")

    def pre_indexer_proj(self, qr, hidden_states, position_ids):
        """(q_fp8, k_fp8, k_scale, weights, q_scale); FP4 packs q/k to head_dim // 2 bytes."""
        hidden = hidden_states.float()
        q = self.wq_b(qr.float()).view(-1, self.n_heads, self.head_dim)
        k = self.wk(hidden)
        weights = self.weights_proj(hidden)
        q_fp8, q_scale = self._prep_q_or_k(q[..., :self.rope_dim], q[..., self.rope_dim:])
        k_fp8, k_scale = self._prep_q_or_k(k[..., :self.rope_dim], k[..., self.rope_dim:])
        if self.use_fp4:
            q_fp8 = q_fp8.view(-1, self.n_heads, self.head_dim // 2)
            q_scale = q_scale.view(-1, self.n_heads, 1)
            weights = weights.float() * self.weight_scale_factor
        else:
            q_fp8 = q_fp8.view(-1, self.n_heads, self.head_dim)
            q_scale = q_scale.view(-1, self.n_heads, 1)
            weights = self._weight_scale(weights, q_scale)
        return q_fp8, k_fp8, k_scale, weights, q_scale

    def forward_from_projected(self, metadata, hidden_states, indexer_intermediates,
                               is_generation: Optional[bool] = None):
        if is_generation is None:
            start, end = 0, metadata.num_tokens
        elif is_generation:
            start, end = metadata.num_ctx_tokens, metadata.num_tokens
        else:
            start, end = 0, metadata.num_ctx_tokens
        q_fp8, k_fp8, k_scale, weights, q_scale = indexer_intermediates
        return self.sparse_attn_indexer(
            metadata, hidden_states, q_fp8[start:end], k_fp8, k_scale, weights[start:end],
            q_scale=q_scale[start:end] if q_scale is not None else None,
            is_generation=is_generation)

    @torch.inference_mode()
    def forward(self, qr, hidden_states, metadata, position_ids):
        q_fp8, k_fp8, k_scale, weights, q_scale = self.pre_indexer_proj(qr, hidden_states,
                                                                        position_ids)
        intermediates = [q_fp8, k_fp8, k_scale, weights, q_scale]
        self._update_k_cache(k_fp8, k_scale, metadata)
        return self.forward_from_projected(metadata, hidden_states, intermediates)
