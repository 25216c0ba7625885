"""The demo's report: the indexer-bytes figure first, the GPU step times (where measured), an
aligned table of SPIN against all-keep, and the notes under it."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from ..limits import BLOCK_SLOTS, SLOT_BYTES, SUMMARY_BYTES
from ..predictors import REGISTRY


def speed_lines(sp: dict[str, Any]) -> list[str]:
    """The GPU report's first lines: step times where the indexer matters."""
    d, s = sp["dense"], sp["spin"]
    head = (f"decode step, {sp['batch']} requests x {sp['context_tokens']:,} tokens of context "
            f"({sp['context_tokens'] // 4:,} indexer slots), V4-Flash-shaped indexer "
            f"(21 layers, K 512), synthetic caches, CUDA graphs, medians of {d['steps']} steps:")
    rows = [("GPU time per step, ms", f"{s['forward_ms']:.2f}", f"{d['forward_ms']:.2f}"),
            ("  of it the indexer, ms", f"{s['indexer_ms']:.2f}", f"{d['indexer_ms']:.2f}"),
            ("wall time per step, ms", f"{s['step_ms']:.2f}", f"{d['step_ms']:.2f}"),
            ("realized block sparsity", f"{s['realized_sparsity']:.1%}", "0.0%"),
            ("steps SPIN ran", f"{s['spin_steps']}/{s['steps']}", "-")]
    out = [head] + ["  " + ln for ln in table(("", f"SPIN ({sp['switch']})", "all-keep"), rows)]
    if d["indexer_ms"] > 0:
        out.append(f"  all-keep step / SPIN step: {d['forward_ms'] / s['forward_ms']:.2f}x; SPIN's "
                   f"indexer takes {s['indexer_ms'] / d['indexer_ms']:.2f}x the all-keep indexer's "
                   f"time")
    out += _wrap("(auto runs the all-keep indexer on steps where spin_trtllm.costs predicts "
                 "SPIN would not pay. The quality run below decodes real text with the shipped "
                 "model and SPIN on every step; its short contexts are not where SPIN saves time)")
    return out


def _name(predictor: str) -> str:
    return "SPIN" if predictor == "spin" else predictor


def bytes_line(res: dict[str, Any]) -> str:
    """The report's first figure: the indexer's memory traffic per decode step, SPIN against
    all-keep (hardware-independent: counted, see indexer_bytes)."""
    s, d = res["spin"], res["all_keep"]
    if s["indexer_mb_per_step"] is None or d["indexer_mb_per_step"] is None:
        return "indexer bytes read+written per decode step: - (no decode steps)"
    ratio = s["indexer_mb_per_step"] / d["indexer_mb_per_step"]
    predictor = res.get("predictor", "spin")
    summaries = REGISTRY[predictor].query
    return (f"indexer bytes read+written per decode step (mean): {_name(predictor)} "
            f"{s['indexer_mb_per_step']:.3f} MB (K cache{' + summaries' if summaries else ''} "
            f"{s['kcache_mb_per_step']:.3f} MB + state {s['state_mb_per_step']:.3f} MB) vs "
            f"all-keep {d['indexer_mb_per_step']:.3f} MB = {ratio:.2f}x")


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """Label column left-aligned, value columns right-aligned, each as wide as its widest
    cell, two spaces apart: every row's columns start and end at the same offsets."""
    cols = list(zip(header, *rows))
    widths = [max(len(c) for c in col) for col in cols]
    return [(r[0].ljust(widths[0]) + "".join(f"  {c:>{w}}" for c, w in zip(r[1:], widths[1:])))
            for r in [header, *rows]]


def _wrap(note: str, indent: str = "  ") -> list[str]:
    """A note under the report, wrapped to 96 columns, continuation lines indented."""
    return textwrap.wrap(note, 96, initial_indent=indent, subsequent_indent=indent + "  ")


def format_report(res: dict[str, Any]) -> str:
    m, s, d = res["model"], res["spin"], res["all_keep"]
    ratios = m["compress_ratios"]
    indexed = ratios.count(4) + ratios.count(1)
    kind = "CSA" if 4 in ratios else "DSA"
    layout = f"{len(ratios)} layers ({indexed} {kind} with a 64x128 indexer, " \
             f"{sum(1 for r in ratios if r > 4)} HCA, {ratios.count(0)} window-only)"

    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    pct = "{:.1%}"
    miss = "-" if s["mean_miss"] is None else f(s["mean_miss"], pct) + f" ({f(s['p99_miss'], pct)})"
    rows = [
        ("decode steps", f(s["decode_steps"], "{}"), f(d["decode_steps"], "{}")),
        ("step time, median ms", f(s["step_ms_median"]), f(d["step_ms_median"])),
        ("  indexer, median ms", f(s["indexer_ms_median"]), f(d["indexer_ms_median"])),
        ("  indexer share of steps", f(s["indexer_share"], pct), f(d["indexer_share"], pct)),
        ("prefill, s", f(s["prefill_s"]), f(d["prefill_s"])),
        ("realized block sparsity", f(s["realized_sparsity"], pct), "0.0%"),
        ("mean miss (p99)", miss, "0.0%"),
        ("MTP draft acceptance", f(s["mtp_acceptance"], pct), f(d["mtp_acceptance"], pct)),
        ("tokens per decode step (all requests)*", f(s["tokens_per_step"]),
         f(d["tokens_per_step"])),
    ]
    sp = res["spin_config"]["target_sparsity"]
    cpu = not res["device"].startswith("cuda")
    lines = [f"dsa-lite on {res['device_name']}: {layout}, K={m['index_topk']}, "
             f"next_n={m['mtp_depth'] + 1}, {m['dtype']}; weights: {Path(res['weights']).name}; "
             f"logits: {res['logits_backend']}",
             *(speed_lines(res["speed"]) if res.get("speed") else []),
             bytes_line(res)]
    if REGISTRY[res.get("predictor", "spin")].query:
        select_reads = (" and by select over the visible slots"
                        if REGISTRY[res["predictor"]].merges else "")
        lines += _wrap(f"(counted from the indexer kernels' access pattern, not measured: K cache "
                       f"{BLOCK_SLOTS} x {SLOT_BYTES} B per scored block and one "
                       f"{SUMMARY_BYTES}-byte summary row per visible block, which the probe "
                       f"reads; the {res['spin_config']['state_dtype']} V/D state read and "
                       f"written by update over the scored slots{select_reads})")
    else:
        lines += _wrap(f"(counted from the indexer kernels' access pattern, not measured: K cache "
                       f"{BLOCK_SLOTS} x {SLOT_BYTES} B per scored block; SPIN's "
                       f"{res['spin_config']['state_dtype']} V/D state read by select over the "
                       f"visible slots, read and written by update over the scored slots)")
    if cpu:
        lines += _wrap("(CPU: the step times below come from reference ops in plain PyTorch "
                       "and are not the point; the bytes figure is what carries over to a GPU)")
    name = _name(res.get("predictor", "spin"))
    lines += table(("", f"{name} @ {sp:.2f}", "all-keep"), rows)
    lines.append(f"token agreement with all-keep: {f(res['token_agreement'], pct)} of tokens, "
                 f"{res['identical_requests']}/{res['requests']} requests identical")
    lines += _wrap("* tokens the decode steps emitted, all requests together (each turn's first "
                   "token comes from its prefill); with next_n 1 this is the mean batch size, "
                   "with MTP it includes the accepted drafts", indent="")
    if not s["cuda_graphs"] and not cpu:
        lines.append("(eager steps with CUDA-event timing; --cuda-graphs times graph replays "
                     "without the indexer split)")
    if s["mean_miss"] is not None:
        lines.append("(miss: eligible rows only, as in replay; step times exclude the shadow "
                     "dense indexer)")
    else:
        lines.append("(mean miss: run with --measure-miss)")
    if res["trace"]:
        lines.append(f"trace of request 0 written to {res['trace']}")
    return "\n".join(lines)
