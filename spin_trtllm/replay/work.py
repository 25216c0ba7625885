"""How much work a replay is: the layer batches replay runs in, and the estimated peak host
memory and time of replay, ablate, compare-predictors and --mask-plot, from the trace's row_len,
query_pos, metadata and shapes alone (no scores are read).

Work follows the data: replay runs layers in batches (consecutive layers whose rows are about
as long; padding a batch to its longest row at most doubles its slots), a step's MTP rows pad to
the longest (at most limits.MAX_NEXT_N of them), probe temporaries come in chunks
(probe.CHUNK_VALUES), the mask plot is drawn in chunks of steps about as wide. What is left is
estimated here; a run is refused before any work above REPLAY_MAX_WORK_BYTES, or when padding
rows to whole blocks would make its work much larger than its data (PAD_FACTOR).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .._inputs import approx_size, one_line, size_text
from ..errors import SpinError

# Peak memory a run may take beside the loaded traces: half of a 16 GiB workstation. A step
# stays near BATCH_SLOTS x ~100 B; what grows with the trace is the results (32 B per row and
# sparsity: 8 GiB is 89M rows at 3 sparsities, a trace of at least 0.5 GB) and the state.
REPLAY_MAX_WORK_BYTES = 8 << 30
# Padded slots of one replay batch (sparsities x layers x rows x slots): bounds a step's
# temporaries to about 0.4-1 GiB (block_size 64..1) however many layers a trace has.
BATCH_SLOTS = 1 << 22
# A batch may pad its layers to its longest rows while that at most doubles their slots, plus
# this many slot-steps (small traces stay one batch).
BATCH_SLACK = 1 << 20


def _pad(x: torch.Tensor, block_size: int) -> torch.Tensor:
    return (x + block_size - 1) // block_size * block_size


def layer_widths(row_len: torch.Tensor) -> torch.Tensor:
    """int64 [T, L]: the longest row of each layer at each step (a step's rows pad to it)."""
    return row_len.to(torch.int64).amax(2)


def layer_batches(row_len: torch.Tensor, streams: int, block_size: int) -> list[tuple[int, int]]:
    """Consecutive layer ranges [lo, hi) that replay runs together: a batch pads every layer to
    its longest row of the step (rounded up to whole blocks), so a layer joins the batch while
    that keeps the batch's padded slot-steps within twice the layers' own (plus BATCH_SLACK) and
    one step's padded slots (x streams per layer: sparsities x rows) within BATCH_SLOTS."""
    width = _pad(layer_widths(row_len), block_size)                     # [T, L]
    T, L = width.shape
    own = width.sum(0)                                                  # [L]
    batches = []
    lo, top, own_sum = 0, width[:, 0].clone(), int(own[0])
    for layer in range(1, L):
        grown = torch.maximum(top, width[:, layer])
        size = layer - lo + 1
        if (size * int(grown.sum()) <= 2 * (own_sum + int(own[layer])) + BATCH_SLACK
                and size * streams * int(grown.max()) <= BATCH_SLOTS):
            top, own_sum = grown, own_sum + int(own[layer])
            continue
        batches.append((lo, layer))
        lo, top, own_sum = layer, width[:, layer].clone(), int(own[layer])
    batches.append((lo, L))
    return batches


# ---- the estimate -----------------------------------------------------------------------------
# Measured here (2-core x86 host shared with other jobs, torch 2.13 CPU, one thread): peak RSS
# (VmHWM) and wall time of replay over traces of 1..8 layers, 1..8 rows, 1..16 sparsities,
# 100..262,144 slots, block sizes 1..65,536, every reduction, predictor and budget. Bytes are
# the largest measured per unit with a margin; rates the slowest, so times are on the long side.
# A step of a batch: per padded slot of one stream (sparsities x layers x rows x slots), per
# block of one stream (b = 1 makes every block-level tensor slot-sized) and per slot of one
# layer (dense scores and the true top-K, shared by the sparsities).
REPLAY_BYTES_PER_SLOT = 80
REPLAY_BYTES_PER_BLOCK = 128
REPLAY_BYTES_PER_LAYER_SLOT = 64
REPLAY_SECONDS_PER_SLOT = 1.5e-7
REPLAY_SECONDS_PER_BLOCK = 5e-7
REPLAY_SECONDS_PER_LAYER_SLOT = 3e-7
REPLAY_SECONDS_PER_BATCH = 6e-3     # fixed cost of one batch of one step
RESULT_BYTES_PER_ROW = 4 * 8        # miss, random, oracle, Pearson: float64 per stream and row
ADAPTIVE_BYTES_PER_BLOCK = 96       # the adaptive budget's step, per stream and (padded) block
PROBE_SECONDS_PER_VALUE = 1.5e-8    # query-aware scores, per row, summary and (8 D + 4 H)
COMPARE_BYTES_PER_SLOT = 128        # compare-predictors: a batch's step, per row-0 slot
COMPARE_SECONDS_PER_SLOT = 4e-7
COMPARE_SECONDS_PER_BATCH = 1e-2
MASK_BYTES_PER_PIXEL = 64           # --mask-plot: drawing one chunk (matplotlib's float copies)
MASK_SECONDS_PER_PIXEL = 4e-7
MASK_SECONDS_PER_STEP = 1e-3        # the step's top-K of the shown row
BASE_BYTES = 64 << 20               # fixed: the interpreter's growth, small tensors
# Padding a replay may do beyond the scores it holds (rows padded to the step's longest row, at
# most next_n 8 of them, and to whole blocks): at most PAD_FACTOR x the scores + PAD_SLACK
# slot-steps (a block_size far above the rows would otherwise make long work of a small file).
PAD_FACTOR = 64
PAD_SLACK = 1 << 26


@dataclass
class Estimate:
    """Peak memory (bytes: BASE_BYTES + held + step) and rough time (seconds) of one run on one
    trace; held: (bytes, what) held for the whole run; step: (bytes, what) of its largest
    step."""
    run: str
    trace: str
    held: list[tuple[int, str]]
    step: tuple[int, str]
    seconds: float
    refusal: Optional[str] = None      # why it is refused whatever its memory

    @property
    def bytes(self) -> int:
        return BASE_BYTES + sum(b for b, _ in self.held) + self.step[0]

    def largest(self) -> str:
        return max(self.held + [self.step], key=lambda p: p[0])[1]

    def add(self, other: "Estimate") -> "Estimate":
        """This run, then `other` on the same trace while this one's results are held."""
        step = max(self.step, (other.step[0] + sum(b for b, _ in other.held), other.largest()),
                   key=lambda p: p[0])
        return Estimate(f"{self.run} and {other.run}", self.trace, self.held, step,
                        self.seconds + other.seconds, self.refusal or other.refusal)


def seconds_text(s: float) -> str:
    if s < 60:
        return f"{max(s, 1):.0f} s"
    return f"{s / 60:.0f} min" if s < 3600 else f"{s / 3600:.1f} h"


def require(est: Estimate, limit: Optional[int] = None) -> None:
    """SpinError (one line) when the estimate is over the limit (default
    REPLAY_MAX_WORK_BYTES) or pads too much."""
    limit = REPLAY_MAX_WORK_BYTES if limit is None else limit
    if est.refusal:
        raise SpinError(f"trace {one_line(est.trace, 300)}: {est.run}: {est.refusal}")
    if est.bytes > limit:
        raise SpinError(f"trace {one_line(est.trace, 300)}: {est.run} would need about "
                        f"{approx_size(est.bytes)} of memory, over the limit of {size_text(limit)}; "
                        f"most of it: {est.largest()}")


def summary(est: Estimate) -> str:
    """The estimate next to the limit (spin-trtllm info)."""
    over = ""
    if est.refusal or est.bytes > REPLAY_MAX_WORK_BYTES:
        over = f"; refused: {est.refusal or 'over the limit'}"
    return (f"about {approx_size(est.bytes)} of memory and {seconds_text(est.seconds)} (estimated; "
            f"limit {size_text(REPLAY_MAX_WORK_BYTES)}){over}")


def _batch_widths(row_len: torch.Tensor, batches: list[tuple[int, int]],
                  block_size: int) -> list[torch.Tensor]:
    width = _pad(layer_widths(row_len), block_size)
    return [width[:, lo:hi].amax(1) for lo, hi in batches]              # [T] each


def _state_bytes(cfg, slots: int) -> int:
    """One stream's SpinState for `slots` slots: V and D (slots, or blocks for A2) and
    last_seen (int64 per block)."""
    blocks = -(-slots // cfg.block_size)
    per = {"float32": 4, "float16": 2, "float8_e4m3fn": 1}[cfg.state_dtype]
    return 2 * per * (blocks if cfg.reduction == "A2" else slots) + 8 * blocks


def estimate_replay(trace, sparsities: int, cfg, predictor: str = "spin", summaries: int = 1,
                    budget: str = "uniform", masks: bool = False) -> Estimate:
    """replay(trace, sparsities values, cfg (the config for the trace), ...)."""
    from .. import predictors

    S, T, L, R = sparsities, trace.num_steps, trace.num_layers, trace.next_n
    b = cfg.block_size
    G = S * L
    held = [(RESULT_BYTES_PER_ROW * T * G * R,
             f"results of {T:,} steps x {S} sparsities x {L:,} layers x {R} rows")]
    batches = layer_batches(trace.row_len, S * R, b)
    widths = _batch_widths(trace.row_len, batches, b)
    need = torch.maximum(layer_widths(trace.row_len),
                         trace.query_pos.to(torch.int64).amax(1, keepdim=True) + 1)
    per_slot = (REPLAY_BYTES_PER_SLOT + REPLAY_BYTES_PER_BLOCK / b
                + REPLAY_BYTES_PER_LAYER_SLOT / S)
    per_second = (REPLAY_SECONDS_PER_SLOT + REPLAY_SECONDS_PER_BLOCK / b
                  + REPLAY_SECONDS_PER_LAYER_SLOT / S)
    state, slots = 0, 0
    step_bytes, step_what = 0, ""
    for (lo, hi), width in zip(batches, widths):
        state += S * (hi - lo) * _state_bytes(cfg, int(need[:, lo:hi].max()))
        per_step = S * (hi - lo) * R * width                            # [T] padded slots
        slots += int(per_step.sum())
        t = int(per_step.argmax())
        if int(per_step[t] * per_slot) > step_bytes:
            step_bytes = int(per_step[t] * per_slot)
            step_what = (f"step {t}: {S} sparsities x {hi - lo:,} layers x {R} rows x "
                         f"{int(width[t]):,} slots")
    held.append((state, f"the V/D state of {S} sparsities x {L:,} layers up to "
                        f"{int(need.max()):,} slots"))
    seconds = slots * per_second + T * len(batches) * REPLAY_SECONDS_PER_BATCH
    stored, padded = trace.scores.numel(), slots // S
    refusal = None
    if padded > PAD_FACTOR * stored + PAD_SLACK:
        refusal = (f"its {T * L * R:,} rows pad to {padded:,} slot-steps, {padded / stored:,.0f}x "
                   f"the {stored:,} scores it holds (rows pad to whole blocks of block_size "
                   f"{b:,} and to their step's longest row); at most {PAD_FACTOR}x plus "
                   f"{PAD_SLACK:,} (a smaller --block-size pads less)")
    if budget == "adaptive":
        nb = -(-layer_widths(trace.row_len).amax(1) // b)                 # [T] blocks
        t = int(nb.argmax())
        held.append((8 * G * -(-int(need.max()) // b),
                     f"the adaptive budget of {G:,} streams x {-(-int(need.max()) // b):,} blocks"))
        adapt = ADAPTIVE_BYTES_PER_BLOCK * G * int(nb[t])
        if adapt > step_bytes:
            step_what = f"step {t}: the adaptive budget of {G:,} streams x {int(nb[t]):,} blocks"
        step_bytes += adapt
    chosen = predictors.REGISTRY[predictor]
    if chosen.query and trace.keys is not None:
        from .probe import CHUNK_VALUES

        Lk, Sk, D = trace.keys.shape
        H = trace.q.shape[3]
        parts = summaries if chosen.sub_blocks else 1
        sub = max(1, b // parts)
        held.append((8 * Lk * Sk * D + 16 * Lk * -(-Sk // sub) * D,
                     f"the block summaries of keys {Lk:,} x {Sk:,} x {D:,}"))
        per_block = R * parts * (8 * D + 4 * H)             # probe._in_chunks' temporaries
        widest = -(-int(layer_widths(trace.row_len).max()) // b)
        step_bytes += 2 * 4 * min(CHUNK_VALUES, per_block * widest * L)
        blocks = int((-(-layer_widths(trace.row_len) // b)).sum())
        seconds += blocks * per_block * PROBE_SECONDS_PER_VALUE
    if masks:
        kept = int((-(-trace.row_len.to(torch.int64).amax((1, 2)) // b)).sum())
        held.append((S * kept + 512 * T, f"the kept masks of {T:,} steps"))
    return Estimate("replay", trace.name, held, (step_bytes, step_what), seconds, refusal)


# ---- the mask plot ----------------------------------------------------------------------------
MASK_CHUNK_PIXELS = 1 << 20     # one chunk of the canvas (drawing it: MASK_BYTES_PER_PIXEL)
MASK_SLACK = 1 << 16            # pixels a chunk may pad beyond twice its shown slots


def mask_chunks(shown: torch.Tensor) -> list[tuple[int, int, int]]:
    """(t0, t1, width) chunks of consecutive steps (shown [T]: slots shown of each step's row),
    each as wide as its widest step: a step joins the chunk while that keeps the chunk's pixels
    within twice its shown slots (plus MASK_SLACK) and within MASK_CHUNK_PIXELS."""
    widths = [max(1, int(w)) for w in shown.tolist()]
    chunks = []
    t0, top, data = 0, widths[0], widths[0]
    for t in range(1, len(widths)):
        w = widths[t]
        grown, rows = max(top, w), t - t0 + 1
        if rows * grown <= min(2 * (data + w) + MASK_SLACK, MASK_CHUNK_PIXELS):
            top, data = grown, data + w
            continue
        chunks.append((t0, t, top))
        t0, top, data = t, w, w
    chunks.append((t0, len(widths), top))
    return chunks


def estimate_compare(trace) -> Estimate:
    """compare_predictors(trace): row 0 of every layer, batched as replay batches layers."""
    T, L = trace.num_steps, trace.num_layers
    batches = layer_batches(trace.row_len, 1, 1)
    widths = _batch_widths(trace.row_len, batches, 1)
    sizes = torch.tensor([hi - lo for lo, hi in batches])
    step_slots = (torch.stack(widths, 1) * sizes).sum(1)               # [T] a step's batches
    slots, step_bytes, step_what = int(step_slots.sum()), 0, ""
    for (lo, hi), width in zip(batches, widths):
        t = int(width.argmax())
        if (hi - lo) * int(width[t]) * COMPARE_BYTES_PER_SLOT > step_bytes:
            step_bytes = (hi - lo) * int(width[t]) * COMPARE_BYTES_PER_SLOT
            step_what = f"step {t}: {hi - lo:,} layers x {int(width[t]):,} slots"
    held = [(2 * 10 * 8 * T * L, f"results of {T:,} steps x {L:,} layers"),
            (2 * 4 * int(step_slots.max()), f"two steps of row 0 of {L:,} layers")]
    seconds = (slots * COMPARE_SECONDS_PER_SLOT + T * len(batches) * COMPARE_SECONDS_PER_BATCH)
    return Estimate("compare-predictors", trace.name, held, (step_bytes, step_what), seconds)


def estimate_mask_plot(trace, layer: int, row: int = 0, max_slots: Optional[int] = None
                       ) -> Estimate:
    """plots.plot_topk_mask: the canvas chunks (uint8 RGBA) and drawing the largest one."""
    width = min(max_slots or trace.max_slots, trace.max_slots)
    shown = trace.row_len[:, layer, row].to(torch.int64).clamp(max=width)
    chunks = mask_chunks(shown)
    pixels = sum((t1 - t0) * w for t0, t1, w in chunks)
    t0, t1, w = max(chunks, key=lambda c: (c[1] - c[0]) * c[2])
    T = trace.num_steps
    return Estimate("--mask-plot", trace.name,
                    [(4 * pixels, f"the mask plot's canvas of {pixels:,} pixels "
                                  f"({T:,} steps, up to {width:,} slots)")],
                    (MASK_BYTES_PER_PIXEL * (t1 - t0) * w + 64 * int(shown.max()),
                     f"drawing steps {t0}..{t1 - 1} of the mask plot: {t1 - t0:,} x {w:,} pixels"),
                    pixels * MASK_SECONDS_PER_PIXEL + T * MASK_SECONDS_PER_STEP)
