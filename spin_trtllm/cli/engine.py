"""spin-trtllm demo, train-tiny and trace: the dsa-lite commands."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import _inputs
from .._inputs import printable
from .._outputs import write_output
from ..errors import SpinError
from ._common import DEMO_MAX_BATCH_TOKENS, TRAIN_MAX_BATCH_SEQ2, _load_config, _write_json


def cmd_demo(args: argparse.Namespace) -> int:
    from ..harness.demo import DemoOptions, run_demo, with_workload
    from ..harness.engine import resolve_device
    from ..harness.report import format_report

    cfg = _load_config(args)
    if args.sparsity is not None:
        cfg = cfg.with_overrides(target_sparsity=args.sparsity)
    elif "target_sparsity" not in cfg.model_fields_set:
        cfg = cfg.with_overrides(target_sparsity=0.5)
    device = resolve_device(args.device)
    # the workload flags left out take the device's defaults (limits.DEMO_WORKLOADS)
    work = with_workload(DemoOptions(requests=args.requests, prompt_tokens=args.prompt_tokens,
                                     new_tokens=args.new_tokens,
                                     measure_miss=args.measure_miss), device)
    # GPU-only flags are errors elsewhere, not ignored; so is replaying steps that run eagerly
    if device.type != "cuda":
        for flag, given in (("--cuda-graphs", args.cuda_graphs),
                            ("--speed-size", args.speed_size)):
            if given:
                raise SpinError(f"{flag} needs a CUDA device (this run is on {device})")
    if args.cuda_graphs and (work.measure_miss or args.dump_trace):
        raise SpinError("--cuda-graphs replays captured steps, but --measure-miss and "
                        "--dump-trace run every step eagerly: use --no-measure-miss and no "
                        "--dump-trace with it")
    tokens = args.batch * (work.prompt_tokens + work.new_tokens)
    if tokens > DEMO_MAX_BATCH_TOKENS:
        raise SpinError(f"--batch x (--prompt-tokens + --new-tokens) = {tokens:,} is over "
                        f"{DEMO_MAX_BATCH_TOKENS:,} (the caches grow with it)")
    opts = DemoOptions(device=args.device, requests=work.requests,
                       prompt_tokens=work.prompt_tokens, new_tokens=work.new_tokens,
                       max_batch=args.batch, mtp_depth=args.mtp, checkpoint=args.checkpoint,
                       random_weights=args.random_weights,
                       measure_miss=work.measure_miss, dump_trace=args.dump_trace,
                       cuda_graphs=args.cuda_graphs, progress=not args.quiet,
                       logits_backend=args.logits_backend, switch=args.switch,
                       predictor=args.predictor,
                       speed=tuple(args.speed_size) if args.speed_size else None,
                       speed_auto=not args.no_speed)
    if args.speed_size:
        batch, context = args.speed_size
        if not 1 <= batch <= 256 or not 4096 <= context <= 1 << 20:
            raise SpinError(f"--speed-size: batch must be 1..256 and context 4096..1048576 "
                            f"tokens, got {batch} {context}")
    res = run_demo(cfg, opts)
    print(format_report(res))
    _write_json(args.json, res)
    return 0


def _device(name: str):
    from ..harness.engine import resolve_device

    return resolve_device(_inputs.check_device(name))


def cmd_train_tiny(args: argparse.Namespace) -> int:
    from ..harness.config import CSA_RATIO
    from ..harness.model import save_checkpoint
    from ..harness.pretrained import model_card
    from ..harness.train import (TrainConfig, check_train_memory, stdlib_corpus,
                                 stdlib_model_config, train)

    import torch

    work = args.batch * args.seq_len ** 2
    if work > TRAIN_MAX_BATCH_SEQ2:
        raise SpinError(f"--batch x --seq-len^2 = {work:,} is over {TRAIN_MAX_BATCH_SEQ2:,} "
                        f"(4x the default 8 x 4096^2; attention memory grows with it)")
    out, card = Path(args.out), Path(args.card)     # checked with the other outputs
    device = _device(args.device)
    ratios = (1, 0, 1, 64, 1) if args.ratio == 1 else (CSA_RATIO, 0, CSA_RATIO, 64, CSA_RATIO)
    cfg = stdlib_model_config(compress_ratios=ratios,
                              max_context=max(65536, args.seq_len))
    tc = TrainConfig(seconds=args.seconds, seq_len=args.seq_len, batch=args.batch,
                     seed=args.seed)
    check_train_memory(cfg, tc, device)             # before the corpus is read
    corpus = stdlib_corpus(limit_bytes=args.limit_bytes)
    weights, report = train(cfg, tc, corpus, device, log=lambda m: print(m, file=sys.stderr),
                            progress=not args.quiet)
    command = "spin-trtllm train-tiny " + " ".join(sys.argv[2:]) if len(sys.argv) > 1 \
        else "spin-trtllm train-tiny"
    save_checkpoint(out, cfg, weights, dtype=torch.float16,
                    extra={"card": card.name, "held_out_bpb":
                           f"{report['held_out_bpb_sparse']:.4f}"})
    write_output(card, "--card", model_card(cfg, report, command))
    _write_json(args.json, report)
    print(f"wrote {printable(out)} and {printable(card)}")
    return 0


def train_tiny_outputs(args: argparse.Namespace) -> None:
    """train-tiny's default --out and --card, so every output is checked before training."""
    from ..harness.pretrained import train_outputs

    default_out, default_card = train_outputs(args.ratio, args.out)
    args.out = args.out or str(default_out)
    args.card = args.card or str(default_card)


def cmd_trace(args: argparse.Namespace) -> int:
    from ..harness.engine import Engine, Request
    from ..harness.engine.memory import check_trace_memory
    from ..harness.model import load_checkpoint
    from ..harness.pretrained import default_checkpoint
    from ..harness.train import stdlib_corpus

    if args.checkpoint and args.ratio:
        raise SpinError("--checkpoint and --ratio exclude each other (the ratio is the model's)")
    ckpt = args.checkpoint or default_checkpoint(args.ratio or 1)
    if ckpt is None:
        raise SpinError(f"no shipped checkpoint with indexer ratio {args.ratio or 1}: pass "
                        f"--checkpoint or run spin-trtllm train-tiny --ratio {args.ratio or 1}")
    device = _device(args.device)
    text = None
    if args.prompt_file is not None:
        text = _inputs.read_regular_file(args.prompt_file, f"--prompt-file {args.prompt_file}",
                                         _inputs.PROMPT_MAX_BYTES, text=False)
    cfg, weights = load_checkpoint(ckpt)
    if not args.mtp:
        cfg = cfg.with_overrides(mtp_depth=0)
    elif not cfg.mtp_depth:
        raise SpinError("--mtp: the checkpoint has no MTP head")
    if args.layers and (not all(0 <= l < len(cfg.csa_layers) for l in args.layers)
                        or len(set(args.layers)) != len(args.layers)):
        raise SpinError(f"--layers {' '.join(map(str, args.layers))}: name distinct indexer "
                        f"layers of 0..{len(cfg.csa_layers) - 1}")
    need = args.prompt_tokens + args.steps + cfg.next_n + 2
    cfg = cfg.with_overrides(max_context=need)          # caches for this run only
    check_trace_memory(cfg, args.prompt_tokens, args.steps, device)
    if text is None:
        held = stdlib_corpus().held_out
        span = args.prompt_tokens + args.steps + 1
        if held.numel() < span:
            raise SpinError(f"the held-out text ({held.numel()} bytes) is shorter than "
                            f"{span} bytes")
        start = (args.held_out * 7919 * 64) % (held.numel() - span)
        text = bytes(held[start:start + span].tolist())
    if len(text) < args.prompt_tokens:
        raise SpinError(f"prompt has {len(text)} bytes, fewer than --prompt-tokens")
    prompt, rest = text[:args.prompt_tokens], text[args.prompt_tokens:]
    forced = list(rest[:args.steps + 1]) if len(rest) > args.steps and not args.sample else None
    engine = Engine(cfg, None, weights=weights, device=device, trace_request=0)
    engine.run([Request(prompt, max_new_tokens=args.steps + 1, forced=forced,
                        temperature=0.0 if forced else 0.8, seed=args.seed or 0,
                        request_id=0)], progress=not args.quiet)
    trace = engine.trace(0)
    if args.layers:
        trace = trace.keep_layers(args.layers)
    trace.name = Path(args.out).name
    trace.save(args.out)
    print(f"wrote {printable(args.out)} (trace v{trace.version}): {trace.num_steps} steps, "
          f"{trace.num_layers} indexer layers, "
          f"next_n {trace.next_n}, {trace.max_slots} slots, compress_ratio "
          f"{trace.compress_ratio} ({'teacher-forced' if forced else 'sampled'})")
    return 0
