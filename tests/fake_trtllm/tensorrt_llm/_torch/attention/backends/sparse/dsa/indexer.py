import torch

from spin_trtllm import reference as ref


class Indexer(torch.nn.Module):
    def __init__(self, quant_config, pos_embd_params, mla_params, skip_create_weights_in_init,
                 sparse_params, dtype, compress_ratio=1, layer_idx=0):
        super().__init__()
        self.index_topk = sparse_params.index_topk
        self.layer_idx = layer_idx
        self.use_fp4 = False

    def sparse_attn_indexer(self, metadata, hidden_states, q_fp8, k_fp8, k_scale, weights,
                            q_scale=None, is_generation=None):
        buf = torch.full((hidden_states.shape[0], self.index_topk), -7, dtype=torch.int32)
        if metadata.num_generations and not metadata.skip_indexer_for_gen_reqs:
            nc, ng = metadata.num_contexts, metadata.num_generations
            gen = slice(metadata.num_ctx_tokens, metadata.num_tokens)
            next_n = (metadata.num_tokens - metadata.num_ctx_tokens) // ng
            kv = metadata.kv_lens[nc:nc + ng]
            lens = (kv.view(-1, 1) - next_n + 1 + torch.arange(next_n)).to(torch.int32)
            table = metadata.indexer_k_cache_block_offsets[nc:nc + ng]
            blocks = table.shape[1]
            ids = torch.arange(blocks, dtype=torch.int32).repeat(ng, 1)
            counts = torch.full((ng,), blocks, dtype=torch.int32)
            cache = metadata.kv_cache_manager.get_indexer_k_cache_buffers(self.layer_idx)
            z = ref.masked_indexer_logits(q_fp8[gen], cache, weights[gen], lens, table, ids,
                                          counts, dtype=torch.float32)
            buf[gen] = ref.topk_slots(z, ids, counts, next_n, self.index_topk)
        return buf
