"""Hypothesis property tests of spin_trtllm.reference against an independent pure-Python
oracle written from the module docstring (the spec) and the paper (arXiv 2610.09025).

The oracle below (`oracle_*`) re-derives budgets, forced blocks, exploration, pooling, MTP
masks and the deferred EMA replay with plain Python integers/floats; it never calls the code
under test. Budgets use exact integer arithmetic on percentages (rho = p / 100), which is what
the 1e-6 tolerance of the spec is meant to reproduce.
"""

from __future__ import annotations

import math
from typing import Optional
from dataclasses import dataclass

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from spin_trtllm import SpinConfig
from spin_trtllm.reference import (
    SpinState,
    state_bits,
    block_budget,
    block_list,
    decode_step,
    select_blocks,
    update_state,
)
from spin_trtllm.testing.hash_oracle import py_hash

INF = float("inf")
M32 = 0xFFFFFFFF
SETTINGS = settings(max_examples=80, deadline=None)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def oracle_floor(B: int, K: int, b: int, n: Optional[int] = None) -> int:
    """Blocks that hold K visible slots whichever they are: ceil((K + empty slots of a partly
    filled newest block) / b)."""
    return ceil_div(K + (0 if n is None else max(B * b - n, 0)), b)


def oracle_budget(B: int, rho_pct: int, K: int, b: int, n: Optional[int] = None) -> int:
    """min(B, max(floor, ceil((1 - rho) B))) with rho = rho_pct / 100, exactly."""
    return min(B, max(oracle_floor(B, K, b, n), ceil_div((100 - rho_pct) * B, 100)))


def oracle_forced(B: int, cfg: SpinConfig) -> set[int]:
    f = set()
    if B >= 1 and cfg.keep_sink:
        f.add(0)
    if B >= 1 and cfg.keep_newest:
        f.add(B - 1)
    return f


def top_ids(key: dict[int, float], count: int) -> list[int]:
    """The `count` ids of highest key, ties to the lower id."""
    return sorted(key, key=lambda j: (-key[j], j))[:max(count, 0)]


def oracle_explore(cfg, candidates, scores_row, last_seen, request, layer, step, e):
    if e <= 0 or not candidates:
        return set()
    pol = cfg.exploration_policy
    if pol == "random":
        pri = {j: float(py_hash(cfg.seed, request, layer, step, j)) for j in candidates}
    else:
        age = {j: float(max(step - last_seen[j], 0)) for j in candidates}
        pri = dict(age)
        if pol == "staleness":
            # fp32, one rounding per operation (the spec): a double-precision priority can
            # order two near-equal blocks the other way
            f32 = lambda x: _round(x, torch.float32)   # noqa: E731
            s = {j: float(scores_row[j]) for j in candidates}
            lo, hi = min(s.values()), max(s.values())
            span = f32(hi - lo)
            pri = {j: f32(age[j] * f32(1.0 + (f32(f32(s[j] - lo) / span) if span > 0 else 0.0)))
                   for j in candidates}
    return set(top_ids(pri, e))


def oracle_row(cfg, n, rho_pct, scores_row, slot_row, last_seen, request, layer, step,
               dense) -> tuple[set[int], int]:
    """(selected block ids, expected budget) of one MTP row."""
    b, K = cfg.block_size, cfg.index_topk
    B = ceil_div(n, b)
    if dense:
        return set(range(B)), B
    forced = oracle_forced(B, cfg)
    gp = round(cfg.exploration * 100)
    if cfg.reduction == "A0":
        s = n if rho_pct == 0 else min(n, math.ceil(-B * math.log(rho_pct / 100) - 1e-6))
        slots = top_ids({i: float(slot_row[i]) for i in range(n)}, s)
        chosen = {i // b for i in slots} | forced
        deficit = min(B, oracle_floor(B, K, b, n)) - len(chosen)
        if deficit > 0:
            rest = {j: float(scores_row[j]) for j in range(B) if j not in chosen}
            chosen |= set(top_ids(rest, deficit))
        m0 = len(chosen)
        e = min(gp * m0 // 100, B - m0) if gp else 0
    else:
        m = max(oracle_budget(B, rho_pct, K, b, n), len(forced))
        e = min(gp * m // 100, m - len(forced)) if gp else 0
        rest = {j: float(scores_row[j]) for j in range(B) if j not in forced}
        chosen = forced | set(top_ids(rest, m - e - len(forced)))
    cand = [j for j in range(B) if j not in chosen]
    chosen |= oracle_explore(cfg, cand, scores_row, last_seen, request, layer, step, e)
    return chosen, len(chosen)


def oracle_pool(vals: list[float], pooling: str) -> float:
    if not vals:
        return -INF
    if pooling == "max":
        return max(vals)
    if pooling == "top4":
        vals = sorted(vals, reverse=True)[:4]
    return sum(vals) / len(vals)


def oracle_predict(cfg, V, D, n, q) -> tuple[list[float], list[float] | None]:
    """(block scores of visible blocks, slot predictions or None for A2)."""
    b = cfg.block_size
    B = ceil_div(n, b)
    if cfg.reduction == "A2":
        return [max(V[j], D[q // b - j]) for j in range(B)], None
    z = [max(V[i], D[q - i]) for i in range(n)]
    # block scores are fp32 (spec: "fp32 [G, R, NB]"): round the exact pooled value once
    return [_round(oracle_pool(z[j * b:min((j + 1) * b, n)], cfg.pooling), torch.float32)
            for j in range(B)], z


def _round(x: float, dtype) -> float:
    return torch.tensor(x, dtype=dtype).item()


def oracle_update(cfg, V, D, z_rows, mask, n_rows, q_rows, accepted, dtype):
    """Sequential deferred EMA replay. Returns (V, D, touched V idx, touched D idx)."""
    V, D = list(V), list(D)
    a, b = cfg.ema_decay, cfg.block_size
    rows = [0] if cfg.mtp_update == "row0" else [r for r in range(len(n_rows)) if r <= accepted]
    tv, td = set(), set()
    for r in rows:
        n, q, z = n_rows[r], q_rows[r], z_rows[r]
        if cfg.reduction == "A2":
            for j in range(ceil_div(n, b)):
                if not mask[j]:
                    continue
                zz = oracle_pool(z[j * b:min((j + 1) * b, n)], cfg.pooling)
                o = q // b - j
                V[j] = _round(a * V[j] + (1 - a) * zz, dtype)
                D[o] = _round(a * D[o] + (1 - a) * zz, dtype)
                tv.add(j)
                td.add(o)
        else:
            for i in range(n):
                if not mask[i // b]:
                    continue
                o = q - i
                V[i] = _round(a * V[i] + (1 - a) * z[i], dtype)
                D[o] = _round(a * D[o] + (1 - a) * z[i], dtype)
                tv.add(i)
                td.add(o)
    return V, D, tv, td


# ---- scenarios ------------------------------------------------------------------------------------
@dataclass
class Scn:
    cfg: SpinConfig
    G: int
    R: int
    n: list          # [G][R]
    q: list          # [G][R]
    W: int
    capacity: int
    rho_pct: list    # [G]
    request: list
    layer: list
    step: list
    accepted: list
    decode_steps: list
    data_seed: int

    @property
    def NB(self) -> int:
        return ceil_div(self.W, self.cfg.block_size)

    def tensors(self):
        i64 = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        return dict(n=i64(self.n), q=i64(self.q), accepted=i64(self.accepted),
                    target_sparsity=torch.tensor([p / 100 for p in self.rho_pct],
                                                 dtype=torch.float64),
                    request=i64(self.request), layer=i64(self.layer), step=i64(self.step))

    def random_state(self) -> SpinState:
        gen = torch.Generator().manual_seed(self.data_seed)
        st_ = SpinState.zeros(self.G, self.capacity, self.cfg)
        st_.V.copy_((torch.randint(-8, 9, st_.V.shape, generator=gen) / 4).to(st_.V.dtype))
        st_.D.copy_((torch.randint(-8, 9, st_.D.shape, generator=gen) / 4).to(st_.D.dtype))
        st_.last_seen.copy_(torch.randint(0, 51, st_.last_seen.shape, generator=gen))
        st_.decode_steps.copy_(torch.tensor(self.decode_steps, dtype=torch.int64))
        return st_

    def random_block_scores(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.data_seed + 1)
        return torch.randint(-4, 5, (self.G, self.R, self.NB), generator=gen).float()

    def random_slot_pred(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.data_seed + 2)
        x = torch.randint(-4, 5, (self.G, self.R, self.W), generator=gen).float()
        visible = torch.arange(self.W) < torch.tensor(self.n).unsqueeze(-1)
        return x.masked_fill(~visible, -INF)

    def random_dense(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.data_seed + 3)
        return torch.randint(-8, 9, (self.G, self.R, self.W), generator=gen) / 4

    def random_mask(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.data_seed + 4)
        return torch.rand(self.G, self.NB, generator=gen) < 0.5


@st.composite
def scenarios(draw, reductions=("A0", "A1", "A2"), max_rows=4):
    b = draw(st.sampled_from([1, 2, 3, 4, 8]))
    cfg = SpinConfig(
        block_size=b,
        index_topk=draw(st.integers(1, 40)),
        target_sparsity=0.4,
        exploration=draw(st.sampled_from([0, 5, 10, 25, 29, 50, 90])) / 100,
        exploration_policy=draw(st.sampled_from(["random", "staleness", "age"])),
        reduction=draw(st.sampled_from(reductions)),
        pooling=draw(st.sampled_from(["max", "mean", "top4"])),
        keep_sink=draw(st.booleans()),
        keep_newest=draw(st.booleans()),
        mtp_mask=draw(st.sampled_from(["union", "row0"])),
        mtp_update=draw(st.sampled_from(["prefix_valid", "row0"])),
        warmup_steps=draw(st.integers(1, 3)),
        ema_decay=draw(st.sampled_from([0.0, 0.25, 0.5, 0.75])),
        state_dtype=draw(st.sampled_from(["float32", "float16", "float8_e4m3fn"])),
        seed=draw(st.integers(0, M32)),
    )
    G = draw(st.integers(1, 3))
    R = draw(st.integers(1, max_rows))
    n, q = [], []
    for _ in range(G):
        rows = [draw(st.integers(1, 40))]           # tiny contexts, one block, ragged...
        for _ in range(1, R):
            rows.append(rows[-1] + draw(st.integers(0, 2)))
        extra = draw(st.integers(0, 2))              # q >= n - 1
        n.append(rows)
        q.append([x - 1 + extra for x in rows])
    W = max(max(r) for r in n) + draw(st.integers(0, b))
    capacity = max(W, max(max(r) for r in q) + 1) + draw(st.integers(0, 3))
    return Scn(cfg=cfg, G=G, R=R, n=n, q=q, W=W, capacity=capacity,
               rho_pct=[draw(st.integers(0, 99)) for _ in range(G)],
               request=[draw(st.integers(0, 1000)) for _ in range(G)],
               layer=[draw(st.integers(0, 60)) for _ in range(G)],
               step=[draw(st.integers(50, 100)) for _ in range(G)],
               accepted=[draw(st.integers(0, R)) for _ in range(G)],
               decode_steps=[draw(st.integers(0, 4)) for _ in range(G)],
               data_seed=draw(st.integers(0, 2**31 - 1)))


def _ids(row: torch.Tensor) -> set[int]:
    return {int(j) for j in torch.nonzero(row).flatten()}


def _check_selection(scn: Scn, sel, block_scores, slot_pred, state_before: SpinState):
    """Compare a Selection with the oracle; shared by select_blocks and decode_step tests."""
    cfg, b = scn.cfg, scn.cfg.block_size
    NB = sel.mask.shape[-1]
    for g in range(scn.G):
        dense = scn.decode_steps[g] < cfg.warmup_steps
        assert bool(sel.dense[g]) == dense
        last_seen = state_before.last_seen[g].tolist()
        rows = []
        for r in range(scn.R):
            n = scn.n[g][r]
            B = ceil_div(n, b)
            exp, m = oracle_row(cfg, n, scn.rho_pct[g], block_scores[g][r], 
                                None if slot_pred is None else slot_pred[g][r], last_seen,
                                scn.request[g], scn.layer[g], scn.step[g], dense)
            got = _ids(sel.row_mask[g, r])
            assert got == exp, (g, r, n, sorted(got), sorted(exp))
            assert m == len(got)
            assert int(sel.n_blocks[g, r]) == B
            assert all(j < B for j in got)                       # nothing past B_t
            assert oracle_forced(B, cfg) <= got                  # forced present
            if cfg.reduction != "A0" and not dense:
                # m_t = max(budget formula, forced count)
                assert m == max(oracle_budget(B, scn.rho_pct[g], cfg.index_topk, b, n),
                                len(oracle_forced(B, cfg)))
            rows.append(got)
        union = _ids(sel.mask[g])
        for r in range(scn.R):
            # row0 sharing: a row's m_t is what the shared mask gives it
            B = ceil_div(scn.n[g][r], b)
            shared = cfg.mtp_mask == "row0" and scn.R > 1
            m = len({j for j in union if j < B}) if shared else len(rows[r])
            assert int(sel.budget[g, r]) == m
            assert bool(sel.eligible[g, r]) == ((not dense) and m < B)
        if cfg.mtp_mask == "union" or scn.R == 1:
            assert union == set().union(*rows)
        else:
            B0 = ceil_div(scn.n[g][0], b)
            beyond = {j for r in range(scn.R) for j in range(B0, ceil_div(scn.n[g][r], b))}
            assert union == rows[0] | beyond
        assert all(r <= set().union(*rows) | union for r in rows)
        # block_list of the union: ascending, unique, -1 padded, count
        lst, cnt = block_list(sel.mask[g:g + 1], NB)
        lst = lst[0].tolist()
        k = int(cnt[0])
        assert k == len(union)
        assert lst[:k] == sorted(union) and lst[k:] == [-1] * (NB - k)
        assert len(set(lst[:k])) == k


# ---- properties -------------------------------------------------------------------------------------
@SETTINGS
@given(scn=scenarios())
def test_select_blocks_matches_oracle(scn: Scn):
    cfg = scn.cfg
    state = scn.random_state()
    bs = scn.random_block_scores()
    sp = scn.random_slot_pred() if cfg.reduction == "A0" else None
    t = scn.tensors()
    sel = select_blocks(bs, sp, t["n"], state, cfg, t["target_sparsity"], t["request"], t["layer"],
                        t["step"])
    _check_selection(scn, sel, bs.tolist(), None if sp is None else sp.tolist(), state)
    # determinism: same inputs -> identical selection
    sel2 = select_blocks(bs.clone(), None if sp is None else sp.clone(), t["n"].clone(),
                         state, cfg, t["target_sparsity"], t["request"], t["layer"], t["step"])
    assert torch.equal(sel.mask, sel2.mask) and torch.equal(sel.row_mask, sel2.row_mask)
    assert torch.equal(sel.budget, sel2.budget)
    # the union mask contains every row mask
    if cfg.mtp_mask == "union":
        assert bool((sel.row_mask <= sel.mask.unsqueeze(1)).all())


@SETTINGS
@given(scn=scenarios(reductions=("A1", "A2")))
def test_budget_formula_vectorized(scn: Scn):
    cfg, b = scn.cfg, scn.cfg.block_size
    B = torch.tensor([[ceil_div(x, b) for x in row] for row in scn.n], dtype=torch.int64)
    rho = torch.tensor([[p / 100] * scn.R for p in scn.rho_pct], dtype=torch.float64)
    n = torch.tensor(scn.n, dtype=torch.int64)
    assert block_budget(B, rho, cfg).tolist() == [
        [oracle_budget(int(B[g, r]), scn.rho_pct[g], cfg.index_topk, b) for r in range(scn.R)]
        for g in range(scn.G)]
    got = block_budget(B, rho, cfg, n).tolist()
    exp = [[oracle_budget(int(B[g, r]), scn.rho_pct[g], cfg.index_topk, b, scn.n[g][r])
            for r in range(scn.R)] for g in range(scn.G)]
    assert got == exp


@SETTINGS
@given(scn=scenarios())
# near-equal staleness priorities: the oracle once ordered blocks 8 and 18 in double precision
@example(scn=Scn(
    cfg=SpinConfig(block_size=1, target_sparsity=0.4, ema_decay=0.0, exploration=0.29,
                   exploration_policy="staleness", index_topk=1, warmup_steps=1,
                   keep_sink=False, keep_newest=False, reduction="A1", pooling="max",
                   mtp_mask="union", mtp_update="prefix_valid", state_dtype="float32", seed=0),
    G=1, R=3, n=[[33, 35, 36]], q=[[32, 34, 35]], W=37, capacity=40, rho_pct=[20],
    request=[0], layer=[0], step=[85], accepted=[0], decode_steps=[1], data_seed=1241))
def test_decode_step_matches_oracle(scn: Scn):
    """Full step: predict (own oracle), select, deferred EMA replay; skipped slots exact."""
    cfg = scn.cfg
    state = scn.random_state()
    before = SpinState(state.V.clone(), state.D.clone(), state.last_seen.clone(),
                       state.decode_steps.clone())
    z = scn.random_dense()
    t = scn.tensors()
    sel, slot_pred = decode_step(state, cfg, z, t["n"], t["q"], t["accepted"], t["target_sparsity"],
                                 t["request"], t["layer"], t["step"])
    Vb, Db = before.V.float().tolist(), before.D.float().tolist()
    NB = scn.NB
    bs_rows, sp_rows = [], []
    for g in range(scn.G):
        bs_g, sp_g = [], []
        for r in range(scn.R):
            blocks, slots = oracle_predict(cfg, Vb[g], Db[g], scn.n[g][r], scn.q[g][r])
            bs_g.append(blocks + [-INF] * (NB - len(blocks)))
            sp_g.append(None if slots is None else slots + [-INF] * (scn.W - len(slots)))
        bs_rows.append(bs_g)
        sp_rows.append(sp_g)
    if cfg.reduction == "A2":
        assert slot_pred is None
    else:
        assert slot_pred.tolist() == sp_rows
    _check_selection(scn, sel, bs_rows, sp_rows if cfg.reduction == "A0" else None, before)

    dtype = state.V.dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=4e-3, atol=4e-3)
    for g in range(scn.G):
        mask = sel.mask[g].tolist()
        V, D, tv, td = oracle_update(cfg, Vb[g], Db[g], z[g].tolist(), mask, scn.n[g],
                                     scn.q[g], scn.accepted[g], dtype)
        got_v, got_d = state.V[g], state.D[g]
        torch.testing.assert_close(got_v.float(), torch.tensor(V), **tol)
        torch.testing.assert_close(got_d.float(), torch.tensor(D), **tol)
        keep_v = torch.ones(got_v.shape[0], dtype=torch.bool)
        keep_v[sorted(tv)] = False
        keep_d = torch.ones(got_d.shape[0], dtype=torch.bool)
        keep_d[sorted(td)] = False
        # untouched slots / offsets: bit-identical
        assert torch.equal(got_v[keep_v], before.V[g][keep_v])
        assert torch.equal(got_d[keep_d], before.D[g][keep_d])
        # last_seen = step for every block of the indexer mask, else unchanged
        exp_ls = [scn.step[g] if j < NB and mask[j] else int(before.last_seen[g, j])
                  for j in range(state.last_seen.shape[1])]
        assert state.last_seen[g].tolist() == exp_ls
    assert state.decode_steps.tolist() == [d + 1 for d in scn.decode_steps]


@SETTINGS
@given(scn=scenarios())
def test_update_state_random_mask_oracle(scn: Scn):
    """update_state with an arbitrary mask and accepted count: prefix rows 0..a in order."""
    cfg = scn.cfg
    state = scn.random_state()
    V0, D0 = state.V.clone(), state.D.clone()
    mask = scn.random_mask()
    z = scn.random_dense()
    t = scn.tensors()
    update_state(state, z, mask, t["n"], t["q"], t["accepted"], cfg, t["step"])
    dtype = state.V.dtype
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=4e-3, atol=4e-3)
    for g in range(scn.G):
        V, D, tv, td = oracle_update(cfg, V0[g].float().tolist(), D0[g].float().tolist(),
                                     z[g].tolist(), mask[g].tolist(), scn.n[g], scn.q[g],
                                     scn.accepted[g], dtype)
        torch.testing.assert_close(state.V[g].float(), torch.tensor(V), **tol)
        torch.testing.assert_close(state.D[g].float(), torch.tensor(D), **tol)
        for i in range(state.V.shape[1]):
            if i not in tv:
                assert torch.equal(state.V[g, i], V0[g, i])
        for o in range(state.D.shape[1]):
            if o not in td:
                assert torch.equal(state.D[g, o], D0[g, o])


@SETTINGS
@given(scn=scenarios(), which_bits=st.integers(0, 7), step=st.integers(0, 1000))
def test_reset_zeroes_exactly_the_chosen_streams(scn: Scn, which_bits, step):
    state = scn.random_state()
    V0, D0 = state.V.clone(), state.D.clone()
    L0, S0 = state.last_seen.clone(), state.decode_steps.clone()
    which = torch.tensor([bool(which_bits >> g & 1) for g in range(scn.G)])
    state.reset(which, step=step)
    for g in range(scn.G):
        if which[g]:
            assert state.V[g].float().abs().sum().item() == 0
            assert state.D[g].float().abs().sum().item() == 0
            assert state.last_seen[g].tolist() == [step] * state.last_seen.shape[1]
            assert int(state.decode_steps[g]) == 0
        else:
            assert torch.equal(state_bits(state.V[g]), state_bits(V0[g]))
            assert torch.equal(state_bits(state.D[g]), state_bits(D0[g]))
            assert torch.equal(state.last_seen[g], L0[g])
            assert int(state.decode_steps[g]) == int(S0[g])
    state.reset()
    assert state.V.float().abs().sum().item() == 0 and state.D.float().abs().sum().item() == 0
    assert state.decode_steps.tolist() == [0] * scn.G


@settings(max_examples=50, deadline=None)
@given(scn=scenarios(max_rows=2))
def test_warmup_after_reset_then_budget(scn: Scn):
    cfg, b = scn.cfg, scn.cfg.block_size
    state = scn.random_state()
    state.reset(step=0)
    t = scn.tensors()
    z = scn.random_dense()
    w = cfg.warmup_steps
    for k in range(w + 2):
        step = t["step"] + k
        sel, _ = decode_step(state, cfg, z, t["n"], t["q"], t["accepted"], t["target_sparsity"],
                             t["request"], t["layer"], step)
        for g in range(scn.G):
            assert bool(sel.dense[g]) == (k < w)
            for r in range(scn.R):
                B = ceil_div(scn.n[g][r], b)
                got = _ids(sel.row_mask[g, r])
                if k < w:
                    assert got == set(range(B))
                elif cfg.reduction != "A0":
                    m = max(oracle_budget(B, scn.rho_pct[g], cfg.index_topk, b,
                                          scn.n[g][r]), len(oracle_forced(B, cfg)))
                    assert len(got) == m


# ---- CPU vs CUDA ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("reduction", ["A0", "A1", "A2"])
@pytest.mark.parametrize("policy", ["random", "age", "staleness"])
def test_decode_step_cpu_matches_cuda(reduction, policy):
    cfg = SpinConfig(block_size=4, index_topk=8, exploration=0.25, exploration_policy=policy,
                     reduction=reduction, ema_decay=0.5)
    G, R, W = 3, 3, 61
    gen = torch.Generator().manual_seed(1234)
    n = torch.tensor([[40, 41, 42], [57, 58, 59], [9, 10, 11]])
    q = n - 1
    states = {d: SpinState.zeros(G, 64, cfg, device=d) for d in ("cpu", "cuda")}
    rho = torch.tensor([0.3, 0.5, 0.0], dtype=torch.float64)
    req, layer = torch.tensor([0, 1, 2]), torch.tensor([5, 5, 6])
    for t in range(6):
        # dyadic scores: the alpha = 0.5 EMA stays exact, so both devices must agree bitwise
        z = torch.randint(-16, 17, (G, R, W), generator=gen) / 8
        acc = torch.randint(0, R, (G,), generator=gen)
        step = torch.full((G,), t)
        out = {}
        for d, stt in states.items():
            args = [x.to(d) for x in (z, n, q, acc, rho, req, layer, step)]
            out[d] = decode_step(stt, cfg, *args)
        s_cpu, s_gpu = out["cpu"][0], out["cuda"][0]
        assert torch.equal(s_cpu.mask, s_gpu.mask.cpu())
        assert torch.equal(s_cpu.row_mask, s_gpu.row_mask.cpu())
        assert torch.equal(s_cpu.budget, s_gpu.budget.cpu())
        assert torch.equal(s_cpu.dense, s_gpu.dense.cpu())
        if out["cpu"][1] is not None:
            assert torch.equal(out["cpu"][1], out["cuda"][1].cpu())
        for name in ("V", "D", "last_seen", "decode_steps"):  # bytes: float8 included
            a, b = getattr(states["cpu"], name), getattr(states["cuda"], name).cpu()
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
