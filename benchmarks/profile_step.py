"""Where a dsa-lite decode step's GPU time goes, kernel by kernel (CUDA GPU, torch.profiler).

    python benchmarks/profile_step.py [--context 131072] [--batch 32] [--modes dense 0.3 0.5]
        [--state-dtype float16] [--backend native] [--steps 3] [--json OUT]

Builds the engine as bench_dsa_lite.py does (synthetic contexts), runs warm-up steps, then
profiles `--steps` eager steps and prints, per mode, the kernels by GPU time per step (calls per
step beside them). Eager steps launch the same kernels as the captured graph replays.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from spin_trtllm import SpinConfig
from spin_trtllm._inputs import exit_code_of
from spin_trtllm._outputs import write_output
from spin_trtllm.harness import init_weights
from spin_trtllm.harness.speed import step_config, synthetic_engine


def profile_mode(cfg, weights, mode, args):
    spin = None if mode == "dense" else SpinConfig(
        index_topk=cfg.index_topk, target_sparsity=float(mode), state_dtype=args.state_dtype)
    engine = synthetic_engine(cfg, weights, spin, args.context, args.batch,
                              args.warmup + args.steps + 2, args.backend, args.graphs,
                              switch="spin" if spin is not None else None)
    for _ in range(args.warmup):
        engine.step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    total = defaultdict(float)
    calls = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name[:90]
            total[name] += ev.time_range.elapsed_us() / args.steps     # us per step
            calls[name] += 1
    hist = engine.history[-args.steps:]
    if args.graphs:
        print(f"graphs captured: {len(engine.graphs.entries)}, generation {engine.graphs.generation}")
    sel = sum(s.selected_blocks for s in hist)
    vis = sum(s.visible_blocks for s in hist)
    del engine
    torch.cuda.empty_cache()
    kernels = sorted(total, key=total.get, reverse=True)
    return {"mode": mode, "gpu_us_per_step": sum(total.values()),
            "forward_ms": [round(1e3 * s.forward_seconds, 3) for s in hist],
            "realized_sparsity": (1 - sel / vis) if vis else 0.0,
            "kernels": [{"name": k, "us_per_step": total[k], "calls_per_step": calls[k] / args.steps}
                        for k in kernels]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--mtp", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=["dense", "0.3", "0.5"])
    ap.add_argument("--state-dtype", choices=["float32", "float16", "float8_e4m3fn"],
                    default="float16")
    ap.add_argument("--backend", default="native")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--graphs", action="store_true",
                    help="profile CUDA-graph replays (kernels inside graphs, as CUPTI sees them)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_step: needs a CUDA GPU", file=sys.stderr)
        return 2
    cfg = step_config(args.context, args.mtp, args.warmup + args.steps + 2)
    weights = init_weights(cfg)
    results = []
    for mode in args.modes:
        r = profile_mode(cfg, weights, mode, args)
        results.append(r)
        print(f"== ctx {args.context} B {args.batch} next_n {args.mtp + 1} mode {mode} "
              f"({args.backend}, state {args.state_dtype}): GPU {r['gpu_us_per_step'] / 1e3:.2f} "
              f"ms/step, realized sparsity {r['realized_sparsity']:.3f}, forward ms {r['forward_ms']}")
        for k in r["kernels"][:args.top]:
            print(f"  {k['us_per_step']:9.1f} us  x{k['calls_per_step']:5.0f}  {k['name']}")
    if args.json:
        write_output(args.json, "--json",
                     json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(exit_code_of(main, Path(sys.argv[0]).name))
