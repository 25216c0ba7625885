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
    k = trace.index_topk if index_topk is None else index_topk
    if k < 1:
        raise SpinError(f"index_topk must be >= 1, got {k}")
    L = trace.num_layers
    gen = torch.Generator().manual_seed(seed)
    turn_starts = trace.turn_starts()
    per = {m: {"pearson": [], "recall": []} for m in METHODS}
    prev: Optional[torch.Tensor] = None
    for t in tqdm(range(trace.num_steps), desc=f"predictors {trace.name}", disable=not progress,
                  leave=False, unit="step"):
        cur = trace.step_scores(t)[:, 0]                    # [L, W] row 0, -inf padded
        n = trace.row_len[t, :, 0].to(torch.int64)
        if t not in turn_starts and prev is not None:
            W = cur.shape[-1]
            visible = torch.arange(W) < n.unsqueeze(-1)
            proxies = {}
            rnd = torch.rand(cur.shape, generator=gen, dtype=torch.float64).float()
            proxies["random"] = rnd.masked_fill(~visible, NEG_INF)
            aligned = torch.full_like(cur, NEG_INF)
            w = min(W, prev.shape[-1])
            aligned[:, :w] = prev[:, :w]
            proxies["prev_iter"] = aligned.masked_fill(~visible, NEG_INF)
            shifted = torch.full_like(cur, NEG_INF)
            shifted[:, 1:] = aligned[:, :-1]
            proxies["prev_iter_offset1"] = shifted.masked_fill(~visible, NEG_INF)
            for name, proxy in proxies.items():
                pear, rec = _metrics(proxy, cur, n, k)
                per[name]["pearson"].append(pear)
                per[name]["recall"].append(rec)
            if L > 1:
                # proxies from layer l - d for d = 1..5, for layers l >= d
                by_dist = []
                for d in range(1, min(5, L - 1) + 1):
                    proxy = torch.full_like(cur, NEG_INF)
                    proxy[d:] = cur[:-d]
                    proxy = proxy.masked_fill(~visible, NEG_INF)
                    pear, rec = _metrics(proxy, cur, n, k)
                    has = torch.arange(L) >= d
                    by_dist.append((torch.where(has, pear, torch.nan),
                                    torch.where(has, rec, torch.nan)))
                nan = torch.full((1,), torch.nan, dtype=torch.float64)
                per["prev_layer"]["pearson"].append(torch.cat([nan, by_dist[0][0][1:]]))
                per["prev_layer"]["recall"].append(torch.cat([nan, by_dist[0][1][1:]]))
                pears = torch.stack([p for p, _ in by_dist])
                recs = torch.stack([r for _, r in by_dist])
                per["prev_layer_best5"]["pearson"].append(_nanmax(pears))
                per["prev_layer_best5"]["recall"].append(_nanmax(recs))
        prev = cur
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
