"""Replay SPIN over a trace of dense indexer scores and measure what its block masks miss.

Metric definitions (docs/algorithm.md repeats them):
- warm-up steps score everything and are not counted;
- eligible row = a non-warm-up row where m_t < B_t, and (with MTP) a committed row r <= a;
- miss = |true top-K' slots outside the selected blocks| / K', K' = min(K, N_t); the true
  top-K' is torch.topk of the row's dense scores;
- mean miss and p99 miss over eligible rows (p99 = numpy.percentile, linear);
- realized sparsity = 1 - sum(selected blocks) / sum(B_t) over all non-warm-up rows (every
  MTP row, since the indexer scores every row; a row counts the union blocks it can see);
- top-K recall = 1 - mean miss; Pearson correlation of predicted vs true slot scores over
  each eligible row's visible slots, averaged over rows (A2 predicts blocks: no Pearson);
- references on the same eligible rows with the same budget (the m_r selected blocks row r
  can see): random = the expected miss of m_r blocks drawn uniformly from the row's B_r
  visible blocks, 1 - m_r / B_r (the floor); oracle = the miss of the m_r blocks that hold
  the most true top-K' slots (the best any block selection can do: the limit);
- bytes (over the same rows as realized sparsity): dense = 132 B per visible slot;
  scored = 132 B per visible slot of the blocks the row scores; predictor = 132 B per
  summary row read (spin 0, probe/hybrid c per visible block, quest 2: probe.py);
  probe_bytes_fraction = predictor / dense, effective_sparsity = 1 - (scored + predictor) /
  dense (compare predictors at equal effective sparsity: at_effective interpolates).
All target sparsities of one call replay together as a batch of independent streams.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch
from tqdm import tqdm

from ..config import SpinConfig
from .. import predictors
from ..errors import SpinError
from ..reference import SpinState, block_count, decode_step, hybrid_scores, predict_blocks
from ..predictors import BUDGETS
from .probe import AdaptiveBudget, QueryProbe, require_query_data, rows_read_per_block
from .trace import SpinTrace


def config_for_trace(trace: SpinTrace, cfg: Optional[SpinConfig]) -> SpinConfig:
    """K and block size from the trace's metadata unless the config set them explicitly."""
    cfg = cfg or SpinConfig()
    explicit = cfg.model_fields_set
    return cfg.with_overrides(
        index_topk=None if "index_topk" in explicit else trace.index_topk,
        block_size=None if "block_size" in explicit else trace.block_size)


def check_sparsities(sparsities: Sequence[float]) -> list[float]:
    out = []
    for s in sparsities:
        if not (0.0 <= float(s) < 1.0):
            raise SpinError(f"target sparsity {s}: must satisfy 0 <= x < 1")
        out.append(float(s))
    if not out:
        raise SpinError("give at least one target sparsity")
    return out


def topk_mask(scores: torch.Tensor, n: torch.Tensor, k: int) -> torch.Tensor:
    """bool [..., W]: the top-K' (K' = min(k, n)) of each row's first n entries; ties at the
    K'-th value go to the lower slot id, so the set does not depend on the top-k kernel."""
    width = scores.shape[-1]
    k_row = n.to(torch.int64).clamp(max=k).unsqueeze(-1)
    visible = torch.arange(width, device=scores.device) < n.unsqueeze(-1)
    scores = scores.masked_fill(~visible, float("-inf"))
    top = scores.topk(min(k, width), dim=-1).values
    kth = top.gather(-1, (k_row - 1).clamp(min=0))
    greater = (scores > kth) & visible
    ties = (scores == kth) & visible
    need = k_row - greater.sum(-1, keepdim=True)
    return greater | (ties & (ties.cumsum(-1) <= need))


def row_pearson(pred: torch.Tensor, true: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Pearson correlation per row over visible entries; NaN where a side is constant.

    Values stay fp32 and are centred by the row mean before the fp64 sums."""
    f64 = torch.float64
    zero = torch.zeros((), dtype=torch.float32, device=pred.device)
    cnt = visible.sum(-1, keepdim=True).clamp(min=1)
    p = torch.where(visible, pred.float(), zero)
    t = torch.where(visible, true.float(), zero)
    p = torch.where(visible, p - (p.sum(-1, keepdim=True, dtype=f64) / cnt).float(), zero)
    t = torch.where(visible, t - (t.sum(-1, keepdim=True, dtype=f64) / cnt).float(), zero)
    cov = (p * t).sum(-1, dtype=f64)
    den = torch.sqrt((p * p).sum(-1, dtype=f64) * (t * t).sum(-1, dtype=f64))
    return torch.where(den > 0, cov / torch.where(den > 0, den, 1.0), torch.nan)


def _summary(miss: np.ndarray, pearson: np.ndarray, selected: float, total: float,
             rows: int, random_miss: Optional[np.ndarray] = None,
             oracle_miss: Optional[np.ndarray] = None,
             slot_bytes: Optional[tuple[float, float, float]] = None) -> dict[str, Any]:
    """slot_bytes: (dense, scored, predictor) slots read over the counted rows."""
    eligible = int(miss.size)
    mean = float(miss.mean()) if eligible else None
    finite_p = pearson[np.isfinite(pearson)]
    refs = {}
    for name, arr in (("random", random_miss), ("oracle", oracle_miss)):
        if arr is not None:
            refs[f"{name}_mean_miss"] = float(arr.mean()) if arr.size else None
            refs[f"{name}_p99_miss"] = float(np.percentile(arr, 99, method="linear")) \
                if arr.size else None
    if slot_bytes is not None:
        dense_s, scored_s, probe_s = slot_bytes
        refs["probe_bytes_fraction"] = probe_s / dense_s if dense_s else None
        refs["effective_sparsity"] = 1.0 - (scored_s + probe_s) / dense_s if dense_s else None
    return {
        "realized_sparsity": (1.0 - selected / total) if total else None,
        "mean_miss": mean,
        "p99_miss": float(np.percentile(miss, 99, method="linear")) if eligible else None,
        "recall": (1.0 - mean) if eligible else None,
        "pearson": float(finite_p.mean()) if finite_p.size else None,
        "eligible_rows": eligible,
        "rows": rows,
        **refs,
    }


def replay(trace: SpinTrace, sparsities: Sequence[float], cfg: Optional[SpinConfig] = None,
           progress: bool = False, pearson: bool = True, label: Optional[str] = None,
           keep_masks_for_layer: Optional[int] = None,
           desc: Optional[str] = None, predictor: str = "spin", budget: str = "uniform",
           summaries: int = 1) -> list[dict[str, Any]]:
    """Replay SPIN at each target sparsity; one result dict per sparsity. desc: the progress
    bar's label (default "replay TRACE").

    predictor: spin (V/D history), or probe / hybrid / quest / gauss (need a trace v2: q, w, keys;
    spin_trtllm.replay.probe), which only change the block scores selection ranks by;
    summaries: summary keys per block of probe/hybrid. budget: uniform (m from the target
    sparsity in every layer) or adaptive (probe.AdaptiveBudget: the same total per step,
    spread over layers)."""
    cfg = config_for_trace(trace, cfg)
    sparsities = check_sparsities(sparsities)
    if predictor not in predictors.REPLAY_PREDICTORS:
        raise SpinError(f"predictor {predictor!r}: choose one of "
                        f"{', '.join(predictors.REPLAY_PREDICTORS)}")
    chosen = predictors.REGISTRY[predictor]
    if budget not in BUDGETS:
        raise SpinError(f"budget {budget!r}: choose one of {', '.join(BUDGETS)}")
    require_query_data(trace, predictor)
    budget_mode = budget
    custom = chosen.query or budget != "uniform"
    if custom and cfg.reduction == "A0":
        raise SpinError(f"--predictor {predictor} --budget {budget}: reduction A0 selects "
                        f"slots from SPIN's slot predictions; use A1 or A2")
    probe = QueryProbe(trace, predictor, cfg.block_size, summaries) \
        if chosen.query else None
    rows_per_block = rows_read_per_block(predictor, summaries)
    S, T, L, R = len(sparsities), trace.num_steps, trace.num_layers, trace.next_n
    G = S * L
    b, K = cfg.block_size, cfg.index_topk
    capacity = max(trace.max_slots, int(trace.query_pos.max()) + 1)
    state = SpinState.zeros(G, capacity, cfg)
    target_sparsity = torch.tensor(sparsities, dtype=torch.float64).repeat_interleave(L)
    layer_ids = torch.arange(L).repeat(S)
    request_ids = torch.zeros(G, dtype=torch.int64)
    turn_starts = trace.turn_starts()
    accepted = trace.accepted_or_zero().to(torch.int64)

    miss_rows: list[torch.Tensor] = []      # per step: miss [G, R] (nan where not eligible)
    random_rows: list[torch.Tensor] = []    # the references, same rows and budgets
    oracle_rows: list[torch.Tensor] = []
    pearson_rows: list[torch.Tensor] = []
    sel_blocks = torch.zeros(G, dtype=torch.float64)
    tot_blocks = torch.zeros(G, dtype=torch.float64)
    counted_rows = torch.zeros(G, dtype=torch.int64)
    masks = [] if keep_masks_for_layer is not None else None
    if masks is not None and not 0 <= keep_masks_for_layer < L:
        raise SpinError(f"layer {keep_masks_for_layer} is outside [0, {L})")
    max_blocks = -(-capacity // b)
    adaptive = AdaptiveBudget(S, L, cfg, max_blocks) if budget == "adaptive" else None
    dense_slots = torch.zeros(G, dtype=torch.float64)      # bytes in slots of 132 B
    scored_slots = torch.zeros(G, dtype=torch.float64)
    probe_slots = torch.zeros(G, dtype=torch.float64)

    for t in tqdm(range(T), desc=desc or f"replay {trace.name}", disable=not progress,
                  leave=False, unit="step"):
        if t in turn_starts:
            state.reset(step=t)
        dense = trace.step_scores(t)                                   # [L, R, W]
        width = dense.shape[-1]
        n = trace.row_len[t].to(torch.int64).repeat(S, 1)              # [G, R]
        q = trace.query_pos[t].to(torch.int64).expand(G, R)
        step = torch.full((G,), t, dtype=torch.int64)
        acc = accepted[t].expand(G)
        dense_g = dense.repeat(S, 1, 1)
        if not custom:
            sel, slot_pred = decode_step(state, cfg, dense_g, n, q, acc, target_sparsity,
                                         request_ids, layer_ids, step)
        else:
            nb_w = -(-width // b)
            blocks = slot_pred = None
            if chosen.history:
                blocks, slot_pred = predict_blocks(state, n, q, cfg, width)
            if probe is not None:
                pb = probe.scores(t, trace.row_len[t], nb_w).repeat(S, 1, 1)
                blocks = hybrid_scores(pb, blocks, block_count(n, b)) \
                    if chosen.merges else pb
                slot_pred = None
            sparsity_t = target_sparsity
            if adaptive is not None:
                sparsity_t, _ = adaptive.allocate(blocks, block_count(n[:, 0], b),
                                                  target_sparsity, n[:, 0])
            sel, _ = decode_step(state, cfg, dense_g, n, q, acc, sparsity_t, request_ids,
                                 layer_ids, step, block_scores=blocks)

        # miss against the true top-K' (computed once per layer, shared by all sparsities)
        true_top = topk_mask(dense, trace.row_len[t], K)                   # [L, R, W]
        k_row = true_top.sum(-1)                                           # K' per row
        kk = min(K, width)
        idx = true_top.to(torch.float32).topk(kk, dim=-1).indices          # K' set ids first
        valid_k = torch.arange(kk) < k_row.unsqueeze(-1)
        idx, valid_k, k_row = idx.repeat(S, 1, 1), valid_k.repeat(S, 1, 1), k_row.repeat(S, 1)
        hit = sel.mask.gather(1, (idx // b).flatten(1)).view_as(idx)
        miss = (valid_k & ~hit).sum(-1).double() / k_row.clamp(min=1)
        committed = torch.arange(R) <= acc[:, None]
        eligible = sel.eligible & committed
        miss_rows.append(torch.where(eligible, miss, torch.nan))
        # references: the budget m_r is the selected blocks row r can see
        row_valid = torch.arange(sel.mask.shape[-1]) < sel.n_blocks.unsqueeze(-1)
        budget = (sel.mask.unsqueeze(1) & row_valid).sum(-1)               # [G, R]
        blocks_r = sel.n_blocks.clamp(min=1).double()
        random_rows.append(torch.where(eligible, 1.0 - budget.double() / blocks_r, torch.nan))
        nb = -(-width // b)
        per_block = torch.nn.functional.pad(true_top, (0, nb * b - width)).view(
            L, R, nb, b).sum(-1).repeat(S, 1, 1)                           # [G, R, nb]
        best = per_block.sort(-1, descending=True).values.cumsum(-1)
        covered = torch.where(budget > 0, best.gather(
            -1, (budget - 1).clamp(min=0, max=nb - 1).unsqueeze(-1)).squeeze(-1), 0)
        oracle = 1.0 - covered.double() / k_row.clamp(min=1)
        oracle_rows.append(torch.where(eligible, oracle, torch.nan))
        if adaptive is not None:
            adaptive.observe(per_block[:, 0], k_row[:, 0], ~sel.dense)
        if pearson and slot_pred is not None:
            visible = torch.arange(width) < n.unsqueeze(-1)
            pr = row_pearson(slot_pred, dense_g, visible)
            pearson_rows.append(torch.where(eligible, pr, torch.nan))

        # realized sparsity: every row of non-warm-up streams, union blocks each row can see
        live = ~sel.dense
        seen = budget
        sel_blocks += torch.where(live, seen.sum(-1).double(), 0.0)
        tot_blocks += torch.where(live, sel.n_blocks.sum(-1).double(), 0.0)
        counted_rows += torch.where(live, R, 0)
        nb_sel = sel.mask.shape[-1]
        in_block = (n.unsqueeze(-1) - torch.arange(nb_sel) * b).clamp(0, b)   # [G, R, NB]
        scored = (in_block * sel.mask.unsqueeze(1)).sum((-1, -2)).double()
        dense_slots += torch.where(live, n.sum(-1).double(), 0.0)
        scored_slots += torch.where(live, scored, 0.0)
        probe_slots += torch.where(live, rows_per_block * sel.n_blocks.sum(-1).double(), 0.0)
        if masks is not None:
            kept = sel.mask.view(S, L, -1)[:, keep_masks_for_layer]
            masks.append(torch.nn.functional.pad(kept, (0, max_blocks - kept.shape[-1])))

    miss_all = torch.stack(miss_rows).view(T, S, L, R).numpy()
    random_all = torch.stack(random_rows).view(T, S, L, R).numpy()
    oracle_all = torch.stack(oracle_rows).view(T, S, L, R).numpy()
    pear_all = (torch.stack(pearson_rows).view(T, S, L, R).numpy() if pearson_rows
                else np.full((T, S, L, R), np.nan))
    sel_sl = sel_blocks.view(S, L).numpy()
    tot_sl = tot_blocks.view(S, L).numpy()
    rows_sl = counted_rows.view(S, L).numpy()
    bytes_sl = torch.stack([dense_slots, scored_slots, probe_slots], -1).view(S, L, 3).numpy()
    base = cfg.model_dump()
    base.pop("target_sparsity")
    results = []
    for s, rho_s in enumerate(sparsities):
        m = miss_all[:, s]
        p = pear_all[:, s]
        rnd, orc = random_all[:, s], oracle_all[:, s]
        entry = {"trace": trace.name, "target_sparsity": rho_s}
        if label is not None:
            entry["variant"] = label
        entry["predictor"], entry["budget"] = predictor, budget_mode
        if chosen.mean_keys:
            entry["summaries"] = summaries
        ok = np.isfinite(m)
        entry.update(_summary(m[ok], p[ok], sel_sl[s].sum(), tot_sl[s].sum(),
                              int(rows_sl[s].sum()), rnd[ok], orc[ok],
                              tuple(bytes_sl[s].sum(0))))
        entry["steps"], entry["layers"], entry["next_n"] = T, L, R
        entry["config"] = base
        entry["per_layer"] = []
        for layer in range(L):
            ml, pl = m[:, layer], p[:, layer]
            okl = np.isfinite(ml)
            per = {"layer": layer}
            per.update(_summary(ml[okl], pl[okl], sel_sl[s, layer], tot_sl[s, layer],
                                int(rows_sl[s, layer]), rnd[:, layer][okl],
                                orc[:, layer][okl], tuple(bytes_sl[s, layer])))
            entry["per_layer"].append(per)
        if masks is not None:
            entry["masks"] = torch.stack([mk[s] for mk in masks]) if masks else None
        results.append(entry)
    return results


def at_effective(results: Sequence[dict[str, Any]],
                 effective: Sequence[float]) -> list[dict[str, Any]]:
    """Miss at equal effective sparsity: for each (trace, variant, predictor, budget) group of
    results (several target sparsities), mean/p99 miss and the oracle's and random's means
    linearly interpolated in effective_sparsity at each requested value; None outside the
    range the group's targets covered (give targets that bracket it: e.g. effective + c/b
    for a probe reading c rows per b-slot block)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        if r.get("effective_sparsity") is None:
            continue
        key = (r["trace"], r.get("variant"), r.get("predictor", "spin"), r.get("budget", "uniform"))
        groups.setdefault(key, []).append(r)
    out = []
    fields = ("mean_miss", "p99_miss", "oracle_mean_miss", "random_mean_miss")
    for (trace, variant, predictor, budget), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["effective_sparsity"])
        x = np.array([r["effective_sparsity"] for r in rs])
        for e in effective:
            entry: dict[str, Any] = {"trace": trace, "predictor": predictor, "budget": budget,
                                     "effective_sparsity": float(e)}
            if variant is not None:
                entry["variant"] = variant
            inside = x.size and x[0] - 1e-12 <= e <= x[-1] + 1e-12
            for f in fields:
                y = np.array([np.nan if r.get(f) is None else r[f] for r in rs])
                ok = np.isfinite(y)
                entry[f] = float(np.interp(e, x[ok], y[ok])) \
                    if inside and ok.sum() and x[ok][0] - 1e-12 <= e <= x[ok][-1] + 1e-12 \
                    else None
            out.append(entry)
    return out


# ---- studies ----------------------------------------------------------------------------------
STUDIES = ("reduction", "exploration", "mtp", "state_dtype")


def study_variants(study: str, base: SpinConfig, next_n: int) -> list[tuple[str, SpinConfig]]:
    """The paper's ablations (section 4.5-4.6) as labelled configs derived from `base`, and
    `state_dtype`: the same config with V/D in float32, float16 and float8_e4m3fn (the
    faster states)."""
    if study == "reduction":
        core = base.with_overrides(exploration=0.0)
        return [("A0", core.with_overrides(reduction="A0"))] + [
            (f"{red}-{pool}", core.with_overrides(reduction=red, pooling=pool))
            for red in ("A1", "A2") for pool in ("max", "mean", "top4")]
    if study == "exploration":
        if "exploration" in base.model_fields_set and base.exploration == 0:
            raise SpinError("the exploration study compares policies at exploration > 0; "
                            "leave --exploration unset (0.05) or give a positive share")
        gamma = base.exploration
        return [("none", base.with_overrides(exploration=0.0))] + [
            (policy, base.with_overrides(exploration=gamma, exploration_policy=policy))
            for policy in ("random", "staleness", "age")]
    if study == "mtp":
        if next_n < 2:
            raise SpinError("the mtp study needs a trace with next_n > 1 (MTP rows)")
        core = base.with_overrides(exploration=0.0)
        return [(f"mask={mk},update={up}", core.with_overrides(mtp_mask=mk, mtp_update=up))
                for mk in ("union", "row0") for up in ("prefix_valid", "row0")]
    if study == "state_dtype":
        return [(dtype, base.with_overrides(state_dtype=dtype))
                for dtype in ("float32", "float16", "float8_e4m3fn")]
    raise SpinError(f"unknown study {study!r}: choose one of {', '.join(STUDIES)}")


def run_study(trace: SpinTrace, study: str, sparsities: Sequence[float],
              cfg: Optional[SpinConfig] = None, progress: bool = False) -> list[dict[str, Any]]:
    base = config_for_trace(trace, cfg)
    results = []
    variants = study_variants(study, base, trace.next_n)
    for i, (label, variant) in enumerate(variants, 1):
        results.extend(replay(trace, sparsities, variant, progress=progress, label=label,
                              desc=f"{study} {label} ({i}/{len(variants)})"))
    return results
