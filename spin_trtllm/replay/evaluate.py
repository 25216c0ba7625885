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
from . import work
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


def _fresh_state(streams: int, capacity: int, cfg: SpinConfig, step: int) -> SpinState:
    """A state as SpinState.reset(step=step) leaves it, sized for the slots a turn needs."""
    state = SpinState.zeros(streams, capacity, cfg)
    state.last_seen.fill_(step)
    return state


def replay_desc(trace: SpinTrace, sparsities: Sequence[float],
                label: Optional[str] = None) -> str:
    """replay's progress bar label: "replay TRACE [LABEL] sparsity 0.3 0.5"."""
    return (f"replay {trace.name}" + (f" [{label}]" if label else "")
            + " sparsity " + " ".join(f"{float(s):g}" for s in sparsities))


def replay(trace: SpinTrace, sparsities: Sequence[float], cfg: Optional[SpinConfig] = None,
           progress: bool = False, pearson: bool = True, label: Optional[str] = None,
           keep_masks_for_layer: Optional[int] = None,
           desc: Optional[str] = None, predictor: str = "spin", budget: str = "uniform",
           summaries: int = 1) -> list[dict[str, Any]]:
    """Replay SPIN at each target sparsity; one result dict per sparsity. desc: the progress
    bar's label (default replay_desc).

    predictor: spin (V/D history), or probe / hybrid / quest / gauss (need a trace v2: q, w, keys;
    spin_trtllm.replay.probe), which only change the block scores selection ranks by;
    summaries: summary keys per block of probe/hybrid. budget: uniform (m from the target
    sparsity in every layer) or adaptive (probe.AdaptiveBudget: the same total per step,
    spread over layers). keep_masks_for_layer: each result's "masks" is a list of T bool
    tensors, step t's selected blocks of that layer (its ceil(longest row / b) blocks).

    Refused (SpinError) before any work when work.require refuses work.estimate_replay (over
    work.REPLAY_MAX_WORK_BYTES, or padding far beyond the data). Layers run in batches
    (work.layer_batches), each with its own state, sized anew at every turn start for the
    slots that turn needs."""

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
    S, T, L, R = len(sparsities), trace.num_steps, trace.num_layers, trace.next_n
    if keep_masks_for_layer is not None and not 0 <= keep_masks_for_layer < L:
        raise SpinError(f"layer {keep_masks_for_layer} is outside [0, {L})")
    work.require(work.estimate_replay(trace, S, cfg, predictor, summaries, budget_mode,
                                      keep_masks_for_layer is not None))
    probe = QueryProbe(trace, predictor, cfg.block_size, summaries) \
        if chosen.query else None
    rows_per_block = rows_read_per_block(predictor, summaries)
    G = S * L
    b, K = cfg.block_size, cfg.index_topk
    # slots each layer's state covers at each step: its rows and the query positions
    need = torch.maximum(work.layer_widths(trace.row_len),
                         trace.query_pos.to(torch.int64).amax(1, keepdim=True) + 1)   # [T, L]
    batches = work.layer_batches(trace.row_len, S * R, b)
    streams = [(torch.arange(S)[:, None] * L + torch.arange(lo, hi)).flatten()
               for lo, hi in batches]
    target_sparsity = torch.tensor(sparsities, dtype=torch.float64).repeat_interleave(L)
    layer_ids = torch.arange(L).repeat(S)
    request_ids = torch.zeros(G, dtype=torch.int64)
    turn_starts = trace.turn_starts()
    turn_ends = dict(zip(sorted(turn_starts), sorted(turn_starts)[1:] + [T]))
    accepted = trace.accepted_or_zero().to(torch.int64)
    slot_pred_wanted = pearson and chosen.history and probe is None

    # per step and stream: miss (nan where not eligible), its references, Pearson
    miss_all = torch.full((T, G, R), torch.nan, dtype=torch.float64)
    random_all, oracle_all, pear_all = (torch.full_like(miss_all, torch.nan) for _ in range(3))
    sel_blocks = torch.zeros(G, dtype=torch.float64)
    tot_blocks = torch.zeros(G, dtype=torch.float64)
    counted_rows = torch.zeros(G, dtype=torch.int64)
    masks = [] if keep_masks_for_layer is not None else None
    max_blocks = -(-int(need.max()) // b)
    adaptive = AdaptiveBudget(S, L, cfg, max_blocks) if budget == "adaptive" else None
    dense_slots = torch.zeros(G, dtype=torch.float64)      # bytes in slots of 132 B
    scored_slots = torch.zeros(G, dtype=torch.float64)
    probe_slots = torch.zeros(G, dtype=torch.float64)
    states: list[Optional[SpinState]] = [None] * len(batches)

    def block_scores(i: int, n: torch.Tensor, q: torch.Tensor, width: int
                     ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """The custom ranking input of batch i: (block scores, slot predictions or None)."""
        lo, hi = batches[i]
        blocks = slot_pred = None
        if chosen.history:
            blocks, slot_pred = predict_blocks(states[i], n, q, cfg, width)
        if probe is not None:
            nb_w = -(-width // b)
            pb = probe.scores(t, trace.row_len[t, lo:hi], nb_w, (lo, hi)).repeat(S, 1, 1)
            blocks = hybrid_scores(pb, blocks, block_count(n, b)) if chosen.merges else pb
            slot_pred = None
        return blocks, slot_pred

    # every target sparsity runs in the same pass: one bar over the steps names them all
    for t in tqdm(range(T), desc=desc or replay_desc(trace, sparsities, label),
                  disable=not progress, leave=False, unit="step"):
        if t in turn_starts:
            end = turn_ends[t]
            for i, (lo, hi) in enumerate(batches):
                states[i] = None
                states[i] = _fresh_state(len(streams[i]), int(need[t:end, lo:hi].max()), cfg, t)
        n_all = trace.row_len[t].to(torch.int64).repeat(S, 1)              # [G, R]
        sparsity_all = target_sparsity
        pre: list[Optional[torch.Tensor]] = [None] * len(batches)
        if adaptive is not None:            # one budget over all layers: every batch first
            for i, (lo, hi) in enumerate(batches):
                n = trace.row_len[t, lo:hi].to(torch.int64).repeat(S, 1)
                q = trace.query_pos[t].to(torch.int64).expand(n.shape)
                pre[i], _ = block_scores(i, n, q, int(n.max()))
            nb_all = max(p.shape[-1] for p in pre)
            row0 = torch.full((G, 1, nb_all), float("-inf"))
            for i, p in enumerate(pre):
                row0[streams[i], 0, :p.shape[-1]] = p[:, 0].float()
            sparsity_all, _ = adaptive.allocate(row0, block_count(n_all[:, 0], b),
                                                target_sparsity, n_all[:, 0])
            del row0
            top0 = torch.zeros(G, nb_all, dtype=torch.int64)
            k0 = torch.zeros(G, dtype=torch.int64)
            measured = torch.zeros(G, dtype=torch.bool)
        for i, (lo, hi) in enumerate(batches):
            g, Lb, state = streams[i], hi - lo, states[i]
            dense = trace.step_scores(t, layers=(lo, hi))                # [Lb, R, W]
            width = dense.shape[-1]
            n = trace.row_len[t, lo:hi].to(torch.int64).repeat(S, 1)    # [Gb, R]
            Gb = n.shape[0]
            q = trace.query_pos[t].to(torch.int64).expand(Gb, R)
            step = torch.full((Gb,), t, dtype=torch.int64)
            acc = accepted[t].expand(Gb)
            dense_g = dense.repeat(S, 1, 1)
            if not custom:
                sel, slot_pred = decode_step(state, cfg, dense_g, n, q, acc, target_sparsity[g],
                                             request_ids[:Gb], layer_ids[g], step)
            else:
                if pre[i] is not None:
                    blocks, slot_pred = pre[i], None
                    if slot_pred_wanted:
                        _, slot_pred = predict_blocks(state, n, q, cfg, width)
                    pre[i] = None
                else:
                    blocks, slot_pred = block_scores(i, n, q, width)
                sel, _ = decode_step(state, cfg, dense_g, n, q, acc, sparsity_all[g],
                                     request_ids[:Gb], layer_ids[g], step, block_scores=blocks)
                del blocks

            # miss against the true top-K' (computed once per layer, shared by all sparsities)
            true_top = topk_mask(dense, trace.row_len[t, lo:hi], K)               # [Lb, R, W]
            k_row = true_top.sum(-1)                                           # K' per row
            kk = min(K, width)
            idx = true_top.to(torch.float32).topk(kk, dim=-1).indices          # K' set ids first
            valid_k = torch.arange(kk) < k_row.unsqueeze(-1)
            idx, valid_k, k_row = idx.repeat(S, 1, 1), valid_k.repeat(S, 1, 1), k_row.repeat(S, 1)
            hit = sel.mask.gather(1, (idx // b).flatten(1)).view_as(idx)
            miss = (valid_k & ~hit).sum(-1).double() / k_row.clamp(min=1)
            del idx, valid_k, hit
            committed = torch.arange(R) <= acc[:, None]
            eligible = sel.eligible & committed
            miss_all[t, g] = torch.where(eligible, miss, torch.nan)
            # references: the budget m_r is the selected blocks row r can see
            row_valid = torch.arange(sel.mask.shape[-1]) < sel.n_blocks.unsqueeze(-1)
            seen = (sel.mask.unsqueeze(1) & row_valid).sum(-1)                  # [Gb, R]
            blocks_r = sel.n_blocks.clamp(min=1).double()
            random_all[t, g] = torch.where(eligible, 1.0 - seen.double() / blocks_r, torch.nan)
            nb = -(-width // b)
            per_block = torch.nn.functional.pad(true_top, (0, nb * b - width)).view(
                Lb, R, nb, b).sum(-1).repeat(S, 1, 1)                          # [Gb, R, nb]
            best = per_block.sort(-1, descending=True).values.cumsum(-1)
            covered = torch.where(seen > 0, best.gather(
                -1, (seen - 1).clamp(min=0, max=nb - 1).unsqueeze(-1)).squeeze(-1), 0)
            oracle = 1.0 - covered.double() / k_row.clamp(min=1)
            oracle_all[t, g] = torch.where(eligible, oracle, torch.nan)
            del best, true_top
            if adaptive is not None:
                top0[g, :nb] = per_block[:, 0]
                k0[g], measured[g] = k_row[:, 0], ~sel.dense
            del per_block
            if pearson and slot_pred is not None:
                visible = torch.arange(width) < n.unsqueeze(-1)
                pr = row_pearson(slot_pred, dense_g, visible)
                pear_all[t, g] = torch.where(eligible, pr, torch.nan)
                del visible
            del slot_pred, dense_g, dense

            # realized sparsity: every row of non-warm-up streams, union blocks each row can see
            live = ~sel.dense
            sel_blocks[g] += torch.where(live, seen.sum(-1).double(), 0.0)
            tot_blocks[g] += torch.where(live, sel.n_blocks.sum(-1).double(), 0.0)
            counted_rows[g] += torch.where(live, R, 0)
            nb_sel = sel.mask.shape[-1]
            in_block = (n.unsqueeze(-1) - torch.arange(nb_sel) * b).clamp(0, b)   # [Gb, R, NB]
            scored = (in_block * sel.mask.unsqueeze(1)).sum((-1, -2)).double()
            dense_slots[g] += torch.where(live, n.sum(-1).double(), 0.0)
            scored_slots[g] += torch.where(live, scored, 0.0)
            probe_slots[g] += torch.where(live, rows_per_block * sel.n_blocks.sum(-1).double(),
                                          0.0)
            if masks is not None and lo <= keep_masks_for_layer < hi:
                own = -(-int(trace.row_len[t, keep_masks_for_layer].max()) // b)
                masks.append(sel.mask.view(S, Lb, -1)[:, keep_masks_for_layer - lo, :own].clone())
            del sel, in_block
        if adaptive is not None:
            adaptive.observe(top0, k0, measured)

    miss_all = miss_all.view(T, S, L, R).numpy()
    random_all = random_all.view(T, S, L, R).numpy()
    oracle_all = oracle_all.view(T, S, L, R).numpy()
    pear_all = pear_all.view(T, S, L, R).numpy()
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
        if chosen.sub_blocks:
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
            entry["masks"] = [mk[s] for mk in masks]
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


def estimate_study(trace: SpinTrace, study: str, sparsities: int,
                   cfg: Optional[SpinConfig] = None) -> "work.Estimate":
    """run_study's work: its variants replay one after the other (the largest is the peak)."""
    ests = [work.estimate_replay(trace, sparsities, variant)
            for _, variant in study_variants(study, config_for_trace(trace, cfg), trace.next_n)]
    top = max(ests, key=lambda e: e.bytes)
    return work.Estimate(f"ablate --study {study}", trace.name, top.held, top.step,
                         sum(e.seconds for e in ests),
                         next((e.refusal for e in ests if e.refusal), None))
