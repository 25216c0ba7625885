"""Upstream: tensorrt_llm/_torch/pyexecutor/resource_manager.py (not read; names from
dsa/cache_manager.py @12a71fe4).
Stand-in for tensorrt_llm/_torch/pyexecutor/resource_manager.py: KVCacheManager.

Mirrored names: KVCacheManager(kv_cache_config, kv_cache_type, *, num_layers, num_kv_heads,
head_dim, tokens_per_block, max_seq_len, max_batch_size, mapping, dtype, spec_config, ...),
tokens_per_block, max_seq_len, max_blocks_per_seq, num_local_layers, layer_offsets,
blocks_in_primary_pool, get_unique_primary_pool(), get_batch_cache_indices(),
add_dummy_requests(), free_resources().

Simplified: a Python block allocator instead of the C++ manager. The primary pool is one
float32 tensor [blocks, layers, 1, tokens_per_block, head_dim] (the MLA latent cache, no
quantization). Stand-in-only: `add_sequence(request_id, num_tokens)` grows a request's block
list to hold num_tokens (upstream: addSequence / addToken through the scheduler);
`copy_batch_block_offsets(request_ids)` returns [num_seqs, max_blocks_per_seq] int32 block
ids (-1 padded) instead of filling the encoded offset tensor.
"""
import math
from typing import List, Optional

import torch


class KVCacheManager:
    def __init__(self, kv_cache_config, kv_cache_type=None, *, num_layers: int,
                 num_kv_heads: int, head_dim: int, tokens_per_block: int, max_seq_len: int,
                 max_batch_size: int, mapping=None, dtype=None, spec_config=None,
                 layer_mask=None, max_num_tokens: int = 8192, model_config=None,
                 max_beam_width: int = 1, **kwargs):
        self.kv_cache_config = kv_cache_config
        self.tokens_per_block = tokens_per_block
        self.max_seq_len = max_seq_len
        self.max_batch_size = max_batch_size
        self.head_dim = head_dim
        self.dtype = dtype
        num_spec = 0
        if spec_config is not None:
            num_spec = spec_config.num_nextn_predict_layers or 0
        self.num_local_layers = num_layers + num_spec
        self.pp_layers = list(range(self.num_local_layers))
        self.layer_offsets = {layer: i for i, layer in enumerate(self.pp_layers)}
        self.max_blocks_per_seq = math.ceil(max_seq_len / tokens_per_block)
        # one spare sequence's worth for the CUDA-graph padding request
        self.blocks_in_primary_pool = (max_batch_size + 1) * self.max_blocks_per_seq
        self.num_blocks = self.blocks_in_primary_pool
        self._free = list(range(self.blocks_in_primary_pool))
        self._blocks: dict = {}
        self._primary_pool = torch.zeros(self.blocks_in_primary_pool, self.num_local_layers, 1,
                                         tokens_per_block, head_dim)

    # -- allocation ---------------------------------------------------------------------------
    def has_request(self, request_id: int) -> bool:
        return request_id in self._blocks

    def add_sequence(self, request_id: int, num_tokens: int) -> None:
        if num_tokens > self.max_seq_len:
            raise ValueError(f"request {request_id}: {num_tokens} tokens > max_seq_len "
                             f"{self.max_seq_len}")
        blocks = self._blocks.setdefault(request_id, [])
        need = math.ceil(num_tokens / self.tokens_per_block)
        while len(blocks) < need:
            if not self._free:
                raise RuntimeError("KVCacheManager (stand-in): out of blocks")
            blocks.append(self._free.pop(0))

    def add_dummy_requests(self, request_ids: List[int], token_nums: Optional[List[int]] = None,
                           is_gen: bool = False, prepare_resource: bool = True,
                           max_num_draft_tokens: int = 0, **kwargs):
        token_nums = token_nums or [1] * len(request_ids)
        for rid, n in zip(request_ids, token_nums):
            self.add_sequence(rid, n + (max_num_draft_tokens if is_gen else 0))
        return list(request_ids)

    def free_resources(self, request_id: int) -> None:
        self._free.extend(self._blocks.pop(request_id, []))

    # -- views --------------------------------------------------------------------------------
    def get_batch_cache_indices(self, request_ids: List[int], layer_idx: int = 0):
        return [list(self._blocks[r]) for r in request_ids]

    def copy_batch_block_offsets(self, request_ids: List[int]) -> torch.Tensor:
        table = torch.full((len(request_ids), self.max_blocks_per_seq), -1, dtype=torch.int32)
        for i, rid in enumerate(request_ids):
            blocks = self._blocks[rid]
            table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        return table

    def get_unique_primary_pool(self) -> torch.Tensor:
        return self._primary_pool

    def get_buffers(self, layer_idx: int) -> torch.Tensor:
        return self._primary_pool[:, self.layer_offsets[layer_idx]]

    def shutdown(self) -> None:
        self._blocks.clear()
