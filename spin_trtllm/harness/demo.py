"""The main job: dsa-lite with SPIN and with the all-keep indexer, side by side (the report's
text: report.py)."""

from __future__ import annotations

import inspect
import json
import os
import statistics
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional

import numpy as np
import torch

from .. import logits as logits_backends
from ..config import SpinConfig
from ..costs import indexer_bytes
from ..errors import SpinError
from .config import DsaLiteConfig, tiny, v4_flash_indexer
from .engine import Engine, EngineOptions, Request, RequestOutput, resolve_device
from .engine.memory import engine_bytes
from .engine.requests import parse
from .engine.scheduler import EngineProgress, planned_tokens
from .model import check_memory, init_weights, load_checkpoint
from .pretrained import default_checkpoint
from .._threads import one_thread
from ..limits import DEMO_WORKLOADS, DemoWorkload
from .speed import CACHE_BYTES_PER_TOKEN, fitting_size, measure, step_config

MB = 1e6


SAMPLE_TOKENS = 64                      # the prompt's last tokens kept for the report's sample


@dataclass
class DemoOptions:
    device: str = "auto"
    requests: Optional[int] = None            # None: DEMO_WORKLOADS of the device
    prompt_tokens: Optional[int] = None
    new_tokens: Optional[int] = None
    max_batch: int = 4
    mtp_depth: int = 0
    checkpoint: Optional[str] = None
    random_weights: bool = False
    measure_miss: Optional[bool] = None
    dump_trace: Optional[str] = None
    cuda_graphs: bool = False
    progress: bool = True
    logits_backend: str = "native"
    switch: Optional[str] = None              # SPIN engine: auto / spin / dense (Engine default)
    predictor: str = "spin"                   # SPIN engine's block predictor: spin / probe
    speed: Optional[tuple[int, int]] = None   # (batch, context tokens) of the GPU step timing;
    speed_auto: bool = True                   # None + speed_auto: the largest size that fits


def with_workload(opts: DemoOptions, device: torch.device) -> DemoOptions:
    """opts with its None workload fields set from DEMO_WORKLOADS for `device`."""
    work = DEMO_WORKLOADS["cuda" if device.type == "cuda" else "cpu"]
    return replace(opts, **{f: getattr(work, f) for f in DemoWorkload.__dataclass_fields__
                            if getattr(opts, f) is None})


@contextmanager
def cpu_threads(device: torch.device) -> Iterator[None]:
    """On the CPU, one intra-op thread unless OMP_NUM_THREADS says otherwise: the demo's ops
    are small, and with two threads on a busy 2-core machine OpenMP's waits made its steps and
    prefills 2-10x slower, some runs and not others."""
    if device.type != "cpu" or "OMP_NUM_THREADS" in os.environ:
        yield
        return
    with one_thread():
        yield


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


def _engine_options(spin: Optional[SpinConfig], opts: DemoOptions,
                    backend: Optional[logits_backends.LogitsBackend] = None) -> EngineOptions:
    """The demo's engine with SPIN (spin) or all-keep (spin None)."""
    eager = opts.measure_miss or opts.dump_trace or not opts.cuda_graphs
    return EngineOptions(max_batch=opts.max_batch,
                         switch=(opts.switch or "spin") if spin is not None else None,
                         predictor=opts.predictor if spin is not None else "spin",
                         measure_miss=opts.measure_miss and spin is not None,
                         trace_request=0 if (opts.dump_trace and spin is not None) else None,
                         time_indexer=bool(eager), cuda_graphs=False if eager else None,
                         logits_backend=backend or opts.logits_backend)


def check_demo_memory(cfg: DsaLiteConfig, spin: SpinConfig, opts: DemoOptions,
                      device: torch.device, random_weights: bool,
                      backend: Optional[logits_backends.LogitsBackend] = None) -> None:
    """Both engines (SPIN's stays alive while the all-keep one runs) must fit, checked before
    either starts (each Engine checks itself again)."""
    need = sum(engine_bytes(cfg, s, _engine_options(s, opts, backend).resolve(s, device),
                            random_weights and s is spin) for s in (spin, None))
    check_memory(need, device, f"the demo (two engines, --batch {opts.max_batch}; "
                               f"{cfg.sizes()})")


def run_engine(cfg: DsaLiteConfig, spin: Optional[SpinConfig], weights, device, opts: DemoOptions,
               label: str, backend: Optional[logits_backends.LogitsBackend] = None
               ) -> tuple[Engine, dict[int, RequestOutput]]:
    """Run the demo workload; `backend`: opts.logits_backend resolved (None: the Engine
    resolves it). Progress: prompt tokens prefilled and tokens decoded against their totals
    (EngineProgress). The all-keep engine's StepStats get selected_blocks = visible_blocks =
    the blocks its dense indexer scored that step where the engine left them 0, so both sides'
    indexer bytes come from their own runs."""
    engine = Engine(cfg, spin, weights=weights, device=device,
                    options=_engine_options(spin, opts, backend))
    arrivals = workload(opts, cfg)
    layers = len(cfg.csa_layers)
    bars = None
    if opts.progress:
        plans = [planned_tokens(parse(req, cfg, f"request {req.request_id}")[0],
                                req.max_new_tokens) for _, req in arrivals]
        bars = EngineProgress(engine, label, sum(p for p, _ in plans),
                              sum(d for _, d in plans), len(arrivals))
    outs: dict[int, RequestOutput] = {}
    t = 0
    try:
        while len(outs) < len(arrivals):
            for when, req in arrivals:
                if when == t:
                    engine.submit(req)
            before = len(engine.history)
            for o in engine.step():
                outs[o.request_id] = o
            if len(engine.history) > before and spin is None \
                    and not engine.history[-1].visible_blocks:
                stats = engine.history[-1]
                blocks = int(engine.indexer.counts[:engine.indexer.batch].sum()) * layers
                stats.selected_blocks = stats.visible_blocks = blocks
            if bars is not None:
                bars.stepped(engine.history[before:], len(outs))
            t += 1
    finally:
        if bars is not None:
            bars.close()
    return engine, outs


def summarize(engine: Engine, outs: dict[int, RequestOutput], warmup: int) -> dict[str, Any]:
    """One engine's figures. The decode ones come from the median step, so one slow step (a
    first call that compiles or allocates) does not move them: decode tokens/s is tokens per
    decode step over the median step; time per output token is the median step over the
    tokens a request gets per step. Time to first token is the engine's prefill time per
    prefill (each prompt and each later turn), a mean."""
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
    prefills = sum(len(o.turns) for o in outs.values())
    decode_tokens = sum(len(o.tokens) for o in outs.values()) - prefills
    median_ms = statistics.median(step_ms) if steps else None
    per_step = decode_tokens / steps if steps else None
    mean_batch = sum(s.batch for s in hist) / steps if steps else None
    return {
        "decode_steps": steps,
        # steps the SPIN indexer ran (an engine with switch "auto" may run all-keep instead)
        "spin_steps": sum(1 for s in hist if getattr(s, "spin", True)) if engine.spin else 0,
        "step_ms_median": median_ms,
        "indexer_ms_median": statistics.median(index_ms) if steps and engine.time_indexer else None,
        "cuda_graphs": any(s.graph for s in hist),
        "prefill_s": engine.prefill_seconds,
        "prefills": prefills,
        "realized_sparsity": (1 - sel / vis) if vis and engine.spin is not None else None,
        "mean_miss": float(miss.mean()) if miss.size else None,
        "p99_miss": float(np.percentile(miss, 99)) if miss.size else None,
        "miss_rows": int(miss.size),
        "mtp_acceptance": (accepted / drafted) if drafted else None,
        "decode_tokens": decode_tokens,
        "tokens_per_step": per_step,
        "mean_batch": mean_batch,
        "tokens_per_s": 1e3 * per_step / median_ms if steps and median_ms else None,
        "tpot_ms": median_ms * mean_batch / per_step if steps and per_step else None,
        "ttft_ms": 1e3 * engine.prefill_seconds / prefills if prefills else None,
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


def run_speed(spin: SpinConfig, opts: DemoOptions, device: torch.device,
              backend: Optional[logits_backends.LogitsBackend] = None) -> Optional[dict]:
    """GPU: decode-step times where the indexer matters (the V4-Flash-shaped model with
    synthetic long contexts, CUDA graphs): no indexer, all-keep, and SPIN (the engine's switch).
    Runs before the other engines: engines built later in one process run slower (speed.py).
    `backend`: opts.logits_backend resolved (None: each engine resolves it)."""
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
    names = ("null", "dense", opts.switch or "auto")
    bar = None
    if opts.progress:
        from tqdm import tqdm
        bar = tqdm(total=len(names) * (warmup + steps), unit="step", leave=False,
                   desc=f"GPU step timing, {batch} x {context:,} tokens")
    runs = {}
    try:
        with torch.cuda.device(device):
            for name in names:
                if bar is not None:
                    bar.set_postfix_str(f"indexer {name}")
                runs[name if name in ("null", "dense") else "spin"] = measure(
                    cfg, weights, name, context, batch, warmup, steps,
                    backend=backend or opts.logits_backend, spin=sc,
                    on_step=bar.update if bar is not None else None)
    finally:
        if bar is not None:
            bar.close()
    for r in runs.values():
        r["indexer_ms"] = r["forward_ms"] - runs["null"]["forward_ms"]
    return {"batch": batch, "context_tokens": context, "switch": opts.switch or "auto", **runs}


def continuations(cfg: DsaLiteConfig, arrivals: list[tuple[int, Request]],
                  spin_out: dict[int, RequestOutput],
                  dense_out: dict[int, RequestOutput]) -> dict[str, Any]:
    """The first request's prompt end and both engines' continuations (token ids)."""
    _, req = arrivals[0]
    rid = req.request_id
    prompt = parse(req, cfg, f"request {rid}")[0][0]
    return {"request": rid, "prompt_tail": prompt[-SAMPLE_TOKENS:],
            "spin": spin_out[rid].tokens, "all_keep": dense_out[rid].tokens}


def run_demo(spin: SpinConfig, opts: DemoOptions) -> dict[str, Any]:
    device = resolve_device(opts.device)
    opts = with_workload(opts, device)
    with cpu_threads(device):
        return _run_demo(spin, opts)


def _run_demo(spin: SpinConfig, opts: DemoOptions) -> dict[str, Any]:
    device, cfg, weights = _resolve(opts)
    # resolved once, for every engine of the run (unusable: SpinError before any work)
    backend = logits_backends.resolve(opts.logits_backend, device)
    if spin.index_topk != cfg.index_topk:
        if "index_topk" in spin.model_fields_set:
            raise SpinError(f"index_topk {spin.index_topk}: the dsa-lite model uses "
                            f"K = {cfg.index_topk}")
        spin = spin.with_overrides(index_topk=cfg.index_topk)
    check_demo_memory(cfg, spin, opts, device, weights is None, backend)
    speed = run_speed(spin, opts, device, backend) if device.type == "cuda" else None
    if device.type == "cuda":
        # cuBLAS sets itself up on the first matmul (a large part of a short prefill): not
        # inside the first engine's time to first token
        torch.ones(8, 8, device=device) @ torch.ones(8, 8, device=device)
        torch.cuda.synchronize(device)
    if weights is None:
        weights = init_weights(cfg)
    spin_engine, spin_out = run_engine(cfg, spin, weights, device, opts, "SPIN",
                                       backend=backend)
    dense_engine, dense_out = run_engine(cfg, None, weights, device, opts, "all-keep",
                                         backend=backend)
    if opts.dump_trace:
        spin_engine.trace().save(opts.dump_trace)
    arrivals = workload(opts, cfg)
    return {"model": json.loads(cfg.to_json()), "device": str(device),
            "weights": "random (seeded)" if opts.random_weights or not (
                opts.checkpoint or default_checkpoint()) else str(opts.checkpoint or
                                                                  default_checkpoint()),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "spin_config": spin.model_dump(mode="json"), "predictor": opts.predictor,
            "switch": opts.switch or "spin",
            "logits_backend": opts.logits_backend,
            "workload": {"prompt_tokens": [len(parse(r, cfg, f"request {r.request_id}")[0][0])
                                           for _, r in arrivals],
                         "turns": [1 + len(r.turns) for _, r in arrivals],
                         "new_tokens": [r.max_new_tokens for _, r in arrivals],
                         "arrival_steps": [t for t, _ in arrivals],
                         "max_batch": opts.max_batch,
                         "cpu_threads": torch.get_num_threads() if device.type == "cpu"
                         else None},
            "spin": summarize(spin_engine, spin_out, spin.warmup_steps),
            "all_keep": summarize(dense_engine, dense_out, 0),
            **agreement(spin_out, dense_out),
            "sample": continuations(cfg, arrivals, spin_out, dense_out),
            "speed": speed,
            "trace": opts.dump_trace}
