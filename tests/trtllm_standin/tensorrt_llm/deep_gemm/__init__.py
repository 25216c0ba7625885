"""Stand-in for `tensorrt_llm.deep_gemm`, TensorRT-LLM's vendored DeepGEMM, as the DSA indexer
imports it (_torch/attention/backends/sparse/dsa/indexer.py @0b228a79:
`from tensorrt_llm.deep_gemm import fp8_fp4_mqa_logits, fp8_fp4_paged_mqa_logits,
fp8_mqa_logits, fp8_paged_mqa_logits, get_paged_mqa_logits_metadata`).

Signatures and contracts follow deepseek-ai/DeepGEMM 54e22612 csrc/apis/attention.hpp; CPU
reference bodies written here. UNVERIFIED that TensorRT-LLM's vendored copy is that commit.

Simplified / stand-in behaviour:
- the schedule metadata is a stand-in plan (not DeepGEMM's): shape [num_sms + 1, 2] int32 as
  upstream; its last row records (batch, next_n) so the logits call can notice a schedule
  built for another batch (error) or another next_n (recorded in SCHEDULE_MISMATCHES);
- with 2D context lens, logits outside each row's [0, context_lens[b, j]) are unspecified
  upstream (no clean pass); here they are NaN, so a consumer that reads them is caught;
- host checks follow the SM100 rules (block_kv 32 or 64, heads 8/16/32/64, head_dim 128 for FP4);
- the kernels' arguments are taken as plain tensors (a test's host-read guard on device
  tensors stops at a kernel call, as a real kernel reads them on the device);
- with TRTLLM_STANDIN_DEEPGEMM=real the functions are DeepGEMM's own (`import deep_gemm`):
  the stand-in on a GPU drives the kernels TensorRT-LLM runs.
"""
import functools
import os
from typing import Optional

import torch

from ._layout import dequantize_fp4, dequantize_fp8, dequantize_pages

NUM_SMS = 8                       # stand-in SM count (upstream: the device's)
SPLIT_KV = 256                    # DeepGEMM's split_kv for paged MQA logits
SCHEDULE_MISMATCHES: list = []    # (schedule next_n, call next_n) pairs seen by the logits calls


def get_num_sms() -> int:
    return NUM_SMS


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"deep_gemm (stand-in): {msg}")


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_kv: int, num_sms: int,
                                  indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int32 [num_sms + 1, 2] schedule for `*_paged_mqa_logits` (2D context_lens [B, next_n])."""
    _check(context_lens.dim() == 2, "get_paged_mqa_logits_metadata: context_lens must be 2D")
    _check(context_lens.dtype == torch.int32 and context_lens.is_contiguous(),
           "get_paged_mqa_logits_metadata: context_lens must be contiguous int32")
    _check(block_kv in (32, 64), f"get_paged_mqa_logits_metadata: block_kv {block_kv}")
    batch, next_n = context_lens.shape
    # on context_lens' device and without a host read, like the real kernel: callers run it
    # on CUDA, some inside a graph capture
    dev = context_lens.device
    segments = (context_lens.max(dim=1).values.long() + SPLIT_KV - 1) // SPLIT_KV * next_n
    total = segments.sum() if batch else torch.zeros((), dtype=torch.long, device=dev)
    starts = torch.cumsum(segments, 0) - segments
    per_sm = (total + num_sms - 1) // max(num_sms, 1)
    work = torch.minimum(torch.arange(num_sms, device=dev) * per_sm, total)
    meta = torch.zeros(num_sms + 1, 2, dtype=torch.int32, device=dev)
    if batch:
        b = (torch.searchsorted(starts, work, right=True) - 1).clamp(min=0)
        meta[:num_sms, 0] = b.int()
        meta[:num_sms, 1] = (work - starts[b]).int()
    meta[num_sms, 0].fill_(batch)  # fill_: no host-to-device copy (graph capture)
    meta[num_sms, 1].fill_(next_n)
    return meta


def _check_schedule(schedule_meta: torch.Tensor, batch: int, next_n: int) -> None:
    _check(schedule_meta.dtype == torch.int32 and schedule_meta.dim() == 2
           and schedule_meta.shape[1] == 2, "schedule_meta must be int32 [num_sms + 1, 2]")
    _check(schedule_meta.shape[0] == NUM_SMS + 1, "schedule_meta must have num_sms + 1 rows")
    if schedule_meta.is_cuda and torch.cuda.is_current_stream_capturing():
        return  # reading its values would break the capture
    meta_batch, meta_next_n = (int(v) for v in schedule_meta[-1])
    _check(meta_batch == batch, f"schedule_meta was built for batch {meta_batch}, the call has "
                                f"{batch} (stale schedule)")
    if meta_next_n != next_n:
        SCHEDULE_MISMATCHES.append((meta_next_n, next_n))


def _paged_logits(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor,
                  context_lens: torch.Tensor, block_table: torch.Tensor,
                  max_context_len: int) -> torch.Tensor:
    batch, next_n, heads, _ = q.shape
    blocks, slots, _ = keys.shape
    _check(weights.shape == (batch * next_n, heads) and weights.stride(1) == 1,
           f"weights must be [{batch * next_n}, {heads}]")
    _check(weights.dtype in (torch.float32, torch.bfloat16), "weights must be fp32 (or bf16)")
    _check(block_table.dtype == torch.int32 and block_table.shape[0] == batch,
           "block_table must be int32 [batch, max_blocks]")
    _check(context_lens.shape == (batch, next_n) and context_lens.dtype == torch.int32,
           f"context_lens must be int32 [{batch}, {next_n}] (2D only)")
    # all rows at once on q's device and without a host read, like the real kernel: the decode
    # callers capture it into CUDA graphs. Pages past a row's length are clamped, then masked.
    if batch == 0 or max_context_len == 0:
        return torch.full((batch * next_n, max_context_len), float("nan"), device=q.device)
    width = -(-max_context_len // slots)
    table = block_table[:, :width].long()
    if table.shape[1] < width:          # a table too narrow for the lengths: no page there
        table = torch.nn.functional.pad(table, (0, width - table.shape[1]), value=-1)
    live = ((table >= 0) & (table < blocks)).repeat_interleave(slots, dim=1)   # [B, N]
    cols = torch.arange(width * slots, device=q.device)
    if q.device.type == "cpu":  # where a host read costs nothing, bad input is named
        longest = context_lens.long().amax(dim=1)
        if bool((longest > max_context_len).any()):
            _check(False, f"context len {int(longest.max())} > max_context_len {max_context_len}")
        bad = ((cols // slots * slots)[None, :] < longest[:, None]) & ~live
        if bool(bad.any()):
            _check(False, f"block_table row {int(bad.any(1).long().argmax())} holds a page "
                          f"outside [0, {blocks})")
    k = keys[table.clamp(0, blocks - 1)].reshape(batch, width * slots, keys.shape[-1])
    scores = torch.einsum("bjhd,bnd->bjhn", q.float(), k).relu()
    rows = (scores * weights.float().reshape(batch, next_n, heads, 1)).sum(dim=2)  # [B, next_n, N]
    rows = rows[:, :, :max_context_len].reshape(batch * next_n, -1)
    # on the GPU a slot of a page outside the cache reads as NaN (the real kernel reads garbage)
    inside = (cols[None, :max_context_len] < context_lens.reshape(-1, 1).long()) & \
        live[:, :max_context_len].repeat_interleave(next_n, dim=0)
    return rows.masked_fill(~inside, float("nan"))


def fp8_paged_mqa_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                         context_lens: torch.Tensor, block_table: torch.Tensor,
                         schedule_meta: torch.Tensor, max_context_len: int,
                         clean_logits: bool = False,
                         indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 [B * next_n, max_context_len]: row (b, j) scores positions < context_lens[b, j] as
    sum_h weights[row, h] * relu(q[b, j, h] . k). q: e4m3 [B, next_n, H, 128]; kv_cache: uint8
    pages [blocks, 32 or 64, 1, 132]."""
    _check(q.dim() == 4 and q.dtype == torch.float8_e4m3fn, "q must be e4m3 [B, next_n, H, D]")
    _check(kv_cache.dtype == torch.uint8 and kv_cache.shape[2] == 1
           and kv_cache.shape[3] == q.shape[-1] + 4, "kv_cache must be uint8 [blocks, P, 1, D+4]")
    _check(kv_cache.shape[1] in (32, 64), f"block_kv {kv_cache.shape[1]} (32 or 64)")
    _check(q.shape[2] in (8, 16, 32, 64), f"num_heads {q.shape[2]}")
    _check(not clean_logits, "clean_logits needs 1D context lens")
    _check(indices is None, "varlen indices are not supported by the stand-in")
    _check_schedule(schedule_meta, q.shape[0], q.shape[1])
    keys = dequantize_pages(kv_cache, q.shape[-1])
    return _paged_logits(q.float(), keys, weights, context_lens, block_table, max_context_len)


def fp8_fp4_paged_mqa_logits(q: tuple, kv_cache: torch.Tensor, weights: torch.Tensor,
                             context_lens: torch.Tensor, block_table: torch.Tensor,
                             schedule_meta: torch.Tensor, max_context_len: int,
                             clean_logits: bool = False, logits_dtype=torch.float32,
                             indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """As fp8_paged_mqa_logits; q = (q, None) for FP8 or (packed FP4 [B, next_n, H, 64],
    int32 scales [B, next_n, H]) for FP4 keys (pages [blocks, P, 1, 68])."""
    q_fp, q_sf = q
    if q_sf is None:
        return fp8_paged_mqa_logits(q_fp, kv_cache, weights, context_lens, block_table,
                                    schedule_meta, max_context_len, clean_logits, indices)
    batch, next_n, heads, half = q_fp.shape
    _check(half * 2 == 128, "FP4 needs head_dim 128")
    _check(q_sf.shape == (batch, next_n, heads) and q_sf.dtype == torch.int32,
           "q_sf must be int32 [B, next_n, H]")
    _check(kv_cache.dtype == torch.uint8 and kv_cache.shape[3] == half + 4,
           "kv_cache must be uint8 [blocks, P, 1, D/2+4]")
    _check(kv_cache.shape[1] in (32, 64), f"block_kv {kv_cache.shape[1]} (32 or 64)")
    _check(not clean_logits and indices is None, "clean_logits / varlen not supported")
    _check_schedule(schedule_meta, batch, next_n)
    q_deq = dequantize_fp4(q_fp.reshape(-1, half), q_sf.reshape(-1)).view(batch, next_n, heads,
                                                                          2 * half)
    keys = dequantize_pages(kv_cache, 2 * half)
    return _paged_logits(q_deq, keys, weights, context_lens, block_table, max_context_len)


def _ragged_logits(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor,
                   ks: torch.Tensor, ke: torch.Tensor, clean_logits: bool) -> torch.Tensor:
    scores = torch.einsum("thd,nd->thn", q, k).relu()
    logits = (scores * weights.float()[:, :, None]).sum(dim=1)
    cols = torch.arange(k.shape[0], device=k.device)
    inside = (cols[None, :] >= ks[:, None].long()) & (cols[None, :] < ke[:, None].long())
    return logits.masked_fill(~inside, float("-inf") if clean_logits else float("nan"))


def fp8_mqa_logits(q: torch.Tensor, kv: tuple, weights: torch.Tensor,
                   cu_seq_len_k_start: torch.Tensor, cu_seq_len_k_end: torch.Tensor,
                   clean_logits: bool = True, max_seqlen_k: int = 0) -> torch.Tensor:
    """Prefill logits fp32 [T, S]: row t scores keys [ks[t], ke[t]) of the ragged kv."""
    k_fp8, k_scale = kv
    keys = dequantize_fp8(k_fp8, k_scale.reshape(-1))
    return _ragged_logits(q.float(), keys, weights, cu_seq_len_k_start, cu_seq_len_k_end,
                          clean_logits)


def fp8_fp4_mqa_logits(q: tuple, kv: tuple, weights: torch.Tensor,
                       cu_seq_len_k_start: torch.Tensor, cu_seq_len_k_end: torch.Tensor,
                       clean_logits: bool = True, max_seqlen_k: int = 0,
                       logits_dtype=torch.float32) -> torch.Tensor:
    q_fp, q_sf = q
    if q_sf is None:
        return fp8_mqa_logits(q_fp, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end,
                              clean_logits, max_seqlen_k)
    k_packed, k_sf = kv
    heads = weights.shape[1]
    q_deq = dequantize_fp4(q_fp.reshape(-1, q_fp.shape[-1]), q_sf.reshape(-1))
    keys = dequantize_fp4(k_packed.reshape(k_packed.shape[0], -1), k_sf.reshape(-1))
    return _ragged_logits(q_deq.view(-1, heads, keys.shape[-1]), keys, weights,
                          cu_seq_len_k_start, cu_seq_len_k_end, clean_logits)


def _plain(fn):
    def unwrap(value):
        if isinstance(value, torch.Tensor) and type(value) is not torch.Tensor:
            return value.as_subclass(torch.Tensor)
        if isinstance(value, tuple):
            return tuple(unwrap(v) for v in value)
        return value

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*(unwrap(a) for a in args), **{k: unwrap(v) for k, v in kwargs.items()})
    return call


KERNELS = ("get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits", "fp8_fp4_paged_mqa_logits",
           "fp8_mqa_logits", "fp8_fp4_mqa_logits")
if os.environ.get("TRTLLM_STANDIN_DEEPGEMM") == "real":
    import deep_gemm as _real

    for _name in KERNELS + ("get_num_sms",):
        if hasattr(_real, _name):
            globals()[_name] = getattr(_real, _name)
else:
    for _name in KERNELS:
        globals()[_name] = _plain(globals()[_name])
