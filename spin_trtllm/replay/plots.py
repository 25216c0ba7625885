"""Plots: miss vs realized sparsity, and a Figure-1-style top-K mask over decode steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..errors import SpinError
from .trace import SpinTrace


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    try:
        fig.savefig(path, dpi=120, bbox_inches="tight")
    except (OSError, ValueError) as err:
        raise SpinError(f"plot {path}: cannot write ({err})") from None
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
                    max_slots: Optional[int] = None) -> np.ndarray:
    """bool [T, W]: slot i is in step t's true top-K of `layer` (Figure 1 of the paper)."""
    if not 0 <= layer < trace.num_layers:
        raise SpinError(f"layer {layer} is outside [0, {trace.num_layers})")
    if not 0 <= row < trace.next_n:
        raise SpinError(f"row {row} is outside [0, {trace.next_n})")
    width = max_slots or trace.max_slots
    img = np.zeros((trace.num_steps, width), dtype=bool)
    for t in range(trace.num_steps):
        z = trace.step_scores(t)[layer, row]
        k = min(trace.index_topk, int(trace.row_len[t, layer, row]))
        idx = z.topk(k).indices
        idx = idx[idx < width]
        img[t, idx.numpy()] = True
    return img


def plot_topk_mask(trace: SpinTrace, path: str | Path, layer: int = 0, row: int = 0,
                   max_slots: Optional[int] = None,
                   selected: Optional[torch.Tensor] = None) -> Path:
    """Top-K mask image; with `selected` (bool [T, NB] SPIN blocks), skipped blocks are shaded."""
    plt = _pyplot()
    img = topk_mask_image(trace, layer, row, max_slots)
    T, W = img.shape
    canvas = np.ones((T, W, 3))
    if selected is not None:
        blocks = selected.numpy().astype(bool)
        slot_sel = np.repeat(blocks, trace.block_size, axis=1)[:, :W]
        if slot_sel.shape[1] < W:
            slot_sel = np.pad(slot_sel, ((0, 0), (0, W - slot_sel.shape[1])))
        canvas[~slot_sel] = (0.85, 0.85, 0.95)
    canvas[img] = (0.1, 0.1, 0.1)
    if selected is not None:
        canvas[img & ~slot_sel] = (0.85, 0.1, 0.1)
    fig, ax = plt.subplots(figsize=(10, 6))
    ax.imshow(canvas, aspect="auto", interpolation="nearest")
    ax.set_xlabel("KV slot")
    ax.set_ylabel("decode step")
    title = f"{trace.name}: layer {layer} top-{trace.index_topk}"
    if selected is not None:
        title += " (shaded: skipped blocks, red: missed top-K slots)"
    ax.set_title(title, fontsize=9)
    return _save(fig, path)
