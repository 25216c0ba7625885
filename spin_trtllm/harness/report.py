"""The demo's report: what ran, the GPU step timing (where this run measured one), the indexer
bytes per decode step (SPIN against all-keep), a table of both engines, token agreement and
both engines' continuations of one prompt, the GPU speed quoted from benchmarks/RESULTS.md
where this run measured none, and the notes."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from .._inputs import printable
from ..limits import BLOCK_SLOTS, SLOT_BYTES
from ..predictors import REGISTRY

WIDTH = 96                       # notes wrap here
SAMPLE_CHARS = 80                # characters of each continuation shown (escaped)
PROMPT_CHARS = 56                # characters of the prompt's end shown (escaped)


@dataclass(frozen=True)
class QuotedResult:
    """A GPU result of benchmarks/RESULTS.md, quoted where a run measured none."""
    machine: str
    date: str
    commits: str
    where: str
    shape: str
    all_keep_ms: float
    spin_ms: float
    suite: str


# benchmarks/RESULTS.md: its Machine paragraph, section 1's 512K x 96 next_n 1 row (commit
# 7d35e92) and its next_n 1 suite (commit 7683c64). Update with that file; a test checks that
# the figures are still there.
GPU_RESULT = QuotedResult(machine="one NVIDIA H200, CUDA 13.0, torch 2.11", date="2026-12-03",
                          commits="7d35e92, 7683c64", where="benchmarks/RESULTS.md, section 1",
                          shape="512K tokens x 96 requests", all_keep_ms=32.00, spin_ms=27.17,
                          suite="1.011x to 1.176x")


def quoted_lines(q: QuotedResult = GPU_RESULT) -> list[str]:
    """The GPU speed where this run measured none, labelled with where it was measured."""
    return _wrap(f"GPU speed, measured on {q.machine}, {q.date} ({q.where}; commits "
                 f"{q.commits}): dsa-lite decode step at {q.shape}, GPU time all-keep "
                 f"{q.all_keep_ms:.2f} ms, SPIN at target sparsity 0.5 {q.spin_ms:.2f} ms = "
                 f"{q.all_keep_ms / q.spin_ms:.2f}x; over the 8 cases of the next_n 1 suite "
                 f"(128K-512K tokens x 32-96 requests, sparsity 0.3 and 0.5) {q.suite}, "
                 f"never slower", indent="", hang="  ")


def speed_lines(sp: dict[str, Any]) -> list[str]:
    """The GPU report's first lines: step times where the indexer matters, and what they give
    a serving user (tokens per step from the batch and the accepted drafts, wall time)."""
    d, s = sp["dense"], sp["spin"]
    head = _wrap(f"decode step, {sp['batch']} requests x {sp['context_tokens']:,} tokens of "
                 f"context ({sp['context_tokens'] // 4:,} indexer slots), V4-Flash-shaped indexer "
                 f"(21 layers, K 512), synthetic caches, CUDA graphs, medians of {d['steps']} "
                 f"steps:", indent="")

    def tokens(r):                 # each request: one token and its accepted drafts per step
        return sp["batch"] * (1 + r["accepted_per_step"])

    rows = [("GPU time per step, ms", f"{s['forward_ms']:.2f}", f"{d['forward_ms']:.2f}"),
            ("  of it the indexer, ms", f"{s['indexer_ms']:.2f}", f"{d['indexer_ms']:.2f}"),
            ("wall time per step, ms", f"{s['step_ms']:.2f}", f"{d['step_ms']:.2f}"),
            ("tokens per step", f"{tokens(s):.1f}", f"{tokens(d):.1f}"),
            ("decode tokens/s (wall)", f"{1e3 * tokens(s) / s['step_ms']:,.0f}",
             f"{1e3 * tokens(d) / d['step_ms']:,.0f}"),
            ("time per output token, ms (wall)",
             f"{s['step_ms'] / (1 + s['accepted_per_step']):.2f}",
             f"{d['step_ms'] / (1 + d['accepted_per_step']):.2f}"),
            ("realized block sparsity", f"{s['realized_sparsity']:.1%}", "0.0%"),
            ("steps SPIN ran", f"{s['spin_steps']}/{s['steps']}", "-")]
    out = head + ["  " + ln for ln in table(("", f"SPIN ({sp['switch']})", "all-keep"), rows)]
    if d["indexer_ms"] > 0:
        out.append(f"  all-keep step / SPIN step: {d['forward_ms'] / s['forward_ms']:.2f}x; SPIN's "
                   f"indexer takes {s['indexer_ms'] / d['indexer_ms']:.2f}x the all-keep indexer's "
                   f"time")
    out += _wrap("(auto runs the all-keep indexer on steps where spin_trtllm.costs predicts "
                 "SPIN would not pay. The run below serves real text with the shipped model "
                 "and SPIN on every step; its short contexts are not where SPIN saves time)")
    return out


def _name(predictor: str) -> str:
    return "SPIN" if predictor == "spin" else predictor


def bytes_line(res: dict[str, Any]) -> str:
    """The indexer's memory traffic per decode step, SPIN against all-keep (counted from the
    blocks each engine scored: the same on any hardware, see indexer_bytes)."""
    s, d = res["spin"], res["all_keep"]
    if s["indexer_mb_per_step"] is None or d["indexer_mb_per_step"] is None:
        return "indexer bytes read+written per decode step: - (no decode steps)"
    ratio = s["indexer_mb_per_step"] / d["indexer_mb_per_step"]
    return (f"indexer bytes read+written per decode step (mean): "
            f"{_name(res.get('predictor', 'spin'))} {s['indexer_mb_per_step']:.3f} MB vs "
            f"all-keep {d['indexer_mb_per_step']:.3f} MB = {ratio:.2f}x")


def bytes_note(res: dict[str, Any]) -> list[str]:
    """Under bytes_line: the SPIN side's parts and what is counted."""
    s, cfg = res["spin"], res["spin_config"]
    if s["indexer_mb_per_step"] is None:
        return []
    predictor = res.get("predictor", "spin")
    query, merges = REGISTRY[predictor].query, REGISTRY[predictor].merges
    parts = (f"{_name(predictor)}: K cache{' + summaries' if query else ''} "
             f"{s['kcache_mb_per_step']:.3f} MB + state {s['state_mb_per_step']:.3f} MB; "
             f"counted from the blocks each engine's indexer scored in this run, the same on any "
             f"hardware: K cache {BLOCK_SLOTS} x {SLOT_BYTES} B per scored block")
    if query and not merges:
        return _wrap(f"({parts} and {REGISTRY[predictor].summary_bytes} bytes of summary rows "
                     f"per visible block, which {_name(predictor)} reads; no V/D state: update "
                     f"writes each scored block's int64 last step)")
    if query:
        return _wrap(f"({parts} and {REGISTRY[predictor].summary_bytes} bytes of summary rows "
                     f"per visible block, which {_name(predictor)} reads; the "
                     f"{cfg['state_dtype']} V/D state read and written by update over the "
                     f"scored slots and by select over the visible slots)")
    return _wrap(f"({parts}; SPIN's {cfg['state_dtype']} V/D state read by select over the "
                 f"visible slots, read and written by update over the scored slots)")


def table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    """Label column left-aligned, value columns right-aligned, each as wide as its widest
    cell, two spaces apart: every row's columns start and end at the same offsets."""
    cols = list(zip(header, *rows))
    widths = [max(len(c) for c in col) for col in cols]
    return [(r[0].ljust(widths[0]) + "".join(f"  {c:>{w}}" for c, w in zip(r[1:], widths[1:])))
            for r in [header, *rows]]


def _wrap(note: str, indent: str = "  ", hang: Optional[str] = None) -> list[str]:
    """A note under the report, wrapped to WIDTH columns, continuation lines indented."""
    return textwrap.wrap(note, WIDTH, initial_indent=indent,
                         subsequent_indent=indent + "  " if hang is None else hang,
                         break_on_hyphens=False)


def escaped(tokens: Sequence[int], limit: int, tail: bool = False) -> str:
    """Byte tokens as one printable line: UTF-8 where it decodes, other bytes as \\xNN,
    controls, backslashes and double quotes escaped; at most `limit` characters, whole
    escapes only (the last ones with `tail`)."""
    text = bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", "surrogateescape")
    pieces = []
    for c in text:
        if "\udc80" <= c <= "\udcff":                     # a byte that is not UTF-8
            pieces.append(f"\\x{ord(c) - 0xdc00:02x}")
        elif c in '\\"':
            pieces.append("\\" + c)
        else:
            pieces.append(printable(c))
    shown, n = [], 0
    for piece in (reversed(pieces) if tail else pieces):
        if n + len(piece) > limit:
            break
        shown.append(piece)
        n += len(piece)
    return "".join(reversed(shown) if tail else shown)


def sample_lines(res: dict[str, Any]) -> list[str]:
    """The first request's prompt end and each engine's continuation, one line each."""
    sm = res.get("sample")
    if not sm:
        return []
    a, b = sm["spin"], sm["all_keep"]
    same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    agree = "identical" if a == b else f"the first {same} tokens agree"
    name = _name(res.get("predictor", "spin"))
    return [f"request {sm['request']}, greedy continuations (escaped; {agree}):",
            f"  {'prompt':<9} ...\"{escaped(sm['prompt_tail'], PROMPT_CHARS, tail=True)}\"",
            f"  {name:<9} \"{escaped(a, SAMPLE_CHARS)}\"",
            f"  {'all-keep':<9} \"{escaped(b, SAMPLE_CHARS)}\""]


def workload_line(res: dict[str, Any]) -> list[str]:
    """What the two engines served."""
    w = res.get("workload")
    if not w:
        return []
    p, new, turns = w["prompt_tokens"], w["new_tokens"], w["turns"]
    multi = sum(t > 1 for t in turns)
    span = (lambda v, unit: f"{min(v):,}-{max(v):,} {unit}" if min(v) != max(v)
            else f"{v[0]:,} {unit}")
    sp = res["spin_config"]["target_sparsity"]
    return _wrap(f"served: {len(p)} requests, prompts of {span(p, 'tokens')}"
                 f"{f', {multi} with a second turn' if multi else ''}, {span(new, 'new tokens')} "
                 f"a turn, up to {w['max_batch']} decoding together, staggered arrivals, greedy; "
                 f"by {_name(res.get('predictor', 'spin'))} at target sparsity {sp:.2f} and by "
                 f"the all-keep indexer", indent="", hang="  ")


def skipped_nothing_lines(res: dict[str, Any]) -> list[str]:
    """Why the SPIN column equals all-keep's, where it does: the switch never ran SPIN, or SPIN
    ran but its budget kept every block (contexts too short for the budget floor)."""
    s, k = res["spin"], res["model"]["index_topk"]
    if s["decode_steps"] and s.get("spin_steps") == 0:
        if res.get("switch") == "dense":
            return ["(--switch dense: the SPIN engine ran all-keep at every step)"]
        return _wrap("(the switch ran all-keep at every step: at this batch and context the cost "
                     "model finds that SPIN would not pay; --switch spin runs it anyway)",
                     indent="")
    if s["realized_sparsity"] == 0:
        return _wrap(f"(SPIN skipped no block: its budget keeps at least K = {k} slots a request, "
                     f"about all these contexts hold; longer --prompt-tokens let it skip)",
                     indent="")
    return []


def format_report(res: dict[str, Any]) -> str:
    m, s, d = res["model"], res["spin"], res["all_keep"]
    ratios = m["compress_ratios"]
    indexed = ratios.count(4) + ratios.count(1)
    kind = "CSA" if 4 in ratios else "DSA"
    layout = f"{len(ratios)} layers ({indexed} {kind} with a 64x128 indexer, " \
             f"{sum(1 for r in ratios if r > 4)} HCA, {ratios.count(0)} window-only)"
    cpu = not res["device"].startswith("cuda")
    predictor = res.get("predictor", "spin")
    name = _name(predictor)

    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    pct = "{:.1%}"
    rows = [("decode steps", f(s["decode_steps"], "{}"), f(d["decode_steps"], "{}"))]
    if not cpu:
        rows.append(("mean batch (requests per step)", f(s["mean_batch"]), f(d["mean_batch"])))
    rows.append(("tokens per decode step (all requests)*", f(s["tokens_per_step"]),
                 f(d["tokens_per_step"])))
    if not cpu:
        rows.append(("decode step, median ms", f(s["step_ms_median"]), f(d["step_ms_median"])))
        if s["indexer_ms_median"] is not None:         # eager steps only
            rows.append(("  of it the indexer, median ms", f(s["indexer_ms_median"]),
                         f(d["indexer_ms_median"])))
        rows += [("decode tokens/s**", f(s["tokens_per_s"], "{:,.0f}"),
                  f(d["tokens_per_s"], "{:,.0f}")),
                 ("time per output token, ms**", f(s["tpot_ms"]), f(d["tpot_ms"])),
                 ("time to first token, ms**", f(s["ttft_ms"], "{:.1f}"),
                  f(d["ttft_ms"], "{:.1f}"))]
    rows.append(("realized block sparsity", f(s["realized_sparsity"], pct), "0.0%"))
    if s["mean_miss"] is not None:
        rows.append(("mean miss (p99)",
                     f"{f(s['mean_miss'], pct)} ({f(s['p99_miss'], pct)})", "0.0%"))
    if m["mtp_depth"]:
        rows.append(("MTP draft acceptance", f(s["mtp_acceptance"], pct),
                     f(d["mtp_acceptance"], pct)))
    sp = res["spin_config"]["target_sparsity"]
    lines = [*_wrap(f"dsa-lite on {res['device_name']}: {layout}, K={m['index_topk']}, "
                    f"next_n={m['mtp_depth'] + 1}, {m['dtype']}; weights: "
                    f"{printable(Path(res['weights']).name)}; logits: {res['logits_backend']}",
                    indent="", hang="  "),
             *(speed_lines(res["speed"]) if res.get("speed") else []),
             *workload_line(res),
             *_wrap(bytes_line(res), indent="", hang="  "),
             *bytes_note(res)]
    lines += table(("", f"{name} @ {sp:.2f}", "all-keep"), rows)
    lines.append(f"token agreement with all-keep: {f(res['token_agreement'], pct)} of tokens, "
                 f"{res['identical_requests']}/{res['requests']} requests identical")
    lines += skipped_nothing_lines(res)
    lines += sample_lines(res)
    if not res.get("speed"):
        lines += quoted_lines()
    lines += _wrap("* tokens the decode steps emitted, all requests together (each turn's first "
                   "token comes from its prefill); with next_n 1 this is the mean batch size, "
                   "with MTP it includes the accepted drafts", indent="")
    if not cpu:
        lines += _wrap("** from the rows above: decode tokens/s = tokens per decode step / "
                       "median step; time per output token = median step x mean batch / tokens "
                       "per decode step; time to first token = prefill time per prompt or turn "
                       "(mean, no queueing)", indent="")
        if not s["cuda_graphs"]:
            lines += _wrap("(eager steps with CUDA-event timing of the indexer; --cuda-graphs "
                           "times graph replays without the indexer split)", indent="")
    if s["mean_miss"] is not None:
        # no random reference here: the realized sparsity counts warm-up rows the miss leaves
        # out, so it would understate what random blocks miss
        lines += _wrap(f"(miss: the share of the dense top-K's slots in blocks {name} skipped, "
                       f"over the rows where it skipped any, as in replay; "
                       f"benchmarks/QUALITY.md sets it against random blocks and the oracle"
                       f"{'; step times exclude the shadow dense indexer' if not cpu else ''})",
                       indent="")
    else:
        lines.append("(miss against a shadow dense indexer: --measure-miss)")
    if cpu:
        lines += _wrap("(CPU: step and prefill times are in --json only; they time plain-PyTorch "
                       "reference ops at short contexts, which is not what SPIN speeds up)",
                       indent="")
    if res["trace"]:
        lines.append(f"trace of request 0 written to {printable(res['trace'])}")
    return "\n".join(lines)
