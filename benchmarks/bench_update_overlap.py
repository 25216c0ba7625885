"""Select and the EMA update beside the top-K: what a decode step's indexer pays for them (CUDA
GPU, sm_90+).

    python benchmarks/bench_update_overlap.py [--shapes 96x131072 32x131072 96x32768 ...]
        [--state-dtype float16 float8_e4m3fn] [--sparsity 0.5] [--layers 21] [--reps 5]
        [--json OUT]

A step's SPIN indexer (per layer the native masked logits, top-K and one-row update) is captured
in CUDA graphs, one per D skew (contexts n = slots - 8 + s, s = 0..7, so the newest block is
partial), five ways:
  after    select for every layer in one launch at the start; the update after the top-K
  beside   the same, the update launched with beside_previous=True: it runs on the SMs the
           top-K leaves idle and still completes after it
  chain    layer 0's select at the start, then after each top-K the next layer's select and
           the update, both beside it (SpinIndexer's overlap_select, off by default, with
           overlap_update)
  none     select for every layer at the start, no update
  bare     neither select nor update (the blocks selected once, outside the graphs)
Replays are timed with CUDA events, each mode twice, interleaved; the smaller of the two is
kept. "Added" per layer is (mode - bare) / layers: what select and the update add to the step
(negative where it is below the noise between modes, a few us a layer at 96 x 128K). Select alone
is also timed (graphs of 20 launches: all layers, per layer; one layer). With deep_gemm importable
(tests/gpu/deepgemm_env.sh) DeepGEMM's dense logits over the whole context are timed in the same
process (a graph of 20 calls), and the share added / dense logits is printed (issue 16, target
5). Select and update overlap spin's top-K kernel only: where ops.topk runs flashinfer's path
(installed; more than 16 rows of tables wider than TOPK_SPIN_MAX_WIDTH that spin's filter
does not take: ops.spin_topk_is_faster) they follow the remap, so "beside" and "chain" are
"after" there (each row records its top-K path).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from spin_trtllm import ops
from spin_trtllm._inputs import exit_code_of
from spin_trtllm._outputs import write_output

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_decode_indexer import cannot_run, make_inputs, spin_case, time_ms  # noqa: E402
from bench_kernel_times import SKEWS, skew_case_args  # noqa: E402
MODES = ("after", "beside", "chain", "none", "bare")


def event_us(fn, iters: int) -> float:
    """Mean device microseconds of fn() over iters calls (one pair of CUDA events)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def graph_us(fn, calls: int = 20, reps: int = 3) -> float:
    """Device microseconds of one fn() from a CUDA graph of `calls` calls (no host launch gaps,
    which an eager loop of small kernels would time instead); the median of `reps` replays."""
    return 1e3 * time_ms(lambda i: fn(), reps, 1, calls)


def run_case(dg, batch: int, slots: int, dtype: str, rho: float, layers: int, reps: int) -> dict:
    inputs, n_full = make_inputs(batch, slots, 1, 1, seed=1)
    cache, table, q, w = inputs[0]
    dense = None
    if dg is not None:
        meta = dg.dg.get_paged_mqa_logits_metadata(n_full, 64, dg.num_sms(torch.device("cuda")))
        dense = graph_us(lambda: dg.dg.fp8_paged_mqa_logits(q.view(batch, 1, 64, 128), cache, w,
                                                            n_full, table, meta, slots))
    cfg, state, slot, req, step, acc, m_cap, ids, cnt, _, _, z, top = \
        spin_case(n_full, batch, slots, 1, 512, rho, layers, dtype)
    # every argument made up front: a kernel between the top-K and the launch beside it (n - 1,
    # say) would be that launch's predecessor instead of the top-K
    ns = [n_full - SKEWS + s for s in range(SKEWS)]
    qs = [n - 1 for n in ns]
    steps = [step + s for s in range(SKEWS)]

    def select(s: int, layer=None, beside: bool = False) -> None:
        ops.select(state, slot, ns[s], qs[s], req, steps[s], cfg, m_cap, slots, ids, cnt,
                   layer=layer, beside_previous=beside)

    def one_step(s: int, mode: str) -> None:
        chain = mode == "chain"
        if mode in ("after", "beside", "none"):
            select(s)
        elif chain:
            select(s, 0)
        for l in range(layers):
            ops.indexer_logits(q, cache, w, ns[s], table, ids[:, l], cnt[:, l], z)
            ops.topk(z, ids[:, l], cnt[:, l], 1, 512, top)
            if chain and l + 1 < layers:
                select(s, l + 1, beside=True)
            if mode in ("after", "beside", "chain"):
                ops.update(state, slot, z, ids[:, l], cnt[:, l], ns[s], qs[s], acc, steps[s], l,
                           cfg, slots, beside_previous=mode != "after")

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
    select(0)                                    # bare's blocks
    step_us = {mode: [] for mode in MODES}
    for mode in MODES * 2:
        replay = lambda: [graphs[(mode, s)].replay() for s in range(SKEWS)]  # noqa: E731
        replay()
        step_us[mode].append(event_us(replay, reps) / SKEWS)
    best = {mode: min(t) for mode, t in step_us.items()}
    del graphs
    select_alone = graph_us(lambda: select(0)) / layers
    select_one_layer = graph_us(lambda: select(0, layers - 1))
    added = {mode: (best[mode] - best["bare"]) / layers for mode in MODES if mode != "bare"}
    row = {"batch": batch, "slots": slots, "state_dtype": dtype, "sparsity": rho,
           # flashinfer's path ends with the remap kernel, which nothing can overlap
           "topk_path": ops.topk_peer(z, ids[:, 0], 512) or "spin",
           "layers": layers, "step_us": step_us, "select_alone_per_layer_us": select_alone,
           "select_one_layer_alone_us": select_one_layer,
           "added_us": added, "dg_dense_logits_us": dense}
    if dense:  # a negative added time is noise between the modes: counted as 0
        row["share"] = {mode: max(0.0, added[mode]) / dense for mode in added}
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
    shown = ("after", "beside", "chain")
    print(f"{'batch x slots':>15} | {'state':>13} | us per layer: bare | select + update added: "
          f"{' | '.join(shown)} | select alone, per layer of all | DeepGEMM dense | share {' -> '.join(shown)}")
    for batch, slots in shapes:
        for dtype in args.state_dtype:
            r = run_case(dg, batch, slots, dtype, args.sparsity, args.layers, args.reps)
            rows.append(r)
            bare = min(r["step_us"]["bare"]) / args.layers
            added = " | ".join(f"{r['added_us'][m]:6.2f}" for m in shown)
            dense = f"{r['dg_dense_logits_us']:9.1f} us" if r["dg_dense_logits_us"] else "-"
            share = (" -> ".join(f"{100 * r['share'][m]:.1f}%" for m in shown)
                     if "share" in r else "-")
            print(f"{batch:>6} x {slots:<6} | {dtype:>13} | {bare:7.1f} | {added} | "
                  f"{r['select_alone_per_layer_us']:5.2f} ({r['select_one_layer_alone_us']:5.2f} "
                  f"one layer) | {dense} | {share} "
                  f"(top-K: {r['topk_path']})", flush=True)
            torch.cuda.empty_cache()
    if args.json:
        write_output(args.json, "--json", json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(exit_code_of(main, Path(sys.argv[0]).name))
