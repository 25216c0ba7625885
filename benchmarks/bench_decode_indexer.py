"""Decode-indexer benchmark on a CUDA GPU: the SPIN path against the dense path.

    python benchmarks/bench_decode_indexer.py [--batch 8 32] [--slots 32768 131072]
        [--next-n 1] [--topk 512] [--sparsity 0 0.3 0.5] [--layers 21] [--json OUT]
        [--markdown OUT] [--iters 30] [--state-dtype float32|float16|float8_e4m3fn]
    python benchmarks/bench_decode_indexer.py --suite [--json OUT] [--markdown OUT]

Per case (batch x slots per request x next_n x K x target sparsity): each op is called 12 times
in one CUDA graph, rotating over several input sets so the L2 cache does not flatter small
cases, and the median of --iters timed replays (CUDA events) is divided by 12, so host-side
work is not timed:
  dense:  indexer_logits over every block + topk (our kernels); the torch reference
          (dequantize + einsum + topk) for small cases only
  spin:   select for --layers layers in one launch, masked logits, topk, update of one layer
Bytes are the K-cache bytes of the pages read (132 B per slot); bandwidth is compared with a
device-to-device copy measured in the same run (bytes read + written).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from spin_trtllm import SpinConfig
from spin_trtllm import ops
from spin_trtllm._inputs import exit_code_of
from spin_trtllm._outputs import write_output

PAGE_BYTES = 64 * 132


def cannot_run(tool: str) -> bool:
    """Say on stderr why `tool` cannot run here (no CUDA GPU, or no native library); True if
    so (the caller exits 2)."""
    if not torch.cuda.is_available():
        print(f"{tool}: needs a CUDA GPU", file=sys.stderr)
        return True
    if not ops.NATIVE:
        print(f"{tool}: native library not built (./build.sh)", file=sys.stderr)
        return True
    return False


def median_event_ms(run, iters: int) -> float:
    """Median milliseconds of run(i), i = 0..iters-1, each timed with CUDA events."""
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def time_ms(fn, iters: int, sets: int, calls: int = 12) -> float:
    """Median milliseconds per fn(i) call, i cycling over `sets` input sets.

    `calls` calls are captured into one CUDA graph and the graph's replays are timed with CUDA
    events, so the host-side work of an op (argument checks, launch) is not timed: the GPU runs
    the kernels back to back as in a captured decode step.
    """
    for i in range(sets):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % sets)
    graph.replay()
    torch.cuda.synchronize()
    ms = median_event_ms(lambda i: graph.replay(), iters) / calls
    del graph
    return ms


def time_after_ms(before, extra, iters: int, sets: int, tries: int = 1) -> float:
    """Milliseconds `extra(i)` adds right after `before(i)`, as a decode step runs it: the
    difference of the two captured sequences (the smallest of `tries`; timed alone and
    repeated, a small case's inputs stay in L2, which flatters it)."""
    def both(i):
        before(i)
        extra(i)
    return min(time_ms(both, iters, sets) - time_ms(before, iters, sets) for _ in range(tries))


def time_eager_ms(fn, iters: int, sets: int) -> float:
    """Median milliseconds of single eager calls (for code that cannot be captured)."""
    for i in range(min(3, iters)):
        fn(i % sets)
    torch.cuda.synchronize()
    return median_event_ms(lambda i: fn(i % sets), iters)


def copy_bandwidth(iters: int) -> float:
    """TB/s of a 2 GiB device-to-device copy (bytes read + written)."""
    src = torch.empty(1 << 29, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_eager_ms(lambda i: dst.copy_(src), iters, 1)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e12


def bound_us(score_bytes: int, copy_tbs: float) -> float:
    """Microseconds to read `score_bytes` once at `copy_tbs` TB/s."""
    if copy_tbs <= 0:
        raise ValueError(f"copy bandwidth must be > 0 TB/s, got {copy_tbs}")
    return score_bytes / (copy_tbs * 1e12) * 1e6


GPU_QUERY = ("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu",
             "clocks_event_reasons.active")


def gpu_clocks() -> dict | None:
    """SM/memory clocks (MHz), power (W), temperature (C) and the active clock-event
    (throttle) reasons bitmask of the current GPU from nvidia-smi; None where it cannot be read.
    Clocks are not locked here, so a case timed while the GPU slows down shows it in these."""
    index = str(torch.cuda.current_device())
    for fields in (GPU_QUERY, GPU_QUERY[:-1]):  # older drivers lack the reasons field
        try:
            out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}",
                                  "--format=csv,noheader,nounits", "-i", index],
                                 capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
        values = [v.strip() for v in out.stdout.strip().split(",")]
        if out.returncode == 0 and len(values) == len(fields):
            return {name: parse_smi(v) for name, v in zip(fields, values)}
    return None


def parse_smi(value: str) -> float | int | None:
    try:
        return int(value, 16) if value.startswith("0x") else float(value)
    except ValueError:  # "[N/A]" and the like
        return None


KEY_DRAW_PAGES = 4096   # pages of keys drawn in fp32 at once (128 MiB)


def make_inputs(batch: int, slots: int, next_n: int, sets: int, seed: int,
                device: str = "cuda"):
    """`sets` random (cache, block table, q, weights) sets, drawn on `device`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pages = math.ceil(slots / 64)
    inputs = []
    for _ in range(sets):
        num_pages = batch * pages
        # keys drawn in fp32 a chunk of pages at a time: the cache's fp32 draw whole would be
        # four times its fp8 bytes (26 GB at 96 x 512K)
        rows = torch.empty(num_pages, 64 * 128, dtype=torch.float8_e4m3fn, device=device)
        for at in range(0, num_pages, KEY_DRAW_PAGES):
            part = rows[at:at + KEY_DRAW_PAGES]
            part.copy_(torch.randn(part.shape, generator=gen, device=device) * 2)
        scales = torch.rand(num_pages, 64, generator=gen, device=device) * 0.02 + 0.005
        cache = torch.cat([rows.view(torch.uint8), scales.view(torch.uint8)], 1).view(
            num_pages, 64, 1, 132)
        del rows
        table = torch.randperm(num_pages, generator=gen, device=device).view(batch, pages).to(
            torch.int32)
        q = torch.randn(batch * next_n, 64, 128, generator=gen, device=device).to(
            torch.float8_e4m3fn)
        w = torch.randn(batch * next_n, 64, generator=gen, device=device) * 0.1
        inputs.append((cache, table, q, w))
    n = torch.tensor([[slots - next_n + 1 + r for r in range(next_n)]] * batch,
                     dtype=torch.int32, device=device)
    return inputs, n


def spin_case(n, batch, slots, next_n, k, rho, layers, state_dtype):
    """A SPIN decode step's state and buffers on random V/D, after one select: (cfg, state,
    slot, request ids, steps, accepted, m_cap, block ids, counts, dense ids, dense counts,
    logits buffer, top-K buffer)."""
    cfg = SpinConfig(index_topk=k, target_sparsity=rho, state_dtype=state_dtype)
    state = ops.OpState.zeros(batch, layers, slots + 64, cfg, device="cuda")
    state.V.copy_(torch.randn(state.V.shape, device="cuda"))  # normal_ lacks float8
    state.D.copy_(torch.randn(state.D.shape, device="cuda"))
    state.decode_steps.fill_(5)
    slot = torch.arange(batch, dtype=torch.int32, device="cuda")
    req = torch.arange(batch, device="cuda")
    step = torch.full((batch,), 10, device="cuda")
    acc = torch.zeros(batch, dtype=torch.int32, device="cuda")
    m_cap = math.ceil(slots / 64)
    ids = torch.empty(batch, layers, m_cap, dtype=torch.int32, device="cuda")
    cnt = torch.empty(batch, layers, dtype=torch.int32, device="cuda")
    ops.select(state, slot, n, n - 1, req, step, cfg, m_cap, slots, ids, cnt)
    dense_ids = torch.arange(m_cap, dtype=torch.int32, device="cuda").repeat(batch, 1)
    dense_cnt = torch.full((batch,), m_cap, dtype=torch.int32, device="cuda")
    z = torch.empty(batch * next_n, m_cap * 64, device="cuda")
    top = torch.empty(batch * next_n, k, dtype=torch.int32, device="cuda")
    return cfg, state, slot, req, step, acc, m_cap, ids, cnt, dense_ids, dense_cnt, z, top


def run_case(inputs, n, batch, slots, next_n, k, rho, layers, iters, copy_tbs, reference,
             profile=False, state_dtype="float32"):
    cfg, state, slot, req, step, acc, m_cap, ids, cnt, dense_ids, dense_cnt, z, top = \
        spin_case(n, batch, slots, next_n, k, rho, layers, state_dtype)
    pages, sets, q_pos = m_cap, len(inputs), n - 1
    selected = int(cnt[:, 0].sum())

    def dense_logits(i):
        cache, table, q, w = inputs[i]
        ops.indexer_logits(q, cache, w, n, table, dense_ids, dense_cnt, z)

    def spin_logits(i):
        cache, table, q, w = inputs[i]
        ops.indexer_logits(q, cache, w, n, table, ids[:, 0], cnt[:, 0], z)

    if profile:
        # each stage once to warm up, then once more inside the NVTX range "profile" that
        # benchmarks/device_ncu.sh tells ncu to profile: select, dense logits, dense top-K,
        # masked logits, masked top-K, update
        stages = [
            lambda: ops.select(state, slot, n, q_pos, req, step, cfg, m_cap, slots, ids, cnt),
            lambda: dense_logits(0),
            lambda: ops.topk(z, dense_ids, dense_cnt, next_n, k, top),
            lambda: spin_logits(0),
            lambda: ops.topk(z, ids[:, 0], cnt[:, 0], next_n, k, top),
            lambda: ops.update(state, slot, z, ids[:, 0], cnt[:, 0], n, q_pos, acc, step, 0,
                               cfg, slots),
        ]
        for stage in stages:
            stage()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("profile")
        for stage in stages:
            stage()
        torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        return None

    t_dense_logits = time_ms(dense_logits, iters, sets)
    t_dense_topk = time_ms(lambda i: ops.topk(z, dense_ids, dense_cnt, next_n, k, top), iters, sets)
    t_select = time_ms(lambda i: ops.select(state, slot, n, q_pos, req, step, cfg, m_cap, slots,
                                            ids, cnt), iters, sets)
    t_spin_logits = time_ms(spin_logits, iters, sets)
    t_spin_topk = time_ms(lambda i: ops.topk(z, ids[:, 0], cnt[:, 0], next_n, k, top), iters, sets)
    t_update = time_ms(lambda i: ops.update(state, slot, z, ids[:, 0], cnt[:, 0], n, q_pos, acc,
                                            step, 0, cfg, slots), iters, sets)
    t_ref = None
    if reference and batch * slots <= 1 << 18:
        def torch_dense(i):
            from spin_trtllm.reference import dequantize_pages

            cache, table, q, w = inputs[i]
            keys = dequantize_pages(cache)[table.long()].view(batch, -1, 128)
            logits = torch.einsum("brhd,bsd->brsh", q.float().view(batch, next_n, 64, 128), keys)
            scores = (torch.relu(logits) * w.view(batch, next_n, 1, 64)).sum(-1)
            scores.view(batch * next_n, -1).topk(min(k, scores.shape[-1]), dim=-1)

        t_ref = time_eager_ms(torch_dense, max(3, iters // 5), sets)

    dense_bytes = batch * pages * PAGE_BYTES
    spin_bytes = selected * PAGE_BYTES
    dense_ms = t_dense_logits + t_dense_topk
    # per indexer layer: one layer's share of the all-layer select, then that layer's work
    spin_ms = t_select / layers + t_spin_logits + t_spin_topk + t_update

    def tbs(nbytes, ms):
        return nbytes / (ms * 1e-3) / 1e12

    return {
        "batch": batch, "slots": slots, "next_n": next_n, "k": k, "target_sparsity": rho,
        "state_dtype": state_dtype,
        "layers_in_select": layers,
        "realized_sparsity": 1 - selected / (batch * pages),
        "dense_logits_us": 1e3 * t_dense_logits, "dense_topk_us": 1e3 * t_dense_topk,
        "dense_logits_tbs": tbs(dense_bytes, t_dense_logits),
        "select_us": 1e3 * t_select, "select_per_layer_us": 1e3 * t_select / layers,
        "spin_logits_us": 1e3 * t_spin_logits,
        "spin_topk_us": 1e3 * t_spin_topk, "update_us": 1e3 * t_update,
        "spin_logits_tbs": tbs(spin_bytes, t_spin_logits),
        "spin_logits_frac_of_copy": tbs(spin_bytes, t_spin_logits) / copy_tbs,
        "torch_reference_us": None if t_ref is None else 1e3 * t_ref,
        "spin_over_dense": spin_ms / dense_ms,
        "gpu_after_case": gpu_clocks(),
    }


def sm_mhz(row) -> str:
    gpu = row.get("gpu_after_case") or {}
    return "-" if gpu.get("clocks.sm") is None else f"{gpu['clocks.sm']:.0f}"


def markdown(rows, copy_tbs) -> str:
    head = ("| batch | slots | next_n | K | state | target | realized | dense logits us (TB/s) "
            "| dense topk us | select us, all layers (per layer) | spin logits us (TB/s, % copy) "
            "| spin topk us | update us | spin/dense | SM MHz after |")
    lines = [f"Copy bandwidth in this run: {copy_tbs:.2f} TB/s", "", head,
             "|" + "---|" * 15]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['slots']} | {r['next_n']} | {r['k']} "
            f"| {r.get('state_dtype', 'float32').replace('float', 'fp')} | {r['target_sparsity']:.1f} "
            f"| {r['realized_sparsity']:.3f} | {r['dense_logits_us']:.1f} ({r['dense_logits_tbs']:.2f}) "
            f"| {r['dense_topk_us']:.1f} | {r['select_us']:.1f} ({r['select_per_layer_us']:.1f}) "
            f"| {r['spin_logits_us']:.1f} ({r['spin_logits_tbs']:.2f}, {100 * r['spin_logits_frac_of_copy']:.0f}%) "
            f"| {r['spin_topk_us']:.1f} | {r['update_us']:.1f} | {r['spin_over_dense']:.2f} "
            f"| {sm_mhz(r)} |")
    return "\n".join(lines)


# The sweep, trimmed to what one 10-minute GPU call can run (100 cases); the last entry
# times select and update on fp16 state (--state-dtype applies to the others).
SUITE = [
    dict(batch=[1, 8, 32, 96], slots=[8192, 32768, 131072], next_n=[1], topk=[512],
         sparsity=[0.0, 0.2, 0.3, 0.4, 0.5]),
    dict(batch=[8, 32], slots=[262144], next_n=[1], topk=[512], sparsity=[0.0, 0.3, 0.5]),
    dict(batch=[8, 96], slots=[32768], next_n=[2, 4], topk=[512, 2048], sparsity=[0.0, 0.3, 0.5]),
    dict(batch=[32], slots=[131072], next_n=[1], topk=[2048], sparsity=[0.0, 0.5]),
    dict(batch=[8, 96], slots=[32768, 131072], next_n=[1], topk=[512], sparsity=[0.3, 0.5],
         state_dtype=["float16"]),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--slots", type=int, nargs="+", default=[32768])
    ap.add_argument("--next-n", type=int, nargs="+", default=[1])
    ap.add_argument("--topk", type=int, nargs="+", default=[512])
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.0, 0.3, 0.5])
    ap.add_argument("--layers", type=int, default=21)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--sets", type=int, default=3, help="rotating input sets")
    ap.add_argument("--reference", action="store_true", help="also time the torch reference")
    ap.add_argument("--state-dtype", choices=["float32", "float16", "float8_e4m3fn"],
                    default="float32",
                    help="dtype of the V/D state (select and update traffic)")
    ap.add_argument("--suite", action="store_true",
                    help="run the fixed sweep SUITE instead of --batch/--slots/...")
    ap.add_argument("--profile", action="store_true",
                    help="run each stage of the first case once inside the NVTX range 'profile' "
                         "for ncu (benchmarks/device_ncu.sh), print nothing else")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    if cannot_run("bench_decode_indexer"):
        return 2
    if args.profile:
        inputs, n = make_inputs(args.batch[0], args.slots[0], args.next_n[0], 1, 1)
        run_case(inputs, n, args.batch[0], args.slots[0], args.next_n[0], args.topk[0],
                 args.sparsity[0], args.layers, args.iters, 0.0, False, profile=True,
                 state_dtype=args.state_dtype)
        return 0
    gpu_at_start = gpu_clocks()
    copy_tbs = copy_bandwidth(args.iters)
    rows = []

    def save() -> None:  # after every case, so a run cut short keeps what it measured
        if args.json:
            write_output(args.json, "--json", json.dumps(
                {"copy_tbs": copy_tbs, "device": torch.cuda.get_device_name(),
                 "gpu_at_start": gpu_at_start, "rows": rows}, indent=2))
        if args.markdown:
            write_output(args.markdown, "--markdown", markdown(rows, copy_tbs) + "\n")

    sweeps = SUITE if args.suite else [dict(batch=args.batch, slots=args.slots,
                                            next_n=args.next_n, topk=args.topk,
                                            sparsity=args.sparsity)]
    seed = 0
    for sweep in sweeps:
        for batch in sweep["batch"]:
            for slots in sweep["slots"]:
                for next_n in sweep["next_n"]:
                    seed += 1
                    inputs, n = make_inputs(batch, slots, next_n, args.sets, seed)
                    for k, rho, dtype in itertools.product(
                            sweep["topk"], sweep["sparsity"],
                            sweep.get("state_dtype", [args.state_dtype])):
                        row = run_case(inputs, n, batch, slots, next_n, k, rho, args.layers,
                                       args.iters, copy_tbs, args.reference, state_dtype=dtype)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
                        save()
                    del inputs, n
                    torch.cuda.empty_cache()
    print(markdown(rows, copy_tbs))
    return 0


if __name__ == "__main__":
    sys.exit(exit_code_of(main, Path(sys.argv[0]).name))
