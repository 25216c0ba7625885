"""`spin-trtllm build`: a deployable bundle for a DSA model with SPIN enabled.

    <out>/llm_api_options.yaml     LLM(...) keyword arguments / trtllm-serve --config file
    <out>/triton_model_repo/<name>/config.pbtxt
    <out>/triton_model_repo/<name>/1/model.py     enables SPIN, defers to TensorRT-LLM's
                                                  LLM-API Triton model
    <out>/triton_model_repo/<name>/1/model.yaml   that model's LLM(...) arguments
"""

from __future__ import annotations

import json
import os
import shlex
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from ... import __version__, predictors
from ...config import TRTLLM_ALGORITHM_TOPK, SpinConfig
from ..._inputs import one_line
from ..._outputs import check_plan, write_output
from ...errors import SpinError
from ...limits import LLMAPI_MODEL_ENV, LLMAPI_MODEL_PATH, PAGE_SIZES, SLOT_BYTES
from ...predictors import TRTLLM_DEFAULT_PREDICTOR
from .config_ext import PREDICTOR, spin_settings_of


@dataclass
class BundleOptions:
    model: str
    algorithm: str = "deepseek_v4"
    index_topk: Optional[int] = None
    tensor_parallel_size: int = 1
    max_batch_size: Optional[int] = None
    max_seq_len: Optional[int] = None
    mtp_depth: int = 0
    name: str = "spin_llm"
    llmapi_model: Optional[str] = None
    predictor: str = TRTLLM_DEFAULT_PREDICTOR


def sparse_attention_block(spin: SpinConfig, algorithm: str,
                           index_topk: Optional[int] = None,
                           predictor: str = TRTLLM_DEFAULT_PREDICTOR) -> dict[str, Any]:
    """sparse_attention_config with a `spin:` sub-block: only the SPIN fields set explicitly
    (so TensorRT-LLM's YAML stays short) and the predictor (always: a bundle keeps what it
    was built with when the default changes), and K at the
    outer level only when the user asked for one: TensorRT-LLM keeps an explicitly set
    index_topk over the checkpoint's (V4-Flash 512, V4-Pro 1024, V3.2 2048), so writing a
    default would change the model."""
    if algorithm not in TRTLLM_ALGORITHM_TOPK:
        raise SpinError(f"algorithm must be one of {sorted(TRTLLM_ALGORITHM_TOPK)}, got {algorithm!r}")
    k = index_topk if index_topk is not None else (
        spin.index_topk if "index_topk" in spin.model_fields_set else None)
    fields = {n: getattr(spin, n) for n in SpinConfig.model_fields
              if n in spin.model_fields_set and n != "index_topk"}
    block: dict[str, Any] = {"algorithm": algorithm}
    if k is not None:
        block["index_topk"] = k
    fields[PREDICTOR] = predictor
    block["spin"] = fields
    spin_settings_of(block)                  # the runtime will accept what we write
    return block


def llm_api_options(spin: SpinConfig, opts: BundleOptions) -> dict[str, Any]:
    out: dict[str, Any] = {
        "sparse_attention_config": sparse_attention_block(spin, opts.algorithm, opts.index_topk,
                                                          opts.predictor)}
    if opts.tensor_parallel_size != 1:
        out["tensor_parallel_size"] = opts.tensor_parallel_size
    if opts.max_batch_size:
        out["max_batch_size"] = opts.max_batch_size
    if opts.max_seq_len:
        out["max_seq_len"] = opts.max_seq_len
    if opts.mtp_depth:
        out["speculative_config"] = {"decoding_type": "MTP",
                                     "num_nextn_predict_layers": opts.mtp_depth}
    return out


# what `build` assumes of a model whose config.json it cannot read: the released checkpoints'
ASSUMED_SHAPES = {"deepseek_v4": {"spin_layers": 21, "max_seq_len": 1 << 20, "ratio": 4},
                  "dsa": {"spin_layers": 61, "max_seq_len": 163840, "ratio": 1}}


def model_shapes(opts: BundleOptions) -> tuple[dict[str, int], list[str]]:
    """SPIN layers, longest sequence and compress ratio of the model, from its config.json
    when the model is a local folder (else the released checkpoints' shapes), and what was
    assumed."""
    shapes = dict(ASSUMED_SHAPES[opts.algorithm])
    assumed = []
    config: dict[str, Any] = {}
    path = Path(opts.model) / "config.json"
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise SpinError(f"{path}: not readable as JSON ({err})") from None
        if not isinstance(config, dict):
            raise SpinError(f"{path}: expected a JSON object")
    layers = config.get("num_hidden_layers")
    if isinstance(layers, int) and layers > 0:
        ratios = config.get("compress_ratios")
        if shapes["ratio"] > 1 and isinstance(ratios, list):
            shapes["spin_layers"] = sum(1 for r in ratios[:layers] if r == shapes["ratio"])
        elif shapes["ratio"] == 1:
            shapes["spin_layers"] = layers
        else:
            assumed.append("SPIN layers")
    else:
        assumed.append("SPIN layers")
    if opts.max_seq_len:
        shapes["max_seq_len"] = opts.max_seq_len
    elif isinstance(config.get("max_position_embeddings"), int):
        shapes["max_seq_len"] = config["max_position_embeddings"]
    else:
        assumed.append("max sequence length")
    return shapes, assumed


def _gib(n: int) -> str:
    """GiB to two decimals, or MiB where that would read 0.00."""
    return f"{n / 2**30:.2f} GiB" if n >= 0.01 * 2**30 else f"{n / 2**20:.1f} MiB"


def memory_report(spin: SpinConfig, opts: BundleOptions) -> str:
    """What SPIN will hold on each GPU (its state and step buffers, made at the engine's first
    step, during TensorRT-LLM's start-up, before the KV cache is sized)."""
    from .adapter import SpinDecodeAdapter

    shapes, assumed = model_shapes(opts)
    batch = opts.max_batch_size or 1
    if shapes["spin_layers"] < 1:
        return "SPIN memory: the model has no SPIN (indexer) layers"
    state, total = SpinDecodeAdapter.planned_bytes(
        spin, shapes["spin_layers"], batch, shapes["max_seq_len"], shapes["ratio"],
        max_next_n=1 + opts.mtp_depth, predictor=opts.predictor)
    slots = shapes["max_seq_len"] // shapes["ratio"]
    who = f"{batch} requests" if opts.max_batch_size else \
        "1 request (pass --max-batch-size for the engine's total)"
    chosen = predictors.get(opts.predictor, engine=True)
    kept = opts.mtp_depth and chosen.history     # the EMAs read them after acceptance
    line = (f"SPIN memory on each GPU: {_gib(total)} = state {_gib(state)} "
            f"({shapes['spin_layers']} SPIN layers x {who} x {slots:,} slots, "
            f"{spin.state_dtype if chosen.history else 'no V/D: each block its last step'}) "
            f"+ step buffers {_gib(total - state)}"
            f"{' (MTP logits kept until acceptance)' if kept else ''}; made at the "
            f"engine's first step, before TensorRT-LLM sizes its KV cache")
    if chosen.query:
        row = chosen.summary_bytes
        # a page holds tokens_per_block / compress ratio slots: V4 at 128 tokens has 32
        share = {slots: row / (slots * SLOT_BYTES) for slots in PAGE_SIZES}
        line += (f"; predictor {opts.predictor}: summary tables of {row} B per "
                 f"indexer K-cache page per SPIN layer ("
                 + ", ".join(f"{share[s]:.1%} of the indexer K cache with {s}-slot pages"
                             for s in sorted(PAGE_SIZES, reverse=True))
                 + "), made when TensorRT-LLM builds its KV cache")
    if assumed:
        line += f" [assumed, no config.json: {', '.join(assumed)}]"
    return line


CONFIG_PBTXT = """# Generated by spin-trtllm {version} (`spin-trtllm build`): TensorRT-LLM's LLM-API model
# interface (the inputs its model.py reads, as its own config.pbtxt declares them), served by
# 1/model.py with SPIN enabled. max_batch_size 0: no Triton batch
# dimension (the LLM batches in flight); decoupled comes from 1/model.yaml (triton_config).
name: "{name}"
backend: "python"
max_batch_size: 0

input [
  {{ name: "text_input", data_type: TYPE_STRING, dims: [ -1 ] }},
  {{ name: "streaming", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }},
  {{ name: "return_finish_reason", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }},
  {{ name: "stop", data_type: TYPE_BOOL, dims: [ 1 ], optional: true }},
  {{ name: "sampling_param_max_tokens", data_type: TYPE_INT32, dims: [ 1 ], optional: true }},
  {{ name: "sampling_param_temperature", data_type: TYPE_FP32, dims: [ 1 ], optional: true }},
  {{ name: "sampling_param_top_k", data_type: TYPE_INT32, dims: [ 1 ], optional: true }},
  {{ name: "sampling_param_top_p", data_type: TYPE_FP32, dims: [ 1 ], optional: true }},
  {{ name: "sampling_param_seed", data_type: TYPE_UINT64, dims: [ 1 ], optional: true }}
]
output [
  {{ name: "text_output", data_type: TYPE_STRING, dims: [ -1 ] }},
  {{ name: "finish_reason", data_type: TYPE_STRING, dims: [ -1 ] }}
]
instance_group [
  {{ count: 1, kind: KIND_CPU }}
]
"""

MODEL_PY = '''"""Triton Python model generated by spin-trtllm {version} (`spin-trtllm build`).

Serves through TensorRT-LLM's own LLM-API Triton model
({path}), which reads model.yaml beside this
file. When UPSTREAM below is not that file ('': spin-trtllm build did not find it), set
{env} in tritonserver's environment to it. SPIN is activated when that model
imports tensorrt_llm (after MPI and CUDA_VISIBLE_DEVICES are set), not here.
"""

import importlib.util
import os
import sys

from spin_trtllm.integrations.trtllm.deferred import activate_on_import

activate_on_import()   # patches TensorRT-LLM's DSA indexer as soon as it is imported

ENV = {env!r}
UPSTREAM = os.environ.get(ENV, {upstream!r})


def _load_upstream():
    if not UPSTREAM or not os.path.isfile(UPSTREAM):
        where = f"is not at {{UPSTREAM!r}}" if UPSTREAM else "was not found by spin-trtllm build"
        raise RuntimeError(
            f"spin-trtllm bundle: TensorRT-LLM's LLM-API Triton model {{where}}: set {{ENV}} in "
            "tritonserver's environment to your TensorRT-LLM checkout's "
            "{path} "
            "(or rebuild the bundle with spin-trtllm build --llmapi-model)")
    sys.path.insert(0, os.path.dirname(UPSTREAM))      # its helpers sit beside it
    spec = importlib.util.spec_from_file_location("trtllm_llmapi_model", UPSTREAM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TritonPythonModel(_load_upstream().TritonPythonModel):
    """TensorRT-LLM's LLM-API model; SPIN comes from sparse_attention_config.spin in model.yaml."""
'''

def model_folder_warning(model: str) -> Optional[str]:
    """A warning when MODEL is a local folder without config.json (a Hugging Face checkpoint
    folder has one; TensorRT-LLM reads it at load time), or looks like a missing folder (an
    org/name whose org is a local folder), else None. Hub ids stay allowed."""
    folder = Path(model)
    if folder.is_dir():
        if (folder / "config.json").is_file():
            return None
        empty = not any(folder.iterdir())
        return (f"model folder {model} is {'empty' if empty else 'without config.json'}: not "
                f"a Hugging Face checkpoint folder; the bundle points at it anyway")
    if not folder.exists() and str(folder.parent) != "." and folder.parent.is_dir():
        return (f"model {model}: no such folder (but {folder.parent} is one); the bundle "
                f"names it as a hub id")
    return None


def find_llmapi_model() -> str:
    """TensorRT-LLM's LLM-API Triton model.py next to an installed tensorrt_llm (a source
    checkout keeps triton_backend/ beside the package), or '' when it cannot be found."""
    import importlib.util

    spec = importlib.util.find_spec("tensorrt_llm")
    if spec is None or not spec.origin:
        return ""
    candidate = Path(spec.origin).parent.parent / LLMAPI_MODEL_PATH
    return str(candidate) if candidate.is_file() else ""


def next_steps(opts: BundleOptions, out_dir: str | Path) -> tuple[list[str], Optional[str]]:
    """What `spin-trtllm build` prints after the bundle: the commands that serve it, and a
    warning when model.py does not know where TensorRT-LLM's LLM-API model is (it then fails
    at Triton load unless LLMAPI_MODEL_ENV names that file)."""
    out = Path(out_dir)
    upstream = opts.llmapi_model or find_llmapi_model()
    env = "" if upstream else f"{LLMAPI_MODEL_ENV}=/path/to/TensorRT-LLM/{LLMAPI_MODEL_PATH} "
    lines = [
        "next:",
        f"  trtllm-serve with SPIN: spin-trtllm serve {shlex.quote(opts.model)} --config "
        f"{shlex.quote(str(out / 'llm_api_options.yaml'))}",
        f"  Triton: {env}tritonserver --model-repository "
        f"{shlex.quote(str(out / 'triton_model_repo'))}",
        "    (tritonserver's Python needs spin-trtllm and tensorrt_llm installed)",
        f"  a request: python examples/trtllm/client.py --url localhost:8001 --model "
        f"{opts.name} Hello  (gRPC; pip install \"spin-trtllm[triton]\")",
    ]
    warning = None if upstream else (
        f"TensorRT-LLM's LLM-API Triton model ({LLMAPI_MODEL_PATH}) was not found: "
        f"tensorrt_llm is not installed here and --llmapi-model was not given, so the bundle's "
        f"model.py fails at Triton load unless {LLMAPI_MODEL_ENV} names that file in "
        f"tritonserver's environment")
    return lines, warning


def model_yaml(spin: SpinConfig, opts: BundleOptions) -> dict[str, Any]:
    out: dict[str, Any] = {"model": opts.model, "backend": "pytorch",
                           "tensor_parallel_size": opts.tensor_parallel_size,
                           "pipeline_parallel_size": 1,
                           # 0 as upstream ships it: Triton adds no batch dimension (the
                           # LLM batches in flight; its max_batch_size is set below)
                           "triton_config": {"max_batch_size": 0, "decoupled": False}}
    extra = llm_api_options(spin, opts)
    extra.pop("tensor_parallel_size", None)
    out.update(extra)
    return out


def _dump(data: dict[str, Any], header: str) -> str:
    return f"# {header}\n" + yaml.safe_dump(data, sort_keys=False)


def bundle_files(spin: SpinConfig, opts: BundleOptions, out_dir: str | Path,
                 force: bool = False, inputs: Sequence[tuple[str, str]] = ()) -> dict[Path, str]:
    """The bundle's files and their text, every check done: OUTPUT is a folder (or can be
    made one), empty unless `force`; no file of the bundle is reached through a symbolic
    link (so --force never writes outside OUTPUT) or is one of the run's `inputs`."""
    out = Path(out_dir)
    if not opts.name.replace("_", "").replace("-", "").isalnum():
        raise SpinError(f"--name {opts.name!r}: use letters, digits, '_' and '-' only")
    if out.exists() and any(out.iterdir()) and not force:
        raise SpinError(f"{one_line(out, 300)} exists and is not empty (pass --force to "
                        f"overwrite the bundle files in it)")
    header = f"generated by spin-trtllm {__version__} (`spin-trtllm build`)"
    repo = Path("triton_model_repo") / opts.name
    files = {
        Path("llm_api_options.yaml"): _dump(llm_api_options(spin, opts), header),
        repo / "config.pbtxt": CONFIG_PBTXT.format(version=__version__, name=opts.name),
        repo / "1" / "model.py": MODEL_PY.format(
            version=__version__, upstream=opts.llmapi_model or find_llmapi_model(),
            env=LLMAPI_MODEL_ENV, path=LLMAPI_MODEL_PATH),
        repo / "1" / "model.yaml": _dump(model_yaml(spin, opts), header),
    }
    for rel in files:
        _check_inside(out, rel)
    check_plan([("bundle file", out / rel) for rel in files], inputs, parents=True)
    return {out / rel: text for rel, text in files.items()}


def _check_inside(out: Path, rel: Path) -> None:
    """Every existing step from OUTPUT down to OUTPUT/rel is a real folder (the last a
    regular file or nothing): no symbolic link can lead the write elsewhere."""
    step = out
    for i, part in enumerate(rel.parts):
        step = step / part
        last = i == len(rel.parts) - 1
        try:
            st = os.lstat(step)
        except FileNotFoundError:
            return
        where = one_line(step, 300)
        if stat.S_ISLNK(st.st_mode):
            raise SpinError(f"{where}: is a symbolic link; the bundle is written only inside "
                            f"{one_line(out, 300)} (remove the link)")
        if not last and not stat.S_ISDIR(st.st_mode):
            raise SpinError(f"{where}: is not a folder (the bundle needs one there)")
        if last and not stat.S_ISREG(st.st_mode):
            raise SpinError(f"{where}: is not a regular file (the bundle writes a file there)")


def write_bundle(spin: SpinConfig, opts: BundleOptions, out_dir: str | Path,
                 force: bool = False, inputs: Sequence[tuple[str, str]] = ()) -> list[Path]:
    """Check everything (bundle_files), then write each file by the output rule."""
    return write_files(out_dir, bundle_files(spin, opts, out_dir, force, inputs))


def write_files(out_dir: str | Path, files: dict[Path, str]) -> list[Path]:
    out = Path(out_dir)
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        _check_inside(out, path.relative_to(out))      # again: nothing planted meanwhile
        write_output(path, "bundle file", text)
    return list(files)
