"""SPIN's quality on the trained dsa-lite model (benchmarks/QUALITY.md is written from this).

1. traces: the all-keep engine decodes held-out prompts with teacher forcing and dumps SPIN
   trace v1 (dense indexer scores) of every request; one set without MTP, one with MTP rows
   from the model's draft head;
2. replay on the traces: miss vs realized sparsity with the random and oracle references,
   the paper's Table 1, and the exploration / reduction / MTP ablations (plots); and each
   run of step 3 replayed (same predictor, target and pages) beside its in-engine miss;
3. task-quality analog: held-out bits per byte of the teacher-forced continuations when the
   model's sparse attention uses the top-K of the SPIN-masked indexer, against all-keep.
Usage: python benchmarks/quality.py --out DIR [--checkpoint CKPT] [--device cuda]
       [--page-slots 32|64] [--logits-backend native|deepgemm|reference] ...
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from spin_trtllm import SpinConfig
from spin_trtllm._inputs import exit_code_of
from spin_trtllm._outputs import write_output
from spin_trtllm.harness import Engine, Request
from spin_trtllm.harness.engine.options import resolve_backend
from spin_trtllm.harness.model import load_checkpoint
from spin_trtllm.harness.pretrained import default_checkpoint
from spin_trtllm.harness.train import stdlib_corpus
from spin_trtllm.limits import BLOCK_SLOTS, PAGE_SIZES, SLOT_BYTES, SUMMARY_BYTES
from spin_trtllm.options import LOGITS_BACKENDS
from spin_trtllm.predictors import ENGINE_PREDICTORS, REGISTRY
from spin_trtllm.replay.evaluate import replay, run_study
from spin_trtllm.replay.plots import plot_miss_curve, plot_topk_mask
from spin_trtllm.replay.predictors import compare_predictors
from spin_trtllm.replay.probe import rows_read_per_block


def slices(held: torch.Tensor, count: int, length: int) -> list[bytes]:
    """`count` non-overlapping held-out windows spread over the held-out text."""
    if held.numel() < count * length:
        raise SystemExit(f"held-out text has {held.numel()} bytes, need {count * length}")
    step = held.numel() // count
    return [bytes(held[i * step:i * step + length].tolist()) for i in range(count)]


def run_forced(cfg, weights, device, spin, texts, prompt_tokens, steps, trace=False,
               measure_miss=False, predictor="spin", page_slots=64, logits_backend="native"):
    # switch="spin": SPIN (or the probe) on every step, as the quality question asks
    engine = Engine(cfg, spin, weights=weights, device=device, max_batch=len(texts),
                    trace_request=list(range(len(texts))) if trace else None,
                    measure_miss=measure_miss, predictor=predictor,
                    switch="spin" if spin is not None else None, page_slots=page_slots,
                    logits_backend=logits_backend)
    reqs = [Request(t[:prompt_tokens], max_new_tokens=steps, request_id=i,
                    forced=list(t[prompt_tokens:prompt_tokens + steps]))
            for i, t in enumerate(texts)]
    outs = {o.request_id: o for o in engine.run(reqs)}
    return engine, outs


def record_traces(args, cfg, cfg0, weights, texts, out, report, t0):
    # 1. traces (all-keep decoding: the dense indexer's own scores)
    engine, _ = run_forced(cfg, weights, args.device, None, texts[:args.prompts],
                           args.prompt_tokens, args.steps, trace=True, **engine_args(args))
    traces = []
    for i in range(args.prompts):
        tr = engine.trace(i)
        tr.name = f"heldout{i}"
        tr.save(out / f"trace_{i}.safetensors")
        traces.append(tr)
    mtp_traces = []
    if args.mtp_prompts and cfg0.mtp_depth:
        cfg_mtp = cfg.with_overrides(mtp_depth=cfg0.mtp_depth)
        engine, outs = run_forced(cfg_mtp, weights, args.device, None, texts[args.prompts:],
                                  args.prompt_tokens, args.steps, trace=True,
                                  **engine_args(args))
        for i in range(args.mtp_prompts):
            tr = engine.trace(i)
            tr.name = f"heldout_mtp{i}"
            tr.save(out / f"trace_mtp_{i}.safetensors")
            mtp_traces.append(tr)
        report["mtp_acceptance"] = sum(o.accepted for o in outs.values()) / max(
            1, sum(o.drafted for o in outs.values()))
    report["trace_seconds"] = time.time() - t0
    print(f"traces: {len(traces)} + {len(mtp_traces)} MTP, {traces[0].max_slots} slots, "
          f"{traces[0].num_steps} steps [{time.time() - t0:.0f} s]", flush=True)

    return traces, mtp_traces


def summary_share(predictor: str, page_slots: int) -> float:
    """A block's summary bytes over its K-cache bytes: the predictor's rows for each of the
    block's pages (BLOCK_SLOTS / page_slots of them), against 64 keys and scales."""
    rows = rows_read_per_block(predictor, summaries=BLOCK_SLOTS // page_slots)
    return rows * SUMMARY_BYTES / (BLOCK_SLOTS * SLOT_BYTES)


def engine_vs_replay(traces, bpb: list[dict], page_slots: int) -> list[dict]:
    """Each SPIN-masked run's in-engine miss beside the replay's on the all-keep run's traces
    of the same windows: the same predictor, target sparsity and pages (the probe and gauss
    score a block by its best page: with 32-slot pages the replay's 2 summaries). The
    engine's miss is over its own decoding, whose masked attention moves later scores a little;
    the replay's over the all-keep decoding's scores."""
    rows = []
    for run in bpb:
        rho, predictor = run["target_sparsity"], run["predictor"]
        if rho is None:
            continue
        summaries = BLOCK_SLOTS // page_slots if REGISTRY[predictor].sub_blocks else 1
        res = [r for tr in traces for r in replay(tr, [rho], SpinConfig(), pearson=False,
                                                   predictor=predictor, summaries=summaries)]
        eligible = sum(r["eligible_rows"] for r in res)
        effective = [r["effective_sparsity"] for r in res if r["effective_sparsity"] is not None]
        miss = sum(r["mean_miss"] * r["eligible_rows"] for r in res if r["eligible_rows"])
        rows.append({"predictor": predictor, "target_sparsity": rho, "summaries": summaries,
                     "engine_mean_miss": run["mean_miss"],
                     "replay_mean_miss": miss / eligible if eligible else None,
                     "engine_effective_sparsity": run["effective_sparsity"],
                     "replay_effective_sparsity": sum(effective) / len(effective)
                     if effective else None})
        last = rows[-1]
        if last["engine_mean_miss"] is not None and last["replay_mean_miss"] is not None:
            print(f"{predictor} {rho}: mean miss in the engine {last['engine_mean_miss']:.3f}, "
                  f"in the replay {last['replay_mean_miss']:.3f}", flush=True)
    return rows


def engine_args(args) -> dict:
    """The engine choices every run of this tool shares (K-cache page size, logits backend)."""
    return {"page_slots": args.page_slots, "logits_backend": args.logits_backend}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--mtp-prompts", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.2, 0.3, 0.4, 0.5, 0.6])
    ap.add_argument("--predictor", nargs="+", choices=ENGINE_PREDICTORS, default=["spin"],
                    help="block predictors of the bits-per-byte rows (probe: the query-aware "
                         "page summaries, hybrid: those merged with SPIN's history, gauss: "
                         "the mean and spread rows; spin_trtllm.indexer)")
    ap.add_argument("--page-slots", type=int, choices=PAGE_SIZES, default=BLOCK_SLOTS,
                    help="slots per indexer K-cache page (32: DeepSeek-V4's tokens_per_block "
                         "128, one SPIN block spans two pages); the same tokens and blocks "
                         "either way")
    ap.add_argument("--logits-backend", choices=LOGITS_BACKENDS, default="native",
                    help="the decode indexer's logits (32-slot pages: reference on CUDA, or "
                         "deepgemm on SM100; on the CPU native runs the reference)")
    ap.add_argument("--effective", action="store_true",
                    help="--sparsity values are effective sparsities: a query-aware "
                         "predictor's target block sparsity adds its summary rows' share of "
                         "the K-cache bytes (the same bytes read as spin's at that target, "
                         "up to the budget's whole blocks)")
    ap.add_argument("--bpb-only", action="store_true",
                    help="only the bits-per-byte rows (no traces, replays or plots)")
    args = ap.parse_args(argv)
    # refused now, not after the traces (native cannot read 32-slot pages on CUDA); the name
    # the engines run (on the CPU native reads 32-slot pages through the reference)
    backend = resolve_backend(args.logits_backend, torch.device(args.device), args.page_slots)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = args.checkpoint or default_checkpoint()
    if ckpt is None:
        print("quality: no checkpoint (run spin-trtllm train-tiny)", file=sys.stderr)
        return 2
    cfg0, weights = load_checkpoint(ckpt)
    length = args.prompt_tokens + args.steps + 1
    cfg = cfg0.with_overrides(mtp_depth=0, max_context=max(cfg0.max_context, length + 16))
    corpus = stdlib_corpus()
    texts = slices(corpus.held_out, args.prompts + args.mtp_prompts, length)
    report: dict = {"checkpoint": str(ckpt), "device": str(args.device),
                    "prompt_tokens": args.prompt_tokens, "steps": args.steps,
                    "corpus": corpus.source, "page_slots": args.page_slots,
                    "logits_backend": backend.name}
    t0 = time.time()
    if not args.bpb_only:
        traces, mtp_traces = record_traces(args, cfg, cfg0, weights, texts, out, report, t0)
    # 3. bits per byte with SPIN-masked top-K vs all-keep (teacher forcing)
    t1 = time.time()
    bpb = []
    runs = [(None, "spin")] + [(rho, p) for p in args.predictor for rho in args.sparsity]
    for asked, predictor in runs:
        rho, share = asked, summary_share(predictor, args.page_slots)
        if asked is not None and args.effective:
            rho = round(asked + share, 6)
            if not rho < 1.0:
                raise SystemExit(f"quality: effective sparsity {asked} with {predictor}'s "
                                 f"summaries needs a target of {rho}, at least 1")
        spin = None if rho is None else SpinConfig(index_topk=cfg.index_topk, target_sparsity=rho)
        engine, outs = run_forced(cfg, weights, args.device, spin, texts[:args.prompts],
                                  args.prompt_tokens, args.steps, measure_miss=spin is not None,
                                  predictor=predictor, **engine_args(args))
        lp = [x for o in outs.values() for x in o.logprobs]
        hist = engine.history
        sel = sum(s.selected_blocks for s in hist)
        vis = sum(s.visible_blocks for s in hist)
        miss = [m for s in hist for m in s.miss]
        # the predictor's summary rows count as indexer reads, in blocks' worth of bytes
        summary = 0.0 if rho is None else share * vis
        bpb.append({"target_sparsity": rho, "predictor": predictor if rho is not None else None,
                    "effective_target": asked if args.effective else None,
                    "bpb": -sum(lp) / len(lp) / math.log(2),
                    "tokens": len(lp), "realized_sparsity": (1 - sel / vis) if vis else 0.0,
                    "effective_sparsity": (1 - (sel + summary) / vis) if vis else 0.0,
                    "mean_miss": sum(miss) / len(miss) if miss else None})
        miss_txt = "" if bpb[-1]["mean_miss"] is None else f", mean miss {bpb[-1]['mean_miss']:.3f}"
        print(f"bpb {'all-keep' if rho is None else f'{predictor} {rho}'}: {bpb[-1]['bpb']:.4f} "
              f"(realized {bpb[-1]['realized_sparsity']:.3f}, effective "
              f"{bpb[-1]['effective_sparsity']:.3f}{miss_txt})", flush=True)
    report["bpb"] = bpb
    report["bpb_seconds"] = time.time() - t1
    if args.bpb_only:
        write_output(out / "quality.json", "--out", json.dumps(report, indent=1, default=float))
        print(f"wrote {out / 'quality.json'} [{time.time() - t0:.0f} s]")
        return 0

    # 2. replays (CPU)
    t2 = time.time()
    base = SpinConfig()
    results = []
    for tr in traces:
        results += replay(tr, args.sparsity, base)
    report["replay"] = [{k: v for k, v in r.items() if k not in ("config", "masks")}
                        for r in results]
    plot_miss_curve(results, out / "miss_vs_sparsity.png")
    for layer in range(traces[0].num_layers):
        plot_topk_mask(traces[0], out / f"topk_mask_layer{layer}.png", layer=layer)
    report["predictors"] = [compare_predictors(tr) for tr in traces]
    report["engine_vs_replay"] = engine_vs_replay(traces, bpb, args.page_slots)
    studies = {}
    for study in ("exploration", "reduction"):
        res = []
        for tr in traces:
            res += run_study(tr, study, args.sparsity, base)
        studies[study] = [{k: v for k, v in r.items() if k not in ("config", "masks", "per_layer")}
                          for r in res]
        plot_miss_curve(res, out / f"ablate_{study}.png")
    if mtp_traces:
        res = []
        for tr in mtp_traces:
            res += run_study(tr, "mtp", args.sparsity, base)
            res += replay(tr, args.sparsity, base, label="SPIN (union, prefix_valid)")
        studies["mtp"] = [{k: v for k, v in r.items() if k not in ("config", "masks", "per_layer")}
                          for r in res]
    report["studies"] = studies
    report["replay_seconds"] = time.time() - t2
    write_output(out / "quality.json", "--out", json.dumps(report, indent=1, default=float))
    print(f"wrote {out / 'quality.json'} [{time.time() - t0:.0f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(exit_code_of(main, Path(sys.argv[0]).name))
