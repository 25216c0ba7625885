"""dsa-lite decode-step time with SPIN vs the all-keep indexer (CUDA graphs on).

Each case fills B requests with `context` tokens of random cache contents (no prefill: step
times do not depend on the values), then times decode steps after warm-up:
  step ms      wall time of Engine.step() (host scheduling, verification and drafting included)
  forward ms   GPU time of the captured step (select + all layers), CUDA events
  indexer ms   forward ms minus the same step with a no-op indexer (fixed top-K ids)
Usage (GPU): python benchmarks/bench_dsa_lite.py [--contexts 131072 524288] [--batches 32 96]
             [--sparsity 0.3 0.4 0.5] [--mtp 0 3] [--json F] [--markdown F]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time

import torch

from spin_trtllm import SpinConfig
from spin_trtllm.harness import Engine, init_weights, v4_flash_indexer


class NullIndexer:
    """Fixed top-K ids, no work: the rest of the step."""

    def __init__(self, rows: int, k: int, layers: int, device):
        self.top = torch.arange(k, dtype=torch.int32, device=device).repeat(layers, rows, 1)
        self.batch, self.next_n = 0, 1

    def prepare(self, request_ids, context_lens, *args):
        self.batch, self.next_n = len(request_ids), context_lens.shape[1]

    def select(self):
        pass

    def layer(self, layer, q, w, kv):
        return self.top[layer, :self.batch * self.next_n]

    def finish(self, accepted=None):
        pass


def run_case(cfg, weights, mode, context, batch, warmup, steps, state_dtype="float16",
             backend="native"):
    spin = None if mode in ("dense", "null") else SpinConfig(
        index_topk=cfg.index_topk, target_sparsity=float(mode), state_dtype=state_dtype)
    engine = Engine(cfg, spin, weights=weights, device="cuda", max_batch=batch, cuda_graphs=True,
                    logits_backend=backend)
    if mode == "null":
        engine.indexer = NullIndexer(batch * cfg.next_n, cfg.index_topk, len(cfg.csa_layers),
                                     engine.device)
    for i in range(batch):
        engine.add_synthetic(i, context, max_new_tokens=(warmup + steps) * cfg.next_n, seed=i)
    torch.cuda.synchronize()
    for _ in range(warmup + steps):
        engine.step()
    hist = engine.history[warmup:]
    sel = sum(s.selected_blocks for s in hist)
    vis = sum(s.visible_blocks for s in hist)
    out = {"mode": mode, "backend": backend, "context_tokens": context, "indexer_slots": context // 4, "batch": batch,
           "next_n": cfg.next_n, "steps": len(hist),
           "step_ms": 1e3 * statistics.median(s.seconds for s in hist),
           "forward_ms": 1e3 * statistics.median(s.forward_seconds for s in hist),
           "realized_sparsity": (1 - sel / vis) if vis else 0.0,
           "accepted_per_step": sum(s.accepted for s in hist) / max(1, sum(s.batch for s in hist)),
           "cache_gb": engine.caches.nbytes() / 1e9,
           "state_gb": engine.pool.nbytes() / 1e9 if engine.pool is not None else 0.0}
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return out


def backends_here() -> list[str]:
    """native always; deepgemm (what TensorRT-LLM runs) when deep_gemm imports."""
    from spin_trtllm import logits
    ok, why = logits.available("deepgemm", "cuda")
    if not ok:
        print(f"bench_dsa_lite: no DeepGEMM column ({why})", flush=True)
    return ["native"] + (["deepgemm"] if ok else [])


def label(r) -> str:
    name = "all-keep" if r["mode"] == "dense" else f"SPIN {r['mode']}"
    return f"{name} ({r['backend']})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[131072, 524288])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 96])
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.3, 0.4, 0.5])
    ap.add_argument("--mtp", type=int, nargs="+", default=[0, 3])
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--state-dtype", choices=["float16", "float32"], default="float16")
    ap.add_argument("--backends", nargs="+", choices=["native", "deepgemm"],
                    help="logits backends to run (default: native, and deepgemm if it imports)")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_dsa_lite: needs a CUDA GPU", file=sys.stderr)
        return 2
    backends = args.backends or backends_here()
    rows = []
    jf = open(args.json, "w") if args.json else None
    for mtp in args.mtp:
        for context in args.contexts:
            max_new = (args.warmup + args.steps) * (mtp + 1)
            cfg = v4_flash_indexer(mtp_depth=mtp, max_context=context + max_new + mtp + 8)
            weights = init_weights(cfg)
            for batch in args.batches:
                null = None
                dense: dict[str, dict] = {}
                # DeepGEMM's SM90 kernel takes next_n <= 2: the backend runs wider MTP one row
                # per request, which is no dense baseline
                usable = [b for b in backends if b == "native" or mtp + 1 <= 2]
                modes = [("null", "native")] + [("dense", b) for b in usable] + \
                    [(str(s), b) for s in args.sparsity for b in usable]
                for mode, backend in modes:
                    t0 = time.time()
                    r = run_case(cfg, weights, mode, context, batch, args.warmup, args.steps,
                                 args.state_dtype, backend)
                    if mode == "null":
                        null = r
                    r["indexer_ms"] = r["forward_ms"] - null["forward_ms"]
                    if mode == "dense":
                        dense[backend] = r
                    best = min(dense.values(), key=lambda d: d["forward_ms"]) if dense else None
                    if best is not None and mode != "null":
                        r["vs_best_dense"] = label(best)
                        r["step_speedup"] = best["step_ms"] / r["step_ms"]
                        r["forward_speedup"] = best["forward_ms"] / r["forward_ms"]
                        r["indexer_vs_dense"] = r["indexer_ms"] / best["indexer_ms"] \
                            if best["indexer_ms"] > 0 else None
                    r["indexer_share"] = r["indexer_ms"] / r["forward_ms"]
                    r["state_dtype"] = args.state_dtype
                    rows.append(r)
                    if jf:
                        jf.write(json.dumps(r) + "\n")
                        jf.flush()
                    print(f"ctx {context:>7} B {batch:>3} next_n {mtp + 1} {label(r):>22}: step "
                          f"{r['step_ms']:8.2f} ms  forward {r['forward_ms']:8.2f} ms  indexer "
                          f"{r['indexer_ms']:8.2f} ms ({r['indexer_share']:.0%})  sparsity "
                          f"{r['realized_sparsity']:.3f}  x{r.get('forward_speedup', 1):.3f}  "
                          f"[{time.time() - t0:.0f} s]", flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(f"GPU: {torch.cuda.get_device_name()}; SPIN state {args.state_dtype}; "
                    f"speedups against the fastest all-keep of the same case\n\n")
            f.write("| context tokens (slots) | batch | next_n | indexer | step ms | forward ms | "
                    "indexer ms | indexer share | realized sparsity | step speedup | forward "
                    "speedup |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
            for r in rows:
                if r["mode"] == "null":
                    continue
                f.write(f"| {r['context_tokens']} ({r['indexer_slots']}) | {r['batch']} | "
                        f"{r['next_n']} | {label(r)} | {r['step_ms']:.2f} | {r['forward_ms']:.2f} | "
                        f"{r['indexer_ms']:.2f} | {r['indexer_share']:.1%} | "
                        f"{r['realized_sparsity']:.3f} | {r.get('step_speedup', 1):.3f} | "
                        f"{r.get('forward_speedup', 1):.3f} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
