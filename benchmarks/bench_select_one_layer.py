"""What one layer's select costs by itself, and which of its phases (CUDA GPU).

    python benchmarks/bench_select_one_layer.py [--shapes 8x32768 8x131072 96x32768]
        [--state-dtype float16]

One layer's select (ops.select(..., layer=1), what IndexerOptions(overlap_select=True) launches
beside the previous layer's top-K) on random warm V/D, rho 0.5, K 512, timed in a CUDA graph of
20 launches, four ways: as configured (exploration 0.05), without exploration, without a budget
either (rho 0: every block kept, the radix passes still run), and for requests without state (the
kernel returns at once: the launch's floor). One CTA a request: the time is one CTA's latency.
"""

from __future__ import annotations

import argparse
import sys

import torch

from spin_trtllm import ops

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_decode_indexer import cannot_run, spin_case  # noqa: E402
from bench_kernel_times import parse_shapes  # noqa: E402
from bench_update_overlap import graph_us  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["8x32768", "8x131072", "96x32768"],
                    help="BATCHxSLOTS cases")
    ap.add_argument("--state-dtype", default="float16",
                    choices=["float32", "float16", "float8_e4m3fn"])
    args = ap.parse_args(argv)
    shapes = parse_shapes(ap, args.shapes, 64)
    if cannot_run("bench_select_one_layer"):
        return 2
    print(f"{'batch x slots':>15} | us: as configured | no exploration | rho 0 | no state (floor)")
    for batch, slots in shapes:
        n = torch.full((batch, 1), slots - 3, dtype=torch.int32, device="cuda")  # ragged block
        cfg, state, slot, req, step, _, m_cap, ids, cnt, *_ = \
            spin_case(n, batch, slots, 1, 512, 0.5, 2, args.state_dtype)
        q = n - 1
        variants = [(cfg, slot), (cfg.with_overrides(exploration=0.0), slot),
                    (cfg.with_overrides(target_sparsity=0.0, exploration=0.0), slot),
                    (cfg, torch.full_like(slot, -1))]
        times = [graph_us(lambda c=c, s=s: ops.select(state, s, n, q, req, step, c, m_cap, slots,
                                                        ids, cnt, layer=1))
                 for c, s in variants]
        print(f"{batch:>6} x {slots:<6} | " + " | ".join(f"{t:6.2f}" for t in times), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
