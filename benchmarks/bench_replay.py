"""Replay throughput: a 32K-slot, 1,000-step, 4-layer trace at five target sparsities.

    python benchmarks/bench_replay.py [--slots 32768] [--steps 1000] [--layers 4] [--trace PATH]

Synthesizes the trace (or loads --trace), then times one `replay` call that evaluates the five
sparsities together, and prints wall time, steps/s and slot-scores/s with the machine's cores.
"""

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from spin_trtllm import SpinConfig
from spin_trtllm._inputs import exit_code_of
from spin_trtllm._outputs import write_output
from spin_trtllm.replay.evaluate import replay
from spin_trtllm.replay.synth import SynthConfig, synthesize
from spin_trtllm.replay.trace import SpinTrace

SPARSITIES = [0.1, 0.2, 0.3, 0.4, 0.5]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--trace", help="replay this trace instead of synthesizing one")
    ap.add_argument("--json", help="write the measurements here")
    args = ap.parse_args()

    t0 = time.perf_counter()
    if args.trace:
        trace = SpinTrace.load(args.trace)
    else:
        trace = synthesize(SynthConfig(steps=args.steps, layers=args.layers,
                                       prompt_slots=args.slots, seed=0))
    prep = time.perf_counter() - t0
    t0 = time.perf_counter()
    results = replay(trace, SPARSITIES, SpinConfig())
    wall = time.perf_counter() - t0
    scored = int(trace.row_len.to(torch.int64).sum()) * len(SPARSITIES)
    out = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                   f"torch {torch.__version__} ({torch.get_num_threads()} threads)",
        "trace": f"{trace.num_steps} steps x {trace.num_layers} layers x {trace.next_n} rows, "
                 f"{int(trace.row_len.min())}..{trace.max_slots} slots",
        "prepare_s": round(prep, 2),
        "replay_s": round(wall, 2),
        "steps_per_s": round(trace.num_steps / wall, 1),
        "slot_evaluations_per_s": round(scored / wall),
        "results": [{k: r[k] for k in ("target_sparsity", "realized_sparsity", "mean_miss",
                                       "p99_miss")} for r in results],
    }
    print(json.dumps(out, indent=2))
    if args.json:
        write_output(args.json, "--json", json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.exit(exit_code_of(main, Path(sys.argv[0]).name))
