"""Target 5 from kernel times: select + update against DeepGEMM's dense logits (CUDA GPU).

    python benchmarks/bench_kernel_times.py [--shapes 96x131072 32x131072 96x32768]
        [--state-dtype float16 float8_e4m3fn] [--sparsity 0.5] [--reps 3] [--json OUT]

Runs a decode step's indexer kernels eagerly, in step order, at every D skew (context
n = slots - 8 + s, s = 0..7, so the newest block is partial, as in 63 of 64 steps): select (all
21 layers in one launch), the native masked logits, top-K, the one-row update, then DeepGEMM's
dense logits over the whole context. The profiler (CUPTI) gives each kernel's own device time,
averaged over skews and repetitions: the update's time is taken right after the logits and
top-K it follows in a step, without the difference of two captured sequences that
bench_update_skew.py uses (that difference moved by several us between repeats at 96 x 128K).
Prints select's share per layer (its time / 21) + the update, over DeepGEMM's dense logits.
Needs deep_gemm importable (tests/gpu/deepgemm_env.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from spin_trtllm import ops
from spin_trtllm._inputs import exit_code_of
from spin_trtllm._outputs import write_output

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_decode_indexer import cannot_run, make_inputs, spin_case  # noqa: E402

LAYERS = 21
SKEWS = 8


def kernel_times(prof) -> dict:
    """Mean device us and launch count of every kernel the profiler saw, by name."""
    times = {}
    for e in prof.key_averages():
        total = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if e.count and total:
            times[e.key[:90]] = (total / e.count, e.count)
    return times


def run_case(dg, batch: int, slots: int, dtype: str, rho: float, reps: int) -> dict:
    inputs, n_full = make_inputs(batch, slots, 1, 1, seed=1)
    cache, table, q, w = inputs[0]
    meta = dg.dg.get_paged_mqa_logits_metadata(n_full, 64, dg.num_sms(torch.device("cuda")))
    cfg, state, slot, req, step, acc, m_cap, ids, cnt, _, _, z, top = \
        spin_case(n_full, batch, slots, 1, 512, rho, LAYERS, dtype)

    def one_step(s: int) -> None:
        n = n_full - SKEWS + s
        ops.select(state, slot, n, n - 1, req, step + s, cfg, m_cap, slots, ids, cnt)
        ops.indexer_logits(q, cache, w, n, table, ids[:, 0], cnt[:, 0], z)
        ops.topk(z, ids[:, 0], cnt[:, 0], 1, 512, top)
        ops.update(state, slot, z, ids[:, 0], cnt[:, 0], n, n - 1, acc, step + s, 0, cfg, slots)
        dg.dg.fp8_paged_mqa_logits(q.view(batch, 1, 64, 128), cache, w, n_full, table, meta,
                                   slots)

    for s in range(SKEWS):  # warm-up: first launches, allocations
        one_step(s)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for s in range(SKEWS):
                one_step(s)
        torch.cuda.synchronize()
    times = kernel_times(prof)
    update = sum(t for name, (t, _) in times.items() if "update_kernel" in name)
    select = sum(t for name, (t, _) in times.items() if "select_kernel" in name) / LAYERS
    dense = max((t for name, (t, _) in times.items()
                 if "mqa_logits" in name.lower() and "metadata" not in name.lower()), default=0.0)
    return {"batch": batch, "slots": slots, "state_dtype": dtype, "sparsity": rho,
            "update_us": update, "select_per_layer_us": select, "dg_dense_logits_us": dense,
            "share": (update + select) / dense if dense else None, "kernels": times}


def skew_case_args(ap: argparse.ArgumentParser, shapes: list[str], reps: int, argv=None):
    """--shapes/--state-dtype/--sparsity/--reps/--json of the benchmarks that run every D skew;
    returns (args, [(batch, slots)])."""
    ap.add_argument("--shapes", nargs="+", default=shapes, help="BATCHxSLOTS cases")
    ap.add_argument("--state-dtype", nargs="+", default=["float16", "float8_e4m3fn"],
                    choices=["float32", "float16", "float8_e4m3fn"])
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=reps, help="passes over the 8 skews per timing")
    ap.add_argument("--json", help="write every case (with its measurements) here")
    args = ap.parse_args(argv)
    cases = parse_shapes(ap, args.shapes, 64 * SKEWS)
    if not 0.0 <= args.sparsity < 1.0 or args.reps < 1:
        ap.error("--sparsity must be in [0, 1) and --reps >= 1")
    return args, cases


def parse_shapes(ap: argparse.ArgumentParser, texts: list[str], min_slots: int):
    """--shapes BATCHxSLOTS values -> [(batch, slots)], or the parser's error."""
    cases = []
    for text in texts:
        try:
            batch, slots = (int(x) for x in text.lower().split("x"))
        except ValueError:
            ap.error(f"--shapes: {text!r} is not BATCHxSLOTS, e.g. 96x131072")
        if batch < 1 or slots < min_slots:
            ap.error(f"--shapes: {text!r} needs batch >= 1 and slots >= {min_slots}")
        cases.append((batch, slots))
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    args, shapes = skew_case_args(ap, ["96x131072", "32x131072", "96x32768"], 3, argv)
    if cannot_run("bench_kernel_times"):
        return 2
    try:
        from spin_trtllm.logits import DeepGemmLogits
        dg = DeepGemmLogits()
    except Exception as err:  # noqa: BLE001 - any import failure means no peer to compare
        print(f"bench_kernel_times: DeepGEMM is not importable ({err}); see "
              f"tests/gpu/deepgemm_env.sh", file=sys.stderr)
        return 2
    rows = []
    print(f"{'batch x slots':>15} | {'state':>13} | select/layer | update | DeepGEMM dense | share")
    for batch, slots in shapes:
        for dtype in args.state_dtype:
            row = run_case(dg, batch, slots, dtype, args.sparsity, args.reps)
            rows.append(row)
            share = f"{100 * row['share']:.1f}%" if row["share"] is not None else "-"
            print(f"{batch:>6} x {slots:<6} | {dtype:>13} | {row['select_per_layer_us']:9.2f} us "
                  f"| {row['update_us']:6.2f} | {row['dg_dense_logits_us']:11.1f} us | {share}",
                  flush=True)
            torch.cuda.empty_cache()
    if args.json:
        write_output(args.json, "--json", json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(exit_code_of(main, Path(sys.argv[0]).name))
