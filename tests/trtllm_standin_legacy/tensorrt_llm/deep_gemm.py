"""Stand-in for the release-1.2 `tensorrt_llm.deep_gemm` decode calls (1D context lens).

Legacy contract (as the 1.2 indexer calls it): get_paged_mqa_logits_metadata(context_lens [B],
block_kv=tokens_per_block, num_sms) and fp8_paged_mqa_logits(q [B, next_n, H, D], kv_cache
[blocks, 64, 1, D + 4], weights [B * next_n, H], context_lens [B], block_table,
schedule_meta, max_context_len): row j of request b scores positions < context_len - next_n +
j + 1; the rest of the row is -inf. Schedule contents are a stand-in (shape only).
"""
import torch


def get_num_sms() -> int:
    return 8


def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms):
    assert context_lens.dim() == 1 and block_kv == 64
    return torch.zeros(num_sms + 1, 2, dtype=torch.int32)


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                         max_context_len):
    batch, next_n, heads, dim = q.shape
    blocks, slots = kv_cache.shape[:2]
    assert context_lens.dim() == 1 and slots == 64 and kv_cache.shape[-1] == dim + 4
    raw = kv_cache.reshape(blocks, -1)
    keys = raw[:, :slots * dim].contiguous().view(torch.float8_e4m3fn).float().view(
        blocks, slots, dim) * raw[:, slots * dim:].contiguous().view(torch.float32)[..., None]
    out = torch.full((batch * next_n, max_context_len), float("-inf"))
    for b in range(batch):
        n = int(context_lens[b])
        k = keys[block_table[b, :(n + slots - 1) // slots].long()].reshape(-1, dim)[:n]
        s = (torch.relu(torch.einsum("jhd,nd->jhn", q[b].float(), k))
             * weights[b * next_n:(b + 1) * next_n, :, None]).sum(1)
        for j in range(next_n):
            out[b * next_n + j, :n - next_n + j + 1] = s[j, :n - next_n + j + 1]
    return out
