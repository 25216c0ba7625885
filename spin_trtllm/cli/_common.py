"""What every spin-trtllm command shares: limits, the parser class, output helpers and the
rules each checked argument carries."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import yaml

from .. import _inputs
from .._inputs import one_line
from .._outputs import check_output, check_plan, is_device, write_output
from ..errors import SpinError
from ..limits import (BLOCK_SLOTS, DEFAULT_EXPLORATION, DEFAULT_EXPLORATION_POLICY, DEFAULT_SEED,
                      EXPLORATION_POLICY, INT32_MAX)

if TYPE_CHECKING:                        # the parser stays free of pydantic (--help is fast)
    from ..config import SpinConfig


DEFAULT_SPARSITIES = (0.3, 0.4, 0.5)
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


def package_version() -> str:
    from .. import __version__

    return __version__


class _Version(argparse.Action):
    """--version, looked up when asked: importing importlib.metadata would slow the rest."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and exit", **kw)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        parser._print_message(f"{parser.prog} {package_version()}\n", sys.stdout)
        parser.exit(0)


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
    write_output(path, "--json", json.dumps(payload, indent=2))
    print(f"wrote {one_line(path)}", file=sys.stderr)


def _per_trace_path(path: str, trace_name: str, count: int) -> Path:
    """replay --mask-plot with several traces: one image per trace, named after it."""
    p = Path(path)
    return p if count == 1 else p.with_name(f"{p.stem}-{Path(trace_name).stem}{p.suffix}")


def _load_config(args: argparse.Namespace) -> "SpinConfig":
    from ..config import SpinConfig

    cfg = SpinConfig.from_yaml(args.config) if getattr(args, "config", None) is not None \
        else SpinConfig()
    overrides = {k: getattr(args, k, None) for k in
                 ("exploration", "exploration_policy", "index_topk", "block_size", "seed")}
    return cfg.with_overrides(**overrides) if any(v is not None for v in overrides.values()) else cfg


def _sparsities(args: argparse.Namespace, cfg: "SpinConfig") -> list[float]:
    """--sparsity, else the config file's target_sparsity, else 0.3 0.4 0.5."""
    from ..replay.evaluate import check_sparsities

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


# ---- parser -----------------------------------------------------------------------------------
# Each checked argument carries a rule, applied by _check_args before any command runs
# (docs/limits.md lists them): ("int", lo, hi), ("seconds", hi), ("in", max_bytes[, verb]): a
# regular input file, ("traces",): input traces, ("out",): an output file, ("outdir",),
# ("plot"[, "per-trace"]): an image path (one per trace), ("device",).
def _rule(action: argparse.Action, *rule: Any) -> argparse.Action:
    action.spin_rule = rule  # type: ignore[attr-defined]
    if rule[0] == "int":
        action.help = f"{action.help + ' ' if action.help else ''}[{rule[1]}..{rule[2]}]"
    return action


def _int(p: argparse.ArgumentParser, flag: str, lo: int, hi: int, **kw: Any) -> None:
    _rule(p.add_argument(flag, type=int, **kw), "int", lo, hi)


def _flag(action: argparse.Action) -> str:
    return next((s for s in action.option_strings if s.startswith("--")), "output")


def _is_device_path(path: Path) -> bool:
    try:
        return is_device(os.stat(path))
    except (OSError, ValueError):
        return False


def _plot_path(value: str, flag: str) -> Path:
    """An image path: without an extension it gets matplotlib's default .png (so what is
    printed is the file written; a device such as /dev/null is kept, written as PNG); the
    extension must be a format matplotlib writes."""
    path = Path(value) if value else None
    if path is not None and path.name and not path.suffix and not _is_device_path(path):
        path = path.with_name(path.name + ".png")
    if path is not None and path.suffix:
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if path.suffix[1:].lower() not in formats:
            raise SpinError(f"{flag} {value}: unknown image format {path.suffix!r} "
                            f"(use one of {', '.join(sorted(formats))})")
    return check_output(path if path is not None else value, flag)


def _check_args(args: argparse.Namespace) -> None:
    """Every rule of the command's arguments: numbers, input files, output paths, devices,
    all before any work starts; then no output is an input or another output of the run."""
    prepare = getattr(args, "prepare_", None)
    if prepare is not None:              # defaults that depend on other arguments
        prepare(args)
    inputs: list[tuple[str, Any]] = []
    outputs: list[tuple[str, Any]] = []
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
            inputs.append((flag, value))
        elif kind == "traces":
            inputs.extend(("TRACE", v) for v in value)
        elif kind == "out":
            outputs.append((flag, value))
        elif kind == "outdir":
            _inputs.check_output_dir(value, flag)
        elif kind == "plot":
            value = str(_plot_path(value, flag))
            setattr(args, action.dest, value)
            traces = getattr(args, "traces", None) or ()
            if len(rule) > 1 and rule[1] == "per-trace" and len(traces) > 1:
                outputs.extend((flag, _per_trace_path(value, t, len(traces))) for t in traces)
            else:
                outputs.append((flag, value))
        elif kind == "device":
            _inputs.check_device(value, flag)
    check_plan(outputs, inputs)


def or_config(value: Any, config: str = "--config") -> str:
    """Help text of a SpinConfig flag's default: the config file's value, else `value`."""
    return f"(default: {config}'s, else {value})"


def _add_config_flags(p: argparse.ArgumentParser, from_trace: bool = False) -> None:
    """The SpinConfig flags. K and the block size, when neither a flag nor --config sets
    them: the trace's metadata (`from_trace`: replay, ablate), else the model's K and
    SpinConfig's block size."""
    _rule(p.add_argument("--config",
                         help="SpinConfig YAML (flat, spin:, or sparse_attention_config:); the "
                              "flags below override its fields (default: none, SpinConfig's "
                              "defaults)"),
          "in", _inputs.CONFIG_MAX_BYTES)
    p.add_argument("--exploration", type=float,
                   help=f"exploration share gamma, 0 disables {or_config(DEFAULT_EXPLORATION)}")
    p.add_argument("--exploration-policy", choices=list(EXPLORATION_POLICY),
                   help=f"how exploration picks its blocks {or_config(DEFAULT_EXPLORATION_POLICY)}")
    trace = "the trace's metadata"
    k, block = (trace, trace) if from_trace else ("the model's", BLOCK_SLOTS)
    p.add_argument("--index-topk", type=int, help=f"K of the post-indexer top-K {or_config(k)}")
    p.add_argument("--block-size", type=int, help=f"KV slots per block {or_config(block)}")
    p.add_argument("--seed", type=int,
                   help=f"exploration RNG seed {or_config(DEFAULT_SEED)}")


def _add_common(p: argparse.ArgumentParser, sparsity: bool = True) -> None:
    if sparsity:
        p.add_argument("--sparsity", type=float, nargs="+",
                       help="target block sparsities (default: --config's target_sparsity "
                            "if it sets one, else 0.3 0.4 0.5)")
    _rule(p.add_argument("--json", help="write results as JSON here"), "out")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


_STATES_DEFAULT = re.compile(r"\bdefault\b", re.IGNORECASE)


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(_shown(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def state_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option's help says what happens when it is left out: "(default: X)" is appended
    where the default is a value and the help states none; an output left out is not written.
    An option whose default is None states its meaning in its own help
    (tests/test_cli_conventions.py checks every one)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                state_defaults(sub)
            continue
        if not action.option_strings or action.required or action.nargs == 0:
            continue                     # positionals, required options, on/off flags
        text = action.help or ""
        if _STATES_DEFAULT.search(text):
            continue
        if action.default is not None:
            note = f"default: {_shown(action.default)}"
        elif getattr(action, "spin_rule", ("",))[0] in ("out", "plot"):
            note = "default: not written"
        else:
            continue
        action.help = f"{text} ({note})" if text else f"({note})"


def _add_device(p: argparse.ArgumentParser) -> None:
    _rule(p.add_argument("--device", default="auto",
                         help="auto (cuda if present), cpu, cuda or cuda:N"), "device")


def _add_checkpoint(p: argparse.ArgumentParser, help: str) -> None:
    _rule(p.add_argument("--checkpoint", help=help), "in", _inputs.CHECKPOINT_MAX_BYTES,
          "not a readable safetensors file")


def _add_traces(p: argparse.ArgumentParser) -> None:
    _rule(p.add_argument("traces", nargs="+", metavar="TRACE",
                         help=f"SPIN trace v1/v2 files (regular files, at most "
                              f"{_inputs.size_text(_inputs.TRACE_MAX_BYTES)} each for v1, "
                              f"{_inputs.size_text(_inputs.TRACE_V2_MAX_BYTES)} for v2)"),
          "traces")


