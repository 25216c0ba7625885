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
               candidates (0 when they are all equal), in fp32: staleness weighted by
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

from .config import SpinConfig
from .errors import SpinError

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


def block_budget(n_blocks: torch.Tensor, rho: torch.Tensor, cfg: SpinConfig,
                 n: Optional[torch.Tensor] = None) -> torch.Tensor:
    """m = min(B, max(floor, ceil((1 - rho) B))), int64, broadcast over rho; floor from
    budget_floor (n: the rows' visible slots)."""
    keep = ceil_tol((1.0 - torch.as_tensor(rho).to(torch.float64)) * n_blocks.to(torch.float64))
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
def _rank_desc(key: torch.Tensor) -> torch.Tensor:
    """Rank of every entry by descending key along the last dim; ties: lower index first."""
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(key.shape[-1], device=key.device).expand_as(order))
    return rank


def _take_top(key: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return _rank_desc(key) < count.unsqueeze(-1)


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
            s = scores.float()
            lo = torch.where(candidates, s, torch.inf).amin(-1, keepdim=True)
            hi = torch.where(candidates, s, -torch.inf).amax(-1, keepdim=True)
            span = hi - lo
            norm = torch.where(span > 0, (s - lo) / torch.where(span > 0, span, 1.0), 0.0)
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
                  state: SpinState, cfg: SpinConfig, rho: torch.Tensor, request: torch.Tensor,
                  layer: torch.Tensor, step: torch.Tensor) -> Selection:
    """Choose the blocks every row of every stream scores this step.

    block_scores [G, R, NB]; slot_pred [G, R, W] (needed for A0); n, q-independent;
    rho float [G] target sparsity per stream; request/layer/step int [G] (RNG counters).
    """
    G, R, NB = block_scores.shape
    dev = block_scores.device
    b = cfg.block_size
    nblk = block_count(n, b)                                      # [G, R]
    j = torch.arange(NB, device=dev)
    valid = j < nblk.unsqueeze(-1)                                # [G, R, NB]
    forced = torch.zeros_like(valid)
    if cfg.keep_sink:
        forced |= (j == 0) & valid
    if cfg.keep_newest:
        forced |= j == (nblk - 1).unsqueeze(-1)
    n_forced = forced.sum(-1)
    rho_r = torch.as_tensor(rho).to(torch.float64).view(G, 1).expand(G, R)

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
        rest = block_scores.masked_fill(chosen | ~valid, NEG_INF)
        chosen |= _take_top(rest, deficit) & valid & ~chosen
        m0 = chosen.sum(-1)
        n_explore = torch.minimum(floor_tol(cfg.exploration * m0.to(torch.float64)), nblk - m0)
    else:
        m = torch.maximum(block_budget(nblk, rho_r, cfg, n), n_forced)
        n_explore = torch.minimum(floor_tol(cfg.exploration * m.to(torch.float64)), m - n_forced)
        # forced blocks first, then the best of the rest (ranked without them, so no score,
        # not even an overflowed +inf, can tie with a forced block)
        rest = block_scores.masked_fill(forced | ~valid, NEG_INF)
        chosen = forced | (_take_top(rest, m - n_explore - n_forced) & valid & ~forced)

    if cfg.exploration > 0:
        candidates = valid & ~chosen
        pri = _explore_priority(cfg, candidates, block_scores, state.last_seen, request, layer,
                                step)
        chosen |= _take_top(pri, n_explore.clamp(min=0)) & candidates

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
                q: torch.Tensor, accepted: torch.Tensor, rho: torch.Tensor,
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
    sel = select_blocks(blocks, slot_pred, n, state, cfg, rho, request, layer, step)
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


# ---- the paged FP8 indexer and top-K over compact logits (spec of the native ops) ------------
PAGE_SLOTS = 64
MAX_SLOT_ID = 2**31 - 1          # slot ids are int32
KEY_BYTES = 128
SLOT_BYTES = KEY_BYTES + 4


def dequantize_pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """uint8 pages (64 fp8 rows of 128 B, then 64 fp32 scales) -> float32 keys [P, 64, 128]."""
    pages = kv_cache.reshape(kv_cache.shape[0], PAGE_SLOTS * SLOT_BYTES)
    rows = pages[:, :PAGE_SLOTS * KEY_BYTES].contiguous().view(torch.float8_e4m3fn).float()
    scales = pages[:, PAGE_SLOTS * KEY_BYTES:].contiguous().view(torch.float32)
    return rows.view(-1, PAGE_SLOTS, KEY_BYTES) * scales.unsqueeze(-1)


# ---- block summaries and the probe (issue 17: query-aware block scores) ------------------------
# One summary row per K-cache page, kept beside the cache and addressed by the same page ids:
# the mean of the page's first `fill` dequantized keys, re-quantized like a key (e4m3, scale =
# amax / 448), in a 144-byte row (128 fp8 bytes, the fp32 scale, 12 bytes of padding, so rows
# stay 16-byte aligned).
SUMMARY_BYTES = 144
FP8_MAX = 448.0


def table_pages(block_table: torch.Tensor, ids: torch.Tensor,
                num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages of block ids [B, J] through block_table int32 [B, max_pages]: (int64 [B, J] page,
    0 where not live; bool [B, J] live: the id is a table column and its page lies in
    [0, num_pages), so it may be read)."""
    table = block_table.to(torch.int64)
    if table.shape[1] == 0:                        # no pages at all: nothing is read
        table = torch.full((ids.shape[0], 1), -1, dtype=torch.int64, device=ids.device)
    pages = table.gather(1, ids.clamp(0, table.shape[1] - 1))
    live = (ids >= 0) & (ids < block_table.shape[1]) & (pages >= 0) & (pages < num_pages)
    return torch.where(live, pages, 0), live


def summarize_pages(kv_cache: torch.Tensor, pages: torch.Tensor,
                    fill: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summaries of K-cache pages: (fp8 e4m3 keys as uint8 [P, 128], fp32 scales [P]).

    Page pages[i]'s summary is mean_{s < f} k_s over its first f = clamp(fill[i], 0, 64)
    dequantized keys (the products fp8 * scale in fp32, summed in fp64, the mean cast to fp32),
    quantized with scale = max(amax / 448, 1e-12) (fp32) and round-to-nearest e4m3; f = 0 gives
    a zero key."""
    keys = dequantize_pages(kv_cache[pages.long().clamp(0, kv_cache.shape[0] - 1)])
    f = fill.long().clamp(0, PAGE_SLOTS)
    valid = torch.arange(PAGE_SLOTS, device=keys.device) < f.unsqueeze(-1)
    total = torch.where(valid.unsqueeze(-1), keys.double(), 0.0).sum(1)
    mean = (total / f.clamp(min=1).unsqueeze(-1).double()).float()
    scale = (mean.abs().amax(-1) / FP8_MAX).clamp(min=1e-12)
    rows = (mean / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
    return rows, scale


def dequantize_summaries(summaries: torch.Tensor) -> torch.Tensor:
    """uint8 [P, 144] summary rows -> float32 keys [P, 128]."""
    rows = summaries[:, :KEY_BYTES].contiguous().view(torch.float8_e4m3fn).float()
    scales = summaries[:, KEY_BYTES:KEY_BYTES + 4].contiguous().view(torch.float32)
    return rows * scales


def probe_scores(q: torch.Tensor, summaries: torch.Tensor, weights: torch.Tensor,
                 context_lens: torch.Tensor, block_table: torch.Tensor, num_blocks: int,
                 dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """P[b*R + r, j] = sum_h w_h ReLU(q_h . s_j) for blocks j < num_blocks, s_j the summary of
    page block_table[b, j] (the block's mean key, scored like a slot). -inf where block j has
    no visible slot (64 j >= context_lens[b, r]), is past the block table, or its page is
    outside the summaries (never read). [B*R, num_blocks]."""
    B, R = context_lens.shape
    qf = q.float().to(dtype).view(B, R, q.shape[-2], q.shape[-1])
    w = weights.to(dtype).view(B, R, -1)
    j = torch.arange(num_blocks, device=q.device)
    pages, live = table_pages(block_table, j.expand(B, -1), summaries.shape[0])   # [B, J]
    keys = dequantize_summaries(summaries)[pages].to(dtype)                        # [B, J, 128]
    z = (torch.relu(torch.einsum("brhd,bjd->brjh", qf, keys)) * w[:, :, None, :]).sum(-1)
    visible = live.unsqueeze(1) & (j * PAGE_SLOTS < context_lens.to(torch.int64).unsqueeze(-1))
    return z.masked_fill(~visible, float("-inf")).reshape(B * R, num_blocks)


def masked_indexer_logits(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                          context_lens: torch.Tensor, block_table: torch.Tensor,
                          block_ids: torch.Tensor, counts: torch.Tensor,
                          dtype: torch.dtype = torch.float64, chunk: int = 256) -> torch.Tensor:
    """z[i] = sum_h w_h ReLU(q_h . k_i) over the selected blocks, compact [B*R, m_cap*64].

    Slot (c, s) is block block_ids[b, c], slot s. -inf where c >= min(count, m_cap), the block
    id is outside the block table, its page is outside the cache (never read), or the slot is
    past the row's causal length context_lens[b, r]."""
    B, R = context_lens.shape
    m_cap = block_ids.shape[1]
    num_pages = kv_cache.shape[0]
    qf = q.float().to(dtype).view(B, R, q.shape[-2], q.shape[-1])
    w = weights.to(dtype).view(B, R, -1)
    c = torch.arange(m_cap, device=q.device)
    ids = block_ids.to(torch.int64)
    pages, live = table_pages(block_table, ids, num_pages)
    live &= c < counts.to(torch.int64).clamp(max=m_cap).unsqueeze(-1)
    pages = torch.where(live, pages, 0)
    out = torch.zeros(B, R, m_cap, PAGE_SLOTS, dtype=dtype, device=q.device)
    # only the pages of live blocks are read and dequantized, chunk by chunk (on the CPU the
    # live range is known without a sync; on CUDA, where graphs may capture this, all chunks)
    last = m_cap
    if q.device.type == "cpu":
        any_live = live.any(0)
        last = int(torch.nonzero(any_live).max()) + 1 if bool(any_live.any()) else 0
    for start in range(0, last, chunk):
        sub = pages[:, start:start + chunk]
        k = dequantize_pages(kv_cache[sub.reshape(-1)]).to(dtype).view(
            B, sub.shape[1], PAGE_SLOTS, -1)                           # [B, c, 64, 128]
        dots = torch.einsum("brhd,bcsd->brcsh", qf, k)
        out[:, :, start:start + chunk] = (torch.relu(dots) * w[:, :, None, None, :]).sum(-1)
    slot = ids.unsqueeze(-1) * PAGE_SLOTS + torch.arange(PAGE_SLOTS, device=q.device)
    visible = slot.unsqueeze(1) < context_lens.to(torch.int64)[:, :, None, None]
    out = out.masked_fill(~(live[:, None, :, None] & visible), float("-inf"))
    return out.reshape(B * R, m_cap * PAGE_SLOTS)


def topk_slots(logits: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor, next_n: int,
               k: int, row_lens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int32 [B*R, k]: top-k request-local slot ids of the compact logits, ascending, -1
    padded. Only finite scores of selected blocks (and, with row_lens [B, R], positions below
    the row's compact length) compete; ties go to the lower slot id."""
    rows, width = logits.shape
    if width == 0 or k == 0:
        return torch.full((rows, k), -1, dtype=torch.int32, device=logits.device)
    pos = torch.arange(width, device=logits.device)
    scored = (counts.to(torch.int64).clamp(max=block_ids.shape[1]) * PAGE_SLOTS)
    valid = (pos < scored.repeat_interleave(next_n).unsqueeze(-1)) & torch.isfinite(logits)
    if row_lens is not None:
        valid &= pos < row_lens.reshape(-1, 1).to(torch.int64)
    key = torch.where(valid, logits.float(), float("-inf"))
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :k]
    take = torch.arange(order.shape[1], device=logits.device) < valid.sum(-1, keepdim=True)
    chosen = torch.where(take, order, width).sort(-1).values           # ascending positions
    ids = block_ids.to(torch.int64).repeat_interleave(next_n, 0)
    blk = ids.gather(1, (chosen // PAGE_SLOTS).clamp(max=block_ids.shape[1] - 1))
    slots = blk * PAGE_SLOTS + chosen % PAGE_SLOTS
    # a block id that is negative, or whose slots do not fit int32, gives -1
    slots = torch.where((chosen < width) & (blk >= 0) & (slots <= MAX_SLOT_ID), slots, -1)
    out = torch.full((rows, k), -1, dtype=torch.int32, device=logits.device)
    out[:, :slots.shape[1]] = slots.to(torch.int32)
    return out


# ---- a compacted block table for an external paged logits kernel (spec of compact/remap) ------
def compact_block_table(block_ids: torch.Tensor, counts: torch.Tensor, context_lens: torch.Tensor,
                        block_table: torch.Tensor, page_slots: int,
                        width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 [B, width] compact table, int32 [B, R] compact lengths) of the selected blocks.

    With ppb = 64 // page_slots pages per block, entry k*ppb + p is block_table[b, ids[k]*ppb + p]
    for the used blocks k < min(count, m_cap) with ids[k] >= 0 and that column < max_pages; any
    other entry is 0. Row j's length is the sum over the used blocks of
    clamp(context_lens[b, j] - 64 ids[k], 0, 64): with ascending ids the visible slots of a row
    are a prefix of the compact order, compact position k*64 + s being slot ids[k]*64 + s."""
    B, m_cap = block_ids.shape
    ppb = PAGE_SLOTS // page_slots
    dev = block_ids.device
    ids = block_ids.to(torch.int64)
    used = (torch.arange(m_cap, device=dev) < counts.to(torch.int64).clamp(max=m_cap)[:, None]) \
        & (ids >= 0)                                                   # [B, m_cap]
    cols = (ids[:, :, None] * ppb + torch.arange(ppb, device=dev)).flatten(1)   # [B, m_cap*ppb]
    max_pages = block_table.shape[1]
    live = used.repeat_interleave(ppb, 1) & (cols < max_pages)
    pages = torch.zeros_like(cols)
    if max_pages:
        pages = block_table.to(torch.int64).gather(1, cols.clamp(0, max_pages - 1))
    table = torch.zeros(B, width, dtype=torch.int32, device=dev)
    table[:, :m_cap * ppb] = torch.where(live, pages, 0).to(torch.int32)
    first = ids[:, None, :] * PAGE_SLOTS
    seen = (context_lens.to(torch.int64)[:, :, None] - first).clamp(0, PAGE_SLOTS)
    lens = (seen * used[:, None, :]).sum(-1)
    return table, lens.to(torch.int32)


def remap_positions(positions: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor,
                    next_n: int, values: Optional[torch.Tensor] = None,
                    ascending: bool = False,
                    scores: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int32 [B*next_n, K]: compact positions (-1 padded) -> request-local slot ids.

    Position pos of row r (request r // next_n) becomes ids[pos // 64] * 64 + pos % 64 when
    0 <= pos < min(count, m_cap) * 64, that id is >= 0, (values given) values[r, i] is finite
    and (scores given: [B*next_n, >= m_cap * 64], the rows the positions index) scores[r, pos]
    is finite, else -1. The order is kept, or with ascending each row is sorted, -1 last."""
    slots = _remap(positions, block_ids, counts, next_n)
    if values is not None:
        slots = torch.where(torch.isfinite(values), slots, -1)
    if scores is not None and scores.shape[1] > 0:   # no columns: every slot is -1 already
        at = torch.where(slots >= 0, positions.long(), 0)
        slots = torch.where(torch.isfinite(scores.gather(1, at)), slots, -1)
    if ascending:
        last = torch.iinfo(torch.int32).max
        slots = torch.where(slots < 0, last, slots).sort(-1).values
        slots = torch.where(slots == last, -1, slots)
    return slots


def _remap(positions: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor,
           next_n: int) -> torch.Tensor:
    rows, _ = positions.shape
    m_cap = block_ids.shape[1]
    pos = positions.to(torch.int64)
    scored = counts.to(torch.int64).clamp(max=m_cap).repeat_interleave(next_n) * PAGE_SLOTS
    inside = (pos >= 0) & (pos < scored[:, None])
    if m_cap == 0:
        return torch.full_like(positions, -1, dtype=torch.int32)
    ids = block_ids.to(torch.int64).repeat_interleave(next_n, 0)
    block = ids.gather(1, torch.where(inside, pos // PAGE_SLOTS, 0))
    slots = block * PAGE_SLOTS + pos % PAGE_SLOTS
    return torch.where(inside & (block >= 0), slots, -1).to(torch.int32)
