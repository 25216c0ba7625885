"""The main job: dsa-lite with SPIN and with the all-keep indexer, side by side."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
import statistics
import textwrap
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from ..config import SpinConfig
from ..costs import BLOCK_SLOTS, KEY_BYTES_PER_SLOT as K_SLOT_BYTES
from .. import logits as logits_backends
from ..errors import SpinError
from ..reference import SUMMARY_BYTES
from .config import DsaLiteConfig, tiny, v4_flash_indexer
from .engine import Engine, Request, RequestOutput, resolve_device
from .model import init_weights, load_checkpoint
from .pretrained import default_checkpoint

STATE_BYTES = {"float32": 4, "float16": 2, "float8_e4m3fn": 1}
MB = 1e6


@dataclass
class DemoOptions:
    device: str = "auto"
    requests: int = 4
    prompt_tokens: int = 1600
    new_tokens: int = 48
    max_batch: int = 4
    mtp_depth: int = 0
    checkpoint: Optional[str] = None
    random_weights: bool = False
    measure_miss: bool = False
    dump_trace: Optional[str] = None
    cuda_graphs: bool = False
    progress: bool = True
    logits_backend: str = "native"
    switch: Optional[str] = None              # SPIN engine: auto / spin / dense (Engine default)
    predictor: str = "spin"                   # SPIN engine's block predictor: spin / probe
    speed: Optional[tuple[int, int]] = None   # (batch, context tokens) of the GPU step timing;
    speed_auto: bool = True                   # None + speed_auto: the largest size that fits


def corpus(n: int, offset: int) -> bytes:
    """Prompt text that is on every machine: the Python standard library's own source."""
    import argparse
    import dataclasses
    import json as json_mod
    import textwrap
    text = "".join(inspect.getsource(m) for m in (argparse, dataclasses, json_mod.decoder,
                                                  textwrap)).encode()
    start = (offset * 7919) % max(1, len(text) - n)
    return text[start:start + n]


def workload(opts: DemoOptions, cfg: DsaLiteConfig) -> list[tuple[int, Request]]:
    """(arrival step, request): staggered arrivals, mixed lengths, one two-turn conversation."""
    out = []
    for i in range(opts.requests):
        n = max(1, opts.prompt_tokens - (i % 3) * opts.prompt_tokens // 4)
        turns = [corpus(max(1, opts.prompt_tokens // 8), 100 + i)] if i == 1 else []
        new = opts.new_tokens if not turns else max(1, opts.new_tokens // 2)
        out.append((0 if i < max(1, opts.max_batch // 2) else 3 * i,
                    Request(corpus(n, i), max_new_tokens=new, turns=turns, request_id=i,
                            seed=i)))
    return out


def _resolve(opts: DemoOptions) -> tuple[torch.device, DsaLiteConfig, Optional[dict]]:
    device = resolve_device(opts.device)
    checkpoint = opts.checkpoint
    if checkpoint and opts.random_weights:
        raise SpinError("--checkpoint and --random-weights exclude each other")
    if not checkpoint and not opts.random_weights:
        checkpoint = default_checkpoint()       # the shipped stdlib model
    if checkpoint:
        cfg, weights = load_checkpoint(checkpoint)
        if opts.mtp_depth and not cfg.mtp_depth:
            raise SpinError(f"--mtp {opts.mtp_depth}: the checkpoint has no MTP head")
        cfg = cfg.with_overrides(mtp_depth=opts.mtp_depth)
    else:
        base = v4_flash_indexer() if device.type == "cuda" else tiny()
        cfg, weights = base.with_overrides(mtp_depth=opts.mtp_depth), None
    # size the caches for this workload, not for the model's longest context
    need = opts.prompt_tokens + opts.prompt_tokens // 8 + 2 * opts.new_tokens + cfg.next_n + 1
    cfg = cfg.with_overrides(max_context=max(need, 2 * cfg.index_topk))
    return device, cfg, weights


def run_engine(cfg: DsaLiteConfig, spin: Optional[SpinConfig], weights, device, opts: DemoOptions,
               label: str, expected_steps: Optional[int] = None
               ) -> tuple[Engine, dict[int, RequestOutput]]:
    """Run the demo workload. The progress bar counts decode steps (total: expected_steps,
    else unknown) with the requests done in its postfix. The all-keep engine's StepStats get
    selected_blocks = visible_blocks = the blocks its dense indexer scored that step where the
    engine left them 0, so both sides' indexer bytes come from their own runs."""
    eager = opts.measure_miss or opts.dump_trace or not opts.cuda_graphs
    engine = Engine(cfg, spin, weights=weights, device=device, max_batch=opts.max_batch,
                    switch=(opts.switch or "spin") if spin is not None else None,
                    predictor=opts.predictor if spin is not None else "spin",
                    measure_miss=opts.measure_miss and spin is not None,
                    trace_request=0 if (opts.dump_trace and spin is not None) else None,
                    time_indexer=bool(eager), cuda_graphs=False if eager else None,
                    logits_backend=opts.logits_backend)
    arrivals = workload(opts, cfg)
    layers = len(cfg.csa_layers)
    bar = None
    if opts.progress:
        from tqdm import tqdm
        bar = tqdm(total=expected_steps, desc=f"{label} decode steps", unit="step", leave=False)
        bar.set_postfix_str(f"requests done 0/{len(arrivals)}")
    outs: dict[int, RequestOutput] = {}
    t = 0
    while len(outs) < len(arrivals):
        for when, req in arrivals:
            if when == t:
                engine.submit(req)
        before = len(engine.history)
        done = engine.step()
        for o in done:
            outs[o.request_id] = o
        new = len(engine.history) - before
        if new and spin is None and not engine.history[-1].visible_blocks:
            stats = engine.history[-1]
            blocks = int(engine.indexer.counts[:engine.indexer.batch].sum()) * layers
            stats.selected_blocks = stats.visible_blocks = blocks
        if bar is not None:
            bar.update(new)
            if done or new:
                bar.set_postfix_str(f"requests done {len(outs)}/{len(arrivals)}")
        t += 1
    if bar is not None:
        bar.close()
    return engine, outs


def indexer_bytes(selected_blocks: int, visible_blocks: int,
                  state_dtype: Optional[str] = None, predictor: str = "spin") -> tuple[int, int]:
    """(K-cache bytes, SPIN state bytes) the decode indexer reads and writes, counted from the
    kernels' access pattern (not measured), for blocks summed over requests and indexer layers.

    K cache: every slot of every scored block, BLOCK_SLOTS x K_SLOT_BYTES (128 fp8 key bytes +
    a 4-byte fp32 scale) per block; all-keep scores every visible block (selected = visible).
    SPIN state (state_dtype "float32", "float16" or "float8_e4m3fn", s = 4, 2 or 1 bytes;
    None: all-keep, no state; A1's slot-level V/D): select reads V (per slot) and D (per
    offset) of every visible slot, 2 s bytes; update reads and writes V and D of every scored slot and reads
    its fp32 logit, 2 x 2 s + 4 bytes. Blocks count whole (a partial newest block as 64
    slots); one update pass per step (MTP rows up to the accepted draft share it); the logits
    and top-K traffic that SPIN and all-keep both have is not counted.
    predictor "probe": the K-cache figure adds one summary row (SUMMARY_BYTES) per visible
    block, which the probe reads, and select reads no V/D (update still does); "hybrid": the
    summary rows and SPIN's V/D read both."""
    k_cache = selected_blocks * BLOCK_SLOTS * K_SLOT_BYTES
    if state_dtype is None:
        return k_cache, 0
    s = STATE_BYTES[state_dtype]
    state = selected_blocks * BLOCK_SLOTS * (4 * s + 4)
    if predictor != "spin":
        k_cache += visible_blocks * SUMMARY_BYTES
    if predictor != "probe":
        state += visible_blocks * BLOCK_SLOTS * 2 * s
    return k_cache, state


def summarize(engine: Engine, outs: dict[int, RequestOutput], warmup: int) -> dict[str, Any]:
    hist = engine.history
    steps = len(hist)
    step_ms = [1e3 * (s.seconds - s.shadow_seconds) for s in hist]
    index_ms = [1e3 * s.indexer_seconds for s in hist]
    sel = sum(s.selected_blocks for s in hist)
    vis = sum(s.visible_blocks for s in hist)
    # per step: SPIN's state traffic only on steps SPIN ran (StepStats.spin, where the engine
    # records it: an engine that may switch to all-keep for a step)
    traffic = [indexer_bytes(s.selected_blocks, s.visible_blocks,
                             engine.spin.state_dtype if engine.spin is not None
                             and getattr(s, "spin", True) else None,
                             engine.predictor)
               for s in hist]
    k_bytes, state_bytes = sum(t[0] for t in traffic), sum(t[1] for t in traffic)
    miss = np.array([m for s in hist for m in s.miss])
    drafted = sum(o.drafted for o in outs.values())
    accepted = sum(o.accepted for o in outs.values())
    # each turn's first token comes from its prefill, the rest from decode steps
    decode_tokens = sum(len(o.tokens) - len(o.turns) for o in outs.values())
    return {
        "decode_steps": steps,
        "step_ms_median": statistics.median(step_ms) if steps else None,
        "indexer_ms_median": statistics.median(index_ms) if steps and engine.time_indexer else None,
        "indexer_share": (sum(index_ms) / sum(step_ms)) if steps and engine.time_indexer else None,
        "cuda_graphs": any(s.graph for s in hist),
        "prefill_s": engine.prefill_seconds,
        "realized_sparsity": (1 - sel / vis) if vis and engine.spin is not None else None,
        "mean_miss": float(miss.mean()) if miss.size else None,
        "p99_miss": float(np.percentile(miss, 99)) if miss.size else None,
        "miss_rows": int(miss.size),
        "mtp_acceptance": (accepted / drafted) if drafted else None,
        "tokens_per_step": (decode_tokens / steps) if steps else None,
        "mean_batch": (sum(s.batch for s in hist) / steps) if steps else None,
        "selected_blocks": sel,
        "visible_blocks": vis,
        "kcache_mb_per_step": k_bytes / MB / steps if steps else None,
        "state_mb_per_step": state_bytes / MB / steps if steps else None,
        "indexer_mb_per_step": (k_bytes + state_bytes) / MB / steps if steps else None,
    }


def agreement(a: dict[int, RequestOutput], b: dict[int, RequestOutput]) -> dict[str, Any]:
    same = total = identical = 0
    for rid, out in a.items():
        x, y = out.tokens, b[rid].tokens
        n = min(len(x), len(y))
        same += sum(1 for i in range(n) if x[i] == y[i])
        total += max(len(x), len(y))
        identical += x == y
    return {"token_agreement": same / total if total else None, "identical_requests": identical,
            "requests": len(a)}


def run_speed(spin: SpinConfig, opts: DemoOptions, device: torch.device) -> Optional[dict]:
    """GPU: decode-step times where the indexer matters (the V4-Flash-shaped model with
    synthetic long contexts, CUDA graphs): no indexer, all-keep, and SPIN (the engine's switch).
    Runs before the other engines: engines built later in one process were slower."""
    from .speed import CACHE_BYTES_PER_TOKEN, fitting_size, measure, step_config
    size = opts.speed
    if size is None and opts.speed_auto:
        free, _ = torch.cuda.mem_get_info(device)
        size = fitting_size(free)
    if size is None:
        return None
    batch, context = size
    free, _ = torch.cuda.mem_get_info(device)
    if batch * context * CACHE_BYTES_PER_TOKEN > free:
        raise SpinError(f"step timing at {batch} x {context} tokens needs about "
                        f"{batch * context * CACHE_BYTES_PER_TOKEN / 1e9:.0f} GB of caches; "
                        f"{free / 1e9:.0f} GB are free on {device} (--speed-size, --no-speed)")
    warmup, steps = 4, 12
    cfg = step_config(context, opts.mtp_depth, warmup + steps)
    weights = init_weights(cfg)
    sc = spin.with_overrides(index_topk=cfg.index_topk)
    runs = {}
    with torch.cuda.device(device):
        for name in ("null", "dense", opts.switch or "auto"):
            runs[name if name in ("null", "dense") else "spin"] = measure(
                cfg, weights, name, context, batch, warmup, steps, backend=opts.logits_backend,
                spin=sc)
    for r in runs.values():
        r["indexer_ms"] = r["forward_ms"] - runs["null"]["forward_ms"]
    return {"batch": batch, "context_tokens": context, "switch": opts.switch or "auto", **runs}


def run_demo(spin: SpinConfig, opts: DemoOptions) -> dict[str, Any]:
    device, cfg, weights = _resolve(opts)
    logits_backends.resolve(opts.logits_backend, device)   # unusable: SpinError before any work
    speed = run_speed(spin, opts, device) if device.type == "cuda" else None
    if spin.index_topk != cfg.index_topk:
        if "index_topk" in spin.model_fields_set:
            raise SpinError(f"index_topk {spin.index_topk}: the dsa-lite model uses "
                            f"K = {cfg.index_topk}")
        spin = spin.with_overrides(index_topk=cfg.index_topk)
    if weights is None:
        weights = init_weights(cfg)
    spin_engine, spin_out = run_engine(cfg, spin, weights, device, opts, "SPIN")
    dense_engine, dense_out = run_engine(cfg, None, weights, device, opts, "all-keep",
                                         expected_steps=len(spin_engine.history))
    if opts.dump_trace:
        spin_engine.trace().save(opts.dump_trace)
    return {"model": json.loads(cfg.to_json()), "device": str(device),
            "weights": "random (seeded)" if opts.random_weights or not (
                opts.checkpoint or default_checkpoint()) else str(opts.checkpoint or
                                                                  default_checkpoint()),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "spin_config": spin.model_dump(mode="json"), "predictor": opts.predictor,
            "logits_backend": opts.logits_backend,
            "spin": summarize(spin_engine, spin_out, spin.warmup_steps),
            "all_keep": summarize(dense_engine, dense_out, 0),
            **agreement(spin_out, dense_out),
            "speed": speed,
            "trace": opts.dump_trace}


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
    summaries = predictor != "spin"
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
    if res.get("predictor", "spin") != "spin":
        select_reads = (" and by select over the visible slots"
                        if res["predictor"] == "hybrid" else "")
        lines += _wrap(f"(counted from the indexer kernels' access pattern, not measured: K cache "
                       f"{BLOCK_SLOTS} x {K_SLOT_BYTES} B per scored block and one "
                       f"{SUMMARY_BYTES}-byte summary row per visible block, which the probe "
                       f"reads; the {res['spin_config']['state_dtype']} V/D state read and "
                       f"written by update over the scored slots{select_reads})")
    else:
        lines += _wrap(f"(counted from the indexer kernels' access pattern, not measured: K cache "
                       f"{BLOCK_SLOTS} x {K_SLOT_BYTES} B per scored block; SPIN's "
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
