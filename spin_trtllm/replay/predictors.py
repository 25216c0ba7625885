"""The paper's Table 1: how well simple signals predict the indexer's scores.

For every step t (not a turn start) and layer l, row 0 (the committed query), each method
builds a proxy of the true scores z_t,l over the row's visible slots:
  random             i.i.d. uniform scores (seeded)
  prev_layer         z_t,l-1 (layer 0 has none and is skipped)
  prev_layer_best5   the best of z_t,l-1 .. z_t,l-5, per metric (an oracle)
  prev_iter          z_t-1,l at the same absolute slot
  prev_iter_offset1  z_t-1,l shifted by one slot: proxy[i] = z_t-1,l[i - 1] (diagonal)
Slots a proxy has no value for (new slots, shifted-out slot 0) are excluded from Pearson and
rank last for top-K. Reported: Pearson correlation and top-K recall
|topK'(proxy) & topK'(true)| / K', averaged over (step, layer) pairs.
"""

from __future__ import annotations

import bisect
from typing import Any, Optional

import numpy as np
import torch
from tqdm import tqdm

from .evaluate import row_pearson, topk_mask
from ..errors import SpinError
from .trace import SpinTrace

METHODS = ("random", "prev_layer", "prev_layer_best5", "prev_iter", "prev_iter_offset1")
NEG_INF = float("-inf")


def _recall(proxy: torch.Tensor, true: torch.Tensor, n: torch.Tensor, k: int) -> torch.Tensor:
    """[L, W] proxy/true (-inf where undefined/invisible) -> recall per row."""
    hits = (topk_mask(proxy, n, k) & topk_mask(true, n, k)).sum(-1)
    return hits.double() / n.clamp(max=k).clamp(min=1)


def _metrics(proxy: torch.Tensor, true: torch.Tensor, n: torch.Tensor, k: int):
    defined = torch.isfinite(proxy) & torch.isfinite(true)
    return row_pearson(proxy, true, defined), _recall(proxy, true, n, k)


def compare_predictors(trace: SpinTrace, index_topk: Optional[int] = None, seed: int = 0,
                       progress: bool = False) -> dict[str, Any]:
    """Refused (SpinError) before any work when work.estimate_compare is over
    work.REPLAY_MAX_WORK_BYTES. Layers run in batches of about equal row lengths
    (work.layer_batches)."""
    from . import work

    k = trace.index_topk if index_topk is None else index_topk
    if k < 1:
        raise SpinError(f"index_topk must be >= 1, got {k}")
    work.require(work.estimate_compare(trace))
    L = trace.num_layers
    gen = torch.Generator().manual_seed(seed)
    turn_starts = trace.turn_starts()
    batches = work.layer_batches(trace.row_len, 1, 1)
    starts = [lo for lo, _ in batches]
    per = {m: {"pearson": [], "recall": []} for m in METHODS}
    prev: Optional[list[torch.Tensor]] = None
    for t in tqdm(range(trace.num_steps), desc=f"predictors {trace.name} top-{k}",
                  disable=not progress, leave=False, unit="step"):
        # row 0 of each batch of layers: [Lb, Wb] (Wb: the batch's longest row), -inf padded
        curs = [trace.step_scores(t, int(trace.row_len[t, lo:hi].max()), (lo, hi), (0, 1))[:, 0]
                for lo, hi in batches]

        def rows(lo: int, hi: int, width: int) -> torch.Tensor:
            """Row 0 of layers [lo, hi) of this step as [hi - lo, width], -inf padded."""
            out = torch.full((hi - lo, width), NEG_INF)
            i = bisect.bisect_right(starts, lo) - 1
            while i < len(batches) and batches[i][0] < hi:
                a, z = max(batches[i][0], lo), min(batches[i][1], hi)
                w = min(width, curs[i].shape[-1])
                out[a - lo:z - lo, :w] = curs[i][a - batches[i][0]:z - batches[i][0], :w]
                i += 1
            return out

        if t not in turn_starts and prev is not None:
            got = {m: (torch.full((L,), torch.nan, dtype=torch.float64),
                       torch.full((L,), torch.nan, dtype=torch.float64)) for m in METHODS}
            dists = range(1, min(5, L - 1) + 1) if L > 1 else range(0)
            by_dist = {d: (torch.full((L,), torch.nan, dtype=torch.float64),
                           torch.full((L,), torch.nan, dtype=torch.float64)) for d in dists}
            for (lo, hi), cur, before in zip(batches, curs, prev):
                n = trace.row_len[t, lo:hi, 0].to(torch.int64)
                W = cur.shape[-1]
                visible = torch.arange(W) < n.unsqueeze(-1)
                proxies = {}
                rnd = torch.rand(cur.shape, generator=gen, dtype=torch.float64).float()
                proxies["random"] = rnd.masked_fill(~visible, NEG_INF)
                aligned = torch.full_like(cur, NEG_INF)
                w = min(W, before.shape[-1])
                aligned[:, :w] = before[:, :w]
                proxies["prev_iter"] = aligned.masked_fill(~visible, NEG_INF)
                shifted = torch.full_like(cur, NEG_INF)
                shifted[:, 1:] = aligned[:, :-1]
                proxies["prev_iter_offset1"] = shifted.masked_fill(~visible, NEG_INF)
                del rnd, aligned, shifted
                for name, proxy in proxies.items():
                    pear, rec = _metrics(proxy, cur, n, k)
                    got[name][0][lo:hi], got[name][1][lo:hi] = pear, rec
                del proxies
                # proxies from layer l - d for d = 1..5, for layers l >= d
                for d in dists:
                    proxy = torch.full_like(cur, NEG_INF)
                    first = max(lo, d)
                    if first < hi:
                        proxy[first - lo:] = rows(first - d, hi - d, W)
                    proxy = proxy.masked_fill(~visible, NEG_INF)
                    pear, rec = _metrics(proxy, cur, n, k)
                    has = torch.arange(lo, hi) >= d
                    by_dist[d][0][lo:hi] = torch.where(has, pear, torch.nan)
                    by_dist[d][1][lo:hi] = torch.where(has, rec, torch.nan)
            for name in ("random", "prev_iter", "prev_iter_offset1"):
                per[name]["pearson"].append(got[name][0])
                per[name]["recall"].append(got[name][1])
            if L > 1:
                nan = torch.full((1,), torch.nan, dtype=torch.float64)
                per["prev_layer"]["pearson"].append(torch.cat([nan, by_dist[1][0][1:]]))
                per["prev_layer"]["recall"].append(torch.cat([nan, by_dist[1][1][1:]]))
                pears = torch.stack([p for p, _ in by_dist.values()])
                recs = torch.stack([r for _, r in by_dist.values()])
                per["prev_layer_best5"]["pearson"].append(_nanmax(pears))
                per["prev_layer_best5"]["recall"].append(_nanmax(recs))
        prev = curs
    out: dict[str, Any] = {"trace": trace.name, "index_topk": k, "methods": {}}
    for name in METHODS:
        entry = {}
        for metric in ("pearson", "recall"):
            vals = per[name][metric]
            arr = torch.stack(vals).numpy() if vals else np.zeros((0, L))
            flat = arr[np.isfinite(arr)]
            entry[metric] = float(flat.mean()) if flat.size else None
            entry[f"{metric}_per_layer"] = [
                float(np.nanmean(arr[:, l])) if np.isfinite(arr[:, l]).any() else None
                for l in range(L)] if arr.size else [None] * L
        entry["pairs"] = int(np.isfinite(torch.stack(per[name]["recall"]).numpy()).sum()) \
            if per[name]["recall"] else 0
        out["methods"][name] = entry
    return out


def _nanmax(x: torch.Tensor) -> torch.Tensor:
    """Max over dim 0 ignoring NaN; NaN where all are NaN."""
    filled = torch.where(torch.isnan(x), -torch.inf, x)
    best = filled.amax(0)
    return torch.where(torch.isinf(best) & (best < 0), torch.nan, best)
