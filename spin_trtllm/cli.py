"""`spin-trtllm` command line. Bad input: exit code 2 and one line on stderr."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from . import _inputs
from ._inputs import one_line
from .config import MAX_BLOCK_SIZE, MAX_INDEX_TOPK, SpinConfig
from .errors import SpinError

DEFAULT_SPARSITIES = (0.3, 0.4, 0.5)
INT32_MAX = (1 << 31) - 1
MAX_SPARSITIES = 16            # one replay stream (and its V/D state) per target sparsity
# demo: the engine's KV and indexer caches are sized by batch x context (about 1 KiB per
# token for the shipped model, so 4 GiB at this bound)
DEMO_MAX_BATCH_TOKENS = 1 << 22
# train-tiny: attention scores are [batch, heads, seq, seq]; 4x the default 8 x 4096^2
TRAIN_MAX_BATCH_SEQ2 = 1 << 29
# What an error exits 2 on (one escaped line, no traceback): bad input of every kind.
INPUT_ERRORS = (SpinError, OSError, ValueError, OverflowError, yaml.YAMLError)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one escaped line, no usage dump
        self.exit(2, f"{one_line(self.prog, 100)}: error: {one_line(message)}\n")


def _fmt(value: Any, pct: bool = True) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{100 * value:6.2f}%" if pct else f"{value:.3f}"


def _print_table(results: Sequence[dict[str, Any]]) -> None:
    head = ["trace", "variant", "target", "realized", "effective", "mean miss", "p99 miss",
            "recall", "pearson", "random miss", "oracle miss", "eligible"]
    rows = [[r["trace"], r.get("variant", ""), _fmt(r["target_sparsity"]),
             _fmt(r["realized_sparsity"]), _fmt(r.get("effective_sparsity")),
             _fmt(r["mean_miss"]), _fmt(r["p99_miss"]),
             _fmt(r["recall"]), _fmt(r["pearson"], pct=False),
             _fmt(r.get("random_mean_miss")), _fmt(r.get("oracle_mean_miss")),
             str(r["eligible_rows"])]
            for r in results]
    if not any(r[1] for r in rows):
        head.pop(1)
        rows = [r[:1] + r[2:] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def _write_json(path: Optional[str], payload: Any) -> None:
    if path is None:
        return
    try:
        Path(path).write_text(json.dumps(payload, indent=2))
    except OSError as err:
        raise SpinError(f"--json {path}: cannot write ({err.strerror})") from None
    print(f"wrote {path}", file=sys.stderr)


def _load_config(args: argparse.Namespace) -> SpinConfig:
    cfg = SpinConfig.from_yaml(args.config) if getattr(args, "config", None) is not None \
        else SpinConfig()
    overrides = {k: getattr(args, k, None) for k in
                 ("exploration", "exploration_policy", "index_topk", "block_size", "seed")}
    return cfg.with_overrides(**overrides) if any(v is not None for v in overrides.values()) else cfg


def _sparsities(args: argparse.Namespace, cfg: SpinConfig) -> list[float]:
    """--sparsity, else the config file's target_sparsity, else 0.3 0.4 0.5."""
    from .replay.evaluate import check_sparsities

    if args.sparsity is not None:
        if len(args.sparsity) > MAX_SPARSITIES:
            raise SpinError(f"--sparsity: at most {MAX_SPARSITIES} values, got "
                            f"{len(args.sparsity)}")
        return check_sparsities(args.sparsity)
    if "target_sparsity" in cfg.model_fields_set:
        return [cfg.target_sparsity]
    return list(DEFAULT_SPARSITIES)


def _json_results(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "masks"} for r in results]


# ---- commands ---------------------------------------------------------------------------------
def cmd_replay(args: argparse.Namespace) -> int:
    from .replay.evaluate import config_for_trace, replay
    from .replay.probe import require_query_data
    from .replay.trace import SpinTrace

    cfg = _load_config(args)
    sparsities = _sparsities(args, cfg)
    for e in args.effective or ():
        if not 0.0 <= e < 1.0:
            raise SpinError(f"--effective {e}: must satisfy 0 <= x < 1")
    traces = [SpinTrace.load(p) for p in args.traces]  # validate all before the long work
    mask_paths = []
    if args.mask_plot:
        for trace in traces:
            if not 0 <= args.mask_layer < trace.num_layers:
                raise SpinError(f"--mask-layer {args.mask_layer} is outside [0, "
                                f"{trace.num_layers}) for {trace.name}")
            out = _per_trace_path(args.mask_plot, trace.name, len(traces))
            mask_paths.append(_inputs.check_output_path(out, "--mask-plot"))
    for trace in traces:                    # v2 tensors present before the long work
        require_query_data(trace, args.predictor)
    label = None
    if args.predictor != "spin" or args.budget != "uniform":
        label = args.predictor + (f"x{args.summaries}" if args.summaries > 1 else "") \
            + ("+adaptive" if args.budget == "adaptive" else "")
    results = []
    for i, trace in enumerate(traces):
        keep = args.mask_layer if args.mask_plot else None
        res = replay(trace, sparsities, cfg, progress=not args.quiet, keep_masks_for_layer=keep,
                     label=label, predictor=args.predictor, budget=args.budget,
                     summaries=args.summaries)
        results.extend(res)
        if args.mask_plot:
            from .replay.plots import plot_topk_mask

            used = config_for_trace(trace, cfg)
            out = plot_topk_mask(trace, mask_paths[i], layer=args.mask_layer,
                                 selected=res[-1]["masks"], max_slots=args.mask_slots,
                                 block_size=used.block_size, index_topk=used.index_topk)
            print(f"wrote {out}", file=sys.stderr)
    _print_table(results)
    if args.effective:
        from .replay.evaluate import at_effective

        at = at_effective(results, args.effective)
        _print_effective(at)
        if args.json:
            payload = {"results": _json_results(results), "at_effective": at}
            _write_json(args.json, payload)
            args.json = None
    _write_outputs(args, results)
    return 0


def _print_effective(rows: Sequence[dict[str, Any]]) -> None:
    print("\nat equal effective sparsity (interpolated; - = outside the targets' range):")
    for r in rows:
        print(f"  {r['trace']}  {r['predictor']}/{r['budget']}  effective "
              f"{_fmt(r['effective_sparsity'])}  mean miss {_fmt(r['mean_miss'])}  p99 miss "
              f"{_fmt(r['p99_miss'])}  oracle {_fmt(r['oracle_mean_miss'])}")


def _write_outputs(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    """replay/ablate: --json and --plot (both checked before the work)."""
    _write_json(args.json, _json_results(results))
    if args.plot:
        from .replay.plots import plot_miss_curve

        print(f"wrote {plot_miss_curve(results, args.plot)}", file=sys.stderr)


def _per_trace_path(path: str, trace_name: str, count: int) -> Path:
    p = Path(path)
    return p if count == 1 else p.with_name(f"{p.stem}-{Path(trace_name).stem}{p.suffix}")


def cmd_ablate(args: argparse.Namespace) -> int:
    from .replay.evaluate import run_study
    from .replay.trace import SpinTrace

    cfg = _load_config(args)
    sparsities = _sparsities(args, cfg)
    traces = [SpinTrace.load(p) for p in args.traces]  # validate all before the long work
    results = []
    for trace in traces:
        results.extend(run_study(trace, args.study, sparsities, cfg, progress=not args.quiet))
    print(_ablate_exploration(args.study, cfg.exploration, results))
    _print_table(results)
    _write_outputs(args, results)
    return 0


def _ablate_exploration(study: str, asked: float, results: Sequence[dict[str, Any]]) -> str:
    """The table's header line: the exploration share each variant ran with (the reduction
    and mtp studies force 0, whatever the config or --exploration says)."""
    share = {r.get("variant", ""): r["config"]["exploration"] for r in results}
    zero = [v for v, g in share.items() if g == 0]
    if share and len(zero) == len(share) and asked > 0:
        return (f"{study} study: exploration forced to 0 in every variant (the config's "
                f"{asked:g} is not used): the variants are compared on their predictions "
                f"alone, with no exploration blocks in the budget")
    if zero and len(zero) < len(share):
        return (f"{study} study: exploration {asked:g}, 0 in variant {', '.join(zero)}")
    return f"{study} study: exploration {asked:g} in every variant"


def _print_predictors(out: dict[str, Any]) -> None:
    print(f"{out['trace']}  (top-K = {out['index_topk']})")
    print(f"  {'method':<20} {'pearson':>8} {'recall':>8} {'pairs':>7}")
    for name, m in out["methods"].items():
        print(f"  {name:<20} {_fmt(m['pearson'], pct=False):>8} {_fmt(m['recall']):>8} "
              f"{m['pairs']:>7}")


def cmd_compare_predictors(args: argparse.Namespace) -> int:
    from .replay.predictors import compare_predictors
    from .replay.trace import SpinTrace

    k = args.index_topk
    if k is not None and not 1 <= k <= MAX_INDEX_TOPK:
        raise SpinError(f"index_topk must be >= 1 and <= {MAX_INDEX_TOPK}, got {k}")
    traces = [SpinTrace.load(p) for p in args.traces]  # validate all before the long work
    outs = []
    for trace in traces:
        out = compare_predictors(trace, index_topk=k, progress=not args.quiet)
        _print_predictors(out)
        outs.append(out)
    _write_json(args.json, outs)
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from .replay.synth import SynthConfig, synthesize

    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(SynthConfig)
              if getattr(args, f.name, None) is not None}
    trace = synthesize(SynthConfig(**fields), progress=not args.quiet)
    trace.save(args.output)
    print(f"wrote {args.output}: {trace.num_steps} steps x {trace.num_layers} layers x "
          f"{trace.next_n} rows, up to {trace.max_slots} slots, {trace.scores.numel()} scores")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from .replay.trace import SCORE_TOLERANCE, SpinTrace

    for path in args.traces:
        t = SpinTrace.load(path)
        meta = t.metadata()
        print(f"{path}: {t.num_steps} steps, {t.num_layers} layers, next_n {t.next_n}, "
              f"slots {int(t.row_len.min())}..{t.max_slots}, turns {len(t.turn_starts())}, "
              f"scores {str(t.scores.dtype).split('.')[-1]} x {t.scores.numel()}")
        print("  metadata: " + ", ".join(f"{k}={one_line(v, 200)}" for k, v in meta.items()))
        if t.q is not None:      # v2: the scores must follow from q, w and keys
            err = t.check_scores()
            print(f"  v2: {t.num_heads} heads x {t.head_dim} dims, keys of {t.keys.shape[1]} "
                  f"slots; scores = sum_h w relu(q . keys): max error {err:.2e} of the row's "
                  f"max |score| (tolerance {SCORE_TOLERANCE:g})")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .harness.demo import DemoOptions, format_report, run_demo

    cfg = _load_config(args)
    if args.sparsity is not None:
        cfg = cfg.with_overrides(target_sparsity=args.sparsity)
    elif "target_sparsity" not in cfg.model_fields_set:
        cfg = cfg.with_overrides(target_sparsity=0.5)
    tokens = args.batch * (args.prompt_tokens + args.new_tokens)
    if tokens > DEMO_MAX_BATCH_TOKENS:
        raise SpinError(f"--batch x (--prompt-tokens + --new-tokens) = {tokens:,} is over "
                        f"{DEMO_MAX_BATCH_TOKENS:,} (the caches grow with it)")
    opts = DemoOptions(device=args.device, requests=args.requests,
                       prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                       max_batch=args.batch, mtp_depth=args.mtp, checkpoint=args.checkpoint,
                       random_weights=args.random_weights,
                       measure_miss=args.measure_miss, dump_trace=args.dump_trace,
                       cuda_graphs=args.cuda_graphs, progress=not args.quiet,
                       logits_backend=args.logits_backend, switch=args.switch,
                       predictor=args.predictor,
                       speed=tuple(args.speed_size) if args.speed_size else None,
                       speed_auto=not args.no_speed)
    if args.speed_size:
        batch, context = args.speed_size
        if not 1 <= batch <= 256 or not 4096 <= context <= 1 << 20:
            raise SpinError(f"--speed-size: batch must be 1..256 and context 4096..1048576 "
                            f"tokens, got {batch} {context}")
    res = run_demo(cfg, opts)
    print(format_report(res))
    _write_json(args.json, res)
    return 0


def _device(name: str):
    from .harness.engine import resolve_device

    return resolve_device(_inputs.check_device(name))


def cmd_train_tiny(args: argparse.Namespace) -> int:
    from .harness.config import CSA_RATIO
    from .harness.model import save_checkpoint
    from .harness.pretrained import model_card, train_outputs
    from .harness.train import TrainConfig, stdlib_corpus, stdlib_model_config, train

    import torch

    work = args.batch * args.seq_len ** 2
    if work > TRAIN_MAX_BATCH_SEQ2:
        raise SpinError(f"--batch x --seq-len^2 = {work:,} is over {TRAIN_MAX_BATCH_SEQ2:,} "
                        f"(4x the default 8 x 4096^2; attention memory grows with it)")
    # every output is checked before minutes of training
    default_out, default_card = train_outputs(args.ratio, args.out)
    out = _inputs.check_output_path(args.out or default_out, "--out")
    card = _inputs.check_output_path(args.card or default_card, "--card")
    if out.resolve() == card.resolve():
        raise SpinError(f"--card {card} is the checkpoint --out {out}")
    device = _device(args.device)
    ratios = (1, 0, 1, 64, 1) if args.ratio == 1 else (CSA_RATIO, 0, CSA_RATIO, 64, CSA_RATIO)
    cfg = stdlib_model_config(compress_ratios=ratios,
                              max_context=max(65536, args.seq_len))
    tc = TrainConfig(seconds=args.seconds, seq_len=args.seq_len, batch=args.batch,
                     seed=args.seed or 0)
    corpus = stdlib_corpus(limit_bytes=args.limit_bytes)
    weights, report = train(cfg, tc, corpus, device, log=lambda m: print(m, file=sys.stderr))
    command = "spin-trtllm train-tiny " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 \
        else "spin-trtllm train-tiny"
    save_checkpoint(out, cfg, weights, dtype=torch.float16,
                    extra={"card": card.name, "held_out_bpb":
                           f"{report['held_out_bpb_sparse']:.4f}"})
    card.write_text(model_card(cfg, report, command))
    _write_json(args.json, report)
    print(f"wrote {out} and {card}")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    from .harness.engine import Engine, Request
    from .harness.model import load_checkpoint
    from .harness.pretrained import default_checkpoint
    from .harness.train import stdlib_corpus

    if args.checkpoint and args.ratio:
        raise SpinError("--checkpoint and --ratio exclude each other (the ratio is the model's)")
    ckpt = args.checkpoint or default_checkpoint(args.ratio or 1)
    if ckpt is None:
        raise SpinError(f"no shipped checkpoint with indexer ratio {args.ratio or 1}: pass "
                        f"--checkpoint or run spin-trtllm train-tiny --ratio {args.ratio or 1}")
    device = _device(args.device)
    text = None
    if args.prompt_file is not None:
        text = _inputs.read_regular_file(args.prompt_file, f"--prompt-file {args.prompt_file}",
                                         _inputs.PROMPT_MAX_BYTES, text=False)
    cfg, weights = load_checkpoint(ckpt)
    if not args.mtp:
        cfg = cfg.with_overrides(mtp_depth=0)
    elif not cfg.mtp_depth:
        raise SpinError("--mtp: the checkpoint has no MTP head")
    if text is None:
        held = stdlib_corpus().held_out
        span = args.prompt_tokens + args.steps + 1
        if held.numel() < span:
            raise SpinError(f"the held-out text ({held.numel()} bytes) is shorter than "
                            f"{span} bytes")
        start = (args.held_out * 7919 * 64) % (held.numel() - span)
        text = bytes(held[start:start + span].tolist())
    if len(text) < args.prompt_tokens:
        raise SpinError(f"prompt has {len(text)} bytes, fewer than --prompt-tokens")
    prompt, rest = text[:args.prompt_tokens], text[args.prompt_tokens:]
    forced = list(rest[:args.steps + 1]) if len(rest) > args.steps and not args.sample else None
    need = args.prompt_tokens + args.steps + cfg.next_n + 2
    cfg = cfg.with_overrides(max_context=need)          # caches for this run only
    engine = Engine(cfg, None, weights=weights, device=device, trace_request=0)
    engine.run([Request(prompt, max_new_tokens=args.steps + 1, forced=forced,
                        temperature=0.0 if forced else 0.8, seed=args.seed or 0,
                        request_id=0)], progress=not args.quiet)
    trace = engine.trace(0)
    trace.name = Path(args.out).name
    trace.save(args.out)
    print(f"wrote {args.out} (trace v{trace.version}): {trace.num_steps} steps, "
          f"{trace.num_layers} indexer layers, "
          f"next_n {trace.next_n}, {trace.max_slots} slots, compress_ratio "
          f"{trace.compress_ratio} ({'teacher-forced' if forced else 'sampled'})")
    return 0


def _spin_for_deploy(args: argparse.Namespace) -> SpinConfig:
    cfg = _load_config(args)
    if args.sparsity is not None:
        cfg = cfg.with_overrides(target_sparsity=args.sparsity)
    return cfg


def cmd_build(args: argparse.Namespace) -> int:
    import re

    from .integrations.trtllm.bundle import (BundleOptions, memory_report, model_folder_warning,
                                            write_bundle)

    model = args.model
    if Path(model).exists():
        if not Path(model).is_dir():
            raise SpinError(f"model {model}: not a folder (give the checkpoint folder or a "
                            f"hub id org/name)")
        model = str(Path(model).resolve())
    elif not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        raise SpinError(f"model {args.model!r}: not a directory here and not a hub id (org/name)")
    warning = model_folder_warning(args.model)
    if warning:
        print(f"spin-trtllm: warning: {one_line(warning)}", file=sys.stderr)
    opts = BundleOptions(model=model, algorithm=args.algorithm, index_topk=args.index_topk,
                         tensor_parallel_size=args.tp or 1, max_batch_size=args.max_batch_size,
                         max_seq_len=args.max_seq_len, mtp_depth=args.mtp, name=args.name,
                         llmapi_model=args.llmapi_model)
    spin = _spin_for_deploy(args)
    for path in write_bundle(spin, opts, args.output, force=args.force):
        print(path)
    print(memory_report(spin, opts))
    return 0


def cmd_serve(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from .integrations.trtllm.serve import run_trtllm_serve, serve_options

    options = serve_options(args.config_yaml, _spin_for_deploy(args), args.algorithm)
    return run_trtllm_serve(args.model, options, extra)


# ---- parser -----------------------------------------------------------------------------------
# Each checked argument carries a rule, applied by _check_args before any command runs (README
# "Limits" lists them): ("int", lo, hi), ("seconds", hi), ("in", max_bytes[, verb]): a
# regular input file, ("out",): an output file, ("outdir",), ("plot",): an image path, ("device",).
def _rule(action: argparse.Action, *rule: Any) -> argparse.Action:
    action.spin_rule = rule  # type: ignore[attr-defined]
    if rule[0] == "int":
        action.help = f"{action.help + ' ' if action.help else ''}[{rule[1]}..{rule[2]}]"
    return action


def _int(p: argparse.ArgumentParser, flag: str, lo: int, hi: int, **kw: Any) -> None:
    _rule(p.add_argument(flag, type=int, **kw), "int", lo, hi)


def _flag(action: argparse.Action) -> str:
    return next((s for s in action.option_strings if s.startswith("--")), "output")


def _plot_path(value: str, flag: str) -> Path:
    """An image path: without an extension it gets matplotlib's default .png (so what is
    printed is the file written); the extension must be a format matplotlib writes."""
    path = Path(value) if value else None
    if path is not None and path.name and not path.suffix:
        path = path.with_name(path.name + ".png")
    if path is not None and path.suffix:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if path.suffix[1:].lower() not in formats:
            raise SpinError(f"{flag} {value}: unknown image format {path.suffix!r} "
                            f"(use one of {', '.join(sorted(formats))})")
    return _inputs.check_output_path(path if path is not None else value, flag)


def _check_args(args: argparse.Namespace) -> None:
    """Every rule of the command's arguments: numbers, input files, output paths, devices,
    all before any work starts."""
    for action in args.spec_._actions:
        rule = getattr(action, "spin_rule", None)
        value = getattr(args, action.dest, None)
        if rule is None or value is None:
            continue
        flag, kind = _flag(action), rule[0]
        if kind == "int" and not rule[1] <= value <= rule[2]:
            raise SpinError(f"{flag} must be >= {rule[1]} and <= {rule[2]}, got {value}")
        if kind == "seconds" and not (math.isfinite(value) and 0 < value <= rule[1]):
            raise SpinError(f"{flag} must be > 0 and <= {rule[1]:g}, got {value}")
        if kind == "in":
            verb = rule[2] if len(rule) > 2 else "cannot read"
            _inputs.check_input_file(value, f"{flag} {value}".rstrip(), rule[1], verb=verb)
        elif kind == "out":
            _inputs.check_output_path(value, flag)
        elif kind == "outdir":
            _inputs.check_output_dir(value, flag)
        elif kind == "plot":
            setattr(args, action.dest, str(_plot_path(value, flag)))
        elif kind == "device":
            _inputs.check_device(value, flag)


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    _rule(p.add_argument("--config",
                         help="SpinConfig YAML (flat, spin:, or sparse_attention_config:)"),
          "in", _inputs.CONFIG_MAX_BYTES)
    p.add_argument("--exploration", type=float, help="exploration share gamma (0 disables)")
    p.add_argument("--exploration-policy", choices=["random", "staleness", "age"])
    p.add_argument("--index-topk", type=int, help="K (default: the trace's metadata)")
    p.add_argument("--block-size", type=int, help="block size (default: the trace's metadata)")
    p.add_argument("--seed", type=int, help="exploration RNG seed")


def _add_common(p: argparse.ArgumentParser, sparsity: bool = True) -> None:
    if sparsity:
        p.add_argument("--sparsity", type=float, nargs="+",
                       help="target block sparsities (default: --config's target_sparsity "
                            "if it sets one, else 0.3 0.4 0.5)")
    _rule(p.add_argument("--json", help="write results as JSON here"), "out")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_device(p: argparse.ArgumentParser) -> None:
    _rule(p.add_argument("--device", default="auto",
                         help="auto (cuda if present), cpu, cuda or cuda:N"), "device")


def _add_checkpoint(p: argparse.ArgumentParser, help: str) -> None:
    _rule(p.add_argument("--checkpoint", help=help), "in", _inputs.CHECKPOINT_MAX_BYTES,
          "not a readable safetensors file")


def _add_traces(p: argparse.ArgumentParser) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help=f"SPIN trace v1/v2 files (regular files, at most "
                        f"{_inputs.size_text(_inputs.TRACE_MAX_BYTES)} each for v1, "
                        f"{_inputs.size_text(_inputs.TRACE_V2_MAX_BYTES)} for v2)")


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
                                             "sparsity"), "plot")
    _int(p, "--mask-layer", 0, INT32_MAX, default=0)
    _int(p, "--mask-slots", 1, INT32_MAX, help="slots shown in --mask-plot (default all)")
    # replay.probe.PREDICTORS / BUDGETS (not imported here: it pulls in torch)
    p.add_argument("--predictor", choices=["spin", "probe", "hybrid", "quest", "gauss"],
                   default="spin",
                   help="block scores selection ranks by: spin (V/D history), or, with a trace "
                        "v2, probe (block mean keys x query), hybrid (probe + history), quest "
                        "(min/max bound), gauss (mean key and per-dim spread: the expected "
                        "slot score through the ReLU)")
    p.add_argument("--budget", choices=["uniform", "adaptive"], default="uniform",
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
    from .replay.synth import SynthConfig

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
    p.add_argument("--mtp", type=int, default=0, choices=range(0, 8), metavar="D",
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
    p.add_argument("--logits-backend", default="native", choices=["native", "deepgemm", "reference"],
                   help="decode indexer logits of both engines: spin's masked kernel (native), "
                        "DeepGEMM over a compacted block table (deepgemm; CUDA, SM90+), or "
                        "plain PyTorch (reference)")
    p.add_argument("--switch", choices=["auto", "spin", "dense"],
                   help="SPIN engine's indexer per step: auto (all-keep where the cost model says "
                        "SPIN would not pay), spin, dense. Default: spin for the quality run, "
                        "auto for the GPU step timing")
    p.add_argument("--predictor", choices=["spin", "probe", "hybrid"], default="spin",
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
    p.set_defaults(func=cmd_train_tiny, spec_=p)

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
    p.add_argument("--algorithm", choices=["deepseek_v4", "dsa"], default="deepseek_v4")
    p.add_argument("--sparsity", type=float, help="SPIN target block sparsity")
    # TensorRT-LLM reads these as int32
    _int(p, "--tp", 1, INT32_MAX, help="tensor_parallel_size")
    _int(p, "--max-batch-size", 1, INT32_MAX)
    _int(p, "--max-seq-len", 1, INT32_MAX)
    p.add_argument("--mtp", type=int, default=0, choices=range(0, 8), metavar="D",
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
    p.add_argument("--algorithm", choices=["deepseek_v4", "dsa"])
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


if __name__ == "__main__":
    sys.exit(main())
