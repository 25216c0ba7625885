"""SPIN through DeepGEMM against DeepGEMM dense, per indexer layer, in one process (CUDA GPU).

    python benchmarks/bench_deepgemm_path.py [--batch 8 32 96] [--slots 32768 131072]
        [--next-n 1 2] [--sparsity 0.3 0.5] [--topk 512] [--layers 21]
        [--state-dtype float16] [--json OUT] [--markdown OUT]

What TensorRT-LLM runs for the decode indexer is DeepGEMM's fp8_paged_mqa_logits plus a top-K;
SPIN inside TensorRT-LLM keeps that kernel and gives it a compacted block table. Per case, on
the same inputs (times per indexer layer, CUDA-graph replays, medians):
  dense:        DeepGEMM logits over every page + the faster top-K of the dense rows (spin's
                kernel, and flashinfer's where it is installed: each timed, the faster counts);
                the schedule metadata is listed apart (upstream builds it once per step in
                prepare)
  spin (DG):    select / layers + compact + schedule + DeepGEMM logits on the compacted table +
                top-K + update, a compact and a schedule kernel a layer (each also timed alone)
  spin (native): select / layers + spin's masked logits + top-K + update
  as run:       spin (DG) as SpinIndexer runs it by default: every layer's compacted table,
                lengths and DeepGEMM schedule from one ops.compact a step (StepCompaction; /
                layers here), then DeepGEMM's logits alone a layer; without MTP on sm_90 the
                update is launched beside the top-K (IndexerOptions.overlap_update), so the
                top-K and the update are timed together; with MTP (the update deferred to
                finish(), one launch for every layer) they add. Where DeepGEMM's schedule
                function differs from ops.compact's, as run keeps a compact and a schedule a
                layer. One layer's compact with its schedule (the probe's path, whose select
                is per layer) is timed too
  floor:        SPIN's logits alone (the faster of DG and native) over dense: the ratio if
                select, top-K and update cost nothing
  top-K bound:  each top-K's rows of fp32 scores read once at the copy bandwidth of the run
                (target: within 2x), printed as time over bound for SPIN's rows and the dense ones
  bytes moved:  each path's HBM traffic as separate kernels move it at the least
                (costs.traffic_bytes: K cache pages, the fp32 logits written and read once, and
                SPIN's state, select's V/D reads and the update's), SPIN's over dense's: the
                as-run ratio if both ran at one bandwidth; and each path's time over its bytes
                at the run's copy bandwidth (1.00x: at the copy's speed)
It also checks that SPIN through DeepGEMM and through the native kernel select the same
blocks and the same top-K sets, and times the update again right after the native masked logits
and top-K, as a decode step runs it ("update in sequence": the difference of the two sequences;
repeated alone, a small case's state and logits stay in L2). Needs deep_gemm importable
(tests/gpu/deepgemm_env.sh).

    python benchmarks/bench_deepgemm_path.py --logits-only [--next-n 1 2 4] ...

times only the dense logits, spin's native kernel against DeepGEMM's on the same inputs, and
prints their bytes per second and ratio per shape (DeepGEMM columns are "-" where it refuses
the shape, e.g. next_n > 2 on SM90).
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
from spin_trtllm.costs import traffic_bytes
from spin_trtllm.logits import DeepGemmLogits
from spin_trtllm.logits.deepgemm import LayerInputs, schedule_matches

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_decode_indexer import (PAGE_BYTES, bound_us, cannot_run,  # noqa: E402
                                  copy_bandwidth, gpu_clocks, make_inputs, spin_case, time_after_ms,
                                  time_ms)


def same_sets(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of rows whose top-K slot sets are equal (rows are ascending, -1 padded)."""
    return float((a.sort(-1).values == b.sort(-1).values).all(-1).float().mean())


def topk_by_backend(run, iters, sets) -> dict[str, float]:
    """ms of a top-K call (run(i) calls ops.topk) with each backend this run has: spin's kernel,
    and flashinfer's where it is installed."""
    times = {}
    for backend in ("spin", "flashinfer") if ops.peer_available() else ("spin",):
        with ops.using_topk_backend(backend):
            times[backend] = time_ms(run, iters, sets)
    return times


def run_case(inputs, n, batch, slots, next_n, k, rho, layers, iters, state_dtype, dg,
             copy_tbs):
    cfg, state, slot, req, step, acc, m_cap, ids, cnt, dense_ids, dense_cnt, z, top = \
        spin_case(n, batch, slots, next_n, k, rho, layers, state_dtype)
    pages, sets, q_pos = m_cap, len(inputs), n - 1
    selected = int(cnt[:, 0].sum())
    top_dg = torch.empty_like(top)
    num_sms = dg.num_sms(torch.device("cuda"))
    dense_meta = dg.dg.get_paged_mqa_logits_metadata(n, 64, num_sms)
    out = {}

    def dense_dg(i):
        cache, table, q, w = inputs[i]
        out["dense"] = dg.dg.fp8_paged_mqa_logits(q.view(batch, next_n, 64, 128), cache, w, n,
                                                  table, dense_meta, slots)

    def spin_dg(i):
        cache, table, q, w = inputs[i]
        out["spin"] = dg.run(q, cache, w, n, table, ids[:, 0], cnt[:, 0])

    def spin_native(i):
        cache, table, q, w = inputs[i]
        ops.indexer_logits(q, cache, w, n, table, ids[:, 0], cnt[:, 0], z)

    # correctness on input set 0: same selection feeds both; compare top-K sets
    spin_native(0)
    ops.topk(z, ids[:, 0], cnt[:, 0], next_n, k, top)
    spin_dg(0)
    logits, lens = out["spin"]
    ops.topk(logits, ids[:, 0], cnt[:, 0], next_n, k, top_dg, row_lens=lens)
    agree = same_sets(top, top_dg)

    t_meta = time_ms(lambda i: dg.dg.get_paged_mqa_logits_metadata(n, 64, num_sms), iters, sets)
    t_dense = time_ms(dense_dg, iters, sets)
    dense_logits = out["dense"]
    dense_topk = topk_by_backend(lambda i: ops.topk(dense_logits, dense_ids, dense_cnt, next_n,
                                                    k, top, row_lens=n), iters, sets)
    t_dense_topk = min(dense_topk.values())
    t_select = time_ms(lambda i: ops.select(state, slot, n, q_pos, req, step, cfg, m_cap, slots,
                                            ids, cnt), iters, sets)
    t_spin_dg = time_ms(spin_dg, iters, sets)          # compact + schedule + DeepGEMM
    logits, lens = out["spin"]
    t_compact = time_ms(lambda i: ops.compact(ids[:, 0], cnt[:, 0], n, inputs[i][1], 64),
                        iters, sets)
    t_schedule = time_ms(lambda i: dg.dg.get_paged_mqa_logits_metadata(lens, 64, num_sms),
                         iters, sets)
    t_spin_topk = time_ms(lambda i: ops.topk(logits, ids[:, 0], cnt[:, 0], next_n, k, top,
                                             row_lens=lens), iters, sets)
    t_update = time_ms(lambda i: ops.update(state, slot, logits, ids[:, 0], cnt[:, 0], n, q_pos,
                                            acc, step, 0, cfg, slots), iters, sets)
    beside = next_n == 1 and torch.cuda.get_device_capability()[0] >= 9

    def topk_update_beside(i):
        ops.topk(logits, ids[:, 0], cnt[:, 0], next_n, k, top, row_lens=lens)
        ops.update(state, slot, logits, ids[:, 0], cnt[:, 0], n, q_pos, acc, step, 0, cfg, slots,
                   beside_previous=True)

    t_topk_update = time_ms(topk_update_beside, iters, sets) if beside \
        else t_spin_topk + t_update
    stepwide = step_compaction(inputs, dg, n, ids, cnt, iters, sets)
    if stepwide is not None:
        prepared, t_step_compact, t_one_layer = stepwide
        t_dg_prepared = time_ms(lambda i: dg.run(inputs[i][2], inputs[i][0], inputs[i][3], n,
                                                 inputs[i][1], ids[:, 0], cnt[:, 0],
                                                 prepared=prepared[i]), iters, sets)
        logits_p, lens_p = dg.run(inputs[0][2], inputs[0][0], inputs[0][3], n, inputs[0][1],
                                  ids[:, 0], cnt[:, 0], prepared=prepared[0])
        top_p = torch.empty_like(top)
        ops.topk(logits_p, ids[:, 0], cnt[:, 0], next_n, k, top_p, row_lens=lens_p)
        agree_step = same_sets(top_dg, top_p)
    t_native = time_ms(spin_native, iters, sets)
    t_native_topk = time_ms(lambda i: ops.topk(z, ids[:, 0], cnt[:, 0], next_n, k, top),
                            iters, sets)

    # The update where a decode step runs it, right after the masked logits and top-K: timed
    # alone and repeated, a small case's state and logits stay in L2 (50 MB), which flatters it.
    def native_then_topk(i):
        spin_native(i)
        ops.topk(z, ids[:, 0], cnt[:, 0], next_n, k, top)

    def update(i):
        ops.update(state, slot, z, ids[:, 0], cnt[:, 0], n, q_pos, acc, step, 0, cfg, slots)

    t_update_seq = max(0.0, time_after_ms(native_then_topk, update, iters, sets))
    dense_ms = t_dense + t_dense_topk
    per_layer_select = t_select / layers
    spin_dg_ms = per_layer_select + t_spin_dg + t_spin_topk + t_update
    spin_native_ms = per_layer_select + t_native + t_native_topk + t_update
    per_layer_compact_as_run_ms = per_layer_select + t_spin_dg + t_topk_update
    spin_dg_as_run_ms = per_layer_compact_as_run_ms if stepwide is None else \
        per_layer_select + t_step_compact / layers + t_dg_prepared + t_topk_update
    us = 1e3
    # the top-K's bound: its rows' fp32 scores read once at the copy bandwidth of this run
    # (SPIN's rows hold the selected blocks' slots, a ragged last block counted whole)
    spin_topk_bytes = 4 * next_n * selected * 64
    dense_topk_bytes = 4 * int(n.sum())
    # each path's bytes moved (K cache, logits written and read, SPIN's state) at that bandwidth
    visible = int(((n.max(1).values + 63) // 64).sum())
    spin_traffic = traffic_bytes(selected, visible, next_n, state_dtype)
    dense_traffic = traffic_bytes(visible, visible, next_n)
    return {
        "batch": batch, "slots": slots, "next_n": next_n, "k": k, "target_sparsity": rho,
        "state_dtype": state_dtype, "realized_sparsity": 1 - selected / (batch * pages),
        "dense_schedule_us": us * t_meta, "dense_logits_us": us * t_dense,
        "dense_topk_us": us * t_dense_topk,
        "dense_topk_us_by_backend": {b: us * t for b, t in dense_topk.items()},
        "dense_logits_tbs": batch * pages * PAGE_BYTES / (t_dense * 1e-3) / 1e12,
        "select_per_layer_us": us * per_layer_select,
        "spin_dg_logits_us": us * t_spin_dg, "spin_topk_us": us * t_spin_topk,
        "compact_us": us * t_compact, "spin_dg_schedule_us": us * t_schedule,
        "update_us": us * t_update, "update_in_sequence_us": us * t_update_seq,
        "select_update_over_dense_logits": (per_layer_select + t_update_seq) / t_dense,
        "spin_native_logits_us": us * t_native,
        "spin_dg_us": us * spin_dg_ms, "spin_native_us": us * spin_native_ms,
        "dense_us": us * dense_ms, "spin_dg_over_dense": spin_dg_ms / dense_ms,
        "spin_native_over_dense": spin_native_ms / dense_ms,
        "update_beside_topk": beside, "topk_update_us": us * t_topk_update,
        "spin_dg_as_run_us": us * spin_dg_as_run_ms,
        "spin_dg_as_run_over_dense": spin_dg_as_run_ms / dense_ms,
        "schedule_from_compact": stepwide is not None,
        "step_compact_us": None if stepwide is None else us * t_step_compact,
        "compact_one_layer_us": None if stepwide is None else us * t_one_layer,
        "spin_dg_prepared_logits_us": None if stepwide is None else us * t_dg_prepared,
        "topk_sets_equal_step_vs_per_layer": None if stepwide is None else agree_step,
        "per_layer_compact_as_run_us": us * per_layer_compact_as_run_ms,
        "per_layer_compact_as_run_over_dense": per_layer_compact_as_run_ms / dense_ms,
        # what SPIN would cost if select, top-K and update were free: its logits alone
        "logits_floor_over_dense": min(t_spin_dg, t_native) / dense_ms,
        "spin_topk_bound_us": bound_us(spin_topk_bytes, copy_tbs),
        "dense_topk_bound_us": bound_us(dense_topk_bytes, copy_tbs),
        "spin_traffic_mb": spin_traffic / 1e6, "dense_traffic_mb": dense_traffic / 1e6,
        "traffic_floor_spin_us": bound_us(spin_traffic, copy_tbs),
        "traffic_floor_dense_us": bound_us(dense_traffic, copy_tbs),
        "topk_sets_equal_native_vs_dg": agree, "gpu_after_case": gpu_clocks(),
    }


def step_compaction(inputs, dg, n, ids, cnt, iters, sets):
    """Per input set, layer 0's inputs from one ops.compact over every layer with DeepGEMM's
    schedule; ms of that launch (a step's) and of one layer's compact with its schedule. None
    where DeepGEMM's schedule function differs from the one compact writes."""
    source = dg.schedule_source(n)
    if source is None or not schedule_matches(source, n.shape[1], n.device):
        print("DeepGEMM's schedule differs from ops.compact's: as run keeps a compact and a "
              "schedule a layer", file=sys.stderr)
        return None
    L = ids.shape[1]
    work = torch.zeros(L, dtype=torch.int32, device="cuda")
    made = []
    for cache, table, q, w in inputs:
        sched = torch.empty(L, source.num_sms + 1, 2, dtype=torch.int32, device="cuda")
        tables, lens = ops.compact(ids, cnt, n, table, 64, schedule=sched, workspace=work)
        made.append((tables, lens, sched))
    prepared = [LayerInputs(t[0], l[0], s[0]) for t, l, s in made]
    t_step = time_ms(lambda i: ops.compact(ids, cnt, n, inputs[i][1], 64, *made[i], work),
                     iters, sets)
    t_one = time_ms(lambda i: ops.compact(ids[:, 0], cnt[:, 0], n, inputs[i][1], 64,
                                          *prepared[i], work[:1]), iters, sets)
    return prepared, t_step, t_one


def logits_case(inputs, n, batch, slots, next_n, iters, dg):
    """Dense logits over every page: spin's native kernel against DeepGEMM, same inputs."""
    sets, m_cap = len(inputs), -(-slots // 64)
    ids = torch.arange(m_cap, dtype=torch.int32, device="cuda").repeat(batch, 1)
    cnt = torch.full((batch,), m_cap, dtype=torch.int32, device="cuda")
    z = torch.empty(batch * next_n, m_cap * 64, device="cuda")
    t_native = time_ms(lambda i: ops.indexer_logits(inputs[i][2], inputs[i][0], inputs[i][3], n,
                                                    inputs[i][1], ids, cnt, z), iters, sets)
    gb = batch * m_cap * PAGE_BYTES / 1e9
    row = {"batch": batch, "slots": slots, "next_n": next_n, "native_logits_us": 1e3 * t_native,
           "native_tbs": gb / t_native, "dg_logits_us": None, "dg_tbs": None,
           "native_over_dg": None, "max_abs_diff": None}
    try:
        meta = dg.dg.get_paged_mqa_logits_metadata(n, 64, dg.num_sms(torch.device("cuda")))

        def dense_dg(i):
            cache, table, q, w = inputs[i]
            return dg.dg.fp8_paged_mqa_logits(q.view(batch, next_n, 64, 128), cache, w, n,
                                              table, meta, slots)
        ref = dense_dg(0)
        ops.indexer_logits(inputs[0][2], inputs[0][0], inputs[0][3], n, inputs[0][1], ids, cnt, z)
        visible = torch.arange(slots, device="cuda") < n.reshape(-1, 1)  # DeepGEMM leaves the rest
        seen = visible & torch.isfinite(ref[:, :slots]) & torch.isfinite(z[:, :slots])
        row["max_abs_diff"] = float((ref[:, :slots] - z[:, :slots])[seen].abs().max())
        t_dg = time_ms(dense_dg, iters, sets)
    except RuntimeError as e:  # DeepGEMM refuses the shape
        print(f"DeepGEMM, batch {batch} slots {slots} next_n {next_n}: {str(e).splitlines()[0]}",
              file=sys.stderr)
        return row
    row.update(dg_logits_us=1e3 * t_dg, dg_tbs=gb / t_dg, native_over_dg=t_native / t_dg)
    return row


def logits_markdown(rows, copy_tbs) -> str:
    lines = [f"Copy bandwidth in this run: {copy_tbs:.2f} TB/s; dense logits over every page, "
             "K-cache bytes (132 B per slot) per second", "",
             "| batch | slots | next_n | native us (TB/s) | DeepGEMM us (TB/s) | native / DeepGEMM "
             "| max abs diff |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        dg_cell = (f"{r['dg_logits_us']:.1f} ({r['dg_tbs']:.2f})" if r["dg_logits_us"] is not None
                   else "- (refused)")
        ratio = f"{r['native_over_dg']:.2f}" if r["native_over_dg"] is not None else "-"
        diff = f"{r['max_abs_diff']:.2g}" if r["max_abs_diff"] is not None else "-"
        lines.append(f"| {r['batch']} | {r['slots']} | {r['next_n']} | {r['native_logits_us']:.1f} "
                     f"({r['native_tbs']:.2f}) | {dg_cell} | {ratio} | {diff} |")
    return "\n".join(lines)


def topk_cell(row) -> str:
    """The dense top-K's time, and each backend's where there were two (rows of older files
    have one)."""
    by = row.get("dense_topk_us_by_backend", {})
    each = " / ".join(f"{b} {t:.1f}" for b, t in by.items()) if len(by) > 1 else ""
    return f"{row['dense_topk_us']:.1f}" + (f" ({each})" if each else "")


def compact_cell(row) -> str:
    """compact's and the schedule's share of compact+DG, timed alone, and DeepGEMM's logits
    after one compact a step for every layer ("" in older rows)."""
    if "compact_us" not in row:
        return ""
    cell = f" (compact {row['compact_us']:.1f}, schedule {row['spin_dg_schedule_us']:.1f}"
    if row.get("step_compact_us") is not None:
        cell += (f"; DG alone {row['spin_dg_prepared_logits_us']:.1f} after one compact of "
                 f"every layer, {row['step_compact_us']:.1f} a step")
    return cell + ")"


def as_run_cells(row) -> str:
    """The top-K with the update beside it and SPIN(DG) as run over dense ("-" in rows of
    older files; "(after)" where the update ran after the top-K: MTP, or below sm_90)."""
    if "spin_dg_as_run_over_dense" not in row:
        return "- | -"
    after = "" if row["update_beside_topk"] else " (after)"
    per_layer = row.get("per_layer_compact_as_run_over_dense")
    before = f" ({per_layer:.2f} compacting a layer at a time)" \
        if per_layer is not None and row.get("schedule_from_compact") else ""
    return (f"{row['topk_update_us']:.1f}{after} | {row['spin_dg_as_run_over_dense']:.2f}"
            f"{before}")


def floor_cells(row) -> str:
    """SPIN's logits alone over dense (the ratio with select, top-K and update free), and each
    top-K over its bound (scores read once at the copy bandwidth); "-" in older rows."""
    if "logits_floor_over_dense" not in row:
        return "- | -"
    return (f"{row['logits_floor_over_dense']:.2f} | "
            f"{row['spin_topk_us'] / row['spin_topk_bound_us']:.1f}x / "
            f"{row['dense_topk_us'] / row['dense_topk_bound_us']:.1f}x")


def traffic_cells(row) -> str:
    """SPIN's bytes over dense's (costs.traffic_bytes: the as-run ratio if both ran at one
    bandwidth), and SPIN as run and dense over their bytes at the copy bandwidth ("-" in older
    rows)."""
    if "spin_traffic_mb" not in row:
        return "- | -"
    return (f"{row['spin_traffic_mb'] / row['dense_traffic_mb']:.3f} | "
            f"{row['spin_dg_as_run_us'] / row['traffic_floor_spin_us']:.2f}x / "
            f"{row['dense_us'] / row['traffic_floor_dense_us']:.2f}x")


def markdown(rows, copy_tbs) -> str:
    head = ("| batch | slots | next_n | target | realized | DG dense logits us (TB/s) | dense "
            "top-K us (the faster) | DG schedule us | SPIN via DG: select/L + compact+DG + top-K + update us "
            "| SPIN native us | SPIN(DG) / dense | SPIN(native) / dense | top-K + update "
            "beside us | SPIN(DG) as run / dense | top-K sets equal "
            "| update in sequence us | (select/L + update in sequence) / DG dense logits "
            "| SPIN's logits alone / dense | top-K over its bound, SPIN / dense "
            "| bytes moved, SPIN / dense | time over bytes at copy bandwidth, as run / dense |")
    lines = [f"Copy bandwidth in this run: {copy_tbs:.2f} TB/s; times per indexer layer", "",
             head, "|" + "---|" * head.count(" |")]
    for r in rows:
        lines.append(
            f"| {r['batch']} | {r['slots']} | {r['next_n']} | {r['target_sparsity']:.1f} "
            f"| {r['realized_sparsity']:.3f} | {r['dense_logits_us']:.1f} "
            f"({r['dense_logits_tbs']:.2f}) | {topk_cell(r)} "
            f"| {r['dense_schedule_us']:.1f} | {r['select_per_layer_us']:.1f} + "
            f"{r['spin_dg_logits_us']:.1f}{compact_cell(r)} + {r['spin_topk_us']:.1f} + "
            f"{r['update_us']:.1f} = "
            f"{r['spin_dg_us']:.1f} | {r['spin_native_us']:.1f} | {r['spin_dg_over_dense']:.2f} "
            f"| {r['spin_native_over_dense']:.2f} | {as_run_cells(r)} "
            f"| {100 * r['topk_sets_equal_native_vs_dg']:.1f}% "
            f"| {r['update_in_sequence_us']:.1f} "
            f"| {100 * r['select_update_over_dense_logits']:.1f}% "
            f"| {floor_cells(r)} | {traffic_cells(r)} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32, 96])
    ap.add_argument("--slots", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--next-n", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--topk", type=int, nargs="+", default=[512])
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.3, 0.5])
    ap.add_argument("--layers", type=int, default=21)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--sets", type=int, default=2)
    ap.add_argument("--state-dtype", choices=["float32", "float16", "float8_e4m3fn"],
                    default="float16")
    ap.add_argument("--logits-only", action="store_true",
                    help="time only dense logits, native against DeepGEMM")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args()
    if cannot_run("bench_deepgemm_path"):
        return 2
    dg = DeepGemmLogits()
    copy_tbs = copy_bandwidth(args.iters)
    rows = []
    seed = 0
    for batch, slots, next_n in itertools.product(args.batch, args.slots, args.next_n):
        seed += 1
        inputs, n = make_inputs(batch, slots, next_n, args.sets, seed)
        if args.logits_only:
            rows.append(logits_case(inputs, n, batch, slots, next_n, args.iters, dg))
            print(json.dumps(rows[-1]), flush=True)
            del inputs, n
            torch.cuda.empty_cache()
            continue
        for k, rho in itertools.product(args.topk, args.sparsity):
            row = run_case(inputs, n, batch, slots, next_n, k, rho, args.layers, args.iters,
                           args.state_dtype, dg, copy_tbs)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                write_output(args.json, "--json", json.dumps(
                    {"copy_tbs": copy_tbs, "device": torch.cuda.get_device_name(),
                     "rows": rows}, indent=2))
        del inputs, n
        torch.cuda.empty_cache()
    table = (logits_markdown if args.logits_only else markdown)(rows, copy_tbs)
    if args.logits_only and args.json:
        write_output(args.json, "--json", json.dumps(
            {"copy_tbs": copy_tbs, "device": torch.cuda.get_device_name(), "rows": rows},
            indent=2))
    if args.markdown:
        write_output(args.markdown, "--markdown", table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(exit_code_of(main, Path(sys.argv[0]).name))
