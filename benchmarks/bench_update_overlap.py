"""The EMA update beside the top-K: what a decode step's indexer pays for it (CUDA GPU, sm_90+).

    python benchmarks/bench_update_overlap.py [--shapes 96x131072 32x131072 96x32768 ...]
        [--state-dtype float16 float8_e4m3fn] [--sparsity 0.5] [--layers 21] [--reps 5]
        [--json OUT]

A step's SPIN indexer (select for all layers in one launch, then per layer the native masked
logits, top-K and one-row update) is captured in CUDA graphs, one per D skew (contexts
n = slots - 8 + s, s = 0..7, so the newest block is partial), three ways:
  after    the update after the top-K (ops.update as before)
  beside   the update launched with beside_previous=True: it runs on the SMs the top-K leaves
           idle and still completes after it (SpinIndexer's default)
  none     no update (the lower bound)
Replays are timed with CUDA events, each mode twice, interleaved; the smaller of the two is
kept. "Exposed update" per layer is (mode - none) / layers: what the update adds to the step
(negative where it adds less than the noise between modes, about 5 us a layer at 96 x 128K).
With deep_gemm importable (tests/gpu/deepgemm_env.sh) DeepGEMM's dense logits over the whole
context are timed in the same process, and the share (select per layer + exposed update) /
dense logits is printed (issue 16, target 5). The update overlaps spin's top-K kernel only: where
ops.topk runs flashinfer's path (installed, 32 rows or more of 64K slots or more) it follows the
remap, and "beside" is "after" (each row records its top-K path).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from spin_trtllm import ops

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_decode_indexer import cannot_run, make_inputs, spin_case  # noqa: E402
from bench_kernel_times import SKEWS, skew_case_args  # noqa: E402
MODES = ("after", "beside", "none")


def event_us(fn, iters: int) -> float:
    """Mean device microseconds of fn() over iters calls (one pair of CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def run_case(dg, batch: int, slots: int, dtype: str, rho: float, layers: int, reps: int) -> dict:
    inputs, n_full = make_inputs(batch, slots, 1, 1, seed=1)
    cache, table, q, w = inputs[0]
    dense = None
    if dg is not None:
        meta = dg.dg.get_paged_mqa_logits_metadata(n_full, 64, dg.num_sms(torch.device("cuda")))
        run = lambda: dg.dg.fp8_paged_mqa_logits(q.view(batch, 1, 64, 128), cache, w, n_full,  # noqa: E731
                                                 table, meta, slots)
        event_us(run, 3)
        dense = event_us(run, 20)
    cfg, state, slot, req, step, acc, m_cap, ids, cnt, _, _, z, top = \
        spin_case(n_full, batch, slots, 1, 512, rho, layers, dtype)
    # every argument made up front: a kernel between the top-K and the update (n - 1, say) would
    # be the update's predecessor instead of the top-K
    ns = [n_full - SKEWS + s for s in range(SKEWS)]
    qs = [n - 1 for n in ns]
    steps = [step + s for s in range(SKEWS)]

    def one_step(s: int, mode: str) -> None:
        ops.select(state, slot, ns[s], qs[s], req, steps[s], cfg, m_cap, slots, ids, cnt)
        for l in range(layers):
            ops.indexer_logits(q, cache, w, ns[s], table, ids[:, l], cnt[:, l], z)
            ops.topk(z, ids[:, l], cnt[:, l], 1, 512, top)
            if mode != "none":
                ops.update(state, slot, z, ids[:, l], cnt[:, l], ns[s], qs[s], acc, steps[s], l,
                           cfg, slots, beside_previous=mode == "beside")

    graphs = {}
    for mode in MODES:
        for s in range(SKEWS):                   # eager first: first launches, allocations
            one_step(s, mode)
        torch.cuda.synchronize()
        for s in range(SKEWS):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                one_step(s, mode)
            graphs[(mode, s)] = g
    step_us = {mode: [] for mode in MODES}
    for mode in MODES * 2:
        replay = lambda: [graphs[(mode, s)].replay() for s in range(SKEWS)]  # noqa: E731
        replay()
        step_us[mode].append(event_us(replay, reps) / SKEWS)
    best = {mode: min(t) for mode, t in step_us.items()}
    select = event_us(lambda: ops.select(state, slot, ns[0], qs[0], req, steps[0], cfg, m_cap,
                                         slots, ids, cnt), 20) / layers
    exposed = {mode: (best[mode] - best["none"]) / layers for mode in ("after", "beside")}
    row = {"batch": batch, "slots": slots, "state_dtype": dtype, "sparsity": rho,
           # flashinfer's path ends with the remap kernel, which the update cannot overlap
           "topk_path": ops.topk_peer(z, ids[:, 0], 512) or "spin",
           "layers": layers, "step_us": step_us, "select_per_layer_us": select,
           "exposed_update_us": exposed, "dg_dense_logits_us": dense}
    if dense:  # a negative exposed time is noise between the modes: counted as 0
        row["share"] = {mode: (select + max(0.0, exposed[mode])) / dense for mode in exposed}
    del graphs
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=21)
    args, shapes = skew_case_args(ap, ["96x131072", "32x131072", "96x32768", "32x32768",
                                       "8x131072", "8x32768"], 5, argv)
    if args.layers < 1:
        ap.error("--layers must be >= 1")
    if cannot_run("bench_update_overlap"):
        return 2
    try:
        from spin_trtllm.logits import DeepGemmLogits
        dg = DeepGemmLogits()
    except Exception as err:  # noqa: BLE001 - any import failure: no dense column
        print(f"bench_update_overlap: no DeepGEMM column ({err})", file=sys.stderr)
        dg = None
    rows = []
    print(f"{'batch x slots':>15} | {'state':>13} | us per layer: after | beside | none | "
          f"exposed update after -> beside | select | DeepGEMM dense | share after -> beside")
    for batch, slots in shapes:
        for dtype in args.state_dtype:
            r = run_case(dg, batch, slots, dtype, args.sparsity, args.layers, args.reps)
            rows.append(r)
            per = {m: min(t) / args.layers for m, t in r["step_us"].items()}
            dense = f"{r['dg_dense_logits_us']:9.1f} us" if r["dg_dense_logits_us"] else "-"
            share = (f"{100 * r['share']['after']:.1f}% -> {100 * r['share']['beside']:.1f}%"
                     if "share" in r else "-")
            print(f"{batch:>6} x {slots:<6} | {dtype:>13} | {per['after']:8.1f} | "
                  f"{per['beside']:6.1f} | {per['none']:6.1f} | "
                  f"{r['exposed_update_us']['after']:6.2f} -> "
                  f"{r['exposed_update_us']['beside']:5.2f} | {r['select_per_layer_us']:5.2f} | "
                  f"{dense} | {share}", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
