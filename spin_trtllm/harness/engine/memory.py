"""How much memory an Engine (and a traced run) takes, estimated from the config before any of
it is allocated, so that a run that cannot fit is refused with one line instead of failing in
an allocation (model.check_memory compares an estimate with free host or device memory).

Persistent buffers (weights, caches, indexers, SPIN state) follow the shapes their
constructors allocate. The largest forward pass's temporaries (a prefill chunk: prefill_chunk
rows over the window, the top-K or HCA entries, and the prefill indexer's scores of the whole
context; or a decode step: max_batch x next_n rows) are counted tensor by tensor with the
copies the ops make; SLACK covers the allocator's. Measured (one traced request; CPU: peak RSS
of a fresh process; CUDA, H200: max_memory_allocated), the estimate without SLACK was
1.04-1.45x the peak: the shipped checkpoint at 1K..64K-token prompts (e.g. 16K: 3.3 GiB
measured on both, 3.4 GiB estimated; the prefill indexer's 256-block chunks dominate), and
larger windows and prefill chunks (window 8,192, chunk 2,048: 17 GiB measured, 22 estimated).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..._inputs import TRACE_V2_MAX_BYTES, approx_size, size_text
from ...config import SpinConfig
from ...errors import SpinError
from ...indexer import logits_buffer_shape
from ...limits import BLOCK_SLOTS, HEAD_DIM, INDEX_HEADS, KEY_BYTES
from ..config import INDEX_RATIOS, DsaLiteConfig
from ..model import Caches, check_memory, weight_count
from .options import EngineOptions

# live copies of the attention scores (einsum, mask, softmax) and of the gathered keys and
# values (the window's, the compressed entries', their concatenation) at a layer's peak
FORWARD_COPIES = 3
# the paged indexer's scores of one chunk of 256 blocks: einsum, ReLU, weighted (reference ops)
INDEXER_CHUNK_COPIES = 3
# per scored slot and row: the scores (model dtype x 2: written, masked), the top-K's sort key
# (4), sorted values (4) and indices (8), the masks (4 x 1)
TOPK_BYTES_PER_SLOT = 24
FIXED_BYTES = 128 << 20         # small tensors, thread pools
SLACK = 1.25                    # freed blocks the allocator cannot reuse at once


def _slots(cfg: DsaLiteConfig) -> int:
    """Indexer slots of the longest context, rounded up to whole 64-slot blocks."""
    return math.ceil(cfg.index_slots / BLOCK_SLOTS) * BLOCK_SLOTS


def indexer_scores_bytes(rows: int, slots: int, dtype_bytes: int) -> int:
    """Scoring `slots` indexer slots for `rows` query rows and taking their top-K (the
    reference ops: DenseIndexer on the CPU, the prefill indexer everywhere)."""
    blocks = min(math.ceil(slots / BLOCK_SLOTS), 256)
    chunk = rows * blocks * BLOCK_SLOTS * INDEX_HEADS * dtype_bytes * INDEXER_CHUNK_COPIES
    return chunk + rows * slots * (2 * dtype_bytes + TOPK_BYTES_PER_SLOT)


def forward_bytes(cfg: DsaLiteConfig, batch: int, rows: int, prefill: bool) -> int:
    """Temporaries of one forward over [batch, rows] query rows, at its largest layer."""
    dt = getattr(torch, cfg.dtype).itemsize
    idx_dt = 8 if cfg.dtype == "float64" else 4
    BR = batch * rows
    peak = 0
    for r in cfg.compress_ratios:
        entries = 0 if not r else cfg.index_topk if r in INDEX_RATIOS \
            else cfg.max_context // r + 1
        n = cfg.window + entries
        kv = BR * (2 * cfg.window + entries + 2 * n) * cfg.head_dim * dt
        att = FORWARD_COPIES * BR * cfg.heads * n * dt
        masks = BR * (3 * 8 * cfg.window + 2 * n + 16 * entries)
        layer = kv + att + masks
        if prefill and r in INDEX_RATIOS:
            layer += indexer_scores_bytes(BR, _slots(cfg), idx_dt)
        peak = max(peak, layer)
    rows_bytes = BR * (2 * 4 * cfg.vocab_size + 8 * cfg.hidden * dt + 3 * cfg.ffn * dt
                       + INDEX_HEADS * HEAD_DIM * (dt + 4))
    return peak + rows_bytes


def _dense_indexer_bytes(cfg: DsaLiteConfig, max_batch: int) -> int:
    rows, slots = max_batch * cfg.next_n, _slots(cfg)
    m_cap = slots // BLOCK_SLOTS
    return rows * slots * 4 + len(cfg.csa_layers) * rows * cfg.index_topk * 4 \
        + 2 * max_batch * m_cap * 4


def _spin_bytes(cfg: DsaLiteConfig, spin: SpinConfig, max_batch: int, max_requests: int,
                history: bool = True) -> int:
    """SpinIndexer's buffers and the StatePool at its largest capacity (while it grows the old
    and the new state live together: 1.5x). history False (probe, gauss): no V/D and no
    layer's MTP logits kept."""
    L, R = len(cfg.csa_layers), cfg.next_n
    rows, slots = max_batch * R, _slots(cfg)
    m_cap = slots // BLOCK_SLOTS
    logits = math.prod(logits_buffer_shape(L, rows, m_cap, R > 1 and history)) * 4
    indexer = max_batch * L * m_cap * 4 * 2 + logits + L * rows * cfg.index_topk * 4 \
        + 2 * rows * m_cap * 4
    capacity = cfg.index_slots + R
    vd = capacity * 2 * getattr(torch, spin.state_dtype).itemsize if history else 0
    state = max_requests * L * (vd + math.ceil(capacity / BLOCK_SLOTS) * 8)
    return indexer + state * 3 // 2


def engine_bytes(cfg: DsaLiteConfig, spin: Optional[SpinConfig], options: EngineOptions,
                 random_weights: bool = False) -> int:
    """The memory an Engine(cfg, spin, options) takes at its peak: weights (the model's copy;
    with random_weights also init_weights' float32 ones), caches, indexers, SPIN state and the
    largest forward's temporaries. `options` must be resolved (EngineOptions.resolve)."""
    dt = getattr(torch, cfg.dtype).itemsize
    params = weight_count(cfg)
    weights = params * dt + (params * 4 if random_weights else 0)
    max_batch, max_requests = options.max_batch, options.max_requests or options.max_batch
    page_slots = options.page_slots
    pages = options.num_pages or max_requests * math.ceil(cfg.index_slots / page_slots)
    caches = Caches.estimate_bytes(cfg, max_requests, pages, page_slots)
    indexers = 0
    if spin is not None:
        indexers += _spin_bytes(cfg, spin, max_batch, max_requests,
                                options.indexer.block_predictor.history)
    if spin is None or options.switch != "spin":
        indexers += _dense_indexer_bytes(cfg, max_batch)
    if options.measure_miss or options.trace_requests:
        indexers += _dense_indexer_bytes(cfg, max_batch)
    decode_scoring = indexer_scores_bytes(max_batch * cfg.next_n, _slots(cfg),
                                          8 if cfg.dtype == "float64" else 4)
    prefill = forward_bytes(cfg, 1, min(cfg.prefill_chunk, cfg.max_context), True)
    decode = forward_bytes(cfg, max_batch, cfg.next_n, False) + decode_scoring
    # captured decode steps keep their temporaries in the graphs' pool beside the prefill's
    temporaries = prefill + decode if options.cuda_graphs else max(prefill, decode)
    return int(SLACK * (weights + caches + indexers + temporaries)) + FIXED_BYTES


def trace_bytes(cfg: DsaLiteConfig, prompt_tokens: int, steps: int) -> tuple[int, int]:
    """(host memory, file bytes) of the SPIN trace v2 of one request: each decode step keeps
    every indexer layer's dense scores of each row (4 bytes a visible slot), its q (fp16, 16 KiB
    a row) and w; trace() concatenates them (a second copy) and the file holds one."""
    L, R, ratio = len(cfg.csa_layers), cfg.next_n, cfg.index_ratio
    first = prompt_tokens // ratio + 1
    last = (prompt_tokens + steps * R) // ratio + 1
    scores = steps * L * R * (first + last) // 2 * 4
    rows = steps * L * R * (INDEX_HEADS * HEAD_DIM * 2 + INDEX_HEADS * 4 + 3 * 4)
    keys = L * last * KEY_BYTES * 2
    file = scores + rows + keys
    return 2 * file + keys, file


def check_trace_memory(cfg: DsaLiteConfig, prompt_tokens: int, steps: int,
                       device: torch.device) -> None:
    """SpinError (one line) unless a traced run of `cfg` (max_context sized for it) fits: its
    engine on `device`, the recorded trace on the host, and the file under the v2 limit."""
    run = f"trace --prompt-tokens {prompt_tokens:,} --steps {steps:,}"
    host, file = trace_bytes(cfg, prompt_tokens, steps)
    if file > TRACE_V2_MAX_BYTES:
        raise SpinError(f"{run}: the trace would be about {approx_size(file)}, over the "
                        f"{size_text(TRACE_V2_MAX_BYTES)} a v2 trace may have (each step keeps "
                        f"its dense scores of the whole context)")
    engine = engine_bytes(cfg, None, EngineOptions(trace_request=0).resolve(None, device))
    if device.type == "cuda":
        check_memory(engine, device, f"{run}: the engine ({cfg.sizes()})")
        check_memory(host, "cpu", f"{run}: the recorded trace")
    else:
        check_memory(engine + host, device, f"{run} (the engine, {cfg.sizes()}; the recorded "
                                            f"trace)")
