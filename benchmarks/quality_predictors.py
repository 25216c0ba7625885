"""Issue 17: block predictors compared at equal effective sparsity on SPIN trace v2 files.

    python benchmarks/quality_predictors.py TRACE.safetensors... --json OUT [--markdown OUT] [--jobs N]

For each trace and predictor configuration (spin / probe / probe with 2 summaries / hybrid /
quest / gauss / gauss with 2 summaries, uniform or adaptive per-layer budget) replay runs a
grid of target sparsities; miss is then interpolated at effective sparsities 0.3 / 0.5 / 0.7
(effective = 1 - (bytes of scored blocks + bytes the predictor read) / dense bytes:
spin_trtllm.replay.evaluate.at_effective).
The table gives the mean over traces of each trace's mean miss and of each trace's p99 miss;
the oracle and random rows are the references at SPIN's own budgets (they read nothing).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from pathlib import Path

import numpy as np
import torch

from spin_trtllm._inputs import exit_code_of
from spin_trtllm._outputs import write_output
from spin_trtllm.replay.evaluate import at_effective, replay
from spin_trtllm.replay.probe import require_query_data
from spin_trtllm.replay.trace import SpinTrace

CONFIGS = [  # (label, predictor, budget, summaries)
    ("spin", "spin", "uniform", 1),
    ("spin + adaptive", "spin", "adaptive", 1),
    ("probe", "probe", "uniform", 1),
    ("probe + adaptive", "probe", "adaptive", 1),
    ("probe, 2 summaries", "probe", "uniform", 2),
    ("hybrid", "hybrid", "uniform", 1),
    ("hybrid + adaptive", "hybrid", "adaptive", 1),
    ("quest", "quest", "uniform", 1),
    ("gauss", "gauss", "uniform", 1),
    ("gauss + adaptive", "gauss", "adaptive", 1),
    ("gauss, 2 summaries", "gauss", "uniform", 2),   # the engine's on 32-slot pages (V4)
]
TARGETS = [round(0.15 + 0.05 * i, 2) for i in range(15)]        # 0.15 .. 0.85
EFFECTIVE = [0.3, 0.5, 0.7]


def _replay_one(task):
    """One (config, trace) replay, interpolated at EFFECTIVE (a worker of --jobs)."""
    (label, predictor, budget, summaries), path = task
    res = replay(SpinTrace.load(path), TARGETS, predictor=predictor, budget=budget,
                 summaries=summaries, pearson=False)
    return at_effective(res, EFFECTIVE)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--json", required=True)
    ap.add_argument("--markdown")
    ap.add_argument("--jobs", type=int, default=1,
                    help="replays run in this many processes (one per config x trace)")
    args = ap.parse_args(argv)
    if args.jobs < 1:
        raise SystemExit(f"--jobs must be >= 1, got {args.jobs}")
    names = []
    for path in args.traces:                # every file checked before the long work
        trace = SpinTrace.load(path)
        for _label, predictor, _budget, _summaries in CONFIGS:
            require_query_data(trace, predictor)
        names.append(trace.name)
    tasks = [(config, path) for config in CONFIGS for path in args.traces]
    if args.jobs > 1:
        # one thread per worker: the workers share the cores
        with multiprocessing.get_context("spawn").Pool(
                args.jobs, initializer=torch.set_num_threads, initargs=(1,)) as pool:
            done = pool.map(_replay_one, tasks, chunksize=1)
    else:
        done = [_replay_one(task) for task in tasks]
    rows = []
    for c, (label, predictor, budget, summaries) in enumerate(CONFIGS):
        per_trace = done[c * len(args.traces):(c + 1) * len(args.traces)]
        for i, e in enumerate(EFFECTIVE):
            vals = [pt[i] for pt in per_trace]
            row = {"config": label, "predictor": predictor, "budget": budget,
                   "summaries": summaries, "effective_sparsity": e, "traces": len(vals)}
            for f in ("mean_miss", "p99_miss", "oracle_mean_miss", "random_mean_miss"):
                got = [v[f] for v in vals if v.get(f) is not None]
                row[f] = float(np.mean(got)) if len(got) == len(vals) else None
            rows.append(row)
            print(f"{label:>20} @ {e:.1f}: mean {row['mean_miss']}, p99 {row['p99_miss']}",
                  flush=True)
    write_output(args.json, "--json",
                 json.dumps({"traces": names, "targets": TARGETS, "rows": rows}, indent=1))
    if args.markdown:
        write_output(args.markdown, "--markdown", markdown(rows))
    return 0


def pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def markdown(rows) -> str:
    head = "| predictor | " + " | ".join(f"effective {e}: mean / p99 miss" for e in EFFECTIVE)
    out = [head + " |", "|---" * (1 + len(EFFECTIVE)) + "|"]
    for label, *_ in CONFIGS:
        cells = [f"{pct(r['mean_miss'])} / {pct(r['p99_miss'])}"
                 for e in EFFECTIVE for r in rows if r["config"] == label
                 and r["effective_sparsity"] == e]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    ref = [r for r in rows if r["config"] == "spin"]
    out.append("| oracle (SPIN's budget) | " + " | ".join(
        f"{pct(r['oracle_mean_miss'])}" for r in ref) + " |")
    out.append("| random (SPIN's budget) | " + " | ".join(
        f"{pct(r['random_mean_miss'])}" for r in ref) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(exit_code_of(main, Path(sys.argv[0]).name))
