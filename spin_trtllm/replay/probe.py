"""Query-aware block predictors and the per-layer adaptive budget (reference).

SPIN ranks blocks by history (V/D, spin_trtllm.reference). The predictors here rank them with
the current indexer query, read from a SPIN trace v2 (q [T, L, R, H, D] with the quantization
scale folded into w [T, L, R, H], keys [L, S, D]; true slot score
z[i] = sum_h w_h relu(q_h . k_i)). Only the block scores that go into SPIN's selection change:
budget m, forced sink/newest blocks, exploration and the MTP union are
reference.select_blocks', reached through reference.decode_step(block_scores=...).

Block summaries (how they are kept). With c summaries per block (c in {1, 2, ...}, block
size b divisible by c), block j has c sub-blocks of b/c slots; sub-block u covers slots
[u b/c, (u+1) b/c). A sub-block's summary depends only on its own visible keys:
  mean_u = mean of k_i over its visible slots i < n,
  var_u[d] = mean of (k_i[d] - mean_u[d])^2 over the same slots,
  kmin_u[d] = min of k_i[d], kmax_u[d] = max of k_i[d] over the same slots.
So the summaries of complete sub-blocks are built once (at prefill, and once more each time
decode completes a sub-block) and never change; at decode only the newest, partial
sub-block changes (it is recomputed from its < b/c visible keys, per MTP row since later rows
see more slots). BlockSummaries keeps exactly this: a cache of complete sub-blocks plus the
partial one recomputed per call.

Formulas (row r of one layer, visible blocks j < B; -inf for blocks that are not visible):
  probe   P[j] = max over the c sub-blocks u of block j of  sum_h w_h relu(q_h . mean_u)
          (c = 1: the block mean key scored like a slot; c = 2: the means of the two halves)
  quest   Q[j] = sum_h w_h relu(U_h)  if w_h >= 0,  w_h relu(L_h) if w_h < 0, with
            U_h = sum_d max(q_hd kmin_jd, q_hd kmax_jd),  L_h = sum_d min(q_hd kmin_jd, q_hd kmax_jd)
          (the Quest min/max bound; for w >= 0 it is sum_h w_h relu(sum_d max(...)));
          Q[j] >= max_{i in block j, i < n} z[i]: an upper bound of the block's true max.
  gauss   G[j] = max over the c sub-blocks u of block j of  sum_h w_h E[relu(X_h)],
            X_h ~ Normal(mu_h, s_h^2),  mu_h = q_h . mean_u,  s_h^2 = sum_d q_hd^2 var_ud,
            E[relu(X)] = mu Phi(mu/s) + s phi(mu/s) (relu(mu) at s = 0)
          (c = 2: the engine's gauss on 32-slot pages, a block's two pages)
          (the block's keys modelled as independent per-dim Gaussians: an estimate of the
          block's mean slot score that, unlike P, counts the keys' spread through the ReLU)
  hybrid  H[j] = max(rank(P)[j], rank(S)[j]), S = SPIN's V/D block prediction, and
            rank(X)[j] = #{visible j' : X[j'] < X[j]} / max(B - 1, 1)  in [0, 1]
          (share of visible blocks that block j beats: the top block of either predictor
          gets 1, blocks tied with all others get 0 so an untrained, all-zero history
          leaves the ranking to the probe).

K-cache rows the predictor reads per visible block (one row counted as one 132-byte slot):
spin 0 (V/D state is not K cache), probe and hybrid c, quest 2 (kmin and kmax), gauss 2 (mean
and per-dim spread).

Adaptive budget (--budget adaptive; AdaptiveBudget): per step and per target sparsity, the
global budget M = sum over layers of the uniform m_l (row 0). Each layer first gets its
floor f_l = max(min(B_l, ceil(K/b)), forced_l); the M - sum f_l remaining blocks go to the
largest marginal gains g_l(k) over all layers at once, where
  h_l(k)  = EMA (decay 0.8) over the previous non-warm-up steps of the share of layer l's
            true top-K' (row 0) that sat in the block its predictor ranked k-th among the
            non-forced visible blocks (ranked as selection ranks: score desc, lower id);
  g_l(k)  = max_{k' >= k} h_l(k')  (made non-increasing: a block is worth at least what any
            later-ranked block gives, since a layer's blocks are a prefix of its ranking).
So g_l(k) is the expected drop of layer l's miss when it gets its k-th ranked block: a layer
whose top-K spreads deep into its ranking gets blocks from one whose top-K sits in its first
blocks. Ties go to the lower layer, then the lower k (stable sort): deterministic, no RNG,
and the same on every tensor-parallel rank since every input is. Until a layer has a
measurement every layer keeps its uniform m_l. Layer l then runs with rho_l = 1 - m_l / B_l,
which gives it exactly m_l blocks in row 0 (later MTP rows get ceil((m_l / B_l) B_r) as
usual). h needs dense scores after the step: a replay has them; a deployment would measure
it on dense (warm-up or periodic audit) steps.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ..config import SpinConfig
from .. import predictors
from ..errors import SpinError
from ..reference import NEG_INF, block_budget, budget_floor

_ADAPT_DECAY = 0.8


def rows_read_per_block(predictor: str, summaries: int = 1) -> int:
    """K-cache rows (one slot each) the predictor reads per visible block."""
    chosen = predictors.get(predictor)
    return chosen.summary_rows_per_block * (summaries if chosen.sub_blocks else 1)


# ---- block summaries --------------------------------------------------------------------------
# fp32 values one chunk of summary/score temporaries holds (64 MiB): block_size (trace metadata,
# up to 65,536) and long rows are processed in chunks of layers, blocks and partial slots.
CHUNK_VALUES = 1 << 24


class BlockSummaries:
    """Per-sub-block mean / variance / min / max of the visible keys of L layers (keys [L, S, D]).

    The complete sub-blocks are cached; `at(n, count)` adds the partial newest one per row."""

    def __init__(self, keys: torch.Tensor, sub: int):
        if sub < 1:
            raise SpinError(f"summary block size must be >= 1, got {sub}")
        self.keys = keys.float()
        self.sub = sub
        L, S, D = self.keys.shape
        full = (S // sub) * sub
        blocks = self.keys[:, :full].view(L, S // sub, sub, D)
        self.mean = blocks.mean(2)
        # no complete sub-block (keys shorter than one): var() would warn on the empty dims
        self.var = blocks.var(2, unbiased=False) if full else torch.zeros(L, 0, D)
        self.kmin = blocks.amin(2)
        self.kmax = blocks.amax(2)

    def partial(self, n: torch.Tensor, layer0: int = 0) -> dict[str, torch.Tensor]:
        """The newest, partial sub-block of each row (n int [L', R] visible slots of layers
        layer0..layer0+L'-1): mean, var, kmin, kmax float32 [L', R, D] over its visible keys
        [n // sub * sub, n) (zero / +-inf where the newest sub-block is complete). Its keys are
        read in chunks of slots, so a large sub-block needs no [L', R, sub, D] temporary."""
        S, D = self.keys.shape[1:]
        sub = self.sub
        n = n.to(torch.int64)
        Lc, R = n.shape
        keys = self.keys[layer0:layer0 + Lc]
        first = (n // sub) * sub                                        # [L', R]
        fill = n - first                                                # visible partial slots
        span = max(1, min(sub, int(fill.max())))
        step = max(1, min(span, CHUNK_VALUES // max(1, Lc * R * D)))
        cnt = fill.clamp(min=1).unsqueeze(-1).float()

        def rows(a: int) -> tuple[torch.Tensor, torch.Tensor]:
            idx = first.unsqueeze(-1) + torch.arange(a, min(a + step, span))   # [L', R, c]
            seen = (idx < n.unsqueeze(-1)).unsqueeze(-1)
            got = keys.gather(1, idx.clamp(max=S - 1).view(Lc, -1, 1).expand(-1, -1, D))
            return got.view(*idx.shape, D), seen

        total = torch.zeros(Lc, R, D)
        kmin = torch.full((Lc, R, D), torch.inf)
        kmax = torch.full((Lc, R, D), -torch.inf)
        for a in range(0, span, step):
            got, seen = rows(a)
            total += torch.where(seen, got, 0.0).sum(2)
            kmin = torch.minimum(kmin, torch.where(seen, got, torch.inf).amin(2))
            kmax = torch.maximum(kmax, torch.where(seen, got, -torch.inf).amax(2))
        mean = total / cnt
        dev = torch.zeros(Lc, R, D)
        for a in range(0, span, step):
            got, seen = rows(a)
            dev += torch.where(seen, (got - mean.unsqueeze(2)) ** 2, 0.0).sum(2)
        return {"mean": mean, "var": dev / cnt, "kmin": kmin, "kmax": kmax}

    def at(self, n: torch.Tensor, count: int, first: int = 0, layer0: int = 0,
           partial: Optional[dict[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
        """Summaries seen by rows with n visible slots (n int [L', R], layers layer0..) for
        sub-blocks first..first+count-1: mean, var, kmin, kmax float32 [L', R, count, D] and
        visible bool [L', R, count]. partial: self.partial(n, layer0), when already computed."""
        D = self.keys.shape[2]
        sub = self.sub
        n = n.to(torch.int64)
        Lc, R = n.shape
        u = torch.arange(first, first + count)
        complete = (u + 1) * sub <= n.unsqueeze(-1)                     # [L', R, count]
        visible = u * sub < n.unsqueeze(-1)
        is_partial = (u == (n // sub).unsqueeze(-1)) & visible & ~complete
        part = partial if partial is not None else self.partial(n, layer0)
        out = {"visible": visible}
        for name, cached in (("mean", self.mean), ("var", self.var), ("kmin", self.kmin),
                             ("kmax", self.kmax)):
            cached = cached[layer0:layer0 + Lc]
            have = max(0, min(cached.shape[1], first + count) - first)
            full = torch.zeros(Lc, count, D)
            full[:, :have] = cached[:, first:first + have]
            full = full.unsqueeze(1).expand(Lc, R, count, D)
            val = torch.where(is_partial.unsqueeze(-1), part[name].unsqueeze(2), full)
            out[name] = torch.where(visible.unsqueeze(-1), val, 0.0)
        return out


# ---- the predictors ---------------------------------------------------------------------------
def _in_chunks(formula, q: torch.Tensor, w: torch.Tensor, summaries: BlockSummaries,
               n: torch.Tensor, n_blocks: int, parts: int, layer0: int) -> torch.Tensor:
    """fp32 [L', R, n_blocks]: formula(q, w, summaries.at(...)) (scores [L, R, blocks * parts]),
    -inf where nothing is visible, each block's best of its `parts` sub-blocks; over chunks of
    layers and blocks that each hold about CHUNK_VALUES fp32 temporaries (every block's score
    depends only on its own summaries and the row's query)."""
    def block_scores(q, w, s):
        z = formula(q, w, s).masked_fill(~s["visible"], NEG_INF)
        return z if parts == 1 else z.view(*z.shape[:2], -1, parts).amax(-1)

    Lc, R, H, D = q.shape
    per_block = R * parts * (8 * D + 4 * H)          # at()'s summaries and the formula's terms
    layers = max(1, min(Lc, CHUNK_VALUES // max(1, per_block * n_blocks)))
    blocks = n_blocks if layers > 1 else max(1, min(n_blocks, CHUNK_VALUES // per_block))
    if layers == Lc and blocks == n_blocks:
        return block_scores(q, w, summaries.at(n, n_blocks * parts, layer0=layer0))
    out = torch.empty(Lc, R, n_blocks)
    for l0 in range(0, Lc, layers):
        l1 = min(Lc, l0 + layers)
        part = summaries.partial(n[l0:l1], layer0 + l0)
        for j0 in range(0, n_blocks, blocks):
            j1 = min(n_blocks, j0 + blocks)
            s = summaries.at(n[l0:l1], (j1 - j0) * parts, j0 * parts, layer0 + l0, part)
            out[l0:l1, :, j0:j1] = block_scores(q[l0:l1], w[l0:l1], s)
    return out


def probe_scores(q: torch.Tensor, w: torch.Tensor, summaries: BlockSummaries, n: torch.Tensor,
                 n_blocks: int, parts: int, layer0: int = 0) -> torch.Tensor:
    """fp32 [L, R, n_blocks]: P[j] = max_u sum_h w_h relu(q_h . mean_u) over block j's `parts`
    sub-blocks (q [L, R, H, D], w [L, R, H]); -inf for blocks with nothing visible."""
    def formula(q, w, s):
        z = torch.einsum("lrhd,lrud->lruh", q.float(), s["mean"]).relu()
        return (z * w.float().unsqueeze(2)).sum(-1)

    return _in_chunks(formula, q, w, summaries, n, n_blocks, parts, layer0)


def quest_scores(q: torch.Tensor, w: torch.Tensor, summaries: BlockSummaries, n: torch.Tensor,
                 n_blocks: int, layer0: int = 0) -> torch.Tensor:
    """fp32 [L, R, n_blocks]: the Quest bound (module docstring), >= every visible slot's
    score in the block; -inf for blocks with nothing visible."""
    def formula(q, w, s):
        qf = q.float()
        qp, qn = qf.clamp(min=0), qf.clamp(max=0)
        upper = (torch.einsum("lrhd,lrud->lruh", qp, s["kmax"])
                 + torch.einsum("lrhd,lrud->lruh", qn, s["kmin"]))
        lower = (torch.einsum("lrhd,lrud->lruh", qp, s["kmin"])
                 + torch.einsum("lrhd,lrud->lruh", qn, s["kmax"]))
        wf = w.float().unsqueeze(2)
        return torch.where(wf >= 0, wf * upper.relu(), wf * lower.relu()).sum(-1)

    return _in_chunks(formula, q, w, summaries, n, n_blocks, 1, layer0)


def gauss_scores(q: torch.Tensor, w: torch.Tensor, summaries: BlockSummaries, n: torch.Tensor,
                 n_blocks: int, parts: int = 1, layer0: int = 0) -> torch.Tensor:
    """fp32 [L, R, n_blocks]: G[j] = max_u sum_h w_h E[relu(X_h)] (module docstring) from the
    mean key and per-dim variance of each of block j's `parts` sub-blocks; -inf for blocks
    with nothing visible."""
    def formula(q, w, s):
        qf = q.float()
        mu = torch.einsum("lrhd,lrud->lruh", qf, s["mean"])
        sd = torch.einsum("lrhd,lrud->lruh", qf * qf, s["var"]).clamp(min=0).sqrt()
        a = mu / sd.clamp(min=1e-30)
        expected = (mu * torch.special.ndtr(a)
                    + sd * torch.exp(-0.5 * a * a) / math.sqrt(2 * math.pi))
        expected = torch.where(sd > 0, expected, mu.relu())
        return (expected * w.float().unsqueeze(2)).sum(-1)

    return _in_chunks(formula, q, w, summaries, n, n_blocks, parts, layer0)


class QueryProbe:
    """The query-aware block scores of one trace v2, step by step (all layers at once)."""

    def __init__(self, trace, predictor: str, block_size: int, summaries: int = 1):
        query_aware = [name for name, p in predictors.REGISTRY.items() if p.query]
        if predictor not in query_aware:
            raise SpinError(f"predictor {predictor!r}: a query-aware one is one of "
                            f"{', '.join(query_aware)}")
        require_query_data(trace, predictor)
        if summaries < 1 or block_size % summaries:
            raise SpinError(f"summaries per block ({summaries}) must be >= 1 and divide the "
                            f"block size ({block_size})")
        self.trace, self.predictor, self.b = trace, predictor, block_size
        # probe/hybrid: `summaries` mean keys per block, gauss as many (mean, var) pairs, each
        # block scored by its best sub-block; quest: one (min, max) pair per block
        self.parts = summaries if predictors.REGISTRY[predictor].sub_blocks else 1
        self.summaries = BlockSummaries(trace.keys, block_size // self.parts)

    def scores(self, t: int, n: torch.Tensor, n_blocks: int,
               layers: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """fp32 [L', R, n_blocks] of step t (n [L', R]) for layers [lo, hi) (default all):
        probe P, quest Q or gauss G; for hybrid the probe part P (merge with
        reference.hybrid_scores)."""
        l0, l1 = layers or (0, self.trace.num_layers)
        q, w = self.trace.q[t, l0:l1], self.trace.w[t, l0:l1]
        if self.predictor == "quest":
            return quest_scores(q, w, self.summaries, n, n_blocks, l0)
        if self.predictor == "gauss":
            return gauss_scores(q, w, self.summaries, n, n_blocks, self.parts, l0)
        return probe_scores(q, w, self.summaries, n, n_blocks, self.parts, l0)


def require_query_data(trace, predictor: str) -> None:
    if predictors.get(predictor).query and trace.version < 2:
        raise SpinError(f"--predictor {predictor} needs a SPIN trace v2 (tensors q, w, keys); "
                        f"{trace.name} has none (v1): record it with "
                        f"`spin-trtllm trace`")


# ---- adaptive per-layer budget ----------------------------------------------------------------
class AdaptiveBudget:
    """Per-layer block budgets under one global budget per step (module docstring).

    Streams are G = groups x layers (one group per target sparsity, layer-minor, as replay
    lays them out); each group shares one budget."""

    def __init__(self, groups: int, layers: int, cfg: SpinConfig, capacity_blocks: int):
        self.S, self.L, self.cfg = groups, layers, cfg
        self.hit = torch.full((groups * layers, capacity_blocks), float("nan"),
                              dtype=torch.float64)
        self.order: Optional[torch.Tensor] = None     # last allocation's candidate ranking

    def _candidates(self, n_blocks: torch.Tensor, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        j = torch.arange(nb)
        valid = j < n_blocks.unsqueeze(-1)
        forced = torch.zeros_like(valid)
        if cfg.keep_sink:
            forced |= (j == 0) & valid
        if cfg.keep_newest:
            forced |= j == (n_blocks - 1).unsqueeze(-1)
        return valid & ~forced, forced.sum(-1)

    def allocate(self, block_scores: torch.Tensor, n_blocks: torch.Tensor,
                 target_sparsity: torch.Tensor, n: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """(target sparsity float64 [G] per stream, m int64 [G] row-0 blocks) from row 0's
        predicted block scores [G, R, NB], its block count n_blocks [G], its visible slots n [G]
        (the budget floor holds K of them) and the uniform target_sparsity [G]."""
        cfg = self.cfg
        NB = block_scores.shape[-1]
        B = n_blocks.to(torch.int64)
        cand, n_forced = self._candidates(B, NB)
        uniform = torch.maximum(block_budget(B, target_sparsity, cfg, n), n_forced)
        floor = torch.maximum(torch.minimum(B, budget_floor(B, cfg, n)), n_forced)
        key = block_scores[:, 0].float().nan_to_num(nan=NEG_INF).masked_fill(~cand, NEG_INF)
        # candidates first (selection's order: score desc, lower id), then the rest
        order = torch.sort(torch.where(cand, 1, 0), dim=-1, descending=True, stable=True).indices
        order = order.gather(-1, torch.sort(key.gather(-1, order), dim=-1, descending=True,
                                            stable=True).indices)
        self.order = torch.where(cand.gather(-1, order), order, -1)
        m = uniform.clone()
        width = min(NB, self.hit.shape[1])
        h = torch.zeros(B.shape[0], NB, dtype=torch.float64)
        h[:, :width] = self.hit[:, :width].nan_to_num(nan=0.0)
        gain = h.flip(-1).cummax(-1).values.flip(-1)                      # non-increasing
        k = torch.arange(NB)
        n_cand = cand.sum(-1, keepdim=True)
        gain = torch.where((k >= (floor - n_forced).unsqueeze(-1)) & (k < n_cand), gain, -torch.inf)
        known = torch.isfinite(self.hit[:, 0])
        for g in range(self.S):
            sl = slice(g * self.L, (g + 1) * self.L)
            if not bool(known[sl].all()):
                continue                                                  # uniform until measured
            extra = int(uniform[sl].sum() - floor[sl].sum())
            flat = gain[sl].flatten()                                     # layer-major
            top = flat.sort(descending=True, stable=True).indices[:max(extra, 0)]
            top = top[torch.isfinite(flat[top])]
            m[sl] = floor[sl] + torch.bincount(top // NB, minlength=self.L)
        rho_out = 1.0 - m.double() / B.clamp(min=1).double()
        return rho_out.clamp(min=0.0), m

    def observe(self, top_per_block: torch.Tensor, k_row: torch.Tensor,
                measured: torch.Tensor) -> None:
        """Fold the step's true top-K' counts per block of row 0 (int [G, NB]), K' (int [G])
        into h for the streams in `measured` (bool [G]: non-warm-up), by the ranking of the
        last allocation."""
        if self.order is None:
            return
        order = self.order
        width = min(order.shape[-1], self.hit.shape[1])
        share = top_per_block.double().gather(-1, order.clamp(min=0)) \
            / k_row.clamp(min=1).double().unsqueeze(-1)
        share = torch.where(order >= 0, share, 0.0)[:, :width]
        old = self.hit[:, :width]
        new = torch.where(torch.isfinite(old), _ADAPT_DECAY * old + (1 - _ADAPT_DECAY) * share,
                          share)
        self.hit[:, :width] = torch.where(measured.unsqueeze(-1), new, old)
        self.order = None
