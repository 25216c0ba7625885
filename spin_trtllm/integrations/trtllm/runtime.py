"""SPIN's runtime inside TensorRT-LLM: one SpinDecodeAdapter per model geometry over the
engine's KV-cache manager, and the per-step calls the patched upstream functions make
(begin at prepare(), start_forward at the first SPIN layer, on_accepted from the MTP worker)."""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Optional

import torch

from ...errors import SpinError
from .adapter import DecodeBatch, EngineKernel, SpinDecodeAdapter
from .config_ext import SpinSettings

log = logging.getLogger("spin_trtllm")
SPEC_MODULES = ("tensorrt_llm._torch.speculative.mtp", "tensorrt_llm._torch.speculative.eagle3")
_SPEC_WORKERS: list[str] = []     # the speculative workers whose acceptance SPIN hooks

_LAYERS: dict[int, SpinSettings] = {}     # layer_idx -> settings of the SPIN indexer layers
_BASE_LAYERS: dict[int, int] = {}         # id(sparse config) -> the model's num_hidden_layers
_WARNED: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("spin_trtllm: %s", msg)


# ---- the model's SPIN runtime: one SpinDecodeAdapter over the model's KV-cache manager -------
class _Runtime:
    """SPIN's state and step buffers for one model geometry. Made at the first prepare() of any
    step (TensorRT-LLM's start-up runs prefill and decode warm-ups before it sizes the KV cache,
    so the state is part of what that sizing sees) and kept for the process: the engine builds
    its KV cache again after sizing, and the runtime follows the new cache manager."""

    def __init__(self, ratio: int):
        self.ratio = ratio
        self.adapter: Optional[SpinDecodeAdapter] = None
        self.layer_index = {idx: i for i, idx in enumerate(sorted(_LAYERS))}
        self.manager_ref: Callable[[], Any] = lambda: None     # the KV-cache manager it serves
        self.caches: Optional[list] = None       # its SPIN layers' K caches (probe, hybrid)
        self.active = False
        self.step_key: tuple[int, int] = (0, 0)      # (next_n, generation requests) of the step
        # the step's forward seen by Python (eager or CUDA-graph capture) and whether its MTP
        # updates ran in it; graph_finishes: (next_n, batch) graphs whose capture recorded them
        self.forward_in_python = False
        self.finished_in_forward = False
        self.graph_finishes: set[tuple[int, int]] = set()

    def _create(self, md: Any, geometry: dict[str, int]) -> SpinDecodeAdapter:
        settings = set(_LAYERS.values())
        if len(settings) != 1:
            raise SpinError(f"SPIN layers of one model must share one spin block, got "
                            f"{len(settings)}")
        one = next(iter(settings))
        adapter = SpinDecodeAdapter.for_engine(
            one.config, len(self.layer_index), geometry["max_batch"],
            geometry["max_tokens"], self.ratio, geometry["page_slots"], geometry["max_next_n"],
            md.indexer_k_cache_block_offsets.device, EngineKernel(geometry["page_slots"]),
            predictor=one.predictor)
        log.info("spin_trtllm: SPIN (predictor %s) on %d indexer layers (compress ratio %d, "
                 "%d-slot pages, K %d, up to %d requests), %.1f MB of state and step buffers",
                 one.predictor, len(self.layer_index), self.ratio, geometry["page_slots"],
                 adapter.cfg.index_topk, geometry["max_batch"], adapter.nbytes() / 2**20)
        return adapter

    def _caches(self, md: Any) -> Optional[list]:
        """Each SPIN layer's indexer K cache, in SPIN's layer order (what the probe
        summarizes); None with predictor spin."""
        if not self.adapter.query_aware:
            return None
        manager = md.kv_cache_manager
        return [manager.get_indexer_k_cache_buffers(idx) for idx in sorted(self.layer_index)]

    def attach(self, md: Any, geometry: dict[str, int]) -> None:
        manager = md.kv_cache_manager
        if self.adapter is None:
            self.adapter = self._create(md, geometry)
        elif self.manager_ref() is not manager:
            self.adapter.reset(new_cache=True)  # a rebuilt KV cache: no request carries over
            self.graph_finishes.clear()
        self.manager_ref = weakref.ref(manager)
        # looked up once per KV-cache manager, not at every step's prepare()
        self.caches = caches = self._caches(md)
        if caches is not None:      # made now, before any CUDA-graph capture of the probe
            made = self.adapter.make_summaries(caches)
            chosen = self.adapter.options.block_predictor
            log.info("spin_trtllm: %.1f MB of %s summary tables (%d B per indexer page per "
                     "layer)", made / 2**20, chosen.name, chosen.summary_bytes)

    def _settle_previous(self) -> None:
        """Did the last step's MTP updates run inside its forward? (Then the host must not
        replay them.) A replayed CUDA graph runs no Python: its capture tells."""
        if self.adapter is not None and self.adapter.pending:
            done = self.finished_in_forward if self.forward_in_python \
                else self.step_key in self.graph_finishes
            if done:
                self.adapter.drop_pending()
        # decided once: a pending update left now is the host's to replay
        self.forward_in_python = self.finished_in_forward = False
        self.step_key = (0, 0)

    def begin(self, md: Any) -> None:
        """In prepare(): the generation requests of this step, before any layer runs. Host-side
        only: the selection runs inside the step (start_forward)."""
        self.active = False
        self._settle_previous()
        nc, ng = int(md.num_contexts), int(md.num_generations)
        prefill = [int(r) for r in md.request_ids[:nc]]      # their state starts over
        if ng == 0:
            for rid in prefill:
                self.adapter.release(rid)
            return
        if ng > self.adapter.max_batch:
            raise SpinError(f"spin_trtllm: {ng} generation requests in one step, SPIN's buffers "
                            f"hold {self.adapter.max_batch} (the engine's max batch size)")
        gen_tokens = int(md.num_tokens) - int(md.num_ctx_tokens)
        ids = [int(r) for r in md.request_ids[nc:nc + ng]]
        cached, new = _host_lens(md, nc, ng)
        next_n = gen_tokens // ng
        if gen_tokens != ng * next_n or bool((new != next_n).any()):
            # a ragged layout on the host: the layer calls see other query rows than (requests
            # x next_n) and leave those steps to upstream's dense indexer
            _warn_once("ragged", "generation requests verify different draft lengths on the "
                                 "host (ragged verification); those steps run the dense indexer")
            next_n = max(int(new.max()), 1)
        # every step refills SPIN's buffers with its own batch: a graph captured with SPIN
        # never replays an earlier step's rows
        if next_n > 1 and not _SPEC_WORKERS:
            _warn_once("spec", "no one-model speculative worker was found to patch "
                               f"({', '.join(SPEC_MODULES)}): SPIN replays its MTP updates "
                               "from the host at the next step, which with the overlap "
                               "scheduler counts every draft accepted")
        self.adapter.begin_step(DecodeBatch(ids, cached + next_n,
                                            md.indexer_k_cache_block_offsets[nc:nc + ng],
                                            prefill_ids=prefill, kv_caches=self.caches),
                                next_n=next_n, select=False)
        self.active = True
        self.step_key = (next_n, ng)

    def start_forward(self, md: Any) -> None:
        """The first SPIN layer of a forward (eager, warm-up or CUDA-graph capture): the rows'
        lengths from the device kv lens as they stand now (after the overlap scheduler's
        corrections in the step's preprocessing), then every layer's selection."""
        if self.forward_in_python:
            self.adapter.reopen_pending()       # warm-up then capture: one prepare, two forwards
        self.forward_in_python, self.finished_in_forward = True, False
        device_kv = getattr(md, "kv_lens_cuda", None)
        nc = int(md.num_contexts)
        if device_kv is not None:
            self.adapter.select_on_device(device_kv[nc:])
        else:
            self.adapter.indexer.select()

    def on_accepted(self, md: Any, num_accepted: torch.Tensor) -> None:
        """The MTP worker's acceptance (accepted tokens, bonus included, [num_seqs] on the
        device) inside the step: the deferred updates run now, in the same forward."""
        if not (self.active and self.forward_in_python and self.adapter.pending):
            return
        self.adapter.finish_on_device(num_accepted[int(md.num_contexts):], includes_bonus=True)
        self.finished_in_forward = True
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            self.graph_finishes.add(self.step_key)


def geometry_of(md: Any, ratio: int) -> dict[str, int]:
    """What SPIN's buffers are sized from: the engine's limits, not the metadata that happens
    to run first (a CUDA-graph metadata carries its graph's batch)."""
    manager = md.kv_cache_manager
    max_batch = max(int(getattr(manager, "max_batch_size", 0) or 0),
                    int(getattr(md, "max_num_sequences", 0) or 0),
                    int(getattr(md, "max_num_requests", 0) or 0),
                    int(md.indexer_k_cache_block_offsets.shape[0]))
    page_slots = int(getattr(md, "_tokens_per_block", 0) or manager.tokens_per_block // ratio)
    return {"max_batch": max_batch, "max_tokens": int(manager.max_seq_len),
            "page_slots": page_slots,
            "max_next_n": 1 + int(getattr(md, "max_draft_tokens", 0) or 0)}


def _host_lens(md: Any, nc: int, ng: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host copies of the generation requests' cached and new token counts (no device sync):
    main keeps them in kv_cache_params / seq_lens_kv, release 1.2 in num_cached_tokens /
    seq_lens."""
    params = getattr(md, "kv_cache_params", None)
    cached = params.num_cached_tokens_per_seq if params is not None else md.num_cached_tokens
    new = md.seq_lens_kv if getattr(md, "seq_lens_kv", None) is not None else md.seq_lens
    return (torch.as_tensor(cached[nc:nc + ng]).to("cpu", torch.int64),
            torch.as_tensor(new[nc:nc + ng]).to("cpu", torch.int64))


_RUNTIME_ATTR = "_spin_trtllm_runtime"
_RUNTIMES: dict[tuple, _Runtime] = {}     # geometry -> runtime (kept across KV-cache rebuilds)


def _runtime(md: Any, create_ratio: Optional[int] = None) -> Optional[_Runtime]:
    """The model's SPIN runtime. The KV-cache manager, which every attention metadata object
    of the model shares (TensorRT-LLM keeps one metadata per CUDA-graph batch size), points at
    it, so the per-request state is one, whichever metadata runs the step."""
    owner = getattr(md, "kv_cache_manager", None)
    if owner is None:
        return None
    rt = getattr(owner, _RUNTIME_ATTR, None)
    # as upstream's Indexer.prepare: a manager without an indexer K cache (an MTP draft
    # manager) has no indexer to drive
    if rt is None and create_ratio is not None and _LAYERS and \
            callable(getattr(owner, "get_indexer_k_cache_buffers", None)) and \
            getattr(md, "indexer_k_cache_block_offsets", None) is not None:
        geometry = geometry_of(md, create_ratio)
        key = (create_ratio, *sorted(geometry.items()))
        for other in [k for k, r in _RUNTIMES.items() if k != key and r.manager_ref() is None]:
            del _RUNTIMES[other]            # its KV cache is gone: give its memory back
        rt = _RUNTIMES.get(key)
        if rt is None:
            rt = _RUNTIMES[key] = _Runtime(create_ratio)
        rt.attach(md, geometry)
        object.__setattr__(owner, _RUNTIME_ATTR, rt)
    return rt


# ---- one SPIN layer's decode call: the engine's logits kernel on the compacted table ---------
