"""Activate SPIN inside TensorRT-LLM's PyTorch backend (needs tensorrt_llm).

SPIN drives the engine's own indexer kernel: in a SPIN layer's decode step, the paged-logits
call that upstream makes (DeepGEMM fp8_paged_mqa_logits, or its FP4 variant) gets a compacted
block table (the pages of the blocks SPIN selected, in order) and compact lengths, so it scores
only those blocks with upstream's kernel, key dtype and page size; the decode top-K that
follows runs SPIN's top-K, which writes request-local slot ids into upstream's own output rows.
Everything upstream does around the two calls (GVR prior, MTP index sharing, the local-to-global
conversion, sparse MLA) is unchanged and sees SPIN's rows.

What activation patches (each once; a second activate() is a no-op):
- DeepSeekSparseAttentionConfig / DeepSeekV4SparseAttentionConfig get a `spin:` field (YAML,
  LLM(...), trtllm-serve and Triton's model.yaml accept it);
- ModelConfig.from_pretrained, which rebuilds those configs from a fixed field list, carries
  the `spin` block over to the rebuilt config;
- to_sparse_params() hands the SpinConfig (K = the layer's resolved index_topk) to every indexer
  layer except MTP draft layers (layer_idx >= num_hidden_layers), which stay dense;
- Indexer.__init__ registers SPIN layers; the DSA and DeepSeek-V4 metadata's prepare() does
  the step's host bookkeeping (state realigned by request id, buffers refilled; runtime.py),
  and the first SPIN layer's call selects every layer's blocks on the device, inside the
  forward (and so inside a captured CUDA graph);
- the one-model speculative workers' sample_and_accept_draft_tokens (SPEC_MODULES) run the
  deferred MTP updates with the device acceptance right after it returns;
- Indexer.sparse_attn_indexer (any argument order: release 1.2's use_custom_topk or main's
  q_scale/is_generation) marks the call as a SPIN decode call; the indexer module's paged
  logits functions and the decode top-K (TopK.forward; release 1.2:
  torch.ops.trtllm.indexer_topk_decode) act only on such calls and fall through otherwise.

DeepSeek-V4.1 runs on the CSA2 backend, not the DSA Indexer: nothing of it is patched (one log
line says so). Anything this module cannot find is reported by name and nothing is patched.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import logging
import threading
from typing import Any, Callable, Literal, Optional

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
from ...logits.deepgemm import (SCHEDULE_FN, LayerInputs, ScheduleSource,
                                 compact_paged_logits)
from ...predictors import ENGINE_PREDICTORS, TRTLLM_DEFAULT_PREDICTOR
from .runtime import (_BASE_LAYERS, _LAYERS, _RUNTIME_ATTR, _SPEC_WORKERS, SPEC_MODULES,  # noqa: F401
                      _Runtime, _runtime, _warn_once)
from .config_ext import FIELD, SpinSettings, add_spin_field, spin_settings_of

log = logging.getLogger("spin_trtllm")
MIN_VERSION = (1, 2)
PACKAGES = ("tensorrt_llm._torch.attention.backends.sparse",      # main (1.3+)
            "tensorrt_llm._torch.attention_backend.sparse")       # release 1.2
LOGITS_FNS = ("fp8_paged_mqa_logits", "fp8_fp4_paged_mqa_logits")
V41_MODULE = "tensorrt_llm._torch.models.modeling_deepseekv41"


class SpinBlock(SpinConfig):
    """The `spin:` field type: SpinConfig's fields and the block predictor (spin, probe, hybrid
    or gauss; spin_settings_of splits them). Unpickling it (e.g. in TensorRT-LLM's worker
    processes) imports this module, which activates SPIN there too."""

    predictor: Literal[ENGINE_PREDICTORS] = TRTLLM_DEFAULT_PREDICTOR


def _version() -> tuple[int, ...]:
    parts = []
    for p in str(getattr(tensorrt_llm, "__version__", "0")).split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _import(name: str) -> Optional[Any]:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _find(names: list[str], attr: str) -> Optional[Any]:
    for name in names:
        module = _import(name)
        if module is not None and hasattr(module, attr):
            return getattr(module, attr)
    return None


def _locate() -> dict[str, Any]:
    llm_args = "tensorrt_llm.llmapi.llm_args"
    found = {
        "Indexer": _find([f"{p}.dsa.indexer" for p in PACKAGES] + [f"{p}.dsa" for p in PACKAGES],
                         "Indexer"),
        "DSAtrtllmAttentionMetadata": _find(
            [f"{p}.dsa.metadata" for p in PACKAGES] + [f"{p}.dsa" for p in PACKAGES],
            "DSAtrtllmAttentionMetadata"),
        "DeepSeekSparseAttentionConfig": _find([llm_args], "DeepSeekSparseAttentionConfig"),
        "BaseLlmArgs": _find([llm_args], "BaseLlmArgs"),
        "TorchLlmArgs": _find([llm_args], "TorchLlmArgs"),
    }
    missing = [k for k, v in found.items() if v is None]
    if missing:
        raise SpinError(f"TensorRT-LLM {tensorrt_llm.__version__}: cannot find {missing} in the "
                        f"module layout spin-trtllm targets; this version is not supported")
    for cls, method in (("Indexer", "sparse_attn_indexer"), ("DSAtrtllmAttentionMetadata", "prepare")):
        if not callable(getattr(found[cls], method, None)):
            raise SpinError(f"TensorRT-LLM {tensorrt_llm.__version__}: {cls}.{method} not found; "
                            f"this version is not supported")
    module = inspect.getmodule(found["Indexer"])
    fns = [n for n in LOGITS_FNS if callable(getattr(module, n, None))]
    if "fp8_paged_mqa_logits" not in fns or not callable(getattr(module, SCHEDULE_FN, None)):
        raise SpinError(f"TensorRT-LLM {tensorrt_llm.__version__}: {module.__name__} does not "
                        f"call DeepGEMM's fp8_paged_mqa_logits / {SCHEDULE_FN}; this version is "
                        f"not supported")
    params = list(inspect.signature(found["Indexer"].sparse_attn_indexer).parameters)
    expected = ["self", "metadata", "hidden_states", "q_fp8", "k_fp8", "k_scale", "weights"]
    if params[:7] != expected:
        raise SpinError(f"TensorRT-LLM {tensorrt_llm.__version__}: Indexer.sparse_attn_indexer"
                        f"{tuple(params[1:])} differs from the expected {tuple(expected[1:])}; "
                        f"this version is not supported")
    found["indexer_module"], found["logits_fns"] = module, fns
    found["legacy"] = "use_custom_topk" in params
    # main rebuilds the sparse config in ModelConfig.from_pretrained and lowers it per layer
    # with to_sparse_params(); release 1.2 hands the pydantic config to the Indexer itself
    found["ModelConfig"] = _find(["tensorrt_llm._torch.model_config"], "ModelConfig")
    if not found["legacy"]:
        for cls, method in (("DeepSeekSparseAttentionConfig", "to_sparse_params"),
                            ("ModelConfig", "from_pretrained")):
            if not callable(getattr(found[cls], method, None)):
                raise SpinError(f"TensorRT-LLM {tensorrt_llm.__version__}: {cls}.{method} not "
                                f"found; this version is not supported")
    found["TopK"] = _find(["tensorrt_llm._torch.modules.top_k"], "TopK")
    if not found["legacy"] and found["TopK"] is None:
        raise SpinError(f"TensorRT-LLM {tensorrt_llm.__version__}: no TopK module "
                        f"(tensorrt_llm._torch.modules.top_k) for the decode top-K")
    found["DeepSeekV4SparseAttentionConfig"] = _find([llm_args], "DeepSeekV4SparseAttentionConfig")
    found["LlmArgs"] = _find([llm_args], "LlmArgs")
    found["DeepseekV4TrtllmAttentionMetadata"] = _find(
        [f"{p}.deepseek_v4.metadata" for p in PACKAGES] + [f"{p}.deepseek_v4" for p in PACKAGES],
        "DeepseekV4TrtllmAttentionMetadata")
    return found


class _KernelCall:
    """The paged-logits call upstream is making, replayed over SPIN's selection."""

    def __init__(self, fn: Callable, schedule_fn: Callable, num_sms: int, block_kv: int,
                 page_slots: int, q: Any, expanded: bool, one_dim_lens: bool,
                 extra: tuple, kwargs: dict):
        self.fn, self.schedule_fn, self.num_sms, self.block_kv = fn, schedule_fn, num_sms, block_kv
        self.page_slots, self.q, self.expanded = page_slots, q, expanded
        self.one_dim_lens, self.extra, self.kwargs = one_dim_lens, extra, kwargs
        self.name, self.needs_out = "tensorrt_llm", False

    def schedule_source(self, context_lens: torch.Tensor) -> Optional[ScheduleSource]:
        """The schedule this call builds per layer, or None where StepCompaction cannot stand
        in (one request per MTP row, or one length a request)."""
        if self.expanded or self.one_dim_lens:
            return None
        return ScheduleSource(self.schedule_fn, self.block_kv, self.num_sms)

    def run(self, q, kv_cache, weights, context_lens, block_table, block_ids, counts, out=None,
            prepared: Optional[LayerInputs] = None):
        return compact_paged_logits(
            functools.partial(self.fn, **self.kwargs), self.schedule_fn, self.num_sms,
            self.block_kv, self.q, kv_cache, weights, context_lens, block_table, block_ids,
            counts, self.page_slots, self.expanded, *self.extra, one_dim_lens=self.one_dim_lens,
            prepared=prepared)


class _LayerCall:
    """A SPIN layer's decode call in flight (set by sparse_attn_indexer for its duration)."""

    def __init__(self, rt: _Runtime, indexer: Any, md: Any, found: dict[str, Any]):
        self.rt, self.ix = rt, rt.adapter.indexer
        self.layer = rt.layer_index[int(indexer.layer_idx)]
        self.layer_idx = int(indexer.layer_idx)
        self.md, self.found = md, found
        self.logits: Optional[torch.Tensor] = None
        self.lens: Optional[torch.Tensor] = None
        self.done = False

    def run_logits(self, original: Callable, q: Any, kv_cache: torch.Tensor,
                   weights: torch.Tensor, context_lens: torch.Tensor, extra: tuple,
                   kwargs: dict) -> Optional[torch.Tensor]:
        """SPIN's compact logits, or None when this call is not the prepared batch."""
        q_rows = q[0] if isinstance(q, tuple) else q
        B, R = self.ix.batch, self.ix.next_n
        shape = tuple(q_rows.shape[:2])
        if shape not in ((B, R), (B * R, 1)):
            _warn_once("rows", f"indexer layer {self.layer_idx}: query rows {list(shape)} are not "
                               f"the prepared batch ({B} requests x next_n {R}); this call runs "
                               f"the dense indexer")
            self.rt.adapter.layers_skipped()
            return None
        if kv_cache.shape[1] != self.ix.page_slots:
            _warn_once("pages", f"indexer K cache pages of {kv_cache.shape[1]} slots, SPIN "
                                f"prepared {self.ix.page_slots}; this call runs the dense indexer")
            self.rt.adapter.layers_skipped()
            return None
        module = self.found["indexer_module"]
        block_kv = int(getattr(module, "_DG_SCHEDULE_BLOCK_KV", 0) or kv_cache.shape[1])
        num_sms = int(getattr(self.md, "num_sms", 0) or module.get_num_sms())
        if self.found["legacy"] and shape == (B, 4):
            num_sms //= 2     # release 1.2 builds the next_n 4 schedule for half the SMs
        call = _KernelCall(original, getattr(module, SCHEDULE_FN), num_sms, block_kv,
                           self.ix.page_slots, q, shape == (B * R, 1) and R > 1,
                           context_lens.dim() == 1, extra, kwargs)
        self.logits, self.lens = self.ix.layer_logits(self.layer, q, weights, kv_cache,
                                                      backend=call)
        return self.logits

    def run_topk(self, out: torch.Tensor) -> None:
        self.ix.layer_topk(self.layer, self.logits, self.lens, out=out)
        self.done = True


_CALL: contextvars.ContextVar[Optional[_LayerCall]] = contextvars.ContextVar(
    "spin_trtllm_layer_call", default=None)


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
            settings = spin_settings_of(self)
            if settings is None:
                return params
            spin = settings.config
            pretrained = kwargs.get("pretrained_config")
            base_layers = getattr(pretrained, "num_hidden_layers", _BASE_LAYERS.get(id(self)))
            layer_idx = kwargs.get("layer_idx")
            if base_layers is not None and layer_idx is not None and layer_idx >= base_layers:
                return params               # an MTP draft layer: its indexer stays dense
            k = getattr(params, "index_topk", None)
            if k is not None and k != spin.index_topk:
                spin = spin.with_overrides(index_topk=int(k))     # K from the checkpoint
            object.__setattr__(params, "spin", SpinSettings(spin, settings.predictor))
            return params

        cls.to_sparse_params = to_sparse_params
    return [f"{name}.spin" for name in changed]


def _patch_model_config(ModelConfig: type, configs: tuple) -> None:
    """from_pretrained rebuilds the sparse config from a fixed field list, dropping `spin`."""
    original = ModelConfig.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        given = kwargs.get("sparse_attention_config")
        spin = getattr(given, FIELD, None) if given is not None else None
        result = original(cls, *args, **kwargs)
        if spin is None:
            return result
        rebuilt = result.sparse_attention_config
        arch = str((getattr(result.pretrained_config, "architectures", None) or ["?"])[0])
        csa2 = "v41" in arch.lower().replace("_", "") or \
            getattr(rebuilt, "variant", None) == "v41" or getattr(rebuilt, "algorithm", "") == "csa2"
        if csa2 or not isinstance(rebuilt, configs):
            if isinstance(rebuilt, configs):
                object.__setattr__(rebuilt, FIELD, None)
            _warn_once("v41", f"{arch} does not use TensorRT-LLM's DSA indexer (DeepSeek-V4.1 "
                              f"runs on the CSA2 backend and its own candidate prefilter): the "
                              f"spin block is ignored and the model runs as upstream ships it")
        else:
            if getattr(rebuilt, FIELD, None) is None:
                object.__setattr__(rebuilt, FIELD, spin)
                rebuilt.__pydantic_fields_set__.add(FIELD)
            # to_sparse_params may be called without the checkpoint config: MTP layers
            # (layer_idx >= num_hidden_layers) are still known
            layers = getattr(result.pretrained_config, "num_hidden_layers", None)
            if layers is not None:
                _BASE_LAYERS[id(rebuilt)] = int(layers)
        return result

    ModelConfig.from_pretrained = classmethod(from_pretrained)


def _patch_indexer(found: dict[str, Any]) -> None:
    Indexer, legacy = found["Indexer"], found["legacy"]
    original_init = Indexer.__init__
    original_run = Indexer.sparse_attn_indexer
    init_sig = inspect.signature(original_init)
    run_sig = inspect.signature(original_run)

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        bound = init_sig.bind(self, *args, **kwargs).arguments
        params = bound.get("sparse_params", bound.get("sparse_attention_config"))
        settings = getattr(params, "spin", None)
        if settings is not None and legacy:
            settings = spin_settings_of(params)      # 1.2 passes the pydantic config itself
            base_layers = _BASE_LAYERS.get(id(params))
            if base_layers is not None and int(getattr(self, "layer_idx", 0)) >= base_layers:
                settings = None  # an MTP draft layer (1.2 builds it from the same config): dense
        k = getattr(self, "index_topk", None)
        if settings is not None and k is not None and k != settings.config.index_topk:
            settings = SpinSettings(settings.config.with_overrides(index_topk=int(k)),
                                    settings.predictor)              # the layer's resolved K
        if settings is not None and getattr(self, "use_cute_dsl_paged_mqa_logits", False):
            _warn_once("dsl", f"indexer layer {self.layer_idx} uses the CuTe DSL paged logits, "
                              f"which SPIN cannot drive; it runs the dense indexer")
            settings = None
        object.__setattr__(self, "_spin", settings)
        if settings is not None:
            _LAYERS[int(self.layer_idx)] = settings

    def sparse_attn_indexer(self, *args, **kwargs):
        if getattr(self, "_spin", None) is None:
            return original_run(self, *args, **kwargs)
        bound = run_sig.bind(self, *args, **kwargs).arguments
        md = bound["metadata"]
        rt = _runtime(md)
        call = None
        if rt is not None and rt.active and bound.get("is_generation") is not False \
                and not getattr(md, "in_mtp_draft_loop", False):
            if legacy and not bound.get("use_custom_topk", True):
                _warn_once("custom_topk", "use_custom_topk=False: SPIN needs the custom decode "
                                          "top-K; these calls run the dense indexer")
                rt.adapter.layers_skipped()
            elif int(self.layer_idx) not in rt.layer_index:
                _warn_once("late", f"indexer layer {self.layer_idx} registered after the model's "
                                   f"SPIN state was made (one SPIN model per process); it runs "
                                   f"the dense indexer")
            else:
                call = _LayerCall(rt, self, md, found)
                if call.layer == 0:
                    rt.start_forward(md)
        token = _CALL.set(call)
        try:
            out = original_run(self, *args, **kwargs)
        finally:
            _CALL.reset(token)
        if call is not None and call.logits is not None and not call.done:
            raise SpinError(f"indexer layer {self.layer_idx}: SPIN's logits were computed but "
                            f"the decode top-K did not come through SPIN; this TensorRT-LLM's "
                            f"decode path is not supported")
        return out

    Indexer.__init__ = __init__
    Indexer.sparse_attn_indexer = sparse_attn_indexer


def _patch_logits(found: dict[str, Any]) -> None:
    """The indexer module's paged-logits functions: SPIN's compacted call inside a SPIN layer's
    decode call, upstream's otherwise."""
    module = found["indexer_module"]
    for name in found["logits_fns"]:
        original = getattr(module, name)

        def hook(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                 max_context_len, *extra, _original=original, **kwargs):
            call = _CALL.get()
            if call is not None and call.logits is None:
                logits = call.run_logits(_original, q, kv_cache, weights, context_lens, extra,
                                         kwargs)
                if logits is not None:
                    return logits
            return _original(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                             max_context_len, *extra, **kwargs)

        setattr(module, name, functools.wraps(original)(hook))


def _patch_topk(found: dict[str, Any]) -> None:
    """The decode top-K over SPIN's compact logits: SPIN's (slot ids into upstream's rows)."""
    if not found["legacy"]:
        TopK = found["TopK"]
        original = TopK.forward

        def forward(self, scores, output_indices, *args, is_prefill: bool = False, **kwargs):
            call = _CALL.get()
            if call is not None and not is_prefill and scores is call.logits:
                call.run_topk(output_indices)
                return output_indices
            return original(self, scores, output_indices, *args, is_prefill=is_prefill, **kwargs)

        TopK.forward = forward
        return
    ns = torch.ops.trtllm
    original_op = getattr(ns, "indexer_topk_decode")

    def indexer_topk_decode(logits, *args, **kwargs):
        call = _CALL.get()
        if call is not None and logits is call.logits:
            out = args[1] if len(args) > 1 else kwargs["out"]
            call.run_topk(out)
            return None
        return original_op(logits, *args, **kwargs)

    setattr(ns, "indexer_topk_decode", indexer_topk_decode)


def _patch_metadata(cls: type, ratio: int) -> None:
    original = cls.prepare

    def prepare(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        rt = _runtime(self, create_ratio=ratio)
        if rt is not None:
            rt.begin(self)
        return out

    cls.prepare = prepare


def _patch_spec_workers() -> list[str]:
    """TensorRT-LLM's one-model speculative workers verify the drafts inside the model's
    forward (inside its CUDA graph): sample_and_accept_draft_tokens returns the accepted
    tokens per request on the device. SPIN's deferred MTP updates run right after it, in the
    same forward, with exactly that acceptance (the host never needs it)."""
    done = []
    for name in SPEC_MODULES:
        module = _import(name)
        if module is None:
            continue
        for attr, cls in list(vars(module).items()):
            if not isinstance(cls, type) or cls.__module__ != module.__name__ or \
                    "sample_and_accept_draft_tokens" not in cls.__dict__:
                continue
            original = cls.sample_and_accept_draft_tokens
            signature = inspect.signature(original)
            if "attn_metadata" not in signature.parameters:
                continue

            def sample_and_accept_draft_tokens(self, *args, _original=original,
                                               _signature=signature, **kwargs):
                out = _original(self, *args, **kwargs)
                md = _signature.bind(self, *args, **kwargs).arguments["attn_metadata"]
                rt = _runtime(md)
                if rt is not None and isinstance(out, tuple) and len(out) >= 2 and \
                        torch.is_tensor(out[1]):
                    rt.on_accepted(md, out[1])
                return out

            cls.sample_and_accept_draft_tokens = functools.wraps(original)(
                sample_and_accept_draft_tokens)
            done.append(f"{name}.{attr}.sample_and_accept_draft_tokens")
    return done


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
        configs = tuple(c for c in (found["DeepSeekSparseAttentionConfig"],
                                    found["DeepSeekV4SparseAttentionConfig"]) if c is not None)
        if found["ModelConfig"] is not None:
            _patch_model_config(found["ModelConfig"], configs)
            done.append("ModelConfig.from_pretrained")
        _patch_indexer(found)
        done.append(f"{found['Indexer'].__module__}.Indexer")
        _patch_logits(found)
        done += [f"{found['indexer_module'].__name__}.{n}" for n in found["logits_fns"]]
        _patch_topk(found)
        done.append("torch.ops.trtllm.indexer_topk_decode" if found["legacy"]
                    else "TopK.forward")
        _SPEC_WORKERS.extend(_patch_spec_workers())
        done += _SPEC_WORKERS
        _patch_metadata(found["DSAtrtllmAttentionMetadata"], ratio=1)
        done.append("DSAtrtllmAttentionMetadata.prepare")
        v4 = found["DeepseekV4TrtllmAttentionMetadata"]
        if v4 is not None and "prepare" in v4.__dict__:
            _patch_metadata(v4, ratio=4)
            done.append("DeepseekV4TrtllmAttentionMetadata.prepare")
        _PATCHED.extend(done)
        log.info("spin_trtllm: SPIN enabled in TensorRT-LLM %s (%s)", tensorrt_llm.__version__,
                 ", ".join(done))
        if _import(V41_MODULE) is not None:
            log.info("spin_trtllm: DeepSeek-V4.1 (CSA2 backend, %s) is left as upstream ships "
                     "it: SPIN applies to the DSA indexer of DeepSeek-V3.2 and V4", V41_MODULE)
        return list(_PATCHED)


activate()
