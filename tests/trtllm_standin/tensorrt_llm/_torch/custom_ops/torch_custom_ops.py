"""CPU implementations of the `torch.ops.trtllm` ops on the DSA / DeepSeek-V4 decode path.

Upstream these are C++/CUDA ops, one TORCH_LIBRARY_FRAGMENT(trtllm) per file under
cpp/tensorrt_llm/thop/ (IndexerTopKOp.cpp, IndexerKCacheScatterOp.cpp, fusedCatFp8Op.cpp,
fusedCatFp4Op.cpp, convertReqIndexToGlobalOp.cpp) plus the CuTe DSL ops; here each is a plain
torch reference registered under the same namespace and name, with the argument list the
current callers use (dsa/indexer.py @0b228a79, modules/top_k.py).

Simplified / UNVERIFIED:
- indexer_topk_decode: row j of request b scores positions < (seq_len[b] - next_n + j + 1)
  // compress_ratio (the legacy comment "rowEnd = seq_len - next_n + offset + 1"; the
  compress_ratio division is inferred). A row with <= top_k positions gets 0..n-1 then -1;
  a longer one its top_k positions by score (descending). Reading a NaN (a logit the logits
  call left unspecified) raises.
- cute_dsl_gvr_topk_decode is exact (as GVR is); the prior is only checked for shape.
- convert_req_index_to_global: block * stride_factor + layer_offset * tokens_per_block +
  index % tokens_per_block (matching the primary-pool view [blocks * layers * tpb, 1, D]).
- fused_cat_fp8 / fused_cat_fp4 quantize one key per row with power-of-two scales.
"""
import torch

from ...deep_gemm._layout import quantize_fp4, quantize_fp8

_LIB = torch.library.Library("trtllm", "FRAGMENT")


def _register(name: str, schema: str, fn) -> None:
    if hasattr(torch.ops.trtllm, name):     # another stand-in in this process registered it
        return
    _LIB.define(f"{name}{schema}")
    _LIB.impl(name, fn, "CompositeExplicitAutograd")


def _row_topk(values: torch.Tensor, n: int, top_k: int, out: torch.Tensor, what: str) -> None:
    out[:top_k] = -1
    if n <= 0:
        return
    if n <= top_k:
        out[:n] = torch.arange(n, dtype=out.dtype)
        return
    if torch.isnan(values[:n]).any():
        raise RuntimeError(f"trtllm.{what} (stand-in): a scored position holds an unspecified "
                           f"logit (NaN): the logits call did not cover this row's length")
    out[:top_k] = torch.topk(values[:n], top_k).indices.to(out.dtype)


def indexer_topk_decode(logits, seq_lens, indices, next_n, index_topk=2048, pre_idx=None,
                        heuristic_scratch=None, compress_ratio=1, radix_aux_indices=None,
                        radix_aux_logits=None):
    rows, cols = logits.shape
    if seq_lens.dim() != 1 or seq_lens.numel() * next_n != rows:
        raise RuntimeError("trtllm.indexer_topk_decode: seq_lens length * next_n must equal "
                           f"logits.size(0) ({seq_lens.numel()} * {next_n} != {rows})")
    if indices.shape[0] != rows or indices.shape[1] < index_topk:
        raise RuntimeError("trtllm.indexer_topk_decode: indices must be [rows, >= index_topk]")
    lens = seq_lens.tolist()
    for r in range(rows):
        b, j = divmod(r, next_n)
        n = min(max((int(lens[b]) - next_n + j + 1) // compress_ratio, 0), cols)
        _row_topk(logits[r], n, index_topk, indices[r], "indexer_topk_decode")


def indexer_topk_prefill(logits, row_starts, row_ends, indices, index_topk=2048):
    starts, ends = row_starts.tolist(), row_ends.tolist()
    for r in range(logits.shape[0]):
        s, e = int(starts[r]), int(ends[r])
        _row_topk(logits[r, s:], max(e - s, 0), index_topk, indices[r], "indexer_topk_prefill")


def cute_dsl_gvr_topk_decode(scores, prior, seq_lens, out, top_k, next_n=1, compress_ratio=1,
                             max_seq_len=0, order_row=None):
    if prior.dim() != 2 or prior.shape[0] < seq_lens.numel() or prior.shape[1] != top_k:
        raise RuntimeError("trtllm.cute_dsl_gvr_topk_decode: prior must be [>= requests, top_k]")
    indexer_topk_decode(scores, seq_lens, out, next_n, top_k, compress_ratio=compress_ratio)


def indexer_k_cache_scatter_op(k_fp8, k_scale, k_cache, slot_mapping_fp8, slot_mapping_scale,
                               num_tokens):
    flat = k_cache.view(-1)
    data = k_fp8[:num_tokens].contiguous().view(torch.uint8).reshape(num_tokens, -1)
    scale = k_scale[:num_tokens].contiguous().view(torch.uint8).reshape(num_tokens, -1)
    width, sw = data.shape[1], scale.shape[1]
    pos = slot_mapping_fp8[:num_tokens].long()[:, None] + torch.arange(width)
    flat[pos.reshape(-1)] = data.reshape(-1)
    pos = slot_mapping_scale[:num_tokens].long()[:, None] + torch.arange(sw)
    flat[pos.reshape(-1)] = scale.reshape(-1)


def fused_cat_fp8(pe, nope, use_ue8m0=True):
    x = torch.cat([pe, nope], dim=-1)
    fp8, scale = quantize_fp8(x.reshape(-1, x.shape[-1]))
    return fp8, scale.view(-1, 1)


def fused_cat_fp4(pe, nope):
    x = torch.cat([pe, nope], dim=-1)
    packed, sf = quantize_fp4(x.reshape(-1, x.shape[-1]))
    return packed.view(torch.int8), sf.view(packed.shape[0], -1)


def convert_req_index_to_global(req_idx, block_table, topk_indices, tokens_per_block,
                                topk_width, stride_factor, layer_offset):
    idx = topk_indices[:, :topk_width].long()
    req = req_idx.long()[:, None].expand_as(idx)
    col = (idx.clamp(min=0) // tokens_per_block).clamp(max=block_table.shape[1] - 1)
    block = block_table.long()[req, col]
    out = block * stride_factor + layer_offset * tokens_per_block + idx % tokens_per_block
    bad = (idx < 0) | (block < 0) | (idx // tokens_per_block >= block_table.shape[1])
    return torch.where(bad, -1, out).to(torch.int32)


_register("indexer_topk_decode",
          "(Tensor logits, Tensor seq_lens, Tensor(a!) indices, int next_n, "
          "int index_topk=2048, Tensor? pre_idx=None, Tensor? heuristic_scratch=None, "
          "int compress_ratio=1, Tensor? radix_aux_indices=None, "
          "Tensor? radix_aux_logits=None) -> ()", indexer_topk_decode)
_register("indexer_topk_prefill",
          "(Tensor logits, Tensor row_starts, Tensor row_ends, Tensor(a!) indices, "
          "int index_topk=2048) -> ()", indexer_topk_prefill)
_register("cute_dsl_gvr_topk_decode",
          "(Tensor scores, Tensor prior, Tensor seq_lens, Tensor(a!) out, int top_k, "
          "int next_n=1, int compress_ratio=1, int max_seq_len=0, Tensor? order_row=None) -> ()",
          cute_dsl_gvr_topk_decode)
_register("indexer_k_cache_scatter_op",
          "(Tensor k_fp8, Tensor k_scale, Tensor(a!) k_cache, Tensor slot_mapping_fp8, "
          "Tensor slot_mapping_scale, int num_tokens) -> ()", indexer_k_cache_scatter_op)
_register("fused_cat_fp8", "(Tensor pe, Tensor nope, bool use_ue8m0=True) -> (Tensor, Tensor)",
          fused_cat_fp8)
_register("fused_cat_fp4", "(Tensor pe, Tensor nope) -> (Tensor, Tensor)", fused_cat_fp4)
_register("convert_req_index_to_global",
          "(Tensor req_idx, Tensor block_table, Tensor topk_indices, int tokens_per_block, "
          "int topk_width, int stride_factor, int layer_offset) -> Tensor",
          convert_req_index_to_global)
