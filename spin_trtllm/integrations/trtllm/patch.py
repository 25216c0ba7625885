"""Activate SPIN inside TensorRT-LLM's PyTorch backend (needs tensorrt_llm).

What activation patches (each only once; a second activate() is a no-op):
- DeepSeekSparseAttentionConfig / DeepSeekV4SparseAttentionConfig get a `spin:` field (YAML,
  LLM(...) and trtllm-serve accept it), their parents are rebuilt, and to_sparse_params()
  hands the SpinConfig to the indexer layers.
- Indexer.__init__ registers the layers built with a SpinConfig (V3.2 DSA layers, V4's ratio-4
  layers; DeepseekV4Indexer inherits from Indexer).
- The DSA attention metadata's prepare() runs SpinDecodeAdapter.begin_step for the generation
  requests (host side: deferred MTP updates, state realigned by request id, metadata copied,
  blocks selected for every indexer layer) before the step, or its CUDA-graph replay, runs.
- Indexer.sparse_attn_indexer() lets upstream handle the context tokens with the decode part
  switched off, then fills the generation rows of topk_indices_buffer with SPIN's top-K, so
  everything after the indexer is unchanged.

Targets the module layout of TensorRT-LLM 1.2/1.3 (tensorrt_llm/_torch/attention/backends/
sparse/dsa/ and its predecessor tensorrt_llm/_torch/attention_backend/sparse/dsa/); anything
missing is reported by name and nothing is patched.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from typing import Any, Optional

import torch

try:
    import tensorrt_llm
except ImportError as err:  # one clear error instead of an AttributeError later
    raise ImportError(
        "spin_trtllm.trtllm needs TensorRT-LLM (tensorrt_llm >= 1.2, PyTorch backend) in this "
        f"environment ({err}). Without it, use spin_trtllm.integrations.trtllm.adapter "
        "(framework-free) or dsa-lite (spin_trtllm.harness).") from None

from ...config import SpinConfig
from ...errors import SpinError
from .adapter import DecodeBatch, SpinDecodeAdapter
from .config_ext import add_spin_field, spin_config_of

log = logging.getLogger("spin_trtllm")
MIN_VERSION = (1, 2)
PACKAGES = ("tensorrt_llm._torch.attention.backends.sparse",
            "tensorrt_llm._torch.attention_backend.sparse")


class SpinBlock(SpinConfig):
    """The `spin:` field type. Unpickling it (e.g. in TensorRT-LLM's worker processes) imports
    this module, which activates SPIN there too."""


def _version() -> tuple[int, ...]:
    parts = []
    for p in str(getattr(tensorrt_llm, "__version__", "0")).split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _find(names: list[str], attr: str) -> Optional[Any]:
    for name in names:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, attr):
            return getattr(module, attr)
    return None


def _locate() -> dict[str, Any]:
    found = {
        "Indexer": _find([f"{p}.dsa.indexer" for p in PACKAGES] + [f"{p}.dsa" for p in PACKAGES],
                         "Indexer"),
        "DSAtrtllmAttentionMetadata": _find(
            [f"{p}.dsa.metadata" for p in PACKAGES] + [f"{p}.dsa" for p in PACKAGES],
            "DSAtrtllmAttentionMetadata"),
        "DeepSeekSparseAttentionConfig": _find(["tensorrt_llm.llmapi.llm_args"],
                                               "DeepSeekSparseAttentionConfig"),
        "BaseLlmArgs": _find(["tensorrt_llm.llmapi.llm_args"], "BaseLlmArgs"),
        "TorchLlmArgs": _find(["tensorrt_llm.llmapi.llm_args"], "TorchLlmArgs"),
    }
    missing = [k for k, v in found.items() if v is None]
    if missing:
        raise SpinError(f"TensorRT-LLM {tensorrt_llm.__version__}: cannot find {missing} in the "
                        f"module layout spin-trtllm targets; this version is not supported")
    for cls, method in (("Indexer", "sparse_attn_indexer"), ("DSAtrtllmAttentionMetadata", "prepare"),
                        ("DeepSeekSparseAttentionConfig", "to_sparse_params")):
        if not callable(getattr(found[cls], method, None)):
            raise SpinError(f"TensorRT-LLM {tensorrt_llm.__version__}: {cls}.{method} not found; "
                            f"this version is not supported")
    params = inspect.signature(found["Indexer"].sparse_attn_indexer).parameters
    expected = ("metadata", "hidden_states", "q_fp8", "k_fp8", "k_scale", "weights")
    if tuple(params)[1:7] != expected:
        raise SpinError(f"TensorRT-LLM {tensorrt_llm.__version__}: Indexer.sparse_attn_indexer"
                        f"{tuple(params)[1:]} differs from the expected {expected}; this version "
                        f"is not supported")
    found["DeepSeekV4SparseAttentionConfig"] = _find(["tensorrt_llm.llmapi.llm_args"],
                                                     "DeepSeekV4SparseAttentionConfig")
    found["LlmArgs"] = _find(["tensorrt_llm.llmapi.llm_args"], "LlmArgs")
    found["DeepseekV4TrtllmAttentionMetadata"] = _find(
        [f"{p}.deepseek_v4.metadata" for p in PACKAGES] + [f"{p}.deepseek_v4" for p in PACKAGES],
        "DeepseekV4TrtllmAttentionMetadata")
    return found


# ---- runtime: one SpinDecodeAdapter per attention-metadata object -----------------------------
_LAYERS: dict[int, SpinConfig] = {}           # layer_idx -> SpinConfig of SPIN indexer layers
_WARNED: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("spin_trtllm: %s", msg)


class _Runtime:
    def __init__(self, metadata: Any, compress_ratio: int):
        self.ratio = compress_ratio
        self.metadata = metadata
        self.adapter: Optional[SpinDecodeAdapter] = None
        self.layer_index = {idx: i for i, idx in enumerate(sorted(_LAYERS))}
        self.active = False
        self.next_n = 0
        self.gen_ids: list[int] = []

    def begin(self, md: Any) -> None:
        nc, ng = int(md.num_contexts), int(md.num_generations)
        self.active = False
        if ng == 0:
            return
        next_n = (int(md.num_tokens) - int(md.num_ctx_tokens)) // ng
        cfgs = {c for c in _LAYERS.values()}
        if len(cfgs) != 1:
            raise SpinError("SPIN layers of one model must share one SpinConfig")
        cfg = next(iter(cfgs))
        if self.adapter is None:
            max_tokens = int(md.kv_cache_manager.max_seq_len)
            max_seqs = int(getattr(md, "max_num_sequences", 0) or md.max_num_requests)
            slots = max_tokens // self.ratio + 1
            self.adapter = SpinDecodeAdapter(
                cfg, len(self.layer_index), max_seqs, next_n, max_tokens, self.ratio,
                device=md.indexer_k_cache_block_offsets.device,
                initial_capacity=slots + next_n)     # no growth: captured graphs stay valid
            self.next_n = next_n
            ix = self.adapter.indexer
            buffers = sum(t.numel() * t.element_size() for t in (ix.logits, ix.topk, ix.block_ids))
            log.info("spin_trtllm: SPIN on %d indexer layers, next_n %d, compress ratio %d, "
                     "%.1f MB of state + %.1f MB of step buffers", len(self.layer_index), next_n,
                     self.ratio, self.adapter.pool.nbytes() / 2**20, buffers / 2**20)
        if next_n != self.next_n:
            raise SpinError(f"SPIN's TensorRT-LLM integration needs a fixed draft length: built "
                            f"for next_n {self.next_n}, got {next_n}")
        ids = [int(r) for r in md.request_ids[nc:nc + ng]]
        cached = torch.as_tensor(md.kv_cache_params.num_cached_tokens_per_seq[nc:nc + ng])
        new = torch.as_tensor(md.seq_lens_kv[nc:nc + ng]).cpu()
        table = md.indexer_k_cache_block_offsets[nc:nc + ng]
        self.adapter.begin_step(DecodeBatch(ids, cached.to(torch.int64) + new, table))
        self.gen_ids = ids
        self.active = True


_RUNTIME_ATTR = "_spin_trtllm_runtime"


def _runtime(md: Any, create_ratio: Optional[int] = None) -> Optional[_Runtime]:
    """The model's SPIN runtime. It lives on the KV-cache manager, which every attention
    metadata object of the model shares (TensorRT-LLM keeps one metadata per CUDA-graph batch
    size), so the per-request state is one, whichever metadata runs the step."""
    owner = md.kv_cache_manager
    rt = getattr(owner, _RUNTIME_ATTR, None)
    if rt is None and create_ratio is not None and _LAYERS:
        rt = _Runtime(md, create_ratio)
        object.__setattr__(owner, _RUNTIME_ATTR, rt)
    return rt


# ---- the patches --------------------------------------------------------------------------------
def _patch_config(found: dict[str, Any]) -> list[str]:
    configs = [c for c in (found["DeepSeekSparseAttentionConfig"],
                           found["DeepSeekV4SparseAttentionConfig"]) if c is not None]
    parents = [c for c in (found["BaseLlmArgs"], found["TorchLlmArgs"], found["LlmArgs"])
               if c is not None]
    changed = add_spin_field(configs, parents, SpinBlock)
    for cls in configs:
        if "to_sparse_params" not in cls.__dict__:
            continue
        original = cls.to_sparse_params

        def to_sparse_params(self, *args, _original=original, **kwargs):
            params = _original(self, *args, **kwargs)
            spin = spin_config_of(self)
            if spin is not None:
                object.__setattr__(params, "spin", spin)
            return params

        cls.to_sparse_params = to_sparse_params
    return [f"{name}.spin" for name in changed]


def _patch_indexer(Indexer: type) -> None:
    original_init = Indexer.__init__
    original_run = Indexer.sparse_attn_indexer

    signature = inspect.signature(original_init)

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        try:
            params = signature.bind(self, *args, **kwargs).arguments.get("sparse_params")
        except TypeError:
            params = None
        params = params if params is not None else getattr(self, "sparse_params", None)
        spin = getattr(params, "spin", None)
        object.__setattr__(self, "_spin", spin)
        if spin is not None:
            _LAYERS[int(getattr(self, "layer_idx", len(_LAYERS)))] = spin

    def sparse_attn_indexer(self, metadata, hidden_states, q_fp8, k_fp8, k_scale, weights,
                            q_scale=None, is_generation=None):
        rt = _runtime(metadata)
        if getattr(self, "_spin", None) is None or rt is None or not rt.active \
                or is_generation is False:
            return original_run(self, metadata, hidden_states, q_fp8, k_fp8, k_scale, weights,
                                q_scale, is_generation)
        if getattr(self, "use_fp4", False):
            _warn_once("fp4", "FP4 indexer keys are not supported by SPIN's kernels (FP8 "
                              "only); these layers run the dense indexer")
            return original_run(self, metadata, hidden_states, q_fp8, k_fp8, k_scale, weights,
                                q_scale, is_generation)
        skip = "skip_indexer_for_gen_reqs"
        had = hasattr(metadata, skip)
        before = getattr(metadata, skip, None)
        if had:
            object.__setattr__(metadata, skip, True)
        else:
            _warn_once("skip", "this TensorRT-LLM cannot skip its decode indexer; SPIN "
                               "overwrites its top-K (correct, but no speedup)")
        try:
            buf = original_run(self, metadata, hidden_states, q_fp8, k_fp8, k_scale, weights,
                               q_scale, is_generation)
        finally:
            if had:
                object.__setattr__(metadata, skip, before)
        rows = len(rt.gen_ids) * rt.next_n
        start = 0 if is_generation else int(metadata.num_ctx_tokens)
        gen = slice(start, start + rows)
        if q_fp8.shape[0] != start + rows:
            # e.g. an MTP draft layer's own forward inside the step: not the prepared batch
            _warn_once("rows", f"indexer layer {self.layer_idx} got {q_fp8.shape[0]} query rows, "
                               f"SPIN prepared {start + rows}; this call runs the dense indexer")
            return original_run(self, metadata, hidden_states, q_fp8, k_fp8, k_scale, weights,
                                q_scale, is_generation)
        try:
            kv = metadata.kv_cache_manager.get_indexer_k_cache_buffers(self.layer_idx)
        except (AttributeError, KeyError, IndexError, RuntimeError) as err:
            # DeepSeek-V4 keeps compressed keys in another pool; unverified without a real install
            _warn_once("kcache", f"no indexer K cache for layer {self.layer_idx} ({err}); "
                                 f"the dense indexer runs")
            kv = None
        if kv is None or kv.dtype != torch.uint8 or kv.dim() < 2 or kv.shape[1] != 64:
            if kv is not None:
                _warn_once("layout", f"indexer K cache {kv.dtype} {list(kv.shape)} is not "
                                     f"64-slot FP8 pages; SPIN needs them")
            return original_run(self, metadata, hidden_states, q_fp8, k_fp8, k_scale, weights,
                                q_scale, is_generation)
        q = q_fp8[gen].reshape(rows, q_fp8.shape[-2], q_fp8.shape[-1]).contiguous()
        w = weights[gen].float().contiguous()
        rt.adapter.layer(rt.layer_index[int(self.layer_idx)], q, w, kv, out=buf[gen])
        return buf

    Indexer.__init__ = __init__
    Indexer.sparse_attn_indexer = sparse_attn_indexer


def _patch_metadata(cls: type, ratio: int) -> None:
    original = cls.prepare

    def prepare(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        rt = _runtime(self, create_ratio=ratio)
        if rt is not None:
            rt.begin(self)
        return out

    cls.prepare = prepare
    if callable(getattr(cls, "on_update_kv_lens", None)):
        original_update = cls.on_update_kv_lens

        def on_update_kv_lens(self, *args, **kwargs):
            rt = _runtime(self)
            if rt is not None and rt.active and rt.next_n > 1:
                _warn_once("overlap", "kv lens corrected on the device after prepare(): with "
                                      "MTP, SPIN needs disable_overlap_scheduler: true")
            return original_update(self, *args, **kwargs)

        cls.on_update_kv_lens = on_update_kv_lens


_LOCK = threading.Lock()
_PATCHED: list[str] = []


def activate() -> list[str]:
    """Patch TensorRT-LLM once; returns what was patched. Raises SpinError on an unsupported
    TensorRT-LLM (nothing is patched then)."""
    with _LOCK:
        if _PATCHED:
            return list(_PATCHED)
        if _version() < MIN_VERSION:
            raise SpinError(f"TensorRT-LLM {tensorrt_llm.__version__} is too old for SPIN "
                            f"(need >= {'.'.join(map(str, MIN_VERSION))})")
        found = _locate()
        done = _patch_config(found)
        _patch_indexer(found["Indexer"])
        done.append(f"{found['Indexer'].__module__}.Indexer")
        _patch_metadata(found["DSAtrtllmAttentionMetadata"], ratio=1)
        done.append("DSAtrtllmAttentionMetadata.prepare")
        v4 = found["DeepseekV4TrtllmAttentionMetadata"]
        if v4 is not None and "prepare" in v4.__dict__:
            _patch_metadata(v4, ratio=4)
            done.append("DeepseekV4TrtllmAttentionMetadata.prepare")
        _PATCHED.extend(done)
        log.info("spin_trtllm: SPIN enabled in TensorRT-LLM %s (%s)", tensorrt_llm.__version__,
                 ", ".join(done))
        return list(_PATCHED)


activate()
