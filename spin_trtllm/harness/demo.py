"""The main job: dsa-lite with SPIN and with the all-keep indexer, side by side."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
import statistics
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from ..config import SpinConfig
from .. import logits as logits_backends
from ..errors import SpinError
from .config import DsaLiteConfig, tiny, v4_flash_indexer
from .engine import Engine, Request, RequestOutput, resolve_device
from .model import init_weights, load_checkpoint
from .pretrained import default_checkpoint


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
               label: str) -> tuple[Engine, dict[int, RequestOutput]]:
    eager = opts.measure_miss or opts.dump_trace or not opts.cuda_graphs
    engine = Engine(cfg, spin, weights=weights, device=device, max_batch=opts.max_batch,
                    measure_miss=opts.measure_miss and spin is not None,
                    trace_request=0 if (opts.dump_trace and spin is not None) else None,
                    time_indexer=bool(eager), cuda_graphs=False if eager else None,
                    logits_backend=opts.logits_backend)
    arrivals = workload(opts, cfg)
    bar = None
    if opts.progress:
        from tqdm import tqdm
        bar = tqdm(total=len(arrivals), desc=label, unit="req", leave=False)
    outs: dict[int, RequestOutput] = {}
    t = 0
    while len(outs) < len(arrivals):
        for when, req in arrivals:
            if when == t:
                engine.submit(req)
        done = engine.step()
        for o in done:
            outs[o.request_id] = o
        if bar is not None:
            bar.update(len(done))
        t += 1
    if bar is not None:
        bar.close()
    return engine, outs


def summarize(engine: Engine, outs: dict[int, RequestOutput], warmup: int) -> dict[str, Any]:
    hist = engine.history
    steps = len(hist)
    step_ms = [1e3 * (s.seconds - s.shadow_seconds) for s in hist]
    index_ms = [1e3 * s.indexer_seconds for s in hist]
    sel = sum(s.selected_blocks for s in hist)
    vis = sum(s.visible_blocks for s in hist)
    miss = np.array([m for s in hist for m in s.miss])
    drafted = sum(o.drafted for o in outs.values())
    accepted = sum(o.accepted for o in outs.values())
    return {
        "decode_steps": steps,
        "step_ms_median": statistics.median(step_ms) if steps else None,
        "indexer_ms_median": statistics.median(index_ms) if steps and engine.time_indexer else None,
        "indexer_share": (sum(index_ms) / sum(step_ms)) if steps and engine.time_indexer else None,
        "cuda_graphs": any(s.graph for s in hist),
        "prefill_s": engine.prefill_seconds,
        "realized_sparsity": (1 - sel / vis) if vis else None,
        "mean_miss": float(miss.mean()) if miss.size else None,
        "p99_miss": float(np.percentile(miss, 99)) if miss.size else None,
        "miss_rows": int(miss.size),
        "mtp_acceptance": (accepted / drafted) if drafted else None,
        "tokens_per_step": (sum(len(o.tokens) for o in outs.values()) / steps) if steps else None,
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


def run_demo(spin: SpinConfig, opts: DemoOptions) -> dict[str, Any]:
    device, cfg, weights = _resolve(opts)
    logits_backends.resolve(opts.logits_backend, device)   # unusable: SpinError before any work
    if spin.index_topk != cfg.index_topk:
        if "index_topk" in spin.model_fields_set:
            raise SpinError(f"index_topk {spin.index_topk}: the dsa-lite model uses "
                            f"K = {cfg.index_topk}")
        spin = spin.with_overrides(index_topk=cfg.index_topk)
    if weights is None:
        weights = init_weights(cfg)
    spin_engine, spin_out = run_engine(cfg, spin, weights, device, opts, "SPIN")
    dense_engine, dense_out = run_engine(cfg, None, weights, device, opts, "all-keep")
    if opts.dump_trace:
        spin_engine.trace().save(opts.dump_trace)
    return {"model": json.loads(cfg.to_json()), "device": str(device),
            "weights": "random (seeded)" if opts.random_weights or not (
                opts.checkpoint or default_checkpoint()) else str(opts.checkpoint or
                                                                  default_checkpoint()),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "spin_config": spin.model_dump(mode="json"),
            "logits_backend": opts.logits_backend,
            "spin": summarize(spin_engine, spin_out, spin.warmup_steps),
            "all_keep": summarize(dense_engine, dense_out, 0),
            **agreement(spin_out, dense_out),
            "trace": opts.dump_trace}


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
    rows = [
        ("decode steps", f(s["decode_steps"], "{}"), f(d["decode_steps"], "{}")),
        ("step time, median ms", f(s["step_ms_median"]), f(d["step_ms_median"])),
        ("  indexer, median ms", f(s["indexer_ms_median"]), f(d["indexer_ms_median"])),
        ("  indexer share of steps", f(s["indexer_share"], pct), f(d["indexer_share"], pct)),
        ("prefill, s", f(s["prefill_s"]), f(d["prefill_s"])),
        ("realized block sparsity", f(s["realized_sparsity"], pct), "0.0%"),
        ("mean miss (p99)", f(s["mean_miss"], pct) + f" ({f(s['p99_miss'], pct)})"
         if s["mean_miss"] is not None else "- (use --measure-miss)", "0.0%"),
        ("MTP draft acceptance", f(s["mtp_acceptance"], pct), f(d["mtp_acceptance"], pct)),
        ("tokens per step", f(s["tokens_per_step"]), f(d["tokens_per_step"])),
    ]
    sp = res["spin_config"]["target_sparsity"]
    lines = [f"dsa-lite on {res['device_name']}: {layout}, K={m['index_topk']}, "
             f"next_n={m['mtp_depth'] + 1}, {m['dtype']}; weights: {Path(res['weights']).name}; "
             f"logits: {res['logits_backend']}",
             f"{'':28}{'SPIN @ ' + format(sp, '.2f'):>14}{'all-keep':>14}"]
    lines += [f"{a:28}{b:>14}{c:>14}" for a, b, c in rows]
    lines.append(f"token agreement with all-keep: {f(res['token_agreement'], pct)} of tokens, "
                 f"{res['identical_requests']}/{res['requests']} requests identical")
    if not s["cuda_graphs"] and res["device"].startswith("cuda"):
        lines.append("(eager steps with CUDA-event timing; --cuda-graphs times graph replays "
                     "without the indexer split)")
    if s["mean_miss"] is not None:
        lines.append("(miss: eligible rows only, as in replay; step times exclude the shadow "
                     "dense indexer)")
    if res["trace"]:
        lines.append(f"trace of request 0 written to {res['trace']}")
    return "\n".join(lines)
