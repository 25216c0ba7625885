"""Stand-in for tensorrt_llm/_torch/attention_backend/sparse/dsa.py (release-1.2 layout; read
as index excerpt id 3757031829 - one file holding metadata, Indexer, attention and cache).

Mirrored signatures:
- Indexer.__init__(quant_config, pos_embd_params, mla_params, skip_create_weights_in_init,
  sparse_attention_config, dtype, layer_idx=0, aux_stream=None): reads index_n_heads,
  index_head_dim, index_topk from the pydantic config itself; no compress_ratio, no use_fp4;
- Indexer.sparse_attn_indexer(metadata, hidden_states, q_fp8, k_fp8, k_scale, weights,
  use_custom_topk=True): fresh topk buffer (torch.empty) per call; decode with 1D
  context_lens = kv_lens_cuda_runtime, fp8_paged_mqa_logits(..., kv_cache_manager.max_seq_len),
  then torch.ops.trtllm.indexer_topk_decode(logits, kv_lens, rows, next_n) (custom) or a masked
  torch.topk (end position kv - next_n + offset, inclusive). The custom call passes no
  index_topk, so the op's default 2048 applies: an index_topk below 2048 fails the op's
  "indices second dimension must be at least index_topk" check; skip_indexer_for_gen_reqs copies
  from metadata.topk_indices_buffer;
- DSAtrtllmAttentionMetadata.prepare() and DSACacheManager.get_indexer_k_cache_buffers()
  -> uint8 [blocks, tokens_per_block (64), 1, 132].

Simplified: decode only (a context request raises), FP8 keys only, no MTP expansion, no
projections (callers pass q / weights), metadata fields are set directly (no AttentionMetadata
base). `run_selftest()` checks the decode path against a dense torch reference.
"""
import math

import torch

from ....deep_gemm import fp8_paged_mqa_logits, get_paged_mqa_logits_metadata, get_num_sms


class DSACacheManager:
    def __init__(self, *, num_layers: int, tokens_per_block: int, max_seq_len: int,
                 max_batch_size: int, sparse_attention_config):
        self.tokens_per_block, self.max_seq_len = tokens_per_block, max_seq_len
        self.index_head_dim = sparse_attention_config.index_head_dim
        self.quant_block_size = 128
        self.max_blocks_per_seq = math.ceil(max_seq_len / tokens_per_block)
        self.num_blocks = max_batch_size * self.max_blocks_per_seq
        self.layer_offsets = {i: i for i in range(num_layers)}
        width = tokens_per_block * (self.index_head_dim + 4)
        self.indexer_k_cache_pool_per_layer = [torch.zeros(self.num_blocks, width,
                                                           dtype=torch.uint8)
                                               for _ in range(num_layers)]

    def get_indexer_k_cache_buffers(self, layer_idx: int):
        per_token = self.index_head_dim + self.index_head_dim // self.quant_block_size * 4
        return self.indexer_k_cache_pool_per_layer[self.layer_offsets[layer_idx]].view(
            self.num_blocks, self.tokens_per_block, 1, per_token)


class DSAtrtllmAttentionMetadata:
    """Decode fields of the 1.2 metadata; set request_ids, seq_lens, num_contexts,
    num_cached_tokens and block_offsets, then prepare()."""

    def __init__(self, *, kv_cache_manager, max_num_requests: int, sparse_attention_config):
        self.kv_cache_manager = kv_cache_manager
        self.num_sparse_topk = sparse_attention_config.index_topk
        self.enable_indexer_skip = sparse_attention_config.skip_indexer_for_short_seqs
        self.num_sms = get_num_sms()
        self.use_expanded_buffers_for_mtp = False
        self.skip_indexer_for_ctx_reqs = self.skip_indexer_for_gen_reqs = False
        self.indexer_k_cache_block_offsets = torch.zeros(
            max_num_requests, kv_cache_manager.max_blocks_per_seq, dtype=torch.int32)

    def prepare(self):
        self.num_seqs = len(self.request_ids)
        self.num_generations = self.num_seqs - self.num_contexts
        if self.num_contexts:
            raise NotImplementedError("legacy stand-in: decode only")
        self.num_ctx_tokens = 0
        self.num_tokens = int(self.seq_lens.sum())
        kv = torch.tensor(self.num_cached_tokens, dtype=torch.int32) + self.seq_lens
        self.kv_lens_cuda_runtime = kv
        self.indexer_k_cache_block_offsets[:self.num_seqs].copy_(self.block_offsets)
        self.skip_indexer_for_gen_reqs = bool(self.enable_indexer_skip
                                              and int(kv.max()) <= self.num_sparse_topk)
        if self.skip_indexer_for_gen_reqs:
            self.topk_indices_buffer = torch.where(
                torch.arange(self.num_sparse_topk) < kv.repeat_interleave(self.seq_lens)[:, None],
                torch.arange(self.num_sparse_topk), -1).int()
        self.scheduler_metadata_buffer = get_paged_mqa_logits_metadata(
            kv, self.kv_cache_manager.tokens_per_block, self.num_sms)


class Indexer(torch.nn.Module):
    def __init__(self, quant_config, pos_embd_params, mla_params, skip_create_weights_in_init,
                 sparse_attention_config, dtype, layer_idx: int = 0, aux_stream=None):
        super().__init__()
        self.n_heads = sparse_attention_config.index_n_heads
        self.head_dim = sparse_attention_config.index_head_dim
        self.index_topk = sparse_attention_config.index_topk
        self.layer_idx = layer_idx

    def sparse_attn_indexer(self, metadata, hidden_states, q_fp8, k_fp8, k_scale, weights,
                            use_custom_topk: bool = True) -> torch.Tensor:
        nc, ng = metadata.num_contexts, metadata.num_generations
        num_ctx_tokens, num_tokens = metadata.num_ctx_tokens, metadata.num_tokens
        num_gen_tokens = num_tokens - num_ctx_tokens
        topk_indices_buffer = torch.empty((hidden_states.shape[0], self.index_topk),
                                          dtype=torch.int32)
        if not use_custom_topk:
            topk_indices_buffer[:] = -1
        if ng > 0 and not metadata.skip_indexer_for_gen_reqs:
            max_seq_len = metadata.kv_cache_manager.max_seq_len
            next_n = num_gen_tokens // ng
            q_decode = q_fp8[num_ctx_tokens:num_tokens].view(ng, -1, *q_fp8.shape[1:])
            context_lens = metadata.kv_lens_cuda_runtime[nc:nc + ng]
            block_table = metadata.indexer_k_cache_block_offsets[nc:nc + ng]
            k_cache = metadata.kv_cache_manager.get_indexer_k_cache_buffers(self.layer_idx)
            logits = fp8_paged_mqa_logits(q_decode, k_cache, weights[num_ctx_tokens:num_tokens],
                                          context_lens, block_table,
                                          metadata.scheduler_metadata_buffer, max_seq_len)
            rows = topk_indices_buffer[num_ctx_tokens:num_tokens]
            if use_custom_topk:
                torch.ops.trtllm.indexer_topk_decode(logits, context_lens, rows, next_n)
            else:
                end = (context_lens.repeat_interleave(next_n) - next_n
                       + torch.arange(num_gen_tokens) % next_n)[:, None]
                positions = torch.arange(max_seq_len)[None, :]
                masked = logits.masked_fill(positions > end, float("-inf"))
                top = masked.topk(min(self.index_topk, max_seq_len), dim=-1)[1].int()
                rows[:, :top.shape[1]] = top.masked_fill(top > end, -1)
        elif ng > 0 and metadata.skip_indexer_for_gen_reqs:
            topk_indices_buffer[num_ctx_tokens:num_tokens] = \
                metadata.topk_indices_buffer[num_ctx_tokens:num_tokens]
        return topk_indices_buffer


def run_selftest(seed: int = 0) -> None:
    """Decode next_n 2 for two requests; both top-K paths must match a dense reference."""
    from tensorrt_llm.llmapi.llm_args import DeepSeekSparseAttentionConfig
    torch.manual_seed(seed)
    topk, kv_lens, next_n, slots = 2048, [2150, 2100], 2, 64
    cfg = DeepSeekSparseAttentionConfig(index_n_heads=64, index_head_dim=128, index_topk=topk,
                                        skip_indexer_for_short_seqs=False)
    manager = DSACacheManager(num_layers=1, tokens_per_block=slots, max_seq_len=2176,
                              max_batch_size=2, sparse_attention_config=cfg)
    per_seq = manager.max_blocks_per_seq
    keys = torch.randn(2, per_seq * slots, 128)
    pages = manager.get_indexer_k_cache_buffers(0).view(manager.num_blocks, -1)
    scale = keys.abs().amax(-1) / 448.0
    fp8 = (keys / scale[..., None]).to(torch.float8_e4m3fn)
    deq = fp8.float() * scale[..., None]
    table = torch.arange(2 * per_seq, dtype=torch.int32).view(2, per_seq).flip(1).contiguous()
    for b in range(2):
        for p in range(per_seq):
            page, rows = int(table[b, p]), slice(p * slots, (p + 1) * slots)
            pages[page, :slots * 128] = fp8[b, rows].reshape(-1).view(torch.uint8)
            pages[page, slots * 128:] = scale[b, rows].contiguous().view(torch.uint8)
    md = DSAtrtllmAttentionMetadata(kv_cache_manager=manager, max_num_requests=2,
                                    sparse_attention_config=cfg)
    md.request_ids, md.num_contexts = [5, 6], 0
    md.seq_lens = torch.tensor([next_n, next_n], dtype=torch.int32)
    md.num_cached_tokens = [k - next_n for k in kv_lens]
    md.block_offsets = table
    md.prepare()
    q = torch.randn(4, 64, 128).to(torch.float8_e4m3fn)
    w = torch.rand(4, 64)
    ix = Indexer(None, None, None, False, cfg, None, layer_idx=0)
    for custom in (True, False):
        out = ix.sparse_attn_indexer(md, torch.zeros(4, 8), q, None, None, w, custom)
        for r in range(4):
            b, j = divmod(r, next_n)
            n = kv_lens[b] - next_n + j + 1
            ref = (torch.relu(q[r].float() @ deq[b, :n].T) * w[r][:, None]).sum(0)
            chosen = torch.zeros(n, dtype=torch.bool)
            chosen[out[r][out[r] >= 0].long()] = True
            assert int(chosen.sum()) == topk, (custom, r)
            assert float(ref[chosen].min()) >= float(ref[~chosen].max()) - 1e-3, (custom, r)
    small = DeepSeekSparseAttentionConfig(index_n_heads=64, index_head_dim=128, index_topk=16)
    try:
        Indexer(None, None, None, False, small, None).sparse_attn_indexer(
            md, torch.zeros(4, 8), q, None, None, w, True)
    except RuntimeError as err:
        assert "at least index_topk" in str(err)
    else:
        raise AssertionError("index_topk 16 with use_custom_topk must hit the 2048 default")
