"""`spin-trtllm` command line. Bad input: exit code 2 and one line on stderr."""

from __future__ import annotations

import os
import signal
import sys
import threading

# Only the standard library at import time: the heavy imports (yaml, pydantic, torch) happen
# inside main(), where Ctrl-C is handled.
_interrupted = False
_RETRY_S = 0.05
_retry: "threading.Timer | None" = None   # SIGINT sent again once an import is done


def _importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _resend() -> None:
    global _retry
    _retry = None
    os.kill(os.getpid(), signal.SIGINT)


def _on_interrupt(signum: int, frame) -> None:
    global _interrupted, _retry
    _interrupted = True
    if _importing(frame):
        # A module's import may run this handler from C++ (torch's, through PyErr_CheckSignals)
        # where an exception aborts the process (std::terminate, exit -6): signal again once
        # the import is done, one retry at a time. A second Ctrl-C meanwhile leaves at once.
        if _retry is not None:
            _early_interrupt(signum, frame)
        _retry = threading.Timer(_RETRY_S, _resend)
        _retry.daemon = True
        _retry.start()
        return
    raise KeyboardInterrupt              # a library may turn it into another error: main()
                                         # still exits 130


def _early_interrupt(signum: int, frame: object) -> None:
    os.write(2, b"spin-trtllm: interrupted\n")
    os._exit(130)


# Started as the command (`spin-trtllm`, `python -m spin_trtllm.cli`), not imported: Ctrl-C
# before main() runs exits the same way as after.
if sys.argv and (sys.argv[0] == "-m" or os.path.basename(sys.argv[0]) == "spin-trtllm"):
    signal.signal(signal.SIGINT, _early_interrupt)

import argparse  # noqa: E402  (after the handler: importing takes a few milliseconds)
from typing import Optional, Sequence  # noqa: E402


def _command(module: str, name: str):
    """`name` of spin_trtllm.cli.<module>, imported when the command runs: cli/replay.py
    imports pydantic, which --help does not need."""
    def run(*args: object) -> int:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{module}"), name)(*args)

    run.__name__ = name
    return run


def build_parser() -> argparse.ArgumentParser:
    """The parser. Only light modules are imported here (no torch, pydantic or matplotlib):
    every --help runs it."""
    from .. import _inputs
    from ..limits import (DEFAULT_EXPLORATION, DEFAULT_SEED, DEFAULT_TARGET_SPARSITY,
                          LLMAPI_MODEL_ENV, LLMAPI_MODEL_PATH, MAX_BLOCK_SIZE, MAX_INDEX_TOPK,
                          MAX_NEXT_N, TRTLLM_ALGORITHM_TOPK)
    from ..options import LOGITS_BACKENDS, SWITCHES
    from ..predictors import (BUDGETS, ENGINE_PREDICTORS, REPLAY_PREDICTORS,
                              TRTLLM_DEFAULT_PREDICTOR)
    from ._common import (INT32_MAX, _add_checkpoint, _add_common, _add_config_flags,
                          _add_device, _add_traces, _int, _Parser, _rule, _Version, or_config,
                          state_defaults)
    from .deploy import cmd_build, cmd_serve
    DEPLOY_PREDICTOR_HELP = ("what ranks the blocks in TensorRT-LLM (spin.predictor): spin (V/D "
                             "history), probe or hybrid (page summaries scored with the query), "
                             "gauss (the expected ReLU score under a Gaussian of each page's keys)")
    from .engine import cmd_demo, cmd_trace, cmd_train_tiny, train_tiny_outputs

    cmd_replay, cmd_ablate, cmd_compare_predictors, cmd_synth, cmd_info = (
        _command("replay", name) for name in ("cmd_replay", "cmd_ablate",
                                              "cmd_compare_predictors", "cmd_synth", "cmd_info"))

    parser = _Parser(prog="spin-trtllm",
                     description="SPIN, a predictive block selector for the DeepSeek sparse-"
                                 "attention indexer: replay and study SPIN traces, run it in "
                                 "dsa-lite, deploy it with TensorRT-LLM.",
                     epilog="`spin-trtllm COMMAND --help` lists a command's options. Start "
                            "with `spin-trtllm demo`. Bad input exits 2 with one line on "
                            "stderr.")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser,
                                metavar="COMMAND")

    p = sub.add_parser("replay", help="replay SPIN over traces and report miss/sparsity")
    _add_traces(p)
    _add_common(p)
    _add_config_flags(p, from_trace=True)
    _rule(p.add_argument("--plot", help="image (PNG unless another extension): mean/p99 miss "
                                        "(%%) vs sparsity (%%) with the random and oracle "
                                        "references; effective sparsity for a predictor that "
                                        "reads summary rows"), "plot")
    _rule(p.add_argument("--mask-plot", help="image: Figure-1-style top-K mask of one layer "
                                             "over the --mask-slots x --mask-steps window, with "
                                             "the slots SPIN selected and missed at the last "
                                             "target sparsity"), "plot", "per-trace")
    _int(p, "--mask-layer", 0, INT32_MAX, default=0, help="indexer layer --mask-plot shows")
    from ..limits import MASK_SLOTS, MASK_STEPS

    _int(p, "--mask-slots", 1, INT32_MAX, default=MASK_SLOTS,
         help=f"--mask-plot shows the newest W slots (default {MASK_SLOTS}: about 2 pixels a "
              f"slot)")
    _int(p, "--mask-steps", 1, INT32_MAX, default=MASK_STEPS,
         help=f"--mask-plot shows the last N decode steps (default {MASK_STEPS})")
    p.add_argument("--predictor", choices=REPLAY_PREDICTORS,
                   default="spin",
                   help="block scores selection ranks by: spin (V/D history), or, with a trace "
                        "v2, probe (block mean keys x query), hybrid (probe + history), quest "
                        "(min/max bound), gauss (mean key and per-dim spread: the expected "
                        "slot score through the ReLU)")
    p.add_argument("--budget", choices=BUDGETS, default="uniform",
                   help="per-layer blocks: uniform, or adaptive (same total per step)")
    p.add_argument("--summaries", type=int, choices=[1, 2], default=1,
                   help="probe/hybrid/gauss: summaries per block (2: the two halves', as the "
                        "engine's with 32-slot pages)")
    p.add_argument("--effective", type=float, nargs="+", metavar="E",
                   help="also report miss interpolated at these effective sparsities "
                        "(give --sparsity targets that bracket them; default: none)")
    p.set_defaults(func=cmd_replay, spec_=p)

    p = sub.add_parser("ablate", help="the paper's ablations (reduction, exploration, mtp) and "
                                      "fp32 vs fp16 vs fp8 state (state_dtype)")
    _add_traces(p)
    # replay.evaluate.STUDIES (not imported here: it pulls in torch)
    p.add_argument("--study", required=True,
                   choices=["reduction", "exploration", "mtp", "state_dtype"],
                   help="which ablation to run")
    _add_common(p)
    _add_config_flags(p, from_trace=True)
    _rule(p.add_argument("--plot", help="image: mean/p99 miss (%%) vs realized sparsity (%%) "
                                        "per variant, with the random and oracle "
                                        "references"), "plot")
    p.set_defaults(func=cmd_ablate, spec_=p)

    p = sub.add_parser("compare-predictors", help="Table 1: prev-iter vs prev-layer vs random")
    _add_traces(p)
    p.add_argument("--index-topk", type=int, help=f"K (default: the trace's metadata) "
                                                  f"[1..{MAX_INDEX_TOPK}]")
    _add_common(p, sparsity=False)
    p.set_defaults(func=cmd_compare_predictors, spec_=p)

    p = sub.add_parser("synth", help="write a synthetic SPIN trace v1")
    _rule(p.add_argument("output", metavar="OUT.safetensors"), "out")
    import dataclasses

    from ..replay.synth_config import SynthConfig

    bounds = {"index_topk": MAX_INDEX_TOPK, "block_size": MAX_BLOCK_SIZE, "diagonal_bands": 64}
    for f in dataclasses.fields(SynthConfig):
        action = p.add_argument("--" + f.name.replace("_", "-"), dest=f.name,
                                type=type(f.default), default=f.default, help=f.metadata["help"])
        if f.name in bounds:
            _rule(action, "int", 0 if f.name == "diagonal_bands" else 1, bounds[f.name])
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_synth, spec_=p)

    p = sub.add_parser("info", help="validate traces and print their shape and metadata "
                                    "(v2: and check the scores against q, w and keys)")
    _add_traces(p)
    p.set_defaults(func=cmd_info, spec_=p)

    p = sub.add_parser("demo", help="the main job: dsa-lite decoding with SPIN and with the "
                                    "all-keep indexer, side by side")
    from ..limits import DEMO_WORKLOADS

    def by_device(field: str) -> str:
        gpu, cpu = ({True: "on", False: "off"}.get(v, v) for v in
                    (getattr(DEMO_WORKLOADS[d], field) for d in ("cuda", "cpu")))
        return f"(default: {gpu} for a GPU, {cpu} for a CPU)"

    _add_device(p)
    _int(p, "--requests", 1, 1024, help=f"requests served {by_device('requests')}")
    _int(p, "--prompt-tokens", 1, 1 << 17,
         help=f"longest prompt, bytes {by_device('prompt_tokens')}")
    _int(p, "--new-tokens", 1, 1 << 16,
         help=f"tokens generated a turn {by_device('new_tokens')}")
    _int(p, "--batch", 1, 256, default=4, help="max requests decoding together")
    p.add_argument("--mtp", type=int, default=0, choices=range(0, MAX_NEXT_N), metavar="D",
                   help="MTP draft depth (next_n = D + 1)")
    p.add_argument("--sparsity", type=float, help="SPIN target block sparsity (default 0.5)")
    _add_checkpoint(p, "dsa-lite safetensors checkpoint (default: the shipped model trained "
                       "on the Python standard library)")
    p.add_argument("--random-weights", action="store_true",
                   help="seeded random weights: tiny() on the CPU, v4_flash_indexer() on a GPU")
    p.add_argument("--measure-miss", action=argparse.BooleanOptionalAction,
                   help=f"run a shadow dense indexer beside SPIN and report its miss rate "
                        f"{by_device('measure_miss')}")
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
                        "probe (each block's mean key scored with the current query), hybrid "
                        "(the max of both rank shares) or gauss (the expected ReLU score under "
                        "each page's per-dimension Gaussian)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--speed-size", type=int, nargs=2, metavar=("BATCH", "CONTEXT"),
                   help="GPU: the step timing's batch and context tokens (default: the largest "
                        "of 96x524288, 32x524288, 32x131072, 8x131072, 8x32768 that fits)")
    g.add_argument("--no-speed", action="store_true", help="GPU: skip the step timing")
    _add_common(p, sparsity=False)
    _add_config_flags(p)
    p.set_defaults(func=cmd_demo, spec_=p)

    p = sub.add_parser("train-tiny", help="train the small dsa-lite model on the Python "
                                          "standard library (GPU: a few minutes)",
                       description="Train the small dsa-lite model on the Python standard "
                                   "library for --seconds (training and the held-out "
                                   "evaluation), then write the checkpoint and its model card.")
    _rule(p.add_argument("--out", help="checkpoint (default: dsa_lite_stdlib.safetensors, or "
                                       "dsa_lite_stdlib_c4a.safetensors for --ratio 4, in the "
                                       "working directory; the shipped one is never "
                                       "overwritten unless --out names it)"), "out")
    _rule(p.add_argument("--card", help="model card (default: MODEL_CARD.md, or "
                                        "MODEL_CARD_c4a.md for --ratio 4, beside --out)"), "out")
    _rule(p.add_argument("--seconds", type=float, default=240.0,
                         help="time budget of training plus the held-out evaluation (at least "
                              "one step and one evaluation batch run) [> 0, <= 86400]"),
          "seconds", 86400.0)
    _int(p, "--seq-len", 8, 16384, default=4096, help="training sequence length (bytes)")
    _int(p, "--batch", 1, 1024, default=8, help="sequences per step")
    p.add_argument("--ratio", type=int, choices=[1, 4], default=1,
                   help="tokens per indexer slot: 1 (V3.2 DSA) or 4 (V4 C4A)")
    _int(p, "--limit-bytes", 1, 1 << 40,
         help="train on at most this much text (default: all of it)")
    _add_device(p)
    _int(p, "--seed", 0, (1 << 32) - 1, default=0)
    _rule(p.add_argument("--json", help="write the training report here"), "out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_train_tiny, spec_=p, prepare_=train_tiny_outputs)

    p = sub.add_parser("trace", help="dump SPIN trace v2 (dense indexer scores, q, w, keys) "
                                     "from a dsa-lite checkpoint decoding a prompt")
    _rule(p.add_argument("out", metavar="OUT.safetensors"), "out")
    _add_checkpoint(p, "dsa-lite safetensors checkpoint (default: the shipped stdlib model "
                       "of --ratio)")
    p.add_argument("--ratio", type=int, choices=[1, 4],
                   help="tokens per indexer slot of the shipped model to use (default 1)")
    _rule(p.add_argument("--prompt-file",
                         help=f"text whose first --prompt-tokens bytes are the prompt; the next "
                              f"--steps bytes are teacher-forced (a regular file, at most "
                              f"{_inputs.size_text(_inputs.PROMPT_MAX_BYTES)}; default: the "
                              f"held-out text, see --held-out)"),
          "in", _inputs.PROMPT_MAX_BYTES)
    _int(p, "--held-out", 0, INT32_MAX, default=0, metavar="I",
         help="without --prompt-file: the I-th slice of the held-out text")
    _int(p, "--prompt-tokens", 1, 1 << 20, default=8192, help="prompt length (bytes)")
    _int(p, "--steps", 1, 1 << 16, default=256, help="decode steps")
    p.add_argument("--mtp", action="store_true", help="MTP rows from the model's draft head")
    p.add_argument("--sample", action="store_true", help="sample (T = 0.8) instead of forcing")
    p.add_argument("--layers", type=int, nargs="+", metavar="L",
                   help="keep only these indexer layers (0-based), for a smaller file "
                        "(default: all)")
    _add_device(p)
    _int(p, "--seed", 0, (1 << 32) - 1, default=0, help="sampling seed (--sample)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_trace, spec_=p)

    p = sub.add_parser("build", help="write a deployable bundle: LLM-API options YAML with the "
                                     "SPIN block and a Triton model repository (llmapi backend)")
    p.add_argument("model", metavar="MODEL", help="model directory (with config.json) or hub id")
    _rule(p.add_argument("--output", "-o", required=True, help="bundle directory"), "outdir")
    p.add_argument("--algorithm", choices=sorted(TRTLLM_ALGORITHM_TOPK), default="deepseek_v4",
                   help="TensorRT-LLM's sparse attention algorithm (deepseek_v4: V4's C4A, dsa: "
                        "V3.2)")
    p.add_argument("--sparsity", type=float,
                   help=f"SPIN target block sparsity {or_config(DEFAULT_TARGET_SPARSITY)}")
    # TensorRT-LLM reads these as int32
    _int(p, "--tp", 1, INT32_MAX, default=1, help="tensor_parallel_size")
    _int(p, "--max-batch-size", 1, INT32_MAX,
         help="the LLM's max_batch_size (default: not written, TensorRT-LLM's own)")
    _int(p, "--max-seq-len", 1, INT32_MAX,
         help="the LLM's max_seq_len (default: not written, the model's)")
    p.add_argument("--mtp", type=int, default=0, choices=range(0, MAX_NEXT_N), metavar="D",
                   help="MTP draft depth (speculative_config)")
    p.add_argument("--name", default="spin_llm", help="Triton model name")
    _rule(p.add_argument("--llmapi-model",
                         help=f"TensorRT-LLM's {LLMAPI_MODEL_PATH}, which the bundle's model.py "
                              f"loads (default: found next to an installed tensorrt_llm, else "
                              f"{LLMAPI_MODEL_ENV} must name it where tritonserver runs)"),
          "in", _inputs.CONFIG_MAX_BYTES)
    p.add_argument("--predictor", choices=ENGINE_PREDICTORS, default=TRTLLM_DEFAULT_PREDICTOR,
                   help=DEPLOY_PREDICTOR_HELP + f" (default {TRTLLM_DEFAULT_PREDICTOR})")
    p.add_argument("--force", action="store_true", help="overwrite files in a non-empty OUTPUT")
    _add_config_flags(p)
    p.set_defaults(func=cmd_build, spec_=p)

    p = sub.add_parser("serve", help="trtllm-serve with SPIN enabled (needs tensorrt_llm); "
                                     "unknown flags go to trtllm-serve")
    p.add_argument("model", metavar="MODEL", help="model directory or hub id")
    _rule(p.add_argument("--config", dest="config_yaml",
                         help="trtllm-serve LLM-API options YAML; a spin: block in its "
                              "sparse_attention_config wins over the SPIN flags below (default: "
                              "none, only the SPIN block)"), "in", _inputs.CONFIG_MAX_BYTES)
    _rule(p.add_argument("--spin-config", dest="config",
                         help="SpinConfig YAML for the spin block (default: none, SpinConfig's "
                              "defaults)"), "in", _inputs.CONFIG_MAX_BYTES)
    p.add_argument("--algorithm", choices=sorted(TRTLLM_ALGORITHM_TOPK),
                   help="sparse attention algorithm (default: --config's; required without "
                        "one)")
    spin_config = "--spin-config"
    p.add_argument("--sparsity", type=float,
                   help=f"SPIN target block sparsity "
                        f"{or_config(DEFAULT_TARGET_SPARSITY, spin_config)}")
    p.add_argument("--exploration", type=float,
                   help=f"exploration share gamma, 0 disables "
                        f"{or_config(DEFAULT_EXPLORATION, spin_config)}")
    p.add_argument("--seed", type=int,
                   help=f"exploration RNG seed {or_config(DEFAULT_SEED, spin_config)}")
    p.add_argument("--predictor", choices=ENGINE_PREDICTORS,
                   help=DEPLOY_PREDICTOR_HELP + f" (default: --config's spin block, else "
                                               f"{TRTLLM_DEFAULT_PREDICTOR})")
    p.set_defaults(func=cmd_serve, spec_=p, passthrough=True)
    state_defaults(parser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit code 0; 2 with one escaped line on stderr for any bad input; 130 and one line on
    Ctrl-C; 143 on SIGTERM; 141 and nothing more when stdout is closed (`| head`), like the
    Unix tools. Outputs are written whole or not at all (spin_trtllm/_outputs.py)."""
    global _interrupted
    _interrupted = False
    try:
        if _main_thread():
            if signal.getsignal(signal.SIGINT) in (signal.default_int_handler, _early_interrupt):
                signal.signal(signal.SIGINT, _on_interrupt)
            signal.signal(signal.SIGTERM, _terminated)
        return _run(argv)
    except SystemExit as exit_:          # SIGTERM (_terminated)
        if exit_.code == 128 + signal.SIGTERM:
            return exit_.code
        raise
    except KeyboardInterrupt:
        return _exit_interrupted()
    except BrokenPipeError:
        _detach_stdout()
        return 141
    except BaseException:
        if _interrupted:
            return _exit_interrupted()
        raise
    finally:
        if _retry is not None:           # main() is over: no KeyboardInterrupt for the caller
            _retry.cancel()


def _exit_interrupted() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # a second Ctrl-C adds nothing
    _say("spin-trtllm: interrupted")
    return 130


def console() -> None:
    """The `spin-trtllm` command: main(), then exit with its code. After Ctrl-C or SIGTERM the
    process ends at once (outputs are already cleaned up): an interrupted import inside a
    library can leave CPython set to kill itself with SIGINT at exit, which would hide 130."""
    code = main()
    if _main_thread():                   # done: a Ctrl-C during shutdown changes nothing
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if code in (130, 143):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def _run(argv: Optional[Sequence[str]]) -> int:
    import yaml

    from .. import _inputs
    from ._common import INPUT_ERRORS, _check_args

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
        if isinstance(err, BrokenPipeError):
            raise
        text = f"not valid YAML ({_inputs.yaml_error_text(err)})" \
            if isinstance(err, yaml.YAMLError) else str(err)
        _say(f"spin-trtllm: error: {_inputs.one_line(text)}")
        return 2


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)       # unwinds, so partial outputs are removed


def _say(line: str) -> None:
    try:
        print(line, file=sys.stderr)
    except (OSError, ValueError):        # stderr closed too
        pass


def _detach_stdout() -> None:
    """stdout's reader is gone: point it at /dev/null so the exit flush is quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
