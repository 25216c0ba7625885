"""Serving soak of dsa-lite: thousands of requests through the in-flight batching engine.

    python benchmarks/soak.py [--device cpu|cuda[:N]] [--requests N] [--json OUT]
                              [--checkpoint CKPT | --random-weights] [--max-batch B]
                              [--max-context T] [--max-new-tokens M] [--mtp D] [--seed S]
                              [--jobs N]

Half the requests go to an engine without MTP, half to one with MTP (depth --mtp). Prompts are
slices of the Python standard library's source with random lengths (log-uniform, a third in
the upper half of what fits, and every 20th request 1 token or the longest the engine
accepts), random new-token counts, some multi-turn conversations (each turn restarts SPIN's
state), arrivals about 1.5x faster than the engine serves them (requests join and leave on
most steps), and the `auto` switch with a cost model whose fixed costs are scaled to this
model's contexts, so that it flips between SPIN and all-keep. Default model: the shipped
checkpoint on CUDA, tiny() with random weights on the CPU. Checks, printed and in --json:
  leakage   every request is served a second time, by a fresh engine, with every other
            request's prompts replaced by different text of the same length: the kept requests
            must get bit-identical tokens and selected blocks (greedy). With MTP the replaced
            requests are teacher-forced and draft by a script (accepting a fixed number of drafts
            per step), so both runs have the same batches and kernel shapes; the kept ones
            draft with the MTP head;
  memory    (CUDA) torch.cuda.memory_allocated every --sample-every steps once --warmup of the
            requests finished: the largest distance from the first sample (max drift), at most
            --max-drift-mib (what moves it without a leak: the last prefill chunk's hidden
            states of requests not decoded yet, graphs first captured after the warm-up; a few
            MiB at batch 32);
  slots     at the end of each run the SPIN state pool has every slot free (and the indexer
            K cache every page);
  steps     no step raised and every request finished with the tokens it asked for;
  switch    both SPIN and all-keep steps ran in each engine;
  longest   a prompt one token longer than the longest one served is refused.
--jobs N runs the soak's runs (each engine's first pass and its leakage rerun) in up to N
spawned processes at once, each loading the model itself (the soak is bound by Python host work,
on CUDA too); their results are merged as those of --jobs 1 (the default), which runs them one
after the other in this process. Throughput (requests/s) counts the first pass (without the
leakage reruns): its runs' requests over the sum of their own serve times ("seconds"), whatever
--jobs; "wall_seconds" is the wall time of all runs together. Exit code 1 when a check fails, 2
on bad arguments.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import inspect
import json
import math
import multiprocessing
import random
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

from spin_trtllm import SpinConfig, costs
from spin_trtllm._inputs import exit_code_of
from spin_trtllm._outputs import check_plan, write_output
from spin_trtllm.errors import SpinError
from spin_trtllm.harness import DsaLiteConfig, init_weights, load_checkpoint, tiny
from spin_trtllm.harness.engine import Engine, EngineOptions, Request, RequestError, resolve_device
from spin_trtllm.harness.pretrained import default_checkpoint

MIB = 1 << 20
# the fixed-cost terms of the cost model: scaling them moves the switch's boundary to the
# soak's contexts (the H200 constants pick SPIN only past ~100K slots per batch)
FIXED_COSTS = ("logits_fixed_us", "topk_floor_us", "topk_fixed_us", "select_fixed_us",
               "update_fixed_us", "probe_fixed_us", "gauss_fixed_us", "probe_select_fixed_us",
               "engine_overhead_us", "engine_overhead_beside_us", "peer_topk_fixed_us")


@dataclass
class SoakOptions:
    device: str = "cpu"
    requests: int = 200
    max_batch: Optional[int] = None        # default 8 on the CPU, 32 on CUDA
    max_context: Optional[int] = None      # default 512 on the CPU, 2048 on CUDA
    max_new_tokens: Optional[int] = None   # default 8 on the CPU, 32 on CUDA
    mtp: int = 1                           # MTP depth of the MTP engine
    multi_turn: float = 0.15               # share of requests with follow-up turns
    checkpoint: Optional[str] = None       # default: the shipped model on CUDA
    random_weights: Optional[bool] = None  # default: tiny() with random weights on the CPU
    seed: int = 0
    sample_every: int = 10
    warmup: float = 0.1                    # share of a run's requests finished before sampling
    max_drift_mib: float = 16.0
    leakage: bool = True
    progress: bool = True
    jobs: int = 1                          # runs at once, each in a spawned process (1: here)


# ---- the model and the engines ------------------------------------------------------------
def model(opts: SoakOptions, device: torch.device) -> tuple[DsaLiteConfig, dict, str]:
    """(config without MTP, weights, description): the shipped checkpoint, or tiny() with one
    DSA indexer layer, float32 and seeded random weights (prefill through the CPU's reference
    indexer is what bounds the CPU soak's time)."""
    random_weights = opts.random_weights if opts.random_weights is not None else \
        (opts.checkpoint is None and device.type == "cpu")
    if random_weights and opts.checkpoint:
        raise SpinError("--checkpoint and --random-weights exclude each other")
    if random_weights:
        cfg = tiny().with_overrides(compress_ratios=(0, 1, 128), prefill_chunk=256,
                                    max_context=opts.max_context or 512, mtp_depth=opts.mtp,
                                    dtype="float32")
        weights, name = init_weights(cfg), "tiny() with one DSA layer, random weights"
    else:
        path = opts.checkpoint or default_checkpoint()
        if path is None:
            raise SpinError("no shipped checkpoint found; pass --checkpoint or --random-weights")
        cfg, weights = load_checkpoint(path)
        if opts.mtp and not cfg.mtp_depth:
            raise SpinError(f"--mtp {opts.mtp}: the checkpoint has no MTP head")
        cfg = cfg.with_overrides(max_context=opts.max_context or 2048)
        name = Path(path).name
    return cfg.with_overrides(mtp_depth=0), weights, name


def scaled_costs(factor: float, device: torch.device) -> costs.CostModel:
    base = costs.H200.for_device(device)
    return replace(base, **{k: getattr(base, k) / factor for k in FIXED_COSTS})


def switch_costs(cfg: DsaLiteConfig, spin: SpinConfig, max_batch: int, lengths: list[int],
                 device: torch.device, seed: int) -> tuple[costs.CostModel, float]:
    """The cost model (H200's, fixed costs divided by a power of sqrt(2)) under which SPIN wins
    on about 60% of batches drawn from the contexts of this workload's decoding requests (the
    engine's real batches pick it less often: drained batches are small)."""
    rng = random.Random(seed)
    sizes = [max_batch if rng.random() < 0.7 else rng.randint(1, max_batch) for _ in range(100)]
    batches = [[rng.choice(lengths) // cfg.index_ratio + 1 for _ in range(b)] for b in sizes]
    best = None
    for e in range(0, 36):
        factor = 2.0 ** (e / 2)
        cm = scaled_costs(factor, device)
        share = sum(cm.prefer_spin(b, spin.target_sparsity, cfg.next_n, 4,
                                      index_topk=spin.index_topk) for b in batches) / len(batches)
        if best is None or abs(share - 0.6) < abs(best[2] - 0.6):
            best = (cm, factor, share)
    return best[0], best[1]


# ---- the workload ---------------------------------------------------------------------------
def corpus() -> bytes:
    """Prompt text that is on every machine: the Python standard library's own source."""
    import argparse as a
    import dataclasses as d
    import json.decoder as j
    import textwrap as t
    import typing as ty
    return "".join(inspect.getsource(m) for m in (a, d, j, t, ty)).encode()


@dataclass
class Spec:
    """One request of the workload: its segments (prompt, then each turn) by length, with the
    corpus offsets of the original text and of the replacement."""
    index: int
    arrival: int
    new: int
    lengths: list[int]
    offsets: list[int]
    replaced: list[int]
    forced: bool = False            # MTP engine, replaced requests: teacher-forced, scripted drafts
    forced_offsets: tuple[int, int] = (0, 0)


def workload(n: int, cfg: DsaLiteConfig, opts: SoakOptions, text: bytes,
             seed: int) -> list[Spec]:
    rng = random.Random(seed)
    R, top, batch = cfg.next_n, cfg.max_context, opts.max_batch or 8
    specs = []
    for i in range(n):
        new = rng.choice([1, 2]) if rng.random() < 0.1 else rng.randint(1, opts.max_new_tokens)
        turns = 0
        forced = R > 1 and i % 2 == 1       # forced requests have one turn only
        if not forced and i % 20 != 0 and rng.random() < opts.multi_turn:
            turns = rng.randint(1, 2)
        room = top - R - (turns + 1) * new  # positions all prompts together may take
        if i % 20 == 0:
            lengths = [room]                # the longest prompt the engine accepts
        elif i % 20 == 1:
            lengths = [1] * (turns + 1)
        else:
            # log-uniform, and a third in the upper half: contexts of many blocks, where SPIN
            # chooses among them
            share = room // (turns + 1)
            lengths = [rng.randint(share // 2, share) if rng.random() < 0.3 else
                       max(1, min(share, int(2 ** rng.uniform(0, math.log2(share)))))
                       for _ in range(turns + 1)]
        offsets = [rng.randrange(len(text) - k) for k in lengths]
        replaced = []
        for o, k in zip(offsets, lengths):
            r = rng.randrange(len(text) - k)
            while text[r:r + k] == text[o:o + k]:
                r = rng.randrange(len(text) - k)
            replaced.append(r)
        specs.append(Spec(i, 0, new, lengths, offsets, replaced, forced,
                          (rng.randrange(len(text) - new), rng.randrange(len(text) - new))))
    # arrivals: the first batch at once, then about 1.5x what the engine serves per step, so
    # that requests wait and one joins whenever one leaves
    occupancy = sum(max(1.0, len(s.lengths) * (s.new - 1) / R) for s in specs) / n
    rate = 1.5 * batch / occupancy
    t = 0.0
    for s in specs[batch:]:
        t += rng.expovariate(rate)
        s.arrival = int(t)
    return specs


def request(spec: Spec, text: bytes, replace_it: bool) -> Request:
    offsets = spec.replaced if replace_it else spec.offsets
    parts = [text[o:o + n] for o, n in zip(offsets, spec.lengths)]
    forced = None
    if spec.forced:
        o = spec.forced_offsets[1 if replace_it else 0]
        forced = list(text[o:o + spec.new])
    return Request(parts[0], max_new_tokens=spec.new, turns=parts[1:], request_id=spec.index,
                   forced=forced)


def scripted_drafter(specs: list[Spec], text: bytes, replaced: bool, vocab: int):
    """MTP drafts for the forced requests that accept a number of drafts fixed by (request,
    position): the same batches and shapes whatever their text; None (the MTP head) for the
    rest."""
    forced = {}
    for s in specs:
        if s.forced:
            o = s.forced_offsets[1 if replaced and s.index % 2 else 0]
            forced[s.index] = (list(text[o:o + s.new]), s.lengths[0])

    def draft(rid: int, context: list[int], depth: int) -> Optional[list[int]]:
        plan = forced.get(rid)
        if plan is None:
            return None
        tokens, prompt = plan
        n = len(context) - prompt           # tokens emitted so far: row j's target is tokens[n + j]
        out = [tokens[min(n + j, len(tokens) - 1)] for j in range(depth)]
        keep = ((rid * 0x9E3779B1) ^ (n * 0x85EBCA77)) % (depth + 1)
        if keep < depth:
            out[keep] = (out[keep] + 1) % vocab
        return out

    return draft


# ---- one run --------------------------------------------------------------------------------
@dataclass
class Run:
    label: str
    requests: int = 0
    steps: int = 0
    decode_steps: int = 0
    seconds: float = 0.0
    spin_steps: int = 0
    all_keep_steps: int = 0
    switch_flips: int = 0
    join_steps: int = 0
    leave_steps: int = 0
    join_and_leave_steps: int = 0
    error: Optional[str] = None
    unfinished: int = 0
    wrong_lengths: int = 0
    pool_full: Optional[bool] = None
    pages_full: Optional[bool] = None
    memory_samples: int = 0
    memory_drift_bytes: Optional[int] = None
    decode_seconds: float = 0.0     # wall time of the decode steps
    capture_steps: int = 0          # of them: a CUDA graph's first step (eager, then captured)
    capture_seconds: float = 0.0
    prefill_seconds: float = 0.0
    outputs: dict = field(default_factory=dict, repr=False)     # request id -> turns
    blocks: dict = field(default_factory=dict, repr=False)      # request id -> digest
    schedule: list = field(default_factory=list, repr=False)    # (batch, SPIN) per decode step

    def summary(self) -> dict:
        d = {k: v for k, v in asdict(self).items()
             if k not in ("outputs", "blocks", "schedule")}
        d["requests_per_s"] = self.requests / self.seconds if self.seconds else None
        return d


def serve(engine: Engine, specs: list[Spec], text: bytes, replaced: bool, run: Run,
          opts: SoakOptions) -> None:
    """Submit the workload on its arrival steps and step the engine until idle, recording each
    request's tokens, a digest of the blocks SPIN selected for it each step (per indexer layer;
    all-keep steps as such), the decode steps' batches and GPU memory."""
    cuda = engine.device.type == "cuda"
    reqs = [(s.arrival, request(s, text, replaced and s.index % 2 == 1)) for s in specs]
    digests = {s.index: hashlib.blake2b(digest_size=16) for s in specs}
    warm = max(1, math.ceil(opts.warmup * len(specs)))
    base = drift = None
    done = nxt = t = 0
    bar = None
    if opts.progress:
        from tqdm import tqdm
        bar = tqdm(total=len(specs), desc=run.label, unit="req", leave=False)
    t0 = time.perf_counter()
    while nxt < len(reqs) or not engine.idle:
        before = [live.rid for live in engine.running]
        n_hist, n_graphs = len(engine.history), len(engine.graphs)
        try:
            while nxt < len(reqs) and reqs[nxt][0] <= t:
                engine.submit(reqs[nxt][1])
                nxt += 1
            finished = engine.step()
        except Exception:
            run.error = traceback.format_exc(limit=8)
            break
        t += 1
        ids_after = {live.rid for live in engine.running}
        left = {o.request_id for o in finished}
        joined = (ids_after | left) - set(before)
        run.join_steps += bool(joined)
        run.leave_steps += bool(left)
        run.join_and_leave_steps += bool(joined and left)
        if len(engine.history) > n_hist:
            stats = engine.history[-1]
            run.decode_seconds += stats.seconds
            if len(engine.graphs) > n_graphs:
                run.capture_steps += 1
                run.capture_seconds += stats.seconds
            if stats.batch != len(before):
                run.error = f"step {t}: decode batch {stats.batch}, expected {len(before)}"
                break
            run.switch_flips += bool(run.schedule) and run.schedule[-1][1] != stats.spin
            run.schedule.append((stats.batch, stats.spin))
            if stats.spin:
                ix = engine.indexer
                cnt = ix.counts[:stats.batch]
                live = torch.arange(ix.block_ids.shape[2], device=cnt.device) < cnt[..., None]
                ids = torch.where(live, ix.block_ids[:stats.batch], -1).cpu().numpy()
                cnt = cnt.cpu().numpy()
                for b, rid in enumerate(before):
                    digests[rid].update(cnt[b].tobytes())
                    digests[rid].update(ids[b].tobytes())
            else:
                for rid in before:
                    digests[rid].update(b"all-keep")
        for o in finished:
            run.outputs[o.request_id] = o.turns
        done += len(finished)
        if bar is not None and finished:
            bar.update(len(finished))
        if cuda and done >= warm and t % opts.sample_every == 0:
            mem = torch.cuda.memory_allocated(engine.device)
            base = mem if base is None else base
            drift = max(drift or 0, abs(mem - base))
            run.memory_samples += 1
    run.seconds = time.perf_counter() - t0
    run.prefill_seconds = engine.prefill_seconds
    if bar is not None:
        bar.close()
    run.requests = len(specs)
    run.steps = t
    run.decode_steps = len(engine.history)
    run.spin_steps = sum(s.spin for s in engine.history)
    run.all_keep_steps = run.decode_steps - run.spin_steps
    run.memory_drift_bytes = drift
    run.blocks = {rid: h.hexdigest() for rid, h in digests.items()}
    run.unfinished = len(specs) - len(run.outputs)
    run.wrong_lengths = sum(1 for s in specs if s.index in run.outputs and
                            [len(x) for x in run.outputs[s.index]] != [s.new] * len(s.lengths))
    if run.error is None:
        pool = engine.pool
        try:
            free = sorted(pool.free_slots(pool.max_requests))
        except SpinError:                   # fewer free than the pool holds
            free = []
        run.pool_full = engine.idle and pool.active == 0 and \
            free == list(range(pool.max_requests))
        run.pages_full = engine.caches.free_pages == engine.caches.num_pages


def build_engine(cfg: DsaLiteConfig, weights: dict, spin: SpinConfig, device: torch.device,
                 max_batch: int, cost_model: costs.CostModel, drafter) -> Engine:
    return Engine(cfg, spin, weights=weights, device=device,
                  options=EngineOptions(max_batch=max_batch, switch="auto",
                                        cost_model=cost_model, drafter=drafter))


def check_longest(engine: Engine, spec: Spec, text: bytes) -> bool:
    """A prompt one token past the longest accepted is refused (the longest is the longest)."""
    req = request(spec, text, False)
    req.prompt = text[:len(req.prompt) + 1]
    try:
        engine.submit(req)
    except RequestError:
        return engine.idle
    return False


def engine_plan(base_cfg: DsaLiteConfig, opts: SoakOptions, depth: int, device: torch.device,
                text: bytes):
    """The engine of MTP depth `depth` (depth 0 also serves the odd one of an odd --requests):
    (its config, workload, SpinConfig, cost model, the factor its fixed costs are divided by);
    deterministic from opts, so that each run (each process) computes the same."""
    cfg = base_cfg.with_overrides(mtp_depth=depth)
    n = opts.requests // 2 + (0 if depth else opts.requests % 2) if opts.mtp \
        else opts.requests
    specs = workload(n, cfg, opts, text, opts.seed * 1000 + (1 if depth else 0))
    spin = SpinConfig(index_topk=cfg.index_topk, target_sparsity=0.5, exploration=0.1,
                      seed=opts.seed)
    lengths = [s.lengths[0] + s.new // 2 for s in specs if s.new > 1]
    cost_model, factor = switch_costs(cfg, spin, opts.max_batch, lengths, device, opts.seed)
    return cfg, specs, spin, cost_model, factor


def run_label(depth: int, replaced: bool) -> str:
    return f"mtp {depth}" + (", replaced" if replaced else "")


def run_one(opts: SoakOptions, depth: int, replaced: bool, threads: Optional[int] = None,
            loaded: Optional[tuple[DsaLiteConfig, dict]] = None) -> tuple[Run, Optional[bool]]:
    """One run of the soak: a fresh engine of MTP depth `depth` serves its workload (with the
    odd requests' text replaced when `replaced`). (The Run, whether the longest prompt's
    check passed: None on the replaced run, which does not check it.) `opts` as run_soak
    resolved them; `loaded` the (config without MTP, weights) of model(), loaded here when
    None (in a --jobs worker process, with torch's `threads`)."""
    if threads:
        torch.set_num_threads(threads)
    device = resolve_device(opts.device)
    base_cfg, weights = loaded if loaded is not None else model(opts, device)[:2]
    text = corpus()
    cfg, specs, spin, cost_model, _ = engine_plan(base_cfg, opts, depth, device, text)
    drafter = scripted_drafter(specs, text, replaced, cfg.vocab_size) if depth else None
    engine = build_engine(cfg, weights, spin, device, opts.max_batch, cost_model, drafter)
    longest = None if replaced else check_longest(engine, specs[0], text)
    run = Run(run_label(depth, replaced))
    serve(engine, specs, text, replaced, run, opts)
    print(f"{run.label}: {run.requests} requests in {run.seconds:.1f} s: prefill "
          f"{run.prefill_seconds:.1f} s, {run.decode_steps} decode steps "
          f"{run.decode_seconds:.1f} s ({run.capture_steps} captured into graphs "
          f"{run.capture_seconds:.1f} s)", file=sys.stderr, flush=True)
    del engine
    gc.collect()
    return run, longest


# a --jobs worker's initializer (exec'd there: a function of this module could not be found
# before it): this module under the name it has here, when spawn did not load it (it does as
# __main__; tests load it from its path under another name)
_LOAD_MODULE = """
import importlib.util, sys
if NAME not in sys.modules:
    spec = importlib.util.spec_from_file_location(NAME, PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[NAME] = mod
    spec.loader.exec_module(mod)
"""


def run_all(opts: SoakOptions, tasks: list[tuple[int, bool]],
            loaded: Optional[tuple[DsaLiteConfig, dict]]) -> list[tuple[Run, Optional[bool]]]:
    """run_one of each (depth, replaced) in `tasks`, in their order: here one after the other
    with --jobs 1, else in up to opts.jobs spawned processes (CUDA cannot be forked), without
    progress bars. A run that raises is a Run with the traceback as its error."""
    def failed(task: tuple[int, bool], err: BaseException) -> tuple[Run, None]:
        text = "".join(traceback.format_exception(err, limit=8)).rstrip()
        return Run(run_label(*task), error=text), None

    if opts.jobs == 1:
        out = []
        for task in tasks:
            try:
                out.append(run_one(opts, *task, loaded=loaded))
            except Exception as err:
                out.append(failed(task, err))
            gc.collect()
        return out
    worker_opts = replace(opts, progress=False)
    workers = min(opts.jobs, len(tasks))
    # the workers share the CPU threads (--threads) this process has: more contend (on a 2-core
    # machine two workers of two threads each took 35x longer per run)
    threads = max(1, torch.get_num_threads() // workers)
    with ProcessPoolExecutor(max_workers=workers,
                             mp_context=multiprocessing.get_context("spawn"),
                             initializer=exec,
                             initargs=(_LOAD_MODULE, {"NAME": __name__,
                                                      "PATH": str(Path(__file__).resolve())})
                             ) as pool:
        futures = [pool.submit(run_one, worker_opts, *task, threads) for task in tasks]
        out = []
        for task, fut in zip(tasks, futures):
            try:
                out.append(fut.result())
            except Exception as err:        # raised there (or the worker died)
                # its traceback there is its cause; the one here only says fut.result()
                out.append(failed(task, err.with_traceback(None)))
        return out


def run_soak(opts: SoakOptions) -> dict:
    device = resolve_device(opts.device)
    if opts.requests < 2:
        raise SpinError(f"--requests must be >= 2, got {opts.requests}")
    if opts.jobs < 1:
        raise SpinError(f"--jobs must be >= 1, got {opts.jobs}")
    cuda = device.type == "cuda"
    max_batch = opts.max_batch or (32 if cuda else 8)
    opts = replace(opts, max_batch=max_batch,
                   max_new_tokens=opts.max_new_tokens or (32 if cuda else 8))
    if opts.max_new_tokens < 1 or opts.mtp < 0 or opts.sample_every < 1 or max_batch < 1:
        raise SpinError("--max-new-tokens, --max-batch and --sample-every must be >= 1, "
                        "--mtp >= 0")
    base_cfg, weights, model_name = model(opts, device)
    if base_cfg.max_context < 3 * (opts.max_new_tokens + 1) + opts.mtp + 1:
        raise SpinError(f"max_context {base_cfg.max_context} leaves no room for three turns of "
                        f"{opts.max_new_tokens} new tokens")
    text = corpus()
    result: dict = {"device": str(device), "model": model_name,
                    "config": {"max_batch": max_batch, "max_context": base_cfg.max_context,
                               "max_new_tokens": opts.max_new_tokens, "mtp": opts.mtp,
                               "index_topk": base_cfg.index_topk, "dtype": base_cfg.dtype,
                               "seed": opts.seed, "jobs": opts.jobs},
                    "engines": []}
    depths = (0, opts.mtp) if opts.mtp else (0,)
    plans = [engine_plan(base_cfg, opts, depth, device, text) for depth in depths]
    tasks = [(depth, replaced) for depth in depths
             for replaced in ((False, True) if opts.leakage else (False,))]
    loaded = (base_cfg, weights) if opts.jobs == 1 else None   # --jobs workers load their own
    del weights
    t0 = time.perf_counter()
    done = run_all(opts, tasks, loaded)
    wall = time.perf_counter() - t0
    del loaded
    first_pass, reruns = [], []
    leak = {"compared": 0, "token_mismatches": 0, "block_mismatches": 0, "schedules_same": True}
    # a first run that raised before its check has not shown the longest prompt refused
    longest_ok = all(longest is True for (_, replaced), (_, longest) in zip(tasks, done)
                     if not replaced)
    for depth, (_, specs, _, _, factor) in zip(depths, plans):
        runs = [run for (d, _), (run, _) in zip(tasks, done) if d == depth]
        first_pass.append(runs[0])
        reruns += runs[1:]
        if len(runs) == 2:
            a, b = runs
            kept = [s.index for s in specs if s.index % 2 == 0]
            leak["compared"] += len(kept)
            leak["token_mismatches"] += sum(a.outputs.get(i) != b.outputs.get(i) for i in kept)
            leak["block_mismatches"] += sum(a.blocks.get(i) != b.blocks.get(i) for i in kept)
            leak["schedules_same"] &= a.schedule == b.schedule
        result["engines"].append({"mtp_depth": depth, "requests": len(specs), "multi_turn":
                                  sum(len(s.lengths) > 1 for s in specs),
                                  "one_token_prompts": sum(s.lengths[0] == 1 for s in specs),
                                  "longest_prompts": sum(s.index % 20 == 0 for s in specs),
                                  "cost_model_fixed_costs_divided_by": factor,
                                  "runs": [r.summary() for r in runs]})
    runs = first_pass + reruns
    errors = [f"{r.label}: {r.error}" for r in runs if r.error]
    seconds = sum(r.seconds for r in first_pass)
    drifts = [r.memory_drift_bytes for r in runs if r.memory_drift_bytes is not None]
    decode = sum(r.decode_steps for r in runs)
    leak["ok"] = opts.leakage and not errors and leak["schedules_same"] and \
        leak["token_mismatches"] == 0 and leak["block_mismatches"] == 0 and leak["compared"] > 0
    checks = {
        "steps": not errors and all(r.unfinished == 0 and r.wrong_lengths == 0 for r in runs),
        "slots": all(r.pool_full and r.pages_full for r in runs),
        "switch": all(r.spin_steps > 0 and r.all_keep_steps > 0 for r in first_pass),
        "leakage": leak["ok"] if opts.leakage else None,
        "memory": (bool(drifts) and max(drifts) <= opts.max_drift_mib * MIB and
                   all(r.memory_samples >= 2 for r in runs)) if cuda else None,
        "longest_prompt": longest_ok,
    }
    result.update({
        "requests": sum(r.requests for r in first_pass),
        "requests_per_s": sum(r.requests for r in first_pass) / seconds if seconds else None,
        "seconds": seconds,
        "wall_seconds": wall,
        "memory_drift_bytes": max(drifts) if drifts else None,
        "join_share": sum(r.join_steps for r in runs) / max(1, sum(r.steps for r in runs)),
        "leave_share": sum(r.leave_steps for r in runs) / max(1, sum(r.steps for r in runs)),
        "join_and_leave_share": sum(r.join_and_leave_steps for r in runs) /
        max(1, sum(r.steps for r in runs)),
        "spin_steps": sum(r.spin_steps for r in runs),
        "all_keep_steps": decode - sum(r.spin_steps for r in runs),
        "switch_flips": sum(r.switch_flips for r in runs),
        "unfinished": sum(r.unfinished for r in runs),
        "wrong_lengths": sum(r.wrong_lengths for r in runs),
        "leakage": leak,
        "errors": errors,
        "checks": checks,
        "ok": all(v is not False for v in checks.values()),
    })
    return result


def report(r: dict) -> str:
    c = r["checks"]
    mark = lambda v: "n/a" if v is None else ("ok" if v else "FAILED")
    leak = r["leakage"]
    jobs = r["config"]["jobs"]
    rate = "n/a" if r["requests_per_s"] is None else f"{r['requests_per_s']:.2f}"
    drift = "n/a (CPU)" if r["memory_drift_bytes"] is None else f"{r['memory_drift_bytes']:,} B"
    lines = [f"dsa-lite soak on {r['device']}: {r['model']}, {r['requests']} requests "
             f"(MTP {', '.join(str(e['mtp_depth']) for e in r['engines'])}), "
             f"batch {r['config']['max_batch']}, max_context {r['config']['max_context']}",
             f"  requests/s           {rate} ({r['seconds']:.1f} s)",
             f"  wall time            {r['wall_seconds']:.1f} s with {jobs} "
             f"job{'s' if jobs != 1 else ''}",
             f"  memory drift (max)   {drift}: {mark(c['memory'])}",
             f"  state slots          {mark(c['slots'])}",
             f"  leakage              {leak['compared']} requests compared, "
             f"{leak['token_mismatches']} token / {leak['block_mismatches']} block mismatches, "
             f"schedules {'same' if leak['schedules_same'] else 'DIFFER'}: {mark(c['leakage'])}",
             f"  switch               {r['spin_steps']} SPIN / {r['all_keep_steps']} all-keep "
             f"steps, {r['switch_flips']} flips: {mark(c['switch'])}",
             f"  steps                a request joined on {100 * r['join_share']:.0f}% of steps, "
             f"left on {100 * r['leave_share']:.0f}%, both on "
             f"{100 * r['join_and_leave_share']:.0f}%; {len(r['errors'])} raised, "
             f"{r['unfinished']} unfinished, {r['wrong_lengths']} with wrong lengths: "
             f"{mark(c['steps'])}",
             f"  longest prompt       {mark(c['longest_prompt'])}"]
    lines += [f"  error: {e}" for e in r["errors"]]
    lines.append("soak: " + ("ok" if r["ok"] else "FAILED"))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=None,
                    help="default 200 on the CPU, 5000 on CUDA")
    ap.add_argument("--max-batch", type=int)
    ap.add_argument("--max-context", type=int)
    ap.add_argument("--max-new-tokens", type=int, help="default 8 on the CPU, 32 on CUDA")
    ap.add_argument("--mtp", type=int, default=1, help="MTP depth of the MTP engine (0: none)")
    ap.add_argument("--checkpoint")
    ap.add_argument("--random-weights", action="store_true", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-every", type=int, default=10)
    ap.add_argument("--max-drift-mib", type=float, default=16.0)
    ap.add_argument("--no-leakage", action="store_true", help="skip the second runs")
    ap.add_argument("--threads", type=int,
                    help="torch CPU threads (shared out among the --jobs processes)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="runs at once, each in its own process (default 1: one after the "
                         "other here)")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.json:
        check_plan([("--json", args.json)])
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    opts = SoakOptions(device=args.device,
                       requests=args.requests or (5000 if device.type == "cuda" else 200),
                       max_batch=args.max_batch, max_context=args.max_context,
                       max_new_tokens=args.max_new_tokens, mtp=args.mtp,
                       checkpoint=args.checkpoint, random_weights=args.random_weights,
                       seed=args.seed, sample_every=args.sample_every,
                       max_drift_mib=args.max_drift_mib, leakage=not args.no_leakage,
                       progress=not args.quiet, jobs=args.jobs)
    result = run_soak(opts)
    print(report(result))
    if args.json:
        write_output(args.json, "--json", json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(exit_code_of(main, Path(sys.argv[0]).name))
