"""The masked FP8 paged logits kernel alone (CUDA GPU): median time per launch and the K-cache
bytes it reads per second, next to the GPU's HBM bandwidth.

    python benchmarks/bench_logits.py [--shapes 96x131072 32x131072] [--rows 1 2 4]
        [--sparsity 0.5] [--iters 50] [--json OUT]

Each request selects (1 - sparsity) of its blocks at random; a launch reads those pages once
for all rows (64 x 132 B each). Times come from CUDA events around `iters` back-to-back
launches, median of 5 such runs. Inputs are drawn on the GPU, once per shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from spin_trtllm import ops
from spin_trtllm._inputs import exit_code_of
from spin_trtllm._outputs import write_output
from spin_trtllm.errors import SpinError
from spin_trtllm.limits import BLOCK_SLOTS, SLOT_BYTES
from spin_trtllm.testing.pages import make_cache

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_update_overlap import event_us  # noqa: E402

HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12}


def cases(batch: int, slots: int, rows: list[int], sparsity: float, iters: int) -> list[dict]:
    """One shape's cache and selection (drawn on the GPU), timed for each row count."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks = slots // BLOCK_SLOTS
    keep = max(1, round(blocks * (1 - sparsity)))
    cache = make_cache(batch * blocks, gen, device="cuda")
    table = torch.randperm(batch * blocks, generator=gen, device="cuda").view(batch, blocks).int()
    ids = torch.stack([torch.randperm(blocks, generator=gen, device="cuda")[:keep].sort().values
                       for _ in range(batch)]).int()
    cnt = torch.full((batch,), keep, dtype=torch.int32, device="cuda")
    out = []
    for r in rows:
        n = torch.tensor([[slots - r + 1 + j for j in range(r)]] * batch,
                         dtype=torch.int32, device="cuda")
        q = torch.randn(batch * r, 64, 128, generator=gen, device="cuda").to(torch.float8_e4m3fn)
        w = torch.randn(batch * r, 64, generator=gen, device="cuda") * 0.1
        run = lambda: ops.indexer_logits(q, cache, w, n, table, ids, cnt)
        for _ in range(3):
            run()
        us = statistics.median(event_us(run, iters) for _ in range(5))
        read = batch * keep * BLOCK_SLOTS * SLOT_BYTES
        out.append({"batch": batch, "slots": slots, "rows": r, "sparsity": sparsity, "us": us,
                    "cache_bytes": read, "bytes_per_s": read / (us * 1e-6)})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["96x131072", "32x131072"])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SpinError("needs a CUDA GPU")
    if not 0 <= args.sparsity < 1 or not 1 <= args.iters <= 10_000:
        raise SpinError("--sparsity must be in [0, 1) and --iters in 1..10000")
    name = torch.cuda.get_device_name()
    limit = next((v for k, v in HBM_BYTES_PER_S.items() if k in name), None)
    rows = []
    for shape in args.shapes:
        try:
            batch, slots = (int(x) for x in shape.split("x"))
        except ValueError:
            raise SpinError(f"--shapes {shape!r}: use BATCHxSLOTS") from None
        for row in cases(batch, slots, args.rows, args.sparsity, args.iters):
            rows.append(row)
            r = row["rows"]
            share = f", {row['bytes_per_s'] / limit:.0%} of HBM" if limit else ""
            print(f"{name}: {batch} x {slots} slots, rows {r}, sparsity {args.sparsity}: "
                  f"{row['us']:.1f} us, {row['bytes_per_s'] / 1e12:.2f} TB/s of K cache{share}")
    if args.json:
        write_output(args.json, "--json", json.dumps({"device": name, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(exit_code_of(main, Path(sys.argv[0]).name))
