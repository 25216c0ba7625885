"""Issue 17: how far can a block-level summary go? Block rankings from the true scores' block
statistics, against the probes and the oracle, on SPIN trace v2 files.

    python benchmarks/quality_bounds.py TRACE.safetensors... [--sparsity 0.5] [--json OUT]

A probe ranks blocks by one number per block estimated from key summaries. Here the same
number is computed from the true slot scores (which a predictor cannot know) to bound what
any estimate of it can reach:
  true block mean / max        the mean / max of the block's true slot scores
  true mean + c sd             mean plus c standard deviations of them (the upper tail)
  true top-4 mean              the mean of the block's 4 highest scores
  oracle                       the number of true top-K slots in the block
against the predictors' estimates (probe, gauss: spin_trtllm.replay.probe). Simplified
selection, the same for every ranking: row 0 of every non-warm-up step (t >= 8) and layer,
sink and newest blocks forced, m = ceil((1 - rho) B) blocks in all, no exploration; a
predictor that reads r summary rows per block gives up round((r - 1) (B - 1) / b) blocks
(equal bytes with the one-row probe). Miss = share of the row's true top-K outside the
selected blocks. The replay tables (quality_predictors.py) are the full rule; this isolates the
ranking.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

from spin_trtllm._inputs import exit_code_of
from spin_trtllm._outputs import write_output
from spin_trtllm.replay.probe import QueryProbe, rows_read_per_block
from spin_trtllm.replay.trace import SpinTrace

WARMUP_STEPS = 8


def block_rankings(dense: torch.Tensor, n: int, k: int, b: int) -> dict[str, torch.Tensor]:
    """Per complete block (the newest, partial one is forced): the true-score statistics."""
    full = (n - 1) // b                             # blocks before the newest
    z = dense[:full * b].view(full, b).float()
    top = dense[:n].float().topk(k).indices
    hits = torch.bincount(top // b, minlength=full + 1)[:full].float()
    mean, sd = z.mean(1), z.std(1, unbiased=False)
    out = {"oracle": hits, "true block mean": mean, "true block max": z.amax(1),
           "true top-4 mean": z.topk(min(4, b), dim=1).values.mean(1)}
    for c in (1.0, 2.0):
        out[f"true mean + {c:g} sd"] = mean + c * sd
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    rho = args.sparsity
    miss: dict[str, list[float]] = {}
    for path in args.traces:
        trace = SpinTrace.load(path)
        b, K = trace.block_size, trace.index_topk
        probes = {name: QueryProbe(trace, name, b) for name in ("probe", "gauss")}
        for t in range(WARMUP_STEPS, trace.num_steps):
            dense = trace.step_scores(t)
            n_all = trace.row_len[t]
            nb = math.ceil(int(n_all.max()) / b)
            est = {name: p.scores(t, n_all, nb) for name, p in probes.items()}
            for layer in range(trace.num_layers):
                n = int(n_all[layer, 0])
                B = math.ceil(n / b)
                m = math.ceil((1 - rho) * B)
                if m >= B or B < 4:
                    continue
                k = min(K, n)
                ranks = block_rankings(dense[layer, 0], n, k, b)
                hits = ranks["oracle"]
                full = hits.shape[0]
                newest_hits = k - float(hits.sum())    # the rest sit in the newest block
                for name, e in est.items():
                    ranks[name] = e[layer, 0, :full]
                for name, score in ranks.items():
                    summary_rows = rows_read_per_block(name) if name in probes else 1
                    take = m - 2 - round((summary_rows - 1) * full / b)  # a row: 1/b of a block
                    take = max(0, min(take, full - 1))
                    pick = score[1:].topk(take).indices + 1 if take else torch.empty(0).long()
                    got = float(hits[0]) + newest_hits + float(hits[pick].sum())
                    miss.setdefault(name, []).append(1 - got / k)
    rows = []
    for name, v in sorted(miss.items(), key=lambda kv: float(np.mean(kv[1]))):
        arr = np.array(v)
        rows.append({"ranking": name, "sparsity": rho, "mean_miss": float(arr.mean()),
                     "p99_miss": float(np.percentile(arr, 99)), "rows": len(v)})
        print(f"{name:22s} mean miss {100 * arr.mean():5.1f}%   p99 {100 * np.percentile(arr, 99):5.1f}%"
              f"   ({len(v)} rows)")
    if args.json:
        write_output(args.json, "--json",
                     json.dumps({"traces": args.traces, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(exit_code_of(main, Path(sys.argv[0]).name))
