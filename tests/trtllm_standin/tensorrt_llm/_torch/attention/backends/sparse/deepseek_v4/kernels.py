"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/deepseek_v4/kernels.py.

Mirrored name: deepseek_v4_local_to_global_indices(req_id, block_table_swa,
swa_local_indices, ..., tokens_per_block, block_table_compressed, compressed_local_indices,
compress_ratio, num_compressed_indices, ...).

Simplified: upstream produces byte-pointer offsets into the SWA and compressed pools (one
table of window_size + num_compressed_indices entries per token). Here the result is the same
[tokens, window + num_compressed] int32 layout of ROW indices: the first `window` columns index
rows of the SWA pool view [blocks * tokens_per_block], the rest rows of the compressed pool
view [blocks * tokens_per_block // ratio]; -1 marks an unused entry.
"""
import torch


def _to_rows(local, req_id, block_table, page_size):
    local = local.long()
    col = (local.clamp(min=0) // page_size).clamp(max=block_table.shape[1] - 1)
    page = block_table.long()[req_id.long()[:, None].expand_as(local), col]
    rows = page * page_size + local % page_size
    return torch.where((local < 0) | (page < 0), -1, rows)


def deepseek_v4_local_to_global_indices(*, req_id, block_table_swa, swa_local_indices,
                                        swa_pool_base_ptr=None, swa_buffer_ptr=None,
                                        tokens_per_block: int, token_stride=None,
                                        compressed_token_stride=None, block_table_compressed=None,
                                        compressed_local_indices=None, compress_pool_base_ptr=None,
                                        compressed_buffer_ptr=None, compress_ratio: int = 1,
                                        num_compressed_indices: int = 0, split_extra=False,
                                        **kwargs):
    swa = _to_rows(swa_local_indices, req_id, block_table_swa, tokens_per_block)
    if compress_ratio <= 1 or compressed_local_indices is None:
        return swa.int()
    comp = _to_rows(compressed_local_indices[:, :num_compressed_indices], req_id,
                    block_table_compressed, tokens_per_block // compress_ratio)
    return torch.cat([swa, comp], dim=1).int()
