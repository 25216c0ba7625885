"""The SPIN algorithm in plain PyTorch: the executable specification (CPU or GPU).

Everything is vectorized over *streams* (one stream = one (request, indexer layer) pair, the
leading dim G), MTP rows (dim R) and slots/blocks; the only Python loop is over MTP rows in
the EMA replay, which is sequential by definition. Native kernels must match this module.

Definitions (paper arXiv 2610.09025, Algorithm 1 and sections 3.2.1-3.2.2, 4.6):
- Row r of a stream sees n slots (0..n-1) from query position q (slot coordinates, q >= n-1).
  Predicted slot score  z^[i] = max(V[i], D[q - i]).
- Blocks: b(i) = i // b, B = ceil(n / b). Block score S[j] = pool(z^ over the block's
  visible slots), pool in {max, mean, top4 (mean of up to the 4 largest)}.
- Budget  m = min(B, max(f, ceil((1 - rho) B))), f = ceil((K + e)/b) the floor that holds K
  visible slots (e: empty slots of a partly filled newest block); products of a float knob are
  formed in float64 and ceiled/floored with a 1e-6 tolerance, so that e.g. 0.7 * 10 gives 7,
  not 8 (also for a float32 0.7, whose product is 3.00000012 at B = 10).
- Forced blocks: sink (block 0) if keep_sink, newest (block B-1) if keep_newest. They count
  toward m; if they alone exceed m (only when ceil(K/b) = 1) m grows to their count.
- Exploration: e = min(floor(gamma m), m - forced) positions of m are reserved; the other
  m - e positions hold the forced blocks and then the highest-scoring blocks (ties: lower
  block id); the e reserved positions take the highest-priority blocks not yet selected:
    random:    priority = counter_hash(seed, request, layer, step, block), a uint32
    age:       priority = max(step - last_seen[block], 0)  (steps since last scored)
    staleness: priority = age * (1 + s), s = (S - min S) / (max S - min S) over the
               candidates' finite scores (0 when they are all equal, and for a candidate
               whose score is not finite: its age alone), in fp32: staleness weighted by
               predicted importance, which can at most double it.
  Ties: lower block id. MTP rows share the random keys and the block ages, so they mostly
  explore the same blocks (staleness also weighs each row's own predicted scores).
- Reductions (ablations of section 4.6):
    A1  (default) as above.
    A0  slot-level: the s = min(n, ceil(-B ln rho)) highest predicted slots (all if rho = 0;
        -B ln rho slots scattered uniformly would cover (1 - rho) B blocks, so clustered
        predictions give a realized sparsity above the target) are expanded to their blocks,
        forced blocks are added, the best remaining blocks top the count up to ceil(K/b)
        (room for K slots), then e = min(floor(gamma m0), B - m0) exploration blocks are
        added on top (m0 = blocks so far); m = m0 + e.
    A2  block-level state: V[j] per block, D[(q // b) - j] per block offset; the EMA input
        of a block is the pooled indexer score of its visible slots; then as A1.
- MTP rows r = 0..R-1 (R = next_n): mtp_mask=union ORs the row masks; row0 takes row 0's
  mask plus the blocks row 0 cannot see but row r can (B_0 <= j < B_r), and a row's m_t is
  then the number of those blocks it can see.
- Warm-up: the first warmup_steps decode steps after a reset score every block.
- Query-aware block scores (probe / hybrid / quest, spin_trtllm.replay.probe, where their
  formulas are): decode_step(block_scores=S) ranks blocks by S instead of the V/D prediction;
  everything else above (budget, forced blocks, exploration, MTP, the EMA update) is unchanged.
- EMA update (deferred for MTP): for rows r = 0..a in order (mtp_update=prefix_valid; a is
  the accepted draft count, a negative a counts as 0: row 0 is always valid) or row 0 only
  (row0), for every scored slot i < n_r:
      V[i] <- alpha V[i] + (1 - alpha) z[i];   D[q - i] <- alpha D[q - i] + (1 - alpha) z[i]
  computed in fp32 and stored in the state dtype, saturating at its largest finite value
  (fp16 state never holds inf). Slots of unselected blocks are untouched.
  A non-finite score (NaN, +-inf) counts as not observed: it never enters V or D.
  last_seen[j] = step for every block of the union.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..config import SpinConfig
from ..errors import SpinError

_TOL = 1e-6
_M32 = 0xFFFFFFFF
_HASH_STAGE = (0x9E3779B9, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F, 0x165667B1)
NEG_INF = float("-inf")


# ---- integer helpers (spec for the native kernels) --------------------------------------------
def ceil_tol(x: torch.Tensor) -> torch.Tensor:
    return torch.ceil(x.to(torch.float64) - _TOL).to(torch.int64)


def floor_tol(x: torch.Tensor) -> torch.Tensor:
    return torch.floor(x.to(torch.float64) + _TOL).to(torch.int64)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) without overflowing int64."""
    lo = x & 0xFFFF
    hi = x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def counter_hash(seed: int, request: torch.Tensor, layer: torch.Tensor, step: torch.Tensor,
                 block: torch.Tensor) -> torch.Tensor:
    """uint32 (in int64) counter-based random key; all inputs broadcast; low 32 bits used.

    h = fmix32(seed ^ C0); then h = fmix32(h ^ v ^ Ck) for v = request, layer, step, block.
    """
    h = _fmix32(torch.as_tensor((seed & _M32) ^ _HASH_STAGE[0], dtype=torch.int64))
    for value, const in zip((request, layer, step, block), _HASH_STAGE[1:]):
        h = _fmix32(h ^ (value.to(torch.int64) & _M32) ^ const)
    return h


def block_count(n: torch.Tensor, block_size: int) -> torch.Tensor:
    return (n.to(torch.int64) + block_size - 1) // block_size


def floor_blocks(n_blocks, n, index_topk: int, block_size: int):
    """The fewest blocks that hold K visible slots whichever blocks they are:
    ceil((K + e) / b), e = n_blocks * b - n the empty slots of a partly filled newest block.
    Ints or int tensors (n_blocks = ceil(n / b))."""
    return (index_topk + n_blocks * block_size - n + block_size - 1) // block_size


def budget_floor(n_blocks: torch.Tensor, cfg: SpinConfig,
                 n: Optional[torch.Tensor] = None) -> torch.Tensor:
    """floor_blocks of each row (ceil(K/b) when n is not given)."""
    n_blocks = n_blocks.to(torch.int64)
    if n is None:
        return torch.full_like(n_blocks, cfg.min_blocks)
    return floor_blocks(n_blocks, n.to(torch.int64), cfg.index_topk, cfg.block_size)


def block_budget(n_blocks: torch.Tensor, target_sparsity: torch.Tensor, cfg: SpinConfig,
                 n: Optional[torch.Tensor] = None) -> torch.Tensor:
    """m = min(B, max(floor, ceil((1 - rho) B))), int64, broadcast over rho = target_sparsity;
    floor from budget_floor (n: the rows' visible slots)."""
    keep = ceil_tol((1.0 - torch.as_tensor(target_sparsity).to(torch.float64))
                    * n_blocks.to(torch.float64))
    floor = budget_floor(n_blocks, cfg, n)
    return torch.minimum(n_blocks.to(torch.int64), torch.maximum(keep, floor))


# ---- state ------------------------------------------------------------------------------------
@dataclass
class SpinState:
    """V/D EMA state of G streams. A0/A1: slot-level; A2: block-level."""

    V: torch.Tensor           # [G, capacity]
    D: torch.Tensor           # [G, capacity] indexed by relative offset
    last_seen: torch.Tensor   # int64 [G, block capacity]: step a block was last scored
    decode_steps: torch.Tensor  # int64 [G]: decode steps since the last reset

    @classmethod
    def zeros(cls, streams: int, slot_capacity: int, cfg: SpinConfig,
              device: torch.device | str | None = None) -> "SpinState":
        """slot_capacity must cover every visible slot and every query position + 1."""
        if streams < 1 or slot_capacity < 1:
            raise SpinError(f"SpinState: streams ({streams}) and slot_capacity "
                            f"({slot_capacity}) must be >= 1")
        blocks = -(-slot_capacity // cfg.block_size)
        cap = blocks if cfg.reduction == "A2" else slot_capacity
        dtype = getattr(torch, cfg.state_dtype)
        return cls(V=torch.zeros(streams, cap, dtype=dtype, device=device),
                   D=torch.zeros(streams, cap, dtype=dtype, device=device),
                   last_seen=torch.zeros(streams, blocks, dtype=torch.int64, device=device),
                   decode_steps=torch.zeros(streams, dtype=torch.int64, device=device))

    def reset(self, which: Optional[torch.Tensor] = None, step: int | torch.Tensor = 0) -> None:
        """Zero V/D and restart warm-up for the streams in `which` (bool [G]; None = all)."""
        if which is None:
            which = torch.ones(self.V.shape[0], dtype=torch.bool, device=self.V.device)
        state_bits(self.V)[which] = 0
        state_bits(self.D)[which] = 0
        step = torch.as_tensor(step, dtype=torch.int64, device=self.V.device).expand(which.shape)
        self.last_seen[which] = step[which].unsqueeze(-1)
        self.decode_steps[which] = 0


def state_bits(t: torch.Tensor) -> torch.Tensor:
    """V or D viewed as integers of the same width. Zero bits are +0.0 in every state dtype, and
    torch implements fills on this view that it lacks for float8."""
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


@dataclass
class Selection:
    mask: torch.Tensor       # bool [G, NB]: union of the row masks, the indexer's input
    row_mask: torch.Tensor   # bool [G, R, NB]: each row's own mask
    budget: torch.Tensor     # int64 [G, R]: m_t of each row (= selected count of its mask)
    n_blocks: torch.Tensor   # int64 [G, R]: B_t of each row
    dense: torch.Tensor      # bool [G]: warm-up streams (every block selected)

    @property
    def eligible(self) -> torch.Tensor:
        """bool [G, R]: non-warm-up rows that actually skip blocks (m_t < B_t)."""
        return (~self.dense).unsqueeze(-1) & (self.budget < self.n_blocks)


# ---- prediction -------------------------------------------------------------------------------
def predict_scores(V: torch.Tensor, D: torch.Tensor, n: torch.Tensor, q: torch.Tensor,
                   width: int) -> torch.Tensor:
    """fp32 [G, R, width]: max(V[i], D[q - i]) for i < n, -inf elsewhere."""
    _check_capacity_vd(V, D, width, q)
    i = torch.arange(width, device=V.device)
    valid = i < n.unsqueeze(-1)
    offsets = (q.unsqueeze(-1) - i).clamp(min=0)
    d = D.float().gather(1, offsets.flatten(1)).view_as(offsets)
    pred = torch.maximum(V[:, :width].float().unsqueeze(1), d)
    return pred.masked_fill(~valid, NEG_INF)


def _check_capacity_vd(V: torch.Tensor, D: torch.Tensor, width: int, q: torch.Tensor) -> None:
    if width > V.shape[1]:
        raise SpinError(f"state capacity {V.shape[1]} is smaller than the {width} visible "
                        f"positions; allocate SpinState with a larger slot_capacity")
    if q.numel() and bool((q >= D.shape[1]).any()):
        raise SpinError(f"query position {int(q.max())} is past the D state capacity "
                        f"{D.shape[1]}; allocate SpinState with a larger slot_capacity")


def pool_blocks(x: torch.Tensor, block_size: int, pooling: str) -> torch.Tensor:
    """[..., W] (-inf = not visible) -> [..., ceil(W/b)]; blocks with nothing visible: -inf."""
    width = x.shape[-1]
    nb = -(-width // block_size)
    pad = nb * block_size - width
    if pad:
        x = torch.nn.functional.pad(x, (0, pad), value=NEG_INF)
    x = x.view(*x.shape[:-1], nb, block_size)
    if pooling == "max":
        return x.amax(-1)
    if pooling == "top4":
        x = x.topk(min(4, block_size), dim=-1).values
    elif pooling != "mean":
        raise SpinError(f"pooling: unknown method {pooling!r}")
    finite = torch.isfinite(x)
    count = finite.sum(-1)
    total = torch.where(finite, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1)
    return torch.where(count > 0, total / count.clamp(min=1), NEG_INF)


def predict_blocks(state: SpinState, n: torch.Tensor, q: torch.Tensor, cfg: SpinConfig,
                   width: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(block scores fp32 [G, R, ceil(width/b)], slot predictions [G, R, width] or None for A2)."""
    b = cfg.block_size
    if cfg.reduction == "A2":
        nb = -(-width // b)
        return predict_scores(state.V, state.D, block_count(n, b), q // b, nb), None
    slots = predict_scores(state.V, state.D, n, q, width)
    return pool_blocks(slots, b, cfg.pooling), slots


# ---- selection --------------------------------------------------------------------------------
def _rank_desc(key: torch.Tensor, eligible: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rank of every entry by descending key along the last dim; ties: lower index first. With
    `eligible`, every eligible entry ranks before every other one (whatever their keys: an
    eligible -inf before an ineligible entry, as the kernels rank only the eligible)."""
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    if eligible is not None:
        first = eligible.gather(-1, order).to(torch.int8)
        order = order.gather(-1, torch.sort(first, dim=-1, descending=True, stable=True).indices)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(key.shape[-1], device=key.device).expand_as(order))
    return rank


def _take_top(key: torch.Tensor, count: torch.Tensor,
              eligible: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The `count` highest-ranked entries (of the eligible ones, when given)."""
    top = _rank_desc(key, eligible) < count.unsqueeze(-1)
    return top if eligible is None else top & eligible


def _explore_priority(cfg: SpinConfig, candidates: torch.Tensor, scores: torch.Tensor,
                      last_seen: torch.Tensor, request: torch.Tensor, layer: torch.Tensor,
                      step: torch.Tensor) -> torch.Tensor:
    """float64 [G, R, NB] priority of candidate blocks (-inf for non-candidates)."""
    nb = candidates.shape[-1]
    if cfg.exploration_policy == "random":
        blocks = torch.arange(nb, device=candidates.device)
        pri = counter_hash(cfg.seed, request[:, None], layer[:, None], step[:, None], blocks)
        pri = pri.to(torch.float64).unsqueeze(1).expand(candidates.shape)
    else:
        age = (step[:, None] - last_seen[:, :nb]).clamp(min=0).to(torch.float64).unsqueeze(1)
        pri = age.expand(candidates.shape)
        if cfg.exploration_policy == "staleness":
            # fp32, one rounding per operation, so the kernels can match bit for bit
            # over the candidates' finite scores; a non-finite one (a block the given scores
            # do not cover) is ranked by its age alone
            s = scores.float()
            finite = candidates & torch.isfinite(s)
            lo = torch.where(finite, s, torch.inf).amin(-1, keepdim=True)
            hi = torch.where(finite, s, -torch.inf).amax(-1, keepdim=True)
            span = hi - lo
            norm = torch.where((span > 0) & finite,
                               (s - lo) / torch.where(span > 0, span, 1.0), 0.0)
            pri = (pri.float() * (1.0 + norm)).to(torch.float64)
    return torch.where(candidates, pri, -torch.inf)


def rank_share(x: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """fp32 [..., NB]: #{visible j' : x[j'] < x[j]} / max(B - 1, 1) for visible j, -inf
    elsewhere (B = visible count); a NaN score ranks as -inf."""
    x = x.float().nan_to_num(nan=-torch.inf, posinf=torch.inf, neginf=-torch.inf)
    key = torch.where(visible, x, torch.inf)
    ordered = key.sort(-1).values
    below = torch.searchsorted(ordered.contiguous(), key.contiguous(), right=False)
    count = visible.sum(-1, keepdim=True)
    share = below.float() / (count - 1).clamp(min=1).float()
    return share.masked_fill(~visible, NEG_INF)


def hybrid_scores(probe: torch.Tensor, spin: torch.Tensor, n_blocks: torch.Tensor) -> torch.Tensor:
    """The hybrid predictor: max of the rank shares of the probe's block scores and of SPIN's
    block prediction, over the visible blocks j < n_blocks (fp32; -inf elsewhere)."""
    visible = torch.arange(probe.shape[-1], device=probe.device) < n_blocks.unsqueeze(-1)
    return torch.maximum(rank_share(probe, visible), rank_share(spin, visible))


def select_blocks(block_scores: torch.Tensor, slot_pred: Optional[torch.Tensor], n: torch.Tensor,
                  state: SpinState, cfg: SpinConfig, target_sparsity: torch.Tensor,
                  request: torch.Tensor,
                  layer: torch.Tensor, step: torch.Tensor) -> Selection:
    """Choose the blocks every row of every stream scores this step.

    block_scores [G, R, NB]; slot_pred [G, R, W] (needed for A0); n, q-independent;
    target_sparsity float [G] per stream; request/layer/step int [G] (RNG counters).
    """
    G, R, NB = block_scores.shape
    dev = block_scores.device
    b = cfg.block_size
    # a NaN block score (given scores) ranks as -inf, as in the kernels
    block_scores = block_scores.nan_to_num(nan=NEG_INF, posinf=torch.inf, neginf=NEG_INF)
    nblk = block_count(n, b)                                      # [G, R]
    j = torch.arange(NB, device=dev)
    valid = j < nblk.unsqueeze(-1)                                # [G, R, NB]
    forced = torch.zeros_like(valid)
    if cfg.keep_sink:
        forced |= (j == 0) & valid
    if cfg.keep_newest:
        forced |= j == (nblk - 1).unsqueeze(-1)
    n_forced = forced.sum(-1)
    rho_r = torch.as_tensor(target_sparsity).to(torch.float64).view(G, 1).expand(G, R)

    if cfg.reduction == "A0":
        width = slot_pred.shape[-1]
        nb_f = nblk.to(torch.float64)
        # -B ln(rho) slots would expand to (1 - rho) B blocks if they were scattered uniformly
        scattered = ceil_tol(-nb_f * torch.log(rho_r.clamp(min=1e-300)))
        keep_slots = torch.where(rho_r > 0, torch.minimum(n.to(torch.int64), scattered),
                                 n.to(torch.int64))
        slot_sel = _take_top(slot_pred, keep_slots) & torch.isfinite(slot_pred)
        pad = NB * b - width
        if pad:
            slot_sel = torch.nn.functional.pad(slot_sel, (0, pad), value=False)
        chosen = slot_sel.view(G, R, NB, b).any(-1) | forced
        # keep room for K slots: top up to ceil(K/b) blocks with the best remaining ones
        deficit = (torch.minimum(nblk, budget_floor(nblk, cfg, n))
                   - chosen.sum(-1)).clamp(min=0)
        chosen |= _take_top(block_scores, deficit, valid & ~chosen)
        m0 = chosen.sum(-1)
        n_explore = torch.minimum(floor_tol(cfg.exploration * m0.to(torch.float64)), nblk - m0)
    else:
        m = torch.maximum(block_budget(nblk, rho_r, cfg, n), n_forced)
        n_explore = torch.minimum(floor_tol(cfg.exploration * m.to(torch.float64)), m - n_forced)
        # forced blocks first, then the best of the rest (ranked without them, so no score,
        # not even an overflowed +inf or a -inf, can tie with a forced block)
        chosen = forced | _take_top(block_scores, m - n_explore - n_forced, valid & ~forced)

    if cfg.exploration > 0:
        candidates = valid & ~chosen
        pri = _explore_priority(cfg, candidates, block_scores, state.last_seen, request, layer,
                                step)
        chosen |= _take_top(pri, n_explore.clamp(min=0), candidates)

    dense = state.decode_steps < cfg.warmup_steps                 # [G]
    row_mask = torch.where(dense.view(G, 1, 1), valid, chosen)
    if cfg.mtp_mask == "union" or R == 1:
        mask = row_mask.any(1)
        budget = row_mask.sum(-1)
    else:
        beyond_row0 = j >= nblk[:, :1].unsqueeze(-1)
        mask = row_mask[:, 0] | (valid & beyond_row0).any(1)
        # rows past 0 have no mask of their own: their m_t is what the shared mask gives them
        budget = (mask.unsqueeze(1) & valid).sum(-1)
    return Selection(mask=mask, row_mask=row_mask, budget=budget, n_blocks=nblk, dense=dense)


# ---- EMA update -------------------------------------------------------------------------------
def update_state(state: SpinState, scores: torch.Tensor, mask: torch.Tensor, n: torch.Tensor,
                 q: torch.Tensor, accepted: torch.Tensor, cfg: SpinConfig,
                 step: torch.Tensor) -> None:
    """Deferred EMA update from the indexer scores of the scored slots.

    scores fp32 [G, R, W] in slot coordinates (only slots of `mask` blocks are read);
    mask bool [G, NB] (the union the indexer scored); accepted int [G] accepted drafts.
    """
    G, R, W = scores.shape
    b = cfg.block_size
    if cfg.reduction == "A2":
        _check_capacity_vd(state.V, state.D, -(-W // b), q // b)
    else:
        _check_capacity_vd(state.V, state.D, W, q)
    a = cfg.ema_decay
    dev = scores.device
    accepted = accepted.to(torch.int64).to(dev).clamp(min=0)      # row 0 is always valid
    rows = 1 if cfg.mtp_update == "row0" else R
    nb = mask.shape[-1]
    i = torch.arange(W, device=dev)
    slot_in_mask = mask.repeat_interleave(b, dim=-1)[:, :W] if nb * b >= W else None
    if slot_in_mask is None:
        raise SpinError(f"mask covers {nb} blocks but scores have {W} slots")
    for r in range(rows):
        active = r <= accepted                                     # [G]
        z = scores[:, r].float()
        observed = torch.isfinite(z)
        if cfg.reduction == "A2":
            # Block-level EMA from the pooled scores of the row's visible slots.
            pooled = pool_blocks(z.masked_fill((i >= n[:, r, None]) | ~observed, NEG_INF), b,
                                 cfg.pooling)
            k = pooled.shape[-1]
            scored = mask[:, :k] & torch.isfinite(pooled) & active[:, None]
            _ema_vd(state, pooled, scored, q[:, r] // b, a)
        else:
            scored = slot_in_mask & (i < n[:, r, None]) & observed & active[:, None]
            _ema_vd(state, z, scored, q[:, r], a)
    mark_scored(state, mask, step)


def mark_scored(state: SpinState, mask: torch.Tensor, step: torch.Tensor) -> None:
    """The step's counters, with or without the EMAs: last_seen[j] = step for every block of
    the union `mask` (bool [G, NB]) and one more decode step."""
    nb = mask.shape[-1]
    state.last_seen[:, :nb] = torch.where(mask, step[:, None].to(torch.int64),
                                          state.last_seen[:, :nb])
    state.decode_steps += 1


def _ema_vd(state: SpinState, z: torch.Tensor, scored: torch.Tensor, q: torch.Tensor,
            a: float) -> None:
    """V[p] and D[q - p] <- a * old + (1 - a) * z[p] for scored positions p (< z's width).

    D is updated by gathering, per offset o, the position p = q - o: dense ops, no scatter."""
    width = z.shape[-1]
    V = state.V[:, :width]
    state.V[:, :width] = torch.where(scored, _store(a * V.float() + (1.0 - a) * z, V.dtype), V)
    d_width = min(state.D.shape[1], int(q.max()) + 1)
    pos = q.unsqueeze(-1) - torch.arange(d_width, device=z.device)     # p = q - o
    inside = (pos >= 0) & (pos < width)
    pos = pos.clamp(0, width - 1)
    hit = inside & scored.gather(1, pos)
    D = state.D[:, :d_width]
    d_new = a * D.float() + (1.0 - a) * z.gather(1, pos)
    state.D[:, :d_width] = torch.where(hit, _store(d_new, D.dtype), D)


def _store(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast to the state dtype (round to nearest even), saturating at its largest finite value
    (fp16 and float8_e4m3fn overflow)."""
    big = torch.finfo(dtype).max
    return x.clamp(-big, big).to(dtype)


# ---- one decode step (select -> score -> update) ----------------------------------------------
def decode_step(state: SpinState, cfg: SpinConfig, dense_scores: torch.Tensor, n: torch.Tensor,
                q: torch.Tensor, accepted: torch.Tensor, target_sparsity: torch.Tensor,
                request: torch.Tensor, layer: torch.Tensor, step: torch.Tensor,
                block_scores: Optional[torch.Tensor] = None,
                ) -> tuple[Selection, Optional[torch.Tensor]]:
    """Replay one step from known dense scores: predict, select, update. Returns the selection
    and the slot-level predictions (None for A2, or when block_scores is given).

    block_scores fp32 [G, R, ceil(W/b)], optional: the block scores selection ranks by, in
    place of SPIN's V/D prediction (the query-aware predictors of spin_trtllm.replay.probe).
    Only the ranking input changes: budget, forced blocks, exploration and the MTP rules are
    select_blocks' as for SPIN, and the V/D update still learns from the scored slots. A0
    selects slots from SPIN's slot predictions, so it takes no block_scores."""
    width = dense_scores.shape[-1]
    if block_scores is None:
        blocks, slot_pred = predict_blocks(state, n, q, cfg, width)
    elif cfg.reduction == "A0":
        raise SpinError("block_scores: reduction A0 ranks slots, not blocks; use A1 or A2")
    else:
        blocks, slot_pred = block_scores.float(), None
    sel = select_blocks(blocks, slot_pred, n, state, cfg, target_sparsity, request, layer, step)
    update_state(state, dense_scores, sel.mask, n, q, accepted, cfg, step)
    return sel, slot_pred


def block_list(mask: torch.Tensor, m_cap: int,
               truncate: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [G, NB] -> (int32 [G, m_cap] ascending block ids, -1 padded; int32 [G] counts).

    A union larger than m_cap is an error, or with truncate=True keeps its m_cap lowest ids
    while counts still report the full size (the op contract: callers size m_cap)."""
    counts = mask.sum(-1)
    if not truncate and mask.shape[0] and int(counts.max()) > m_cap:
        raise SpinError(f"block_list: {int(counts.max())} selected blocks exceed m_cap {m_cap}")
    nb = mask.shape[-1]
    ids = torch.arange(nb, device=mask.device).expand_as(mask)
    key = torch.where(mask, ids, nb)
    ordered = key.sort(-1).values[:, :m_cap]
    if ordered.shape[-1] < m_cap:
        ordered = torch.nn.functional.pad(ordered, (0, m_cap - ordered.shape[-1]), value=nb)
    return torch.where(ordered == nb, -1, ordered).to(torch.int32), counts.to(torch.int32)


# the specification of the ops that read the paged FP8 K cache
from .paged import (FP8_MAX, MAX_SLOT_ID, block_scores, compact_block_table,  # noqa: E402,F401
                    dequantize_pages, dequantize_summaries, e4m3_query_of_mxfp4, gauss_scores,
                    masked_indexer_logits, newest_pages, page_layout, paged_logits_schedule,
                    probe_scores, remap_positions, summarize_pages, summarize_pages_gauss,
                    table_pages, topk_slots)
