"""`spin-trtllm` command line. Bad input: exit code 2 and one line on stderr."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Optional, Sequence

import yaml

from .. import _inputs
from ..config import MAX_BLOCK_SIZE, MAX_INDEX_TOPK, TRTLLM_ALGORITHM_TOPK
from ..limits import MAX_NEXT_N
from ..options import LOGITS_BACKENDS, SWITCHES
from ..predictors import BUDGETS, ENGINE_PREDICTORS, REPLAY_PREDICTORS
from .._inputs import one_line
from ._common import (INPUT_ERRORS, INT32_MAX, _add_checkpoint, _add_common, _add_config_flags,
                      _add_device, _add_traces, _check_args, _int, _Parser, _rule)
from .deploy import cmd_build, cmd_serve
from .engine import cmd_demo, cmd_trace, cmd_train_tiny, train_tiny_outputs
from .replay import cmd_ablate, cmd_compare_predictors, cmd_info, cmd_replay, cmd_synth


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="spin-trtllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("replay", help="replay SPIN over traces and report miss/sparsity")
    _add_traces(p)
    _add_common(p)
    _add_config_flags(p)
    _rule(p.add_argument("--plot", help="image (PNG unless another extension): mean/p99 miss "
                                        "vs realized sparsity"), "plot")
    _rule(p.add_argument("--mask-plot", help="image: Figure-1-style top-K mask of one layer, "
                                             "with the blocks SPIN skipped at the last target "
                                             "sparsity"), "plot", "per-trace")
    _int(p, "--mask-layer", 0, INT32_MAX, default=0)
    _int(p, "--mask-slots", 1, INT32_MAX, help="slots shown in --mask-plot (default all)")
    p.add_argument("--predictor", choices=REPLAY_PREDICTORS,
                   default="spin",
                   help="block scores selection ranks by: spin (V/D history), or, with a trace "
                        "v2, probe (block mean keys x query), hybrid (probe + history), quest "
                        "(min/max bound), gauss (mean key and per-dim spread: the expected "
                        "slot score through the ReLU)")
    p.add_argument("--budget", choices=BUDGETS, default="uniform",
                   help="per-layer blocks: uniform, or adaptive (same total per step)")
    p.add_argument("--summaries", type=int, choices=[1, 2], default=1,
                   help="probe/hybrid: summary keys per block (2: the two halves' means)")
    p.add_argument("--effective", type=float, nargs="+", metavar="E",
                   help="also report miss interpolated at these effective sparsities "
                        "(give --sparsity targets that bracket them)")
    p.set_defaults(func=cmd_replay, spec_=p)

    p = sub.add_parser("ablate", help="the paper's ablations (reduction, exploration, mtp) and "
                                      "fp32 vs fp16 vs fp8 state (state_dtype)")
    _add_traces(p)
    # replay.evaluate.STUDIES (not imported here: it pulls in torch)
    p.add_argument("--study", required=True,
                   choices=["reduction", "exploration", "mtp", "state_dtype"])
    _add_common(p)
    _add_config_flags(p)
    _rule(p.add_argument("--plot", help="image: miss vs realized sparsity per variant"), "plot")
    p.set_defaults(func=cmd_ablate, spec_=p)

    p = sub.add_parser("compare-predictors", help="Table 1: prev-iter vs prev-layer vs random")
    _add_traces(p)
    p.add_argument("--index-topk", type=int, help=f"K (default: the trace's metadata) "
                                                  f"[1..{MAX_INDEX_TOPK}]")
    _add_common(p, sparsity=False)
    p.set_defaults(func=cmd_compare_predictors, spec_=p)

    p = sub.add_parser("synth", help="write a synthetic SPIN trace v1")
    _rule(p.add_argument("output", metavar="OUT.safetensors"), "out")
    from ..replay.synth import SynthConfig

    bounds = {"index_topk": MAX_INDEX_TOPK, "block_size": MAX_BLOCK_SIZE, "diagonal_bands": 64}
    for f in dataclasses.fields(SynthConfig):
        kind = type(f.default)
        action = p.add_argument("--" + f.name.replace("_", "-"), dest=f.name,
                                type=kind if kind in (int, float) else str,
                                help=f"default {f.default}")
        if f.name in bounds:
            _rule(action, "int", 0 if f.name == "diagonal_bands" else 1, bounds[f.name])
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_synth, spec_=p)

    p = sub.add_parser("info", help="validate traces and print their shape and metadata "
                                    "(v2: and check the scores against q, w and keys)")
    _add_traces(p)
    p.set_defaults(func=cmd_info, spec_=p)

    p = sub.add_parser("demo", help="the main job: dsa-lite decoding with SPIN and with the "
                                    "all-keep indexer, side by side")
    _add_device(p)
    _int(p, "--requests", 1, 1024, default=4)
    _int(p, "--prompt-tokens", 1, 1 << 17, default=1600, help="longest prompt (bytes)")
    _int(p, "--new-tokens", 1, 1 << 16, default=48)
    _int(p, "--batch", 1, 256, default=4, help="max requests decoding together")
    p.add_argument("--mtp", type=int, default=0, choices=range(0, MAX_NEXT_N), metavar="D",
                   help="MTP draft depth (next_n = D + 1)")
    p.add_argument("--sparsity", type=float, help="SPIN target block sparsity (default 0.5)")
    _add_checkpoint(p, "dsa-lite safetensors checkpoint (default: the shipped model trained "
                       "on the Python standard library)")
    p.add_argument("--random-weights", action="store_true",
                   help="seeded random weights: tiny() on the CPU, v4_flash_indexer() on a GPU")
    p.add_argument("--measure-miss", action="store_true",
                   help="run a shadow dense indexer and report SPIN's miss rate")
    _rule(p.add_argument("--dump-trace", metavar="FILE",
                         help="write SPIN trace v2 of request 0"), "out")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="GPU: replay captured decode steps (no indexer time split)")
    p.add_argument("--logits-backend", default="native", choices=LOGITS_BACKENDS,
                   help="decode indexer logits of both engines: spin's masked kernel (native), "
                        "DeepGEMM over a compacted block table (deepgemm; CUDA, SM90+), or "
                        "plain PyTorch (reference)")
    p.add_argument("--switch", choices=SWITCHES,
                   help="SPIN engine's indexer per step: auto (all-keep where the cost model says "
                        "SPIN would not pay), spin, dense. Default: spin for the quality run, "
                        "auto for the GPU step timing")
    p.add_argument("--predictor", choices=ENGINE_PREDICTORS, default="spin",
                   help="SPIN engine's block predictor in the quality run: spin (V/D history), "
                        "probe (each block's mean key scored with the current query) or hybrid "
                        "(the max of both rank shares)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--speed-size", type=int, nargs=2, metavar=("BATCH", "CONTEXT"),
                   help="GPU: the step timing's batch and context tokens (default: the largest "
                        "of 96x524288, 32x524288, 32x131072, 8x131072, 8x32768 that fits)")
    g.add_argument("--no-speed", action="store_true", help="GPU: skip the step timing")
    _add_common(p, sparsity=False)
    _add_config_flags(p)
    p.set_defaults(func=cmd_demo, spec_=p)

    p = sub.add_parser("train-tiny", help="train the small dsa-lite model on the Python "
                                          "standard library (GPU: a few minutes)")
    _rule(p.add_argument("--out", help="checkpoint (default: dsa_lite_stdlib.safetensors, or "
                                       "dsa_lite_stdlib_c4a.safetensors for --ratio 4, in the "
                                       "working directory; the shipped one is never "
                                       "overwritten unless --out names it)"), "out")
    _rule(p.add_argument("--card", help="model card (default: MODEL_CARD.md, or "
                                        "MODEL_CARD_c4a.md for --ratio 4, beside --out)"), "out")
    _rule(p.add_argument("--seconds", type=float, default=240.0,
                         help="training time budget [> 0, <= 86400]"), "seconds", 86400.0)
    _int(p, "--seq-len", 8, 16384, default=4096)
    _int(p, "--batch", 1, 1024, default=8)
    p.add_argument("--ratio", type=int, choices=[1, 4], default=1,
                   help="tokens per indexer slot: 1 (V3.2 DSA) or 4 (V4 C4A)")
    _int(p, "--limit-bytes", 1, 1 << 40, help="train on at most this much text")
    _add_device(p)
    _int(p, "--seed", 0, (1 << 32) - 1)
    _rule(p.add_argument("--json", help="write the training report here"), "out")
    p.set_defaults(func=cmd_train_tiny, spec_=p, prepare_=train_tiny_outputs)

    p = sub.add_parser("trace", help="dump SPIN trace v2 (dense indexer scores, q, w, keys) "
                                     "from a dsa-lite checkpoint decoding a prompt")
    _rule(p.add_argument("out", metavar="OUT.safetensors"), "out")
    _add_checkpoint(p, "default: the shipped stdlib model of --ratio")
    p.add_argument("--ratio", type=int, choices=[1, 4],
                   help="tokens per indexer slot of the shipped model to use (default 1)")
    _rule(p.add_argument("--prompt-file",
                         help=f"text whose first --prompt-tokens bytes are the prompt; the next "
                              f"--steps bytes are teacher-forced (a regular file, at most "
                              f"{_inputs.size_text(_inputs.PROMPT_MAX_BYTES)})"),
          "in", _inputs.PROMPT_MAX_BYTES)
    _int(p, "--held-out", 0, INT32_MAX, default=0, metavar="I",
         help="without --prompt-file: the I-th slice of the held-out text")
    _int(p, "--prompt-tokens", 1, 1 << 20, default=8192)
    _int(p, "--steps", 1, 1 << 16, default=256, help="decode steps")
    p.add_argument("--mtp", action="store_true", help="MTP rows from the model's draft head")
    p.add_argument("--sample", action="store_true", help="sample (T = 0.8) instead of forcing")
    _add_device(p)
    _int(p, "--seed", 0, (1 << 32) - 1)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_trace, spec_=p)

    p = sub.add_parser("build", help="write a deployable bundle: LLM-API options YAML with the "
                                     "SPIN block and a Triton model repository (llmapi backend)")
    p.add_argument("model", metavar="MODEL", help="model directory (with config.json) or hub id")
    _rule(p.add_argument("--output", "-o", required=True, help="bundle directory"), "outdir")
    p.add_argument("--algorithm", choices=sorted(TRTLLM_ALGORITHM_TOPK), default="deepseek_v4")
    p.add_argument("--sparsity", type=float, help="SPIN target block sparsity")
    # TensorRT-LLM reads these as int32
    _int(p, "--tp", 1, INT32_MAX, help="tensor_parallel_size")
    _int(p, "--max-batch-size", 1, INT32_MAX)
    _int(p, "--max-seq-len", 1, INT32_MAX)
    p.add_argument("--mtp", type=int, default=0, choices=range(0, MAX_NEXT_N), metavar="D",
                   help="MTP draft depth (speculative_config)")
    p.add_argument("--name", default="spin_llm", help="Triton model name")
    _rule(p.add_argument("--llmapi-model", help="TensorRT-LLM's triton_backend/all_models/"
                                                "llmapi/tensorrt_llm/1/model.py (default: found "
                                                "next to tensorrt_llm, else set "
                                                "SPIN_TRTLLM_LLMAPI_MODEL)"),
          "in", _inputs.CONFIG_MAX_BYTES)
    p.add_argument("--force", action="store_true", help="overwrite files in a non-empty OUTPUT")
    _add_config_flags(p)
    p.set_defaults(func=cmd_build, spec_=p)

    p = sub.add_parser("serve", help="trtllm-serve with SPIN enabled (needs tensorrt_llm); "
                                     "unknown flags go to trtllm-serve")
    p.add_argument("model", metavar="MODEL")
    _rule(p.add_argument("--config", dest="config_yaml",
                         help="trtllm-serve LLM-API options YAML"), "in", _inputs.CONFIG_MAX_BYTES)
    _rule(p.add_argument("--spin-config", dest="config",
                         help="SpinConfig YAML for the spin block"), "in", _inputs.CONFIG_MAX_BYTES)
    p.add_argument("--algorithm", choices=sorted(TRTLLM_ALGORITHM_TOPK))
    p.add_argument("--sparsity", type=float, help="SPIN target block sparsity")
    p.add_argument("--exploration", type=float)
    p.add_argument("--seed", type=int)
    p.set_defaults(func=cmd_serve, spec_=p, passthrough=True)
    return parser



def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit code 0, or 2 with one escaped line on stderr for any bad input."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and not getattr(args, "passthrough", False):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exit_:          # argparse: --help (0) or a bad flag (2, one line)
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        _check_args(args)
        if getattr(args, "passthrough", False):
            return args.func(args, extra)
        return args.func(args)
    except INPUT_ERRORS as err:
        text = f"not valid YAML ({_inputs.yaml_error_text(err)})" \
            if isinstance(err, yaml.YAMLError) else str(err)
        print(f"spin-trtllm: error: {one_line(text)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("spin-trtllm: interrupted", file=sys.stderr)
        return 130

