"""SPIN decode ops: torch.ops.spin.{select, indexer_logits, topk, update, reset, compact, remap,
summarize, summarize_newest, probe and the gauss forms}, one module per op with its schema,
checks, reference and wrapper (REFERENCE_ONLY: the ops that need no kernel).

Every op validates its arguments in Python (shapes, dtypes, devices, contiguity, config ranges:
clear errors before any launch), then runs the native kernels of cpp/ (libspin_native, built by
build.sh) on CUDA tensors when the library is present, else the reference
(spin_trtllm.reference, the specification). All ops write into caller-provided buffers and
return nothing, so a decode step made of them can be captured in a CUDA graph; fake impls let
torch.compile trace them. Each module's docstring holds its op's contract. The ops implement
reduction A1 (A0/A2 are replay ablations of the reference) and 64-slot blocks.
"""

from __future__ import annotations

import logging

import torch

from ..limits import (BLOCK_SLOTS, EXPLORATION_POLICY, HEAD_DIM, INDEX_HEADS, MAX_HYBRID_BLOCKS,
                      MAX_NEXT_N, MAX_SORTED_K, NATIVE_ABI, POOLING)
from . import _native
from ._common import REFERENCE_ONLY, SCHEMAS, STATE_TORCH_DTYPES, OpState, require_supported
from ._compact import compact, remap
from ._indexer_logits import indexer_logits
from ._probe import (gauss, gauss_summaries_like, probe, summaries_like, summarize, summarize_gauss,
                     summarize_newest)
from ._select import select
from ._topk import (TOPK_BACKENDS, TOPK_RAGGED_MAX_ROWS, TOPK_SPIN_MAX_ROWS, TOPK_SPIN_MAX_WIDTH,
                    peer_available, set_topk_backend, spin_topk_is_faster, topk, topk_backend,
                    topk_filters, topk_peer, using_topk_backend)
from ._update import reset, update

NATIVE = _native.NATIVE
OPS = tuple(SCHEMAS)

log = logging.getLogger("spin_trtllm")
if not NATIVE and torch.cuda.is_available():   # CPU-only torch: the reference is the only path
    log.warning("spin_trtllm: native library not built or not usable; spin::%s run through the "
                "reference implementation (./build.sh builds it where torch has CUDA and nvcc "
                "exists)", ", spin::".join(OPS))
elif not NATIVE:
    log.info("spin_trtllm: no CUDA; spin ops run the reference implementation")

__all__ = ["BLOCK_SLOTS", "EXPLORATION_POLICY", "HEAD_DIM", "INDEX_HEADS", "MAX_HYBRID_BLOCKS",
           "MAX_NEXT_N", "MAX_SORTED_K", "NATIVE", "NATIVE_ABI", "OPS", "POOLING",
           "REFERENCE_ONLY", "SCHEMAS", "STATE_TORCH_DTYPES", "TOPK_BACKENDS",
           "TOPK_RAGGED_MAX_ROWS", "TOPK_SPIN_MAX_ROWS", "TOPK_SPIN_MAX_WIDTH", "OpState",
           "compact", "gauss", "gauss_summaries_like", "indexer_logits", "peer_available",
           "probe", "remap", "require_supported", "reset", "select", "set_topk_backend",
           "spin_topk_is_faster", "summaries_like", "summarize", "summarize_gauss",
           "summarize_newest", "topk", "topk_backend", "topk_filters", "topk_peer", "update",
           "using_topk_backend"]
