"""The query-aware predictors' per-layer cost on a CUDA GPU, against SPIN's select and the dense
logits, same inputs, CUDA-graph replays (medians):

    python benchmarks/bench_probe.py [--batch 32 96] [--slots 32768 131072] [--next-n 1 2]
        [--sparsity 0.5] [--layers 21] [--json OUT]

Per case, per indexer layer: summarize (the newest page of each request, as at decode), probe
(every block's summary scored with q), select of one layer ranked by the probe, and by the hybrid
(the probe merged with SPIN's V/D prediction by rank: select(merge_history=True)), against SPIN's
select (all layers in one launch, divided by --layers) and the dense logits over every page;
gauss's summarize and scores (two rows a page: the mean and the per-dimension std) likewise.
Bytes: the probe reads one 144-byte summary row per block, 1/58 of the block's K-cache pages;
gauss two.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

from spin_trtllm import ops
from spin_trtllm._inputs import exit_code_of
from spin_trtllm._outputs import write_output
from spin_trtllm.limits import GAUSS_SUMMARY_BYTES, SUMMARY_BYTES

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_decode_indexer import (PAGE_BYTES, cannot_run, make_inputs, spin_case,  # noqa: E402
                                  time_ms)


def run_case(inputs, n, batch, slots, next_n, rho, layers, iters):
    cfg, state, slot, req, step, acc, m_cap, ids, cnt, dense_ids, dense_cnt, z, top = \
        spin_case(n, batch, slots, next_n, 512, rho, layers, "float16")
    sets = len(inputs)
    summaries = [ops.summaries_like(c[0]) for c in inputs]
    gauss_summaries = [ops.gauss_summaries_like(c[0]) for c in inputs]
    for (cache, table, _, _), s, g in zip(inputs, summaries, gauss_summaries):
        every_page = table.flatten().contiguous()            # as after prefill
        full = torch.full((table.numel(),), 64, dtype=torch.int32, device="cuda")
        ops.summarize(cache, every_page, full, s)
        ops.summarize_gauss(cache, every_page, full, g)
    newest = [t[:, -1].contiguous() for _, t, _, _ in inputs]
    fill = torch.full((batch,), 64, dtype=torch.int32, device="cuda")
    scores = torch.empty(batch * next_n, m_cap, device="cuda")
    q_pos = n - 1
    t_sum = time_ms(lambda i: ops.summarize(inputs[i][0], newest[i], fill, summaries[i]),
                    iters, sets)
    t_probe = time_ms(lambda i: ops.probe(inputs[i][2], summaries[i], inputs[i][3], n,
                                          inputs[i][1], m_cap, scores), iters, sets)
    t_gsum = time_ms(lambda i: ops.summarize_gauss(inputs[i][0], newest[i], fill,
                                                   gauss_summaries[i]), iters, sets)
    t_gauss = time_ms(lambda i: ops.gauss(inputs[i][2], gauss_summaries[i], inputs[i][3], n,
                                          inputs[i][1], m_cap, scores), iters, sets)
    t_psel = time_ms(lambda i: ops.select(state, slot, n, q_pos, req, step, cfg, m_cap, slots,
                                          ids, cnt, block_scores=scores.view(batch, next_n, -1),
                                          layer=0), iters, sets)
    t_hsel = time_ms(lambda i: ops.select(state, slot, n, q_pos, req, step, cfg, m_cap, slots,
                                          ids, cnt, block_scores=scores.view(batch, next_n, -1),
                                          layer=0, merge_history=True), iters, sets)
    t_sel = time_ms(lambda i: ops.select(state, slot, n, q_pos, req, step, cfg, m_cap, slots,
                                         ids, cnt), iters, sets) / layers
    t_dense = time_ms(lambda i: ops.indexer_logits(inputs[i][2], inputs[i][0], inputs[i][3], n,
                                                   inputs[i][1], dense_ids, dense_cnt, z),
                      iters, sets)
    us = 1e3
    probe_path = t_sum + t_probe + t_psel
    gauss_path = t_gsum + t_gauss + t_psel      # the same one-layer select ranks its scores
    return {"batch": batch, "slots": slots, "next_n": next_n, "target_sparsity": rho,
            "summarize_us": us * t_sum, "probe_us": us * t_probe,
            "probe_select_us": us * t_psel, "probe_path_us": us * probe_path,
            "hybrid_select_us": us * t_hsel, "hybrid_path_us": us * (probe_path - t_psel + t_hsel),
            "gauss_summarize_us": us * t_gsum, "gauss_us": us * t_gauss,
            "gauss_path_us": us * gauss_path,
            "spin_select_per_layer_us": us * t_sel, "dense_logits_us": us * t_dense,
            "probe_path_over_dense": probe_path / t_dense,
            "gauss_path_over_dense": gauss_path / t_dense,
            "probe_tbs": batch * m_cap * SUMMARY_BYTES / (t_probe * 1e-3) / 1e12,
            "gauss_tbs": batch * m_cap * GAUSS_SUMMARY_BYTES / (t_gauss * 1e-3) / 1e12,
            "dense_tbs": batch * m_cap * PAGE_BYTES / (t_dense * 1e-3) / 1e12}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 96])
    ap.add_argument("--slots", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--next-n", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--layers", type=int, default=21)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--sets", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    if cannot_run("bench_probe"):
        return 2
    rows = []
    print("| batch | slots | next_n | summarize us | probe us (TB/s) | select by probe us | "
          "probe path us | select by hybrid us | gauss summarize us | gauss us (TB/s) | "
          "gauss path us | SPIN select / layer us | dense logits us | probe path / dense | "
          "gauss path / dense |")
    print("|---" * 15 + "|")
    for seed, (batch, slots, next_n) in enumerate(
            itertools.product(args.batch, args.slots, args.next_n)):
        inputs, n = make_inputs(batch, slots, next_n, args.sets, seed + 1)
        r = run_case(inputs, n, batch, slots, next_n, args.sparsity, args.layers, args.iters)
        rows.append(r)
        print(f"| {batch} | {slots} | {next_n} | {r['summarize_us']:.1f} | {r['probe_us']:.1f} "
              f"({r['probe_tbs']:.2f}) | {r['probe_select_us']:.1f} | {r['probe_path_us']:.1f} "
              f"| {r['hybrid_select_us']:.1f} | {r['gauss_summarize_us']:.1f} "
              f"| {r['gauss_us']:.1f} ({r['gauss_tbs']:.2f}) | {r['gauss_path_us']:.1f} "
              f"| {r['spin_select_per_layer_us']:.1f} | {r['dense_logits_us']:.1f} "
              f"| {r['probe_path_over_dense']:.3f} | {r['gauss_path_over_dense']:.3f} |",
              flush=True)
        del inputs
        torch.cuda.empty_cache()
    if args.json:
        write_output(args.json, "--json",
                     json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(exit_code_of(main, Path(sys.argv[0]).name))
