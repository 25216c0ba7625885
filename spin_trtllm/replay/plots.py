"""Plots: miss vs realized sparsity, and a Figure-1-style top-K mask over decode steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

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


def _check_mask_args(trace: SpinTrace, layer: int, row: int, max_slots: Optional[int]) -> int:
    """The image width: max_slots (default all), at most the trace's longest row."""
    if not 0 <= layer < trace.num_layers:
        raise SpinError(f"layer {layer} is outside [0, {trace.num_layers})")
    if not 0 <= row < trace.next_n:
        raise SpinError(f"row {row} is outside [0, {trace.next_n})")
    if max_slots is not None and max_slots < 1:
        raise SpinError(f"slots to show must be >= 1, got {max_slots}")
    return min(max_slots or trace.max_slots, trace.max_slots)


def _mask_row(trace: SpinTrace, t: int, layer: int, row: int, k: int, width: int) -> np.ndarray:
    """bool [min(n, width)]: the true top-K of step t's row among its n visible slots."""
    from .evaluate import topk_mask

    z = trace.step_scores(t, layers=(layer, layer + 1), rows=(row, row + 1))[0, 0]
    top = topk_mask(z, trace.row_len[t, layer, row], k)
    return top[:width].numpy()


def topk_mask_image(trace: SpinTrace, layer: int, row: int = 0,
                    max_slots: Optional[int] = None,
                    index_topk: Optional[int] = None) -> np.ndarray:
    """int8 [T, W]: 1 = slot in step t's true top-K of `layer` (Figure 1 of the paper),
    0 = not, -1 = not visible yet."""
    width = _check_mask_args(trace, layer, row, max_slots)
    k = index_topk or trace.index_topk
    img = np.full((trace.num_steps, width), -1, dtype=np.int8)
    for t in range(trace.num_steps):
        top = _mask_row(trace, t, layer, row, k, width)
        img[t, :top.size] = top
    return img


Selected = Union[torch.Tensor, Sequence[torch.Tensor]]   # bool [T, NB], or T bool [NB_t]
# uint8 RGBA of the mask plot: not visible, visible but skipped, true top-K, missed top-K
WHITE = (255, 255, 255, 255)
SKIPPED = (217, 217, 242, 255)
TOP = (26, 26, 26, 255)
MISSED = (217, 26, 26, 255)


def topk_mask_chunks(trace: SpinTrace, layer: int = 0, row: int = 0,
                     max_slots: Optional[int] = None, selected: Optional[Selected] = None,
                     block_size: Optional[int] = None, index_topk: Optional[int] = None
                     ) -> Iterator[tuple[int, int, np.ndarray]]:
    """The mask plot's canvas in chunks of steps (work.mask_chunks: each chunk as wide as its
    longest row, so the canvas follows the data): (t0, t1, uint8 RGBA [t1 - t0, width, 4]).
    selected: SPIN's blocks per step, bool [T, NB] or a list of T bool [NB_t] (replay's
    "masks"); skipped visible slots are shaded and missed top-K slots red."""
    from .work import mask_chunks

    width = _check_mask_args(trace, layer, row, max_slots)
    k = index_topk or trace.index_topk
    b = block_size or trace.block_size
    shown = trace.row_len[:, layer, row].to(torch.int64).clamp(max=width)
    colors = {name: np.array(c, dtype=np.uint8) for name, c in (
        ("white", WHITE), ("skipped", SKIPPED), ("top", TOP), ("missed", MISSED))}
    for t0, t1, chunk_width in mask_chunks(shown):
        canvas = np.empty((t1 - t0, chunk_width, 4), dtype=np.uint8)
        canvas[:] = colors["white"]
        for t in range(t0, t1):
            top = _mask_row(trace, t, layer, row, k, width)
            line = canvas[t - t0, :top.size]
            if selected is not None:
                blocks = np.asarray(selected[t], dtype=bool)
                ids = np.arange(top.size) // b
                kept = np.zeros(top.size, dtype=bool)
                inside = ids < blocks.size
                kept[inside] = blocks[ids[inside]]
                line[~kept] = colors["skipped"]
                line[top] = colors["top"]
                line[top & ~kept] = colors["missed"]
            else:
                line[top] = colors["top"]
        yield t0, t1, canvas


def plot_topk_mask(trace: SpinTrace, path: str | Path, layer: int = 0, row: int = 0,
                   max_slots: Optional[int] = None, selected: Optional[Selected] = None,
                   block_size: Optional[int] = None, index_topk: Optional[int] = None) -> Path:
    """Top-K mask image; with `selected` (SPIN's blocks of `block_size` slots per step: bool
    [T, NB] or a list of T bool [NB_t]), skipped blocks are shaded and missed top-K slots
    drawn red. Invisible slots stay white. Drawn in chunks of steps (topk_mask_chunks)."""
    plt = _pyplot()
    width = _check_mask_args(trace, layer, row, max_slots)
    fig, ax = plt.subplots(figsize=(10, 6))
    for t0, t1, canvas in topk_mask_chunks(trace, layer, row, max_slots, selected, block_size,
                                           index_topk):
        ax.imshow(canvas, aspect="auto", interpolation="nearest",
                  extent=(-0.5, canvas.shape[1] - 0.5, t1 - 0.5, t0 - 0.5))
    ax.set_xlim(-0.5, width - 0.5)
    ax.set_ylim(trace.num_steps - 0.5, -0.5)
    ax.set_xlabel("KV slot")
    ax.set_ylabel("decode step")
    title = f"{trace.name}: layer {layer} top-{index_topk or trace.index_topk}"
    if selected is not None:
        title += " (shaded: skipped blocks, red: missed top-K slots)"
    ax.set_title(title, fontsize=9)
    return _save(fig, path)
