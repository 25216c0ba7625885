"""spin-trtllm replay, ablate, compare-predictors, synth and info: the trace commands."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Sequence

from ..config import MAX_INDEX_TOPK
from ..errors import SpinError
from .._inputs import one_line, printable
from ._common import _per_trace_path, _fmt, _json_results, _load_config, _print_table, _sparsities, _write_json


def cmd_replay(args: argparse.Namespace) -> int:
    from ..replay import work
    from ..replay.evaluate import config_for_trace, replay, replay_desc
    from ..replay.probe import require_query_data

    cfg = _load_config(args)
    sparsities = _sparsities(args, cfg)
    for e in args.effective or ():
        if not 0.0 <= e < 1.0:
            raise SpinError(f"--effective {e}: must satisfy 0 <= x < 1")
    traces = _load_traces(args)             # validate all before the long work
    mask_paths = []
    if args.mask_plot:
        for trace in traces:
            if not 0 <= args.mask_layer < trace.num_layers:
                raise SpinError(f"--mask-layer {args.mask_layer} is outside [0, "
                                f"{trace.num_layers}) for {trace.name}")
            out = _per_trace_path(args.mask_plot, args.traces[len(mask_paths)], len(traces))
            mask_paths.append(out)          # checked with the other outputs
    for trace in traces:                    # v2 tensors present, work bounded: before any work
        require_query_data(trace, args.predictor)
        est = work.estimate_replay(trace, len(sparsities), config_for_trace(trace, cfg),
                                   args.predictor, args.summaries, args.budget,
                                   masks=bool(args.mask_plot))
        if args.mask_plot:
            est = est.add(work.estimate_mask_plot(trace, args.mask_layer, 0, args.mask_slots))
        work.require(est)
    label = None
    if args.predictor != "spin" or args.budget != "uniform":
        label = args.predictor + (f"x{args.summaries}" if args.summaries > 1 else "") \
            + ("+adaptive" if args.budget == "adaptive" else "")
    results = []
    for i, trace in enumerate(traces):
        keep = args.mask_layer if args.mask_plot else None
        desc = replay_desc(trace, sparsities, label) + _place(i, len(traces))
        res = replay(trace, sparsities, cfg, progress=not args.quiet, keep_masks_for_layer=keep,
                     label=label, predictor=args.predictor, budget=args.budget,
                     summaries=args.summaries, desc=desc)
        results.extend(res)
        if args.mask_plot:
            from ..replay.plots import plot_topk_mask

            used = config_for_trace(trace, cfg)
            out = plot_topk_mask(trace, mask_paths[i], layer=args.mask_layer,
                                 selected=res[-1]["masks"], max_slots=args.mask_slots,
                                 max_steps=args.mask_steps, block_size=used.block_size,
                                 index_topk=used.index_topk, sparsity=sparsities[-1],
                                 progress=not args.quiet,
                                 selector="SPIN" if args.predictor == "spin" else args.predictor)
            print(f"wrote {printable(out)}", file=sys.stderr)
    _print_table(results)
    if args.effective:
        from ..replay.evaluate import at_effective

        at = at_effective(results, args.effective)
        _print_effective(at)
        if args.json:
            payload = {"results": _json_results(results), "at_effective": at}
            _write_json(args.json, payload)
            args.json = None
    _write_outputs(args, results)
    return 0


def _load_traces(args: argparse.Namespace) -> list:
    """args.traces as SpinTraces, loaded and validated under a progress bar (a large trace
    takes a while)."""
    from tqdm import tqdm

    from ..replay.trace import SpinTrace

    traces = []
    # shown after a second only, and closed before a load error is printed (one line)
    with tqdm(total=len(args.traces), desc="load traces", unit="trace", disable=args.quiet,
              leave=False, delay=1.0) as bar:
        for path in args.traces:
            traces.append(SpinTrace.load(path))
            bar.update()
    return traces


def _place(i: int, count: int) -> str:
    """A progress bar's place among several traces: ' (trace 2/3)', nothing for one."""
    return f" (trace {i + 1}/{count})" if count > 1 else ""


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
        from ..replay.plots import plot_miss_curve

        print(f"wrote {printable(plot_miss_curve(results, args.plot))}", file=sys.stderr)


def cmd_ablate(args: argparse.Namespace) -> int:
    from ..replay import work
    from ..replay.evaluate import estimate_study, run_study

    cfg = _load_config(args)
    sparsities = _sparsities(args, cfg)
    traces = _load_traces(args)             # validate all before the long work
    for trace in traces:
        work.require(estimate_study(trace, args.study, len(sparsities), cfg))
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
    from ..replay import work
    from ..replay.predictors import compare_predictors

    k = args.index_topk
    if k is not None and not 1 <= k <= MAX_INDEX_TOPK:
        raise SpinError(f"index_topk must be >= 1 and <= {MAX_INDEX_TOPK}, got {k}")
    traces = _load_traces(args)             # validate all before the long work
    for trace in traces:
        work.require(work.estimate_compare(trace))
    outs = []
    for trace in traces:
        out = compare_predictors(trace, index_topk=k, progress=not args.quiet)
        _print_predictors(out)
        outs.append(out)
    _write_json(args.json, outs)
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from ..replay.synth import SynthConfig, synthesize

    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(SynthConfig)
              if getattr(args, f.name, None) is not None}
    trace = synthesize(SynthConfig(**fields), progress=not args.quiet)
    trace.save(args.output)
    print(f"wrote {printable(args.output)}: {trace.num_steps} steps x {trace.num_layers} layers x "
          f"{trace.next_n} rows, up to {trace.max_slots} slots, {trace.scores.numel()} scores")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from ..replay import work
    from ..replay.evaluate import config_for_trace
    from ..replay.trace import SCORE_TOLERANCE, SpinTrace
    from ._common import DEFAULT_SPARSITIES

    for path in args.traces:
        t = SpinTrace.load(path)
        meta = t.metadata()
        S = len(DEFAULT_SPARSITIES)
        est = work.estimate_replay(t, S, config_for_trace(t, None))
        print(f"{printable(path)}: {t.num_steps} steps, {t.num_layers} layers, next_n {t.next_n}, "
              f"slots {int(t.row_len.min())}..{t.max_slots}, turns {len(t.turn_starts())}, "
              f"scores {str(t.scores.dtype).split('.')[-1]} x {t.scores.numel()}; "
              f"replay ({S} sparsities, spin): {work.summary(est)}")
        print("  metadata: " + ", ".join(f"{k}={one_line(v, 200)}" for k, v in meta.items()))
        if t.q is not None:      # v2: the scores must follow from q, w and keys
            err = t.check_scores()
            print(f"  v2: {t.num_heads} heads x {t.head_dim} dims, keys of {t.keys.shape[1]} "
                  f"slots; scores = sum_h w relu(q . keys): max error {err:.2e} of the row's "
                  f"max |score| (tolerance {SCORE_TOLERANCE:g})")
    return 0
