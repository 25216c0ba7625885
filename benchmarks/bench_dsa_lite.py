"""dsa-lite decode-step time with SPIN vs the all-keep indexer (CUDA graphs on).

Each engine is measured in a fresh process (spin_trtllm/harness/speed.py says why), one case at
a time: the no-indexer step ("null"), all-keep, SPIN at each target sparsity every step, and
SPIN with the cost-model switch ("auto": all-keep where SPIN would not pay), with the native
logits kernel and, when deep_gemm imports, with DeepGEMM's (what TensorRT-LLM runs). With
--predictor spin probe hybrid gauss, the SPIN and auto rows run once per predictor (probe: blocks
ranked by their summaries scored with the current query, hybrid: by the max of the rank shares of
those and of SPIN's history, gauss: by the expected ReLU under the summaries' mean and std; rows
labelled "probe 0.5 (native)"). Columns:
  step ms      wall time of Engine.step() (host scheduling, verification and drafting included)
  forward ms   GPU time of the captured step (select + all layers), CUDA events
  indexer ms   forward ms minus the null step's
  speedups     against the fastest all-keep of the same case (any backend)
  ceilings     (SPIN and auto rows) the forward speedup over that all-keep that an indexer
               reading what this row's logits read could reach at most: "kept" if its indexer
               cost the kept share (1 - realized sparsity) of the all-keep indexer, select and
               update free; "HBM" if its logits read this row's scored K-cache bytes at the
               GPU's peak bandwidth (--peak-tbs; default by the GPU's name) and nothing else
               cost time; "traffic" if its indexer took all-keep's time per byte moved, its
               bytes counted as costs.traffic_bytes counts them (K cache, the logits written
               and read once, SPIN's state: select's reads and the update's): the most that
               SPIN's kernels, unfused, can gain at all-keep's efficiency. A target above the
               HBM ceiling cannot be met at that sparsity by any indexer around this model.
  after ms     the step's wall time after the forward (after_ms: verification, finish,
               drafting, the final sync), with its share committing the accepted rows,
               emitting and drafting (advance_ms) and the final sync's wait for the GPU (sync_ms)
  host over    (SPIN and auto rows) their step less their forward, against all-keep's: the host
               time they add a step (host_over_dense_ms), and the step speedup they would have
               without it (all-keep's step less the GPU time saved): the wall speedup is below
               the GPU's by the host time every engine spends alike, even with none added
With --repeats N every engine of a case runs N times, each in a fresh process, round-robin
(null, all-keep, SPIN, ..., then again), and each time is the median of the N runs' medians
(printed with the runs' range):
the host's share of a step moves by milliseconds between processes, more
than SPIN's gain at small batches. The rows keep every run's step and forward times, and SPIN's
rows the range of the per-round step (wall) speedups and whether the forward (GPU) speedup
lies inside it (if not, host work around the step costs more than the runs' spread).
Usage (GPU): python benchmarks/bench_dsa_lite.py [--contexts 131072 524288] [--batches 32 96]
             [--sparsity 0.3 0.5] [--mtp 0 3] [--backends native deepgemm] [--no-auto]
             [--state-dtype float16] [--predictor spin probe hybrid gauss] [--repeats N]
             [--no-overlap-update] [--overlap-select] [--peak-tbs 4.8] [--json F]
             [--markdown F] [--host-profile DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from spin_trtllm._inputs import exit_code_of
from spin_trtllm._outputs import check_plan, write_output
from spin_trtllm.errors import SpinError
from spin_trtllm.predictors import ENGINE_PREDICTORS


def one(spec: dict) -> dict:
    from spin_trtllm.harness import init_weights
    from spin_trtllm.harness.speed import measure, step_config
    cfg = step_config(spec["context"], spec["mtp"], spec["warmup"] + spec["steps"])
    profiler = HostProfile(spec["warmup"]) if spec.get("host_profile") else None
    result = measure(cfg, init_weights(cfg), spec["indexer"], spec["context"], spec["batch"],
                     spec["warmup"], spec["steps"], spec.get("rho"), spec["backend"],
                     spec["state_dtype"], predictor=spec.get("predictor", "spin"),
                     overlap_update=spec.get("overlap_update", True),
                     overlap_select=spec.get("overlap_select", False),
                     on_step=profiler.on_step if profiler else None)
    if profiler is not None:
        profiler.write(Path(spec["host_profile"]), spec["steps"])
    return result


class HostProfile:
    """cProfile of an engine's timed steps (those after `warmup` >= 1: it starts at the end of
    the last warm-up step, measure's only hook before a timed step), for where its host time
    goes; cProfile's own cost inflates every call, so compare engines, not absolute times."""

    def __init__(self, warmup: int):
        if warmup < 1:
            raise ValueError(f"HostProfile needs a warm-up step to start after, got {warmup}")
        self.warmup, self.done = warmup, 0
        self.profile = cProfile.Profile()

    def on_step(self) -> None:
        self.done += 1
        if self.done == self.warmup:
            self.profile.enable()

    def write(self, path: Path, steps: int, top: int = 40) -> None:
        """path.pstats (the raw stats) and path.txt: the process's threads, then the `top`
        functions by own time and by cumulative time, in ms a step."""
        self.profile.disable()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.profile.dump_stats(str(path.parent / f"{path.name}.pstats"))
        stats = pstats.Stats(self.profile)
        tasks = Path("/proc/self/task")    # Linux: the process's OS threads
        threads = len(os.listdir(tasks)) if tasks.is_dir() else "unknown"
        lines = [f"timed steps {steps}; OS threads {threads}; "
                 f"torch intra-op threads {torch.get_num_threads()}"]
        for key in ("tottime", "cumtime"):
            rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2 if key == "tottime" else 3],
                          reverse=True)[:top]
            lines.append(f"\nby {key}: ms a step (own, cumulative), calls a step, function")
            for (file, line, name), (_, calls, own, cum, _) in rows:
                lines.append(f"{1e3 * own / steps:9.3f} {1e3 * cum / steps:9.3f} "
                             f"{calls / steps:8.1f}  {Path(file).name}:{line} {name}")
        (path.parent / f"{path.name}.txt").write_text("\n".join(lines) + "\n")


def in_fresh_process(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)],
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"case {spec} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


# the times a repeated engine reports as the median over its runs
TIMES = ("step_ms", "forward_ms", "prepare_ms", "launch_ms", "wait_ms", "after_ms",
         "advance_ms", "sync_ms")


def merge_runs(runs: list[dict]) -> dict:
    """One row from repeated runs of the same engine: the median of each time over the runs,
    every run's step and forward times kept (step_ms_runs, forward_ms_runs); the other fields
    (realized sparsity, SPIN steps, ...) are the first run's: every run replays the same requests."""
    if not runs:
        raise ValueError("merge_runs: no runs")
    row = dict(runs[0])
    for key in TIMES:
        if all(key in r for r in runs):     # rows of older runs lack advance_ms and sync_ms
            row[key] = statistics.median(r[key] for r in runs)
    row["step_ms_runs"] = [r["step_ms"] for r in runs]
    row["forward_ms_runs"] = [r["forward_ms"] for r in runs]
    row["repeats"] = len(runs)
    return row


# peak HBM bandwidth (TB/s) by a GPU name's part, most specific first: --peak-tbs's default
PEAK_TBS = {"H200": 4.8, "H100 NVL": 3.9, "H100 PCIe": 2.0, "H100": 3.35}
FALLBACK_PEAK_TBS = PEAK_TBS["H200"]


def peak_tbs_of(name: str) -> float | None:
    """The peak memory bandwidth of the GPU called `name`, where PEAK_TBS knows it."""
    return next((tbs for part, tbs in PEAK_TBS.items() if part in name), None)


def ceilings(r: dict, null: dict, best: dict, peak_tbs: float) -> dict:
    """The "kept" and "HBM" ceilings of r's forward speedup over the all-keep row `best` (see
    the module docstring), from the no-indexer row `null`."""
    if peak_tbs <= 0:
        raise ValueError(f"peak_tbs must be > 0, got {peak_tbs}")
    kept = 1 - r["realized_sparsity"]
    out = {"ceiling_kept": best["forward_ms"] / (null["forward_ms"] + kept * best["indexer_ms"]),
           # GB / (TB/s) = ms
           "ceiling_hbm": best["forward_ms"] / (null["forward_ms"] + r["scored_gb"] / peak_tbs)}
    if r.get("traffic_gb") and best.get("traffic_gb"):   # rows of older files lack it
        out["ceiling_traffic"] = best["forward_ms"] / (
            null["forward_ms"] + r["traffic_gb"] / best["traffic_gb"] * best["indexer_ms"])
    return out


def wall_against_gpu(r: dict, best: dict) -> dict:
    """With repeated runs (round-robin: run k of each engine in round k): the step speedup of
    each round over the same round's all-keep, its range, and whether the forward (GPU)
    speedup lies inside it: if not, the host work around the step moves wall time by more than
    the runs' own spread."""
    rounds = list(zip(best["step_ms_runs"], r["step_ms_runs"]))
    if len(rounds) < 2:
        return {}
    speedups = [dense / spin for dense, spin in rounds]
    return {"step_speedup_range": [min(speedups), max(speedups)],
            "wall_agrees_with_gpu": min(speedups) <= r["forward_speedup"] <= max(speedups)}


def own_host_time(r: dict, best: dict) -> dict:
    """SPIN's host time a step beyond the all-keep row's (its step less its forward, against
    theirs), and the step speedup it would have without it (all-keep's step less the GPU time
    saved): a wall speedup sits below the GPU's by the host time every engine spends alike, so
    this, not the gap, is the host work SPIN adds."""
    return {"host_over_dense_ms": (r["step_ms"] - r["forward_ms"])
            - (best["step_ms"] - best["forward_ms"]),
            "step_speedup_without_own_host": best["step_ms"]
            / (best["step_ms"] - best["forward_ms"] + r["forward_ms"])}


def with_spread(r: dict, key: str) -> str:
    """The median of a time (step_ms, forward_ms) and, over repeated runs, their range."""
    runs = r.get(f"{key}_runs", [])
    spread = f" ({min(runs):.2f}-{max(runs):.2f})" if len(runs) > 1 else ""
    return f"{r[key]:.2f}{spread}"


def speedup_range(r: dict) -> str:
    low, high = r["step_speedup_range"]
    return f"{low:.3f}-{high:.3f}"


def report(r: dict, null: dict | None, dense: list[dict], rows: list[dict], context: int,
           batch: int, mtp: int, seconds: float,
           peak_tbs: float = FALLBACK_PEAK_TBS) -> dict | None:
    """Derive r's indexer time and speedups (against the null row and the fastest all-keep row
    so far), keep it in `rows`, print it. Returns the null row."""
    if r["indexer"] == "null":
        null = r
    elif r["indexer"] == "dense":
        dense.append(r)
    r["indexer_ms"] = r["forward_ms"] - null["forward_ms"]
    best = min(dense, key=lambda d: d["forward_ms"]) if dense else None
    if best is not None and r["indexer"] != "null":
        r["vs"] = label(best)
        r["step_speedup"] = best["step_ms"] / r["step_ms"]
        r["forward_speedup"] = best["forward_ms"] / r["forward_ms"]
        r["indexer_vs_dense"] = r["indexer_ms"] / best["indexer_ms"] \
            if best["indexer_ms"] > 0 else None
        if r["indexer"] in ("spin", "auto"):
            r.update(ceilings(r, null, best, peak_tbs))
            r.update(wall_against_gpu(r, best))
            r.update(own_host_time(r, best))
    r["indexer_share"] = r["indexer_ms"] / r["forward_ms"]
    rows.append(r)
    print(f"ctx {context:>7} B {batch:>3} next_n {mtp + 1} {label(r):>24}: step "
          f"{with_spread(r, 'step_ms')} ms  forward {with_spread(r, 'forward_ms')} ms  indexer "
          f"{r['indexer_ms']:6.2f} ms ({r['indexer_share']:.0%})  sparsity "
          f"{r['realized_sparsity']:.3f}  SPIN steps {r['spin_steps']}/{r['steps']}"
          f"  x{r.get('step_speedup', 1):.3f}" + (
              f"  ceilings x{r['ceiling_kept']:.3f} kept x{r['ceiling_hbm']:.3f} HBM"
              + (f" x{r['ceiling_traffic']:.3f} traffic" if "ceiling_traffic" in r else "")
              if "ceiling_hbm" in r else "") + (
              f"  wall x{speedup_range(r)} "
              f"{'holds' if r['wall_agrees_with_gpu'] else 'misses'} GPU "
              f"x{r['forward_speedup']:.3f}" if "step_speedup_range" in r else "") + (
              f"  host {r['host_over_dense_ms']:+.2f} ms over all-keep's (x"
              f"{r['step_speedup_without_own_host']:.3f} without)"
              if "host_over_dense_ms" in r else "")
          + f"  [{seconds:.0f} s]", flush=True)
    return null


def backends_here() -> list[str]:
    """native always; deepgemm (what TensorRT-LLM runs) when deep_gemm imports."""
    from spin_trtllm import logits
    ok, why = logits.available("deepgemm", "cuda")
    if not ok:
        print(f"bench_dsa_lite: no DeepGEMM column ({why})", flush=True)
    return ["native"] + (["deepgemm"] if ok else [])


def label(r) -> str:
    name = {"null": "no indexer", "dense": "all-keep"}.get(r["indexer"])
    if name is None:
        pred = "SPIN" if r.get("predictor", "spin") == "spin" else r["predictor"]
        name = f"{pred} {r['rho']}" + (" auto" if r["indexer"] == "auto" else "")
    return f"{name} ({r['backend']})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 96])
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.3, 0.5])
    ap.add_argument("--mtp", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--state-dtype", choices=["float32", "float16", "float8_e4m3fn"],
                    default="float16")
    ap.add_argument("--backends", nargs="+", choices=["native", "deepgemm"],
                    help="logits backends to run (default: native, and deepgemm if it imports)")
    ap.add_argument("--no-auto", action="store_true", help="skip the cost-model switch rows")
    ap.add_argument("--no-overlap-update", action="store_true",
                    help="SPIN's EMA update after each layer's top-K, not beside it")
    ap.add_argument("--overlap-select", action="store_true",
                    help="SPIN selects each layer beside the previous layer's top-K, not every "
                         "layer in one launch at the step's start")
    ap.add_argument("--predictor", nargs="+", choices=ENGINE_PREDICTORS, default=["spin"],
                    help="block predictors of the SPIN/auto rows (default: spin)")
    ap.add_argument("--peak-tbs", type=float,
                    help="the GPU's peak memory bandwidth in TB/s for the HBM ceiling "
                         f"(default: by the GPU's name, {PEAK_TBS})")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every engine, each in a fresh process; times are medians")
    ap.add_argument("--host-profile", metavar="DIR",
                    help="cProfile each engine's timed steps into "
                         "DIR/<context>x<batch>_mtp<depth>_<engine>_r<round>.txt (and .pstats): "
                         "where its host time goes (it slows the host)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.peak_tbs is not None and args.peak_tbs <= 0:
        ap.error(f"--peak-tbs must be > 0, got {args.peak_tbs}")
    if args.host_profile and Path(args.host_profile).exists() \
            and not Path(args.host_profile).is_dir():
        ap.error(f"--host-profile must be a directory, {args.host_profile} is a file")
    if args.host_profile and args.warmup < 1:
        ap.error("--host-profile needs --warmup >= 1: the profile starts after the warm-up")
    if not torch.cuda.is_available():
        print("bench_dsa_lite: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return 0
    if args.peak_tbs is None:
        try:
            name = torch.cuda.get_device_name()
        except (RuntimeError, AssertionError):
            name = "this GPU"
        args.peak_tbs = peak_tbs_of(name)
        if args.peak_tbs is None:
            args.peak_tbs = FALLBACK_PEAK_TBS
            print(f"bench_dsa_lite: the peak bandwidth of {name} is not known here: HBM ceilings "
                  f"at {FALLBACK_PEAK_TBS} TB/s (the H200's); pass --peak-tbs", file=sys.stderr)
    check_plan([(flag, path) for flag, path in (("--json", args.json),
                                                 ("--markdown", args.markdown)) if path])
    backends = args.backends or backends_here()
    rows: list[dict] = []
    try:
        run_cases(args, backends, rows)
    except Exception:
        # an engine failed: the rows of those that ended are written (a Ctrl-C writes nothing)
        if args.json:
            try:
                write_output(args.json, "--json", json_lines(rows))
            except SpinError as err:
                print(f"bench_dsa_lite: {err}", file=sys.stderr)
        raise
    if args.json:
        write_output(args.json, "--json", json_lines(rows))
    if args.markdown:
        write_output(args.markdown, "--markdown", markdown(rows, args))
    return 0


def json_lines(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def run_cases(args, backends: list[str], rows: list[dict]) -> None:
    """Every case of the sweep, each engine's row appended to `rows` as it ends."""
    for mtp in args.mtp:
        # DeepGEMM's SM90 kernel takes next_n <= 2; the backend runs wider MTP one row per
        # request, which is no dense baseline
        usable = [b for b in backends if b == "native" or mtp + 1 <= 2]
        for context in args.contexts:
            for batch in args.batches:
                base = dict(mtp=mtp, context=context, batch=batch, warmup=args.warmup,
                            steps=args.steps, state_dtype=args.state_dtype,
                            overlap_update=not args.no_overlap_update,
                            overlap_select=args.overlap_select)
                specs = [dict(indexer="null", backend="native")]
                specs += [dict(indexer="dense", backend=b) for b in usable]
                for p in args.predictor:
                    specs += [dict(indexer="spin", rho=s, backend=b, predictor=p)
                              for s in args.sparsity for b in usable]
                if not args.no_auto:
                    specs += [dict(indexer="auto", rho=s, backend="native", predictor=p)
                              for p in args.predictor for s in args.sparsity]
                null, dense = None, []
                runs = [[] for _ in specs]
                seconds = [0.0 for _ in specs]
                reported = 0
                # round-robin, so that host drift hits every engine alike; the last round
                # reports each engine as it ends (null and all-keep come first)
                try:
                    for round_ in range(args.repeats):
                        for i, spec in enumerate(specs):
                            t0 = time.time()
                            run = {**base, **spec}
                            if args.host_profile:
                                run["host_profile"] = str(Path(args.host_profile) / (
                                    f"{context}x{batch}_mtp{mtp}_{profile_name(spec)}"
                                    f"_r{round_}"))
                            runs[i].append(in_fresh_process(run))
                            seconds[i] += time.time() - t0
                            if round_ == args.repeats - 1:
                                null = report(merge_runs(runs[i]), null, dense, rows,
                                              context, batch, mtp, seconds[i], args.peak_tbs)
                                reported = i + 1
                finally:
                    # after a failure the engines not yet reported report the runs they have
                    # (null runs first every round, so it has runs whenever another does)
                    for i in range(reported, len(specs)):
                        if runs[i]:
                            null = report(merge_runs(runs[i]), null, dense, rows,
                                          context, batch, mtp, seconds[i], args.peak_tbs)


def profile_name(spec: dict) -> str:
    """A file-name-safe label of an engine: indexer, rho, predictor, backend."""
    parts = [spec["indexer"]]
    if spec.get("rho") is not None:
        parts.append(f"{spec['rho']:g}".replace(".", "p"))
    if spec.get("predictor", "spin") != "spin":
        parts.append(spec["predictor"])
    return "_".join(parts + [spec["backend"]])


def markdown(rows: list[dict], args) -> str:
    out = [f"GPU: {torch.cuda.get_device_name()}; SPIN state {args.state_dtype}; "
           f"speedups against the fastest all-keep of the same case; ceilings at "
           f"{args.peak_tbs} TB/s peak (module docstring)\n\n",
           "| context tokens (slots) | batch | next_n | indexer | step ms (runs' range) | "
           "forward ms (range) | "
           "indexer ms | realized sparsity | SPIN steps | step speedup | forward "
           "speedup | ceiling kept / HBM / traffic | step speedup per round (holds GPU's?) "
           "| after the forward ms (advance / final sync) | host ms over all-keep's (step "
           "speedup without) |\n"
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"]
    for r in rows:
        out.append(f"| {r['context_tokens']} ({r['indexer_slots']}) | {r['batch']} | "
                   f"{r['next_n']} | {label(r)} | {with_spread(r, 'step_ms')} | "
                   f"{with_spread(r, 'forward_ms')} | "
                   f"{r['indexer_ms']:.2f} | {r['realized_sparsity']:.3f} | "
                   f"{r['spin_steps']}/{r['steps']} | {r.get('step_speedup', 1):.3f} | "
                   f"{r.get('forward_speedup', 1):.3f} | " + (
                       f"{r['ceiling_kept']:.3f} / {r['ceiling_hbm']:.3f}"
                       + (f" / {r['ceiling_traffic']:.3f}" if "ceiling_traffic" in r else "")
                       if "ceiling_hbm" in r else "") + " | " + (
                       f"{speedup_range(r)} "
                       f"({'yes' if r['wall_agrees_with_gpu'] else 'no'})"
                       if "step_speedup_range" in r else "") + " | " + (
                       f"{r['after_ms']:.2f} ({r['advance_ms']:.2f} / {r['sync_ms']:.2f})"
                       if "advance_ms" in r else "") + " | " + (
                       f"{r['host_over_dense_ms']:+.2f} "
                       f"({r['step_speedup_without_own_host']:.3f})"
                       if "host_over_dense_ms" in r else "") + " |\n")
    return "".join(out)


if __name__ == "__main__":
    sys.exit(exit_code_of(main, Path(sys.argv[0]).name))
