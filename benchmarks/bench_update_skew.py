"""The one-row EMA update's time at every D skew, per indexer layer (CUDA GPU).

    python benchmarks/bench_update_skew.py [--batch 8 32 96] [--slots 32768 131072]
        [--sparsity 0.5] [--state-dtype float16] [--iters 20] [--json OUT]

D is indexed by the offset q - i, so a block's D window [q - 64j - 63, q - 64j] starts on a
16-byte vector only when (q + 1) % 8 == 0 (fp16; % 4 for fp32): at every other skew the update
writes the two vectors at each block edge entry by entry. A decode step sees every skew in
turn, one per token. For each skew s (context n = slots - 8 + s, query n - 1, so
(q + 1) % 8 == s) this times the update alone and right after the native masked logits and
top-K it follows in a step ("in sequence": the difference of the two captured sequences), and
prints the bytes it moves (scored slots' logits, V and D read and written) against a device
copy's bandwidth. bench_deepgemm_path.py times the update on whole-block contexts only
(n = slots: skew 0, every block full), where no row has an edge block.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from spin_trtllm import ops
from spin_trtllm._inputs import exit_code_of, one_line
from spin_trtllm._outputs import check_output, write_output
from spin_trtllm.errors import SpinError

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_decode_indexer import (cannot_run, copy_bandwidth, make_inputs, spin_case,  # noqa: E402
                                  time_after_ms, time_ms)

LAYERS = 21
SKEWS = 8


def run_case(batch: int, slots: int, rho: float, state_dtype: str, iters: int) -> dict:
    torch.manual_seed(0)
    inputs, n_full = make_inputs(batch, slots, 1, 1, seed=1)
    cfg, state, slot, req, step, acc, m_cap, ids, cnt, _, _, z, top = \
        spin_case(n_full, batch, slots, 1, 512, rho, LAYERS, state_dtype)
    cache, table, q, w = inputs[0]
    entry = state.V.element_size()
    row = {"batch": batch, "slots": slots, "sparsity": rho, "state_dtype": state_dtype,
           "alone_us": [], "in_sequence_us": [], "mbytes": []}
    for s in range(SKEWS):
        n = n_full - SKEWS + s                  # (q + 1) % 8 == s with q = n - 1
        ops.select(state, slot, n, n - 1, req, step, cfg, m_cap, slots, ids, cnt)
        scored = int(cnt[:, 0].clamp(max=m_cap).sum()) * 64

        def logits_topk(i, n=n):
            ops.indexer_logits(q, cache, w, n, table, ids[:, 0], cnt[:, 0], z)
            ops.topk(z, ids[:, 0], cnt[:, 0], 1, 512, top)

        def update(i, n=n):
            ops.update(state, slot, z, ids[:, 0], cnt[:, 0], n, n - 1, acc, step, 0, cfg, slots)

        # the smaller of two: a replay of the longer sequence can be disturbed
        seq = time_after_ms(logits_topk, update, iters, 1, tries=2)
        row["in_sequence_us"].append(1e3 * seq)
        row["alone_us"].append(1e3 * time_ms(update, iters, 1))
        row["mbytes"].append(scored * (4 + 4 * entry) / 1e6)
    del inputs, cache, table, q, w, state, z
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 32, 96])
    ap.add_argument("--slots", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--state-dtype", choices=["float32", "float16", "float8_e4m3fn"],
                    default="float16")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", help="append one JSON line per case")
    args = ap.parse_args(argv)
    if cannot_run("bench_update_skew"):
        return 2
    if any(s < 1024 or s % 64 for s in args.slots):
        ap.error("--slots must be multiples of 64, at least 1024")
    if args.json:
        check_output(args.json, "--json")
        if os.path.isfile(args.json) and not os.access(args.json, os.R_OK):
            raise SpinError(f"--json {one_line(args.json, 300)}: cannot append (not readable)")
    lines: list[str] = []
    try:
        run_cases(args, lines)
    except Exception:
        # a case failed: the lines of those that ended are appended (a Ctrl-C appends nothing)
        try:
            append_lines(args.json, lines)
        except SpinError as err:
            print(f"bench_update_skew: {err}", file=sys.stderr)
        raise
    append_lines(args.json, lines)
    return 0


def append_lines(path: str | None, lines: list[str]) -> None:
    """Append `lines` to the file at `path` (the whole file rewritten by write_output)."""
    if not path or not lines:
        return
    try:
        old = Path(path).read_bytes() if os.path.isfile(path) else b""
    except OSError as err:
        raise SpinError(f"--json {one_line(path, 300)}: cannot append ({err.strerror})") from None
    write_output(path, "--json", old + "".join(lines).encode())


def run_cases(args, lines: list[str]) -> None:
    """Time every case, print its line, and add its JSON line to `lines`."""
    copy_tbs = copy_bandwidth(10)
    print(f"device copy: {copy_tbs:.2f} TB/s (read + write)")
    print(f"{'batch x slots':>15} | {'skew 0':>7} | {'skews 1-7 min..max':>18} | {'mean':>6} | "
          f"{'alone s0 / mean':>15} | {'MB':>6} | {'at copy bw':>10}   (us, in sequence)")
    for batch in args.batch:
        for slots in args.slots:
            row = run_case(batch, slots, args.sparsity, args.state_dtype, args.iters)
            row["copy_tbs"] = copy_tbs
            seq, alone = row["in_sequence_us"], row["alone_us"]
            mean = sum(seq) / len(seq)
            mb = sum(row["mbytes"]) / len(row["mbytes"])
            print(f"{batch:>6} x {slots:>6} | {seq[0]:7.2f} | {min(seq[1:]):8.2f}..{max(seq[1:]):8.2f} | "
                  f"{mean:6.2f} | {alone[0]:6.2f} / {sum(alone) / len(alone):6.2f} | {mb:6.1f} | "
                  f"{mb / copy_tbs:10.2f}")
            lines.append(json.dumps(row) + "\n")


if __name__ == "__main__":
    sys.exit(exit_code_of(main, Path(sys.argv[0]).name))
