"""select's time by MTP rows, beside the bytes it must read (CUDA GPU).

    python benchmarks/bench_select_rows.py [--batch 32 96] [--slots 32768 131072]
        [--next-n 1 2 4] [--state-dtype float16 float8_e4m3fn] [--layers 21] [--iters 20]
        [--json OUT]

Times the select launch of every layer (one a decode step, as SpinIndexer runs it) in CUDA-graph
replays, on random V/D at rho 0.5, every request past warm-up, its MTP rows at consecutive
queries (mtp_mask "union", the default: each row is scored). Prints us a layer, and the floor:
V and D of every visible slot read once at the run's copy bandwidth. Scoring each row from its
own read of the state reads them next_n times; the rows scored together read them once.
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

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_decode_indexer import (bound_us, cannot_run, copy_bandwidth,  # noqa: E402
                                  spin_case, time_ms)


def run_case(batch: int, slots: int, next_n: int, state_dtype: str, layers: int, iters: int,
             copy_tbs: float) -> dict:
    n = torch.tensor([[slots - next_n + 1 + r for r in range(next_n)]] * batch,
                     dtype=torch.int32, device="cuda")
    cfg, state, slot, req, step, _, m_cap, ids, cnt, *_ = spin_case(
        n, batch, slots, next_n, 512, 0.5, layers, state_dtype)
    q = n - 1
    ms = time_ms(lambda i: ops.select(state, slot, n, q, req, step, cfg, m_cap, slots, ids, cnt),
                 iters, 1)
    state_bytes = state.V.element_size()
    floor = bound_us(2 * state_bytes * batch * layers * int(n.max()), copy_tbs)
    per_layer = 1e3 * ms / layers
    row = {"batch": batch, "slots": slots, "next_n": next_n, "state_dtype": state_dtype,
           "layers": layers, "select_us": 1e3 * ms, "select_per_layer_us": per_layer,
           "floor_per_layer_us": floor / layers, "over_floor": 1e3 * ms / floor,
           "selected_blocks_per_layer": int(cnt[:, 0].sum())}
    del state, ids, cnt
    torch.cuda.empty_cache()
    return row


def markdown(rows: list[dict], copy_tbs: float) -> str:
    lines = [f"Copy bandwidth in this run: {copy_tbs:.2f} TB/s; one select launch of every "
             "layer, us a layer", "",
             "| batch | slots | next_n | state | select us a layer | floor us (V/D read once) "
             "| over the floor |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['slots']} | {r['next_n']} | {r['state_dtype']} "
                     f"| {r['select_per_layer_us']:.1f} | {r['floor_per_layer_us']:.1f} "
                     f"| {r['over_floor']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 96])
    ap.add_argument("--slots", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--next-n", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--state-dtype", nargs="+", default=["float16", "float8_e4m3fn"],
                    choices=["float32", "float16", "float8_e4m3fn"])
    ap.add_argument("--layers", type=int, default=21)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    if cannot_run("bench_select_rows"):
        return 2
    copy_tbs = copy_bandwidth(args.iters)
    rows = []
    for batch, slots, next_n, dtype in itertools.product(args.batch, args.slots, args.next_n,
                                                         args.state_dtype):
        rows.append(run_case(batch, slots, next_n, dtype, args.layers, args.iters, copy_tbs))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        write_output(args.json, "--json", json.dumps(
            {"copy_tbs": copy_tbs, "device": torch.cuda.get_device_name(), "rows": rows},
            indent=2))
    print(markdown(rows, copy_tbs))
    return 0


if __name__ == "__main__":
    sys.exit(exit_code_of(main, Path(sys.argv[0]).name))
