"""Plots: miss vs sparsity against the random and oracle references, and a Figure-1-style
top-K mask over a window of decode steps and slots. The *_figure functions return the
matplotlib Figure; the plot_* functions write it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

import numpy as np
import torch

from .._inputs import one_line
from .._outputs import write_output
from ..errors import SpinError
from ..limits import MASK_SLOTS, MASK_STEPS
from .trace import SpinTrace


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


DPI = 120                 # the figures' resolution, on screen and in the file


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    fmt = path.suffix[1:].lower() or "png"
    try:
        write_output(path, "plot", writer=lambda tmp: fig.savefig(
            tmp, format=fmt, dpi=DPI, bbox_inches="tight"))
    except ValueError as err:            # matplotlib: an unknown format (SpinError passes)
        if isinstance(err, SpinError):
            raise
        raise SpinError(f"plot {one_line(path, 300)}: cannot write ({one_line(err, 200)})") \
            from None
    finally:
        _pyplot().close(fig)
    return path


# The miss plot: one panel per statistic; result keys f"{stat}_miss", f"{ref}_{stat}_miss"
MISS_PANELS = (("mean", "mean miss"), ("p99", "p99 miss"))
# reference selections on the same rows with the same block budget (evaluate.py's docstring)
REFERENCES = {"random": ("--", "tab:gray", "random: blocks drawn uniformly"),
              "oracle": (":", "black", "oracle: the blocks holding the most top-K slots")}
# reference curves of several variants closer than this everywhere (percentage points: a few
# pixels) are one line: variants with one budget differ by a few rows' rounding at most
REF_SAME_PP = 0.5
# x axis of the miss plot: the result key and the axis label
SPARSITY_AXES = {
    "realized": ("realized_sparsity", "realized block sparsity (% of visible blocks skipped)"),
    "effective": ("effective_sparsity",
                  "effective sparsity (% of dense indexer bytes not read, summary rows counted)"),
}


def miss_curve_axis(results: Sequence[dict[str, Any]]) -> str:
    """'effective' where the results compare predictors or a predictor reads summary rows (its
    bytes are part of the cost, so realized sparsity would flatter it), else 'realized'."""
    predictors = {r.get("predictor", "spin") for r in results}
    reads = any((r.get("probe_bytes_fraction") or 0) > 0 for r in results)
    known = any(r.get("effective_sparsity") is not None for r in results)
    return "effective" if known and (len(predictors) > 1 or reads) else "realized"


def _percent_axes(ax) -> None:
    """Both axes in %, from 0 (after the lines: the top keeps matplotlib's autoscale)."""
    from matplotlib.ticker import PercentFormatter

    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(PercentFormatter(100))
    ax.set_xlim(0, max(ax.get_xlim()[1], 1.0))
    ax.set_ylim(0, max(ax.get_ylim()[1], 1.0))


def _curve(rows: Sequence[dict[str, Any]], x_key: str, y_key: str
           ) -> tuple[list[float], list[float]]:
    """(x %, y %) of the rows that have both, by x."""
    pts = sorted((100.0 * r[x_key], 100.0 * r[y_key]) for r in rows
                 if r.get(x_key) is not None and r.get(y_key) is not None)
    return [p[0] for p in pts], [p[1] for p in pts]


def _merge_curves(curves: dict[str, tuple[list[float], list[float]]]
                  ) -> list[tuple[list[str], list[float], list[float]]]:
    """Reference curves of variants with one budget, drawn once: (names, x, y) per curve that
    stays within REF_SAME_PP of an earlier one at every point (the earlier one is drawn)."""
    merged: list[tuple[list[str], list[float], list[float]]] = []
    for name, (xs, ys) in curves.items():
        for names, mx, my in merged:
            if len(mx) == len(xs) and np.allclose(mx, xs, rtol=0, atol=REF_SAME_PP) \
                    and np.allclose(my, ys, rtol=0, atol=REF_SAME_PP):
                names.append(name)
                break
        else:
            merged.append(([name], xs, ys))
    return merged


def _names(names: Sequence[str], groups: dict[str, Any]) -> str:
    """A reference line's variants, short enough for a legend."""
    others = [g for g in groups if g not in names]
    if len(names) <= 2:
        return ", ".join(names)
    if len(others) <= 2:
        return "all but " + ", ".join(others)
    return f"{names[0]} and {len(names) - 1} more"


def miss_curve_figure(results: Sequence[dict[str, Any]], x: Optional[str] = None):
    """The miss plot as a matplotlib Figure: mean and p99 miss (% of the top-K slots) against
    sparsity (%), one line per (trace, variant), with the random and oracle references the
    results carry. x: 'realized' or 'effective' sparsity (default miss_curve_axis)."""
    x = x or miss_curve_axis(results)
    if x not in SPARSITY_AXES:
        raise SpinError(f"miss plot x axis {x!r}: choose one of {', '.join(SPARSITY_AXES)}")
    x_key, x_label = SPARSITY_AXES[x]
    traces = list(dict.fromkeys(r["trace"] for r in results))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        name = r.get("variant") or r.get("predictor", "spin")
        groups.setdefault(name if len(traces) == 1 else f"{r['trace']} [{name}]", []).append(r)
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), dpi=DPI, sharex=True)
    for ax, (stat, title) in zip(axes, MISS_PANELS):
        colors = {}
        for name, rows in groups.items():
            xs, ys = _curve(rows, x_key, f"{stat}_miss")
            if xs:
                (line,) = ax.plot(xs, ys, marker="o", label=name)
                colors[name] = line.get_color()
        for ref, (style, color, _) in REFERENCES.items():
            curves = {name: _curve(rows, x_key, f"{ref}_{stat}_miss")
                      for name, rows in groups.items()}
            merged = _merge_curves({name: c for name, c in curves.items() if c[0]})
            for names, xs, ys in merged:
                ax.plot(xs, ys, linestyle=style,
                        color=colors.get(names[0], color) if len(names) == 1 else color,
                        label=ref if len(merged) == 1 else f"{ref} ({_names(names, groups)})")
        ax.set_xlabel(x_label, fontsize=8)
        ax.set_ylabel(f"{title} (% of top-K slots)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        _percent_axes(ax)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no eligible rows", ha="center", va="center",
                    transform=ax.transAxes)
    head = f"{traces[0]}: " if len(traces) == 1 else ""
    fig.suptitle(f"{head}miss vs {x} sparsity", fontsize=10)
    fig.text(0.01, -0.02, "; ".join(note for _, _, note in REFERENCES.values())
             + "; both on the same rows with the same block budget", fontsize=7)
    fig.tight_layout()
    return fig


def plot_miss_curve(results: Sequence[dict[str, Any]], path: str | Path,
                    x: Optional[str] = None) -> Path:
    """miss_curve_figure written to `path`."""
    return _save(miss_curve_figure(results, x), path)



def mask_window(trace: SpinTrace, layer: int = 0, row: int = 0,
                max_slots: Optional[int] = MASK_SLOTS, max_steps: Optional[int] = MASK_STEPS
                ) -> tuple[int, int, int, int]:
    """The mask plot's window (t0, t1, lo, width): steps [t0, t1) are the last max_steps
    steps, slots [lo, lo + width) the newest max_slots slots those steps' rows see (None: all
    steps, all slots)."""
    if not 0 <= layer < trace.num_layers:
        raise SpinError(f"layer {layer} is outside [0, {trace.num_layers})")
    if not 0 <= row < trace.next_n:
        raise SpinError(f"row {row} is outside [0, {trace.next_n})")
    for what, value in (("slots", max_slots), ("steps", max_steps)):
        if value is not None and value < 1:
            raise SpinError(f"{what} to show must be >= 1, got {value}")
    T = trace.num_steps
    t0 = max(0, T - max_steps) if max_steps is not None else 0
    longest = max(1, int(trace.row_len[t0:, layer, row].max()))
    width = min(max_slots or longest, longest)
    return t0, T, longest - width, width


def _mask_row(trace: SpinTrace, t: int, layer: int, row: int, k: int, lo: int, width: int
              ) -> np.ndarray:
    """bool [visible slots of lo..lo + width - 1]: step t's true top-K among the row's slots."""
    from .evaluate import topk_mask

    z = trace.step_scores(t, layers=(layer, layer + 1), rows=(row, row + 1))[0, 0]
    top = topk_mask(z, trace.row_len[t, layer, row], k)
    return top[lo:lo + width].numpy()


def topk_mask_image(trace: SpinTrace, layer: int, row: int = 0,
                    max_slots: Optional[int] = MASK_SLOTS,
                    index_topk: Optional[int] = None,
                    max_steps: Optional[int] = MASK_STEPS) -> np.ndarray:
    """int8 [t1 - t0, width] over mask_window: 1 = slot in step t's true top-K of `layer`
    (Figure 1 of the paper), 0 = not, -1 = not visible yet."""
    t0, t1, lo, width = mask_window(trace, layer, row, max_slots, max_steps)
    k = index_topk or trace.index_topk
    img = np.full((t1 - t0, width), -1, dtype=np.int8)
    for t in range(t0, t1):
        top = _mask_row(trace, t, layer, row, k, lo, width)
        img[t - t0, :top.size] = top
    return img


Selected = Union[torch.Tensor, Sequence[torch.Tensor]]   # bool [T, NB], or T bool [NB_t]
# uint8 RGBA of the mask plot's slots, and what each means (the colour key)
WHITE = (255, 255, 255, 255)        # not visible yet
VISIBLE = (230, 230, 230, 255)      # visible, not top-K (no selection given)
KEPT = (190, 228, 183, 255)         # selected, not top-K
SKIPPED = (210, 210, 240, 255)      # visible, not selected
TOP = (26, 26, 26, 255)             # top-K (and selected, with a selection)
MISSED = (217, 26, 26, 255)         # top-K, not selected: a miss
MASK_KEY = {"top": (TOP, "top-K slot"), "visible": (VISIBLE, "visible slot, not top-K"),
            "white": (WHITE, "not visible yet")}


def mask_key_selected(selector: str = "SPIN") -> dict[str, tuple[tuple[int, ...], str]]:
    """The mask plot's colours with a selection, named after what selected the blocks."""
    return {"top": (TOP, f"top-K slot {selector} selected"),
            "missed": (MISSED, f"top-K slot {selector} skipped (a miss)"),
            "kept": (KEPT, f"{selector} selected, not top-K"),
            "skipped": (SKIPPED, f"{selector} skipped, not top-K"),
            "white": (WHITE, "not visible yet")}


def topk_mask_chunks(trace: SpinTrace, layer: int = 0, row: int = 0,
                     max_slots: Optional[int] = MASK_SLOTS, selected: Optional[Selected] = None,
                     block_size: Optional[int] = None, index_topk: Optional[int] = None,
                     max_steps: Optional[int] = MASK_STEPS
                     ) -> Iterator[tuple[int, int, np.ndarray]]:
    """The mask plot's canvas over mask_window in chunks of steps (work.mask_chunks: each chunk
    as wide as its longest row in the window, so the canvas follows the data): (t0, t1, uint8
    RGBA [t1 - t0, width, 4]), column c = slot lo + c. selected: SPIN's blocks per step (all
    T steps), bool [T, NB] or a list of T bool [NB_t] (replay's "masks"); colours MASK_KEY, or
    mask_key_selected() with a selection."""
    from .work import mask_chunks

    w0, w1, lo, width = mask_window(trace, layer, row, max_slots, max_steps)
    k = index_topk or trace.index_topk
    b = block_size or trace.block_size
    shown = (trace.row_len[w0:w1, layer, row].to(torch.int64) - lo).clamp(0, width)
    colors = {name: np.array(c, dtype=np.uint8) for name, c in (
        ("white", WHITE), ("visible", VISIBLE), ("kept", KEPT), ("skipped", SKIPPED),
        ("top", TOP), ("missed", MISSED))}
    for c0, c1, chunk_width in mask_chunks(shown):
        canvas = np.empty((c1 - c0, chunk_width, 4), dtype=np.uint8)
        canvas[:] = colors["white"]
        for t in range(w0 + c0, w0 + c1):
            top = _mask_row(trace, t, layer, row, k, lo, width)
            line = canvas[t - w0 - c0, :top.size]
            if selected is not None:
                blocks = np.asarray(selected[t], dtype=bool)
                ids = (lo + np.arange(top.size)) // b
                kept = np.zeros(top.size, dtype=bool)
                inside = ids < blocks.size
                kept[inside] = blocks[ids[inside]]
                line[kept] = colors["kept"]
                line[~kept] = colors["skipped"]
                line[top] = colors["top"]
                line[top & ~kept] = colors["missed"]
            else:
                line[:] = colors["visible"]
                line[top] = colors["top"]
        yield w0 + c0, w0 + c1, canvas


def topk_mask_figure(trace: SpinTrace, layer: int = 0, row: int = 0,
                     max_slots: Optional[int] = MASK_SLOTS, selected: Optional[Selected] = None,
                     block_size: Optional[int] = None, index_topk: Optional[int] = None,
                     max_steps: Optional[int] = MASK_STEPS, sparsity: Optional[float] = None,
                     progress: bool = False, selector: str = "SPIN"):
    """The mask plot as a matplotlib Figure: each step's true top-K over mask_window, with a
    colour key; with `selected` (the blocks of `block_size` slots per step that `selector`
    chose: bool [T, NB] or a list of T bool [NB_t]; `sparsity` only names it in the title),
    which slots it selected and the top-K slots it skipped. Drawn in chunks of steps
    (topk_mask_chunks)."""
    from matplotlib.patches import Patch
    from tqdm import tqdm

    t0, t1, lo, width = mask_window(trace, layer, row, max_slots, max_steps)
    k = index_topk or trace.index_topk
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 6), dpi=DPI)
    with tqdm(total=t1 - t0, desc=f"mask plot {trace.name} layer {layer}", unit="step",
              disable=not progress, leave=False) as bar:
        for c0, c1, canvas in topk_mask_chunks(trace, layer, row, max_slots, selected,
                                               block_size, index_topk, max_steps):
            ax.imshow(canvas, aspect="auto", interpolation="nearest",
                      extent=(lo - 0.5, lo + canvas.shape[1] - 0.5, c1 - 0.5, c0 - 0.5))
            bar.update(c1 - c0)
    ax.set_xlim(lo - 0.5, lo + width - 0.5)
    ax.set_ylim(t1 - 0.5, t0 - 0.5)
    ax.set_xlabel(f"KV slot (the newest {width:,} of {lo + width:,})")
    ax.set_ylabel(f"decode step (the last {t1 - t0:,} of {trace.num_steps:,})")
    title = f"{trace.name}: layer {layer}, row {row}: true top-{k} per decode step"
    if selected is not None:
        title += f", {selector}'s blocks of {block_size or trace.block_size} slots"
        if sparsity is not None:
            title += f" at target sparsity {100 * sparsity:g}%"
    ax.set_title(title, fontsize=9)
    key = mask_key_selected(selector) if selected is not None else MASK_KEY
    ax.legend(handles=[Patch(facecolor=np.array(c) / 255, edgecolor="0.4", label=label)
                       for c, label in key.values()],
              loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3, fontsize=8,
              frameon=False)
    return fig


def plot_topk_mask(trace: SpinTrace, path: str | Path, layer: int = 0, row: int = 0,
                   max_slots: Optional[int] = MASK_SLOTS, selected: Optional[Selected] = None,
                   block_size: Optional[int] = None, index_topk: Optional[int] = None,
                   max_steps: Optional[int] = MASK_STEPS, sparsity: Optional[float] = None,
                   progress: bool = False, selector: str = "SPIN") -> Path:
    """topk_mask_figure written to `path`."""
    return _save(topk_mask_figure(trace, layer, row, max_slots, selected, block_size,
                                  index_topk, max_steps, sparsity, progress, selector), path)
