"""Plots: miss vs realized sparsity, and a Figure-1-style top-K mask over decode steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from .._inputs import one_line
from .._outputs import write_output
from ..errors import SpinError
from .trace import SpinTrace


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    fmt = path.suffix[1:].lower() or "png"
    try:
        write_output(path, "plot", writer=lambda tmp: fig.savefig(
            tmp, format=fmt, dpi=120, bbox_inches="tight"))
    except ValueError as err:            # matplotlib: an unknown format (SpinError passes)
        if isinstance(err, SpinError):
            raise
        raise SpinError(f"plot {one_line(path, 300)}: cannot write ({one_line(err, 200)})") \
            from None
    finally:
        _pyplot().close(fig)
    return path


def plot_miss_curve(results: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Mean and p99 miss against realized sparsity, one line per (trace, variant)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharex=True)
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        key = r["trace"] + (f" [{r['variant']}]" if "variant" in r else "")
        groups.setdefault(key, []).append(r)
    for key, rows in groups.items():
        rows = [r for r in rows if r["realized_sparsity"] is not None and r["mean_miss"] is not None]
        rows.sort(key=lambda r: r["realized_sparsity"])
        x = [r["realized_sparsity"] for r in rows]
        axes[0].plot(x, [r["mean_miss"] for r in rows], marker="o", label=key)
        axes[1].plot(x, [r["p99_miss"] for r in rows], marker="o", label=key)
    for ax, title in zip(axes, ("mean miss", "p99 miss")):
        ax.set_xlabel("realized block sparsity")
        ax.set_ylabel(title)
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper left")
    return _save(fig, path)


def topk_mask_image(trace: SpinTrace, layer: int, row: int = 0,
                    max_slots: Optional[int] = None,
                    index_topk: Optional[int] = None) -> np.ndarray:
    """int8 [T, W]: 1 = slot in step t's true top-K of `layer` (Figure 1 of the paper),
    0 = not, -1 = not visible yet."""
    from .evaluate import topk_mask

    if not 0 <= layer < trace.num_layers:
        raise SpinError(f"layer {layer} is outside [0, {trace.num_layers})")
    if not 0 <= row < trace.next_n:
        raise SpinError(f"row {row} is outside [0, {trace.next_n})")
    if max_slots is not None and max_slots < 1:
        raise SpinError(f"slots to show must be >= 1, got {max_slots}")
    k = index_topk or trace.index_topk
    width = min(max_slots or trace.max_slots, trace.max_slots)
    img = np.full((trace.num_steps, width), -1, dtype=np.int8)
    for t in range(trace.num_steps):
        n = trace.row_len[t, layer, row]
        top = topk_mask(trace.step_scores(t)[layer, row], n, k)
        shown = min(int(n), width)
        img[t, :shown] = top[:shown].numpy()
    return img


def plot_topk_mask(trace: SpinTrace, path: str | Path, layer: int = 0, row: int = 0,
                   max_slots: Optional[int] = None, selected: Optional[torch.Tensor] = None,
                   block_size: Optional[int] = None, index_topk: Optional[int] = None) -> Path:
    """Top-K mask image; with `selected` (bool [T, NB] SPIN blocks of `block_size` slots),
    skipped blocks are shaded and missed top-K slots drawn red. Invisible slots stay white."""
    plt = _pyplot()
    img = topk_mask_image(trace, layer, row, max_slots, index_topk)
    T, W = img.shape
    b = block_size or trace.block_size
    canvas = np.ones((T, W, 3))
    top = img == 1
    if selected is not None:
        slot_sel = np.repeat(selected.numpy().astype(bool), b, axis=1)[:, :W]
        if slot_sel.shape[1] < W:
            slot_sel = np.pad(slot_sel, ((0, 0), (0, W - slot_sel.shape[1])))
        canvas[(img >= 0) & ~slot_sel] = (0.85, 0.85, 0.95)
    canvas[top] = (0.1, 0.1, 0.1)
    if selected is not None:
        canvas[top & ~slot_sel] = (0.85, 0.1, 0.1)
    fig, ax = plt.subplots(figsize=(10, 6))
    ax.imshow(canvas, aspect="auto", interpolation="nearest")
    ax.set_xlabel("KV slot")
    ax.set_ylabel("decode step")
    title = f"{trace.name}: layer {layer} top-{index_topk or trace.index_topk}"
    if selected is not None:
        title += " (shaded: skipped blocks, red: missed top-K slots)"
    ax.set_title(title, fontsize=9)
    return _save(fig, path)
