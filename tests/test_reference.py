"""Hand-computed small cases of SPIN Algorithm 1 (spin_trtllm.reference).

Every expected value below is derived by hand from the module docstring of
spin_trtllm/reference/ and the paper (arXiv 2610.09025, Algorithm 1, sections 3.2.1,
3.2.2, 4.6); the derivation is written next to each literal. The code under test is never
used to produce an expectation.
"""

from __future__ import annotations

import pytest
import torch

from spin_trtllm import SpinConfig, SpinError
from spin_trtllm.reference import (
    SpinState,
    block_budget,
    block_list,
    counter_hash,
    decode_step,
    pool_blocks,
    predict_blocks,
    predict_scores,
    select_blocks,
    update_state,
)
from spin_trtllm.testing.hash_oracle import fmix32, py_hash as _py_hash

INF = float("inf")
M32 = 0xFFFFFFFF


# ---- helpers ----------------------------------------------------------------------------------
def mk(**kw) -> SpinConfig:
    """Small config: b = 4, K = 4 (so ceil(K/b) = 1), no exploration unless asked."""
    base = dict(block_size=4, index_topk=4, target_sparsity=0.5, exploration=0.0,
                ema_decay=0.5)
    base.update(kw)
    return SpinConfig(**base)


def i64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


def f32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def warm_state(cfg: SpinConfig, streams: int, capacity: int) -> SpinState:
    """A zero state that is past its warm-up (decode_steps = warmup_steps)."""
    st = SpinState.zeros(streams, capacity, cfg)
    st.decode_steps.fill_(cfg.warmup_steps)
    return st


def select(cfg, block_scores, n, rho, *, state=None, slot_pred=None, step=10, request=0,
           layer=0):
    """select_blocks on one stream (G = 1). block_scores: [NB] or [R][NB]; n: int or [R]."""
    bs = f32(block_scores)
    if bs.dim() == 1:
        bs = bs[None]
    bs = bs[None]                                   # [1, R, NB]
    R, NB = bs.shape[1], bs.shape[2]
    n_t = i64(n).reshape(1, -1).expand(1, R).contiguous()
    if state is None:
        state = warm_state(cfg, 1, NB * cfg.block_size)
    if slot_pred is not None:
        slot_pred = f32(slot_pred)
        if slot_pred.dim() == 1:
            slot_pred = slot_pred[None]
        slot_pred = slot_pred[None]
    return select_blocks(bs, slot_pred, n_t, state, cfg, torch.tensor([rho], dtype=torch.float64),
                         i64([request]), i64([layer]), i64([step]))


def ids(mask_row: torch.Tensor) -> list[int]:
    return [int(j) for j in torch.nonzero(mask_row).flatten()]


# ---- budget m_t = min(B, max(ceil(K/b), ceil((1 - rho) B))) -----------------------------------
@pytest.mark.parametrize("B,rho,K,b,expected", [
    (10, 0.3, 4, 4, 7),     # ceil(0.7 * 10) = 7 ; ceil(4/4) = 1 -> 7
    (10, 0.7, 4, 4, 3),     # (1 - 0.7) * 10 = 3.0000000000000004 in fp64: tolerance -> 3, not 4
    (100, 0.71, 4, 4, 29),  # (1 - 0.71) * 100 = 29.000000000000004 in fp64 -> 29, not 30
    (10, 0.0, 4, 4, 10),    # rho = 0 -> every block
    (1, 0.0, 4, 4, 1),
    (1, 0.9, 4, 4, 1),      # ceil(0.1) = 1 = B
    (10, 0.5, 4, 4, 5),     # ceil(5) = 5
    (7, 0.5, 4, 4, 4),      # ceil(3.5) = 4
    (10, 0.95, 8, 4, 2),    # ceil(0.05 * 10) = 1 < ceil(8/4) = 2 -> 2
    (10, 0.95, 5, 4, 2),    # ceil(5/4) = 2 (ceil, not floor)
    (6, 0.5, 40, 4, 6),     # ceil(40/4) = 10 > B = 6 -> capped at B: K beyond the context
    (20, 0.9, 40, 4, 10),   # max(10, ceil(2)) = 10
    (0, 0.5, 4, 4, 0),      # empty context -> nothing
])
def test_block_budget_hand_values(B, rho, K, b, expected):
    cfg = mk(index_topk=K, block_size=b)
    got = block_budget(i64(B), torch.tensor(rho, dtype=torch.float64), cfg)
    assert int(got) == expected


def test_block_budget_broadcasts_over_rho_and_min_blocks():
    cfg = mk(index_topk=9, block_size=4)            # ceil(9/4) = 3
    assert cfg.min_blocks == 3
    B = i64([4, 4, 10, 2, 12])
    rho = torch.tensor([0.0, 0.5, 0.3, 0.9, 0.75], dtype=torch.float64)
    # [min(4,max(3,4)), min(4,max(3,2)), min(10,max(3,7)), min(2,max(3,1)), min(12,max(3,3))]
    assert block_budget(B, rho, cfg).tolist() == [4, 3, 7, 2, 3]


def test_budget_rho_0p3_selects_seven_of_ten_top_blocks():
    cfg = mk(keep_sink=False, keep_newest=False)
    # n = 40, b = 4 -> B = 10; m = ceil(0.7 * 10) = 7; scores 10 - j -> blocks 0..6
    sel = select(cfg, [10.0 - j for j in range(10)], 40, 0.3)
    assert ids(sel.mask[0]) == [0, 1, 2, 3, 4, 5, 6]
    assert sel.budget.tolist() == [[7]] and sel.n_blocks.tolist() == [[10]]
    assert sel.eligible.tolist() == [[True]]


def test_budget_rho_zero_selects_everything():
    cfg = mk()
    sel = select(cfg, [1.0, -5.0, 3.0, -2.0, 0.0], 20, 0.0)
    assert ids(sel.mask[0]) == [0, 1, 2, 3, 4]
    assert sel.budget.tolist() == [[5]]
    assert sel.eligible.tolist() == [[False]]    # m_t = B_t: nothing skipped


def test_context_shorter_than_K_selects_every_block():
    # K = 16, b = 4 -> ceil(K/b) = 4; n = 10 -> B = 3 (ragged); m = min(3, max(4, 2)) = 3
    cfg = mk(index_topk=16, keep_sink=False, keep_newest=False)
    sel = select(cfg, [-1.0, -9.0, -3.0, 100.0], 10, 0.5)
    assert ids(sel.mask[0]) == [0, 1, 2]          # block 3 is past the context
    assert sel.budget.tolist() == [[3]] and sel.n_blocks.tolist() == [[3]]
    assert sel.eligible.tolist() == [[False]]


# ---- forced sink / newest blocks ---------------------------------------------------------------
LOW_ENDS = [-10.0, 5.0, 4.0, 3.0, 2.0, -20.0]       # B = 6: sink and newest score lowest


@pytest.mark.parametrize("keep_sink,keep_newest,expected", [
    (True, True, [0, 1, 5]),     # m = ceil(0.5 * 6) = 3: forced {0, 5} + best other {1}
    (False, True, [1, 2, 5]),    # forced {5} + top-2 {1, 2}
    (True, False, [0, 1, 2]),    # forced {0} + top-2 {1, 2}
    (False, False, [1, 2, 3]),   # plain top-3
])
def test_forced_blocks_count_toward_budget(keep_sink, keep_newest, expected):
    cfg = mk(keep_sink=keep_sink, keep_newest=keep_newest)
    sel = select(cfg, LOW_ENDS, 24, 0.5)          # n = 24 -> B = 6
    assert ids(sel.mask[0]) == expected
    assert sel.budget.tolist() == [[3]]


def test_forced_blocks_grow_budget_when_they_exceed_it():
    # b = 4, K = 4 -> ceil(K/b) = 1; B = 4, rho = 0.9 -> ceil(0.4) = 1 -> m = 1, but the two
    # forced blocks {0, 3} alone exceed it -> m grows to 2
    cfg = mk()
    sel = select(cfg, [-1.0, 9.0, 8.0, -1.0], 16, 0.9)
    assert ids(sel.mask[0]) == [0, 3]
    assert sel.budget.tolist() == [[2]]


def test_single_block_sink_is_newest():
    # n = 3 -> B = 1; block 0 is both sink and newest: one forced block, m = 1
    cfg = mk()
    sel = select(cfg, [-7.0, 50.0], 3, 0.9)
    assert ids(sel.mask[0]) == [0]
    assert sel.budget.tolist() == [[1]]


def test_newest_block_is_the_ragged_last_visible_block():
    # n = 9 -> B = 3 (block 2 holds only slot 8); NB = 5 columns. rho = 0.9 -> 1 block, but
    # the floor holds K = 4 visible slots: ceil((4 + 3 empty) / 4) = 2 blocks
    cfg = mk(keep_sink=False)
    sel = select(cfg, [9.0, 8.0, -5.0, 99.0, 99.0], 9, 0.9)
    # forced newest = block 2 (not NB - 1 = 4), then the best other block (0)
    assert ids(sel.mask[0]) == [0, 2]


@pytest.mark.parametrize("K,b,n", [(4, 4, 9), (512, 64, 1000), (512, 64, 1025), (500, 64, 1010),
                                   (8, 4, 8), (6, 4, 7), (1, 4, 5)])
def test_the_budget_floor_holds_k_visible_slots(K, b, n):
    """At the floor (high sparsity) the selected blocks hold at least min(K, n) visible
    slots, however the blocks rank: DeepSeek-V4's sparse attention counts min(kv // 4, K)
    entries of the top-K row, so fewer would put -1 inside that count."""
    cfg = mk(index_topk=K, block_size=b, keep_sink=False, keep_newest=True)
    NB = -(-n // b)
    for scores in ([float(NB - j) for j in range(NB)], [float(j) for j in range(NB)]):
        sel = select(cfg, scores, n, 0.99)
        blocks = ids(sel.mask[0])
        visible = sum(min(b, n - j * b) for j in blocks)
        assert visible >= min(K, n), (blocks, visible)
        # and no more than the floor asks for: one block fewer would not hold K
        floor = -(-(K + NB * b - n) // b)
        assert len(blocks) == min(NB, floor)


# ---- ties ----------------------------------------------------------------------------------------
def test_ties_lower_block_id_wins():
    cfg = mk(keep_sink=False, keep_newest=False)
    sel = select(cfg, [1.0] * 6, 24, 0.5)          # m = 3, all tied -> {0, 1, 2}
    assert ids(sel.mask[0]) == [0, 1, 2]
    sel = select(cfg, [0.0, 2.0, 1.0, 2.0, 1.0, 2.0], 24, 0.5)  # three 2.0 -> {1, 3, 5}
    assert ids(sel.mask[0]) == [1, 3, 5]
    sel = select(cfg, [0.0, 2.0, 1.0, 3.0, 1.0, 0.0], 24, 0.5)  # 3, 2, then 1 at ids 2<4
    assert ids(sel.mask[0]) == [1, 2, 3]


def test_ties_with_forced_blocks():
    cfg = mk()
    # B = 6, rho = 1/3 -> ceil(4) = 4: forced {0, 5} + 2 of the tied {1, 2, 3, 4} -> {1, 2}
    sel = select(cfg, [1.0, 5.0, 5.0, 5.0, 5.0, 1.0], 24, 1.0 / 3.0)
    assert ids(sel.mask[0]) == [0, 1, 2, 5]


# ---- pooling over visible slots -----------------------------------------------------------------
def test_pooling_ragged_last_block_b6():
    x = f32([6, 1, 5, 2, 4, 3, 10, 0, 2])          # width 9, b = 6: block 1 has 3 slots
    # block 0: max 6; mean 21/6 = 3.5; top4 mean(6, 5, 4, 3) = 4.5
    # block 1: max 10; mean 12/3 = 4; top4 = mean of the 3 visible = 4
    assert pool_blocks(x, 6, "max").tolist() == [6.0, 10.0]
    assert pool_blocks(x, 6, "mean").tolist() == [3.5, 4.0]
    assert pool_blocks(x, 6, "top4").tolist() == [4.5, 4.0]
    # the same with the invisible slots explicitly -inf in a full-width row
    xi = torch.cat([x, f32([-INF] * 3)])
    assert pool_blocks(xi, 6, "max").tolist() == [6.0, 10.0]
    assert pool_blocks(xi, 6, "mean").tolist() == [3.5, 4.0]
    assert pool_blocks(xi, 6, "top4").tolist() == [4.5, 4.0]


def test_pooling_block_with_nothing_visible_is_neg_inf():
    x = f32([1, 2, 3, 4, -INF, -INF, -INF, -INF])
    for pooling in ("max", "mean", "top4"):
        out = pool_blocks(x, 4, pooling)
        assert out[1].item() == -INF
    assert pool_blocks(x, 4, "mean")[0].item() == 2.5    # (1+2+3+4)/4
    assert pool_blocks(x, 4, "top4")[0].item() == 2.5


def test_pooling_top4_with_b8_and_negatives():
    x = f32([-1, -2, -3, -4, -5, -6, -7, -8, 7, -INF, -INF, -INF, -INF, -INF, -INF, -INF])
    # block 0: top4 = mean(-1, -2, -3, -4) = -2.5; mean = -36/8 = -4.5; max = -1
    # block 1: only slot 8 visible = 7 for every pooling
    assert pool_blocks(x, 8, "top4").tolist() == [-2.5, 7.0]
    assert pool_blocks(x, 8, "mean").tolist() == [-4.5, 7.0]
    assert pool_blocks(x, 8, "max").tolist() == [-1.0, 7.0]


@pytest.mark.parametrize("pooling,expected", [
    ("max", [0.0, 2.0]),     # block 1 visible slots 4, 5 hold V = 1, 2
    ("mean", [0.0, 1.5]),    # (1 + 2) / 2, not (1 + 2 + 100 + 100) / 4
    ("top4", [0.0, 1.5]),
])
def test_predict_blocks_ragged_ignores_invisible_slots(pooling, expected):
    cfg = mk(pooling=pooling)
    st = SpinState.zeros(1, 8, cfg)
    st.V[0] = f32([0, 0, 0, 0, 1, 2, 100, 100])    # slots 6, 7 are not visible (n = 6)
    blocks, slots = predict_blocks(st, i64([[6]]), i64([[5]]), cfg, 8)
    assert blocks[0, 0].tolist() == expected
    assert slots[0, 0, 6:].tolist() == [-INF, -INF]


# ---- prediction z^[i] = max(V[i], D[q - i]) --------------------------------------------------------
def test_predict_scores_hand_state():
    V = f32([[5, -3, 0, 3, 0, 1, 9, 9]])
    D = f32([[0, 0, 2, 0, 4, 2, -1, 7]])
    # n = 6, q = 7:  i=0 max(5, D7=7)=7; i=1 max(-3, D6=-1)=-1; i=2 max(0, D5=2)=2;
    # i=3 max(3, D4=4)=4; i=4 max(0, D3=0)=0; i=5 max(1, D2=2)=2; i=6,7 invisible
    pred = predict_scores(V, D, i64([[6]]), i64([[7]]), 8)
    assert pred[0, 0].tolist() == [7.0, -1.0, 2.0, 4.0, 0.0, 2.0, -INF, -INF]
    # block scores with b = 4: max [7, 2]; mean [(7-1+2+4)/4 = 3, (0+2)/2 = 1]
    assert pool_blocks(pred, 4, "max")[0, 0].tolist() == [7.0, 2.0]
    assert pool_blocks(pred, 4, "mean")[0, 0].tolist() == [3.0, 1.0]


def test_predict_scores_two_rows_use_their_own_q():
    V = f32([[0, 0, 0, 0]])
    D = f32([[1, 2, 3, 4]])
    # row 0: n=2, q=1 -> [D1, D0] = [2, 1];  row 1: n=3, q=3 -> [D3, D2, D1] = [4, 3, 2]
    pred = predict_scores(V, D, i64([[2, 3]]), i64([[1, 3]]), 4)
    assert pred[0].tolist() == [[2.0, 1.0, -INF, -INF], [4.0, 3.0, 2.0, -INF]]


def test_predict_blocks_selects_by_hand_prediction():
    # V favours block 1, D favours block 3 (via offsets): b=4, n=16, q=15
    cfg = mk(keep_sink=False, keep_newest=False)
    st = warm_state(cfg, 1, 16)
    st.V[0, 5] = 4.0                                 # block 1 -> 4
    st.D[0, 15 - 13] = 6.0                           # slot 13 (block 3) via D[2] -> 6
    st.D[0, 15 - 9] = 1.0                            # slot 9 (block 2) via D[6] -> 1
    blocks, _ = predict_blocks(st, i64([[16]]), i64([[15]]), cfg, 16)
    assert blocks[0, 0].tolist() == [0.0, 4.0, 1.0, 6.0]
    sel = select_blocks(blocks, None, i64([[16]]), st, cfg, torch.tensor([0.5], dtype=torch.float64),
                        i64([0]), i64([0]), i64([3]))
    assert ids(sel.mask[0]) == [1, 3]                # m = 2: the two largest


# ---- EMA update --------------------------------------------------------------------------------------
def test_ema_update_by_hand_alpha_0p75():
    cfg = mk(ema_decay=0.75)
    st = SpinState.zeros(1, 12, cfg)
    st.V[0] = f32([0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 0])
    st.D[0] = f32([8 * o for o in range(12)])        # D[o] = 8 o
    V0, D0 = st.V.clone(), st.D.clone()
    z = f32([[[4 * (i + 1) for i in range(8)]]])     # z[i] = 4 (i + 1)
    mask = torch.tensor([[True, False]])             # only block 0 (slots 0..3) scored
    update_state(st, z, mask, i64([[8]]), i64([[8]]), i64([0]), cfg, i64([42]))
    # V[i] = 0.75 i + 0.25 * 4 (i+1) = 1.75 i + 1 -> [1, 2.75, 4.5, 6.25]
    assert st.V[0].tolist() == [1.0, 2.75, 4.5, 6.25, 4, 5, 6, 7, 0, 0, 0, 0]
    # D[8 - i] = 0.75 * 8 (8 - i) + (i + 1) = 49 - 5 i -> D8=49, D7=44, D6=39, D5=34
    assert st.D[0].tolist() == [0, 8, 16, 24, 32, 34, 39, 44, 49, 72, 80, 88]
    # skipped slots / offsets: exact equality with the old values
    assert torch.equal(st.V[0, 4:], V0[0, 4:])
    assert torch.equal(st.D[0, :5], D0[0, :5]) and torch.equal(st.D[0, 9:], D0[0, 9:])
    assert st.last_seen[0].tolist() == [42, 0, 0]    # block 0 scored at step 42
    assert st.decode_steps.tolist() == [1]


def test_ema_update_reads_only_mask_blocks_and_visible_slots():
    cfg = mk(ema_decay=0.5)
    st = SpinState.zeros(1, 8, cfg)
    z = f32([[[2, 2, 2, 2, 2, 2, 1000, 1000]]])     # slots 6, 7 not visible (n = 6)
    update_state(st, z, torch.tensor([[True, True]]), i64([[6]]), i64([[5]]), i64([0]), cfg,
                 i64([1]))
    # from zero: V[i] = 0.5 * 2 = 1 for i < 6; D[5 - i] = 1 for offsets 0..5
    assert st.V[0].tolist() == [1, 1, 1, 1, 1, 1, 0, 0]
    assert st.D[0].tolist() == [1, 1, 1, 1, 1, 1, 0, 0]


def test_decode_step_skipped_blocks_untouched_exactly():
    cfg = mk(ema_decay=0.75, keep_sink=False, keep_newest=False)
    st = warm_state(cfg, 1, 16)
    st.V[0] = f32([1] * 4 + [5] * 4 + [0.1] * 4 + [3] * 4)
    st.D[0] = -100.0                                 # prediction = V
    V0 = st.V.clone()
    z = torch.full((1, 1, 16), 2.0)
    sel, _ = decode_step(st, cfg, z, i64([[16]]), i64([[15]]), i64([0]),
                         torch.tensor([0.5], dtype=torch.float64), i64([0]), i64([0]), i64([7]))
    # block scores [1, 5, 0.1, 3], m = 2 -> blocks {1, 3}
    assert ids(sel.mask[0]) == [1, 3]
    # V: 0.75 * 5 + 0.25 * 2 = 4.25 ; 0.75 * 3 + 0.5 = 2.75 ; blocks 0, 2 bit-identical
    assert st.V[0, 4:8].tolist() == [4.25] * 4 and st.V[0, 12:].tolist() == [2.75] * 4
    assert torch.equal(st.V[0, :4], V0[0, :4]) and torch.equal(st.V[0, 8:12], V0[0, 8:12])
    # D offsets 15 - i: block 1 -> 8..11, block 3 -> 0..3 : 0.75 * -100 + 0.5 = -74.5
    assert st.D[0].tolist() == [-74.5] * 4 + [-100.0] * 4 + [-74.5] * 4 + [-100.0] * 4
    assert st.last_seen[0].tolist() == [0, 7, 0, 7]


def test_ema_float16_state_stored_in_state_dtype():
    cfg = mk(ema_decay=0.5, state_dtype="float16")
    st = SpinState.zeros(1, 4, cfg)
    assert st.V.dtype == torch.float16 and st.D.dtype == torch.float16
    update_state(st, f32([[[3.0, 5.0, 7.0, 9.0]]]), torch.tensor([[True]]), i64([[4]]),
                 i64([[3]]), i64([0]), cfg, i64([0]))
    # 0.5 * z: [1.5, 2.5, 3.5, 4.5] all exact in fp16; D[3 - i] -> reversed
    assert st.V[0].tolist() == [1.5, 2.5, 3.5, 4.5]
    assert st.D[0].tolist() == [4.5, 3.5, 2.5, 1.5]
    assert st.V.dtype == torch.float16


def test_ema_float8_state_rounds_to_nearest_even_and_saturates():
    cfg = mk(ema_decay=0.5, state_dtype="float8_e4m3fn")
    st = SpinState.zeros(1, 4, cfg)
    assert st.V.dtype == torch.float8_e4m3fn and st.D.dtype == torch.float8_e4m3fn
    # 0.5 * z = [1.5, 1.15, 1.1875, 900]: e4m3 holds 1.5; 1.15 -> 1.125 (steps of 1/8 in [1, 2));
    # 1.1875 sits halfway between 1.125 and 1.25 -> the even mantissa, 1.25; 900 -> 448
    update_state(st, f32([[[3.0, 2.3, 2.375, 1800.0]]]), torch.tensor([[True]]), i64([[4]]),
                 i64([[3]]), i64([0]), cfg, i64([0]))
    assert st.V[0].float().tolist() == [1.5, 1.125, 1.25, 448.0]
    assert st.D[0].float().tolist() == [448.0, 1.25, 1.125, 1.5]
    SpinState.reset(st)
    assert st.V.float().abs().sum() == 0 and st.D.float().abs().sum() == 0


@pytest.mark.parametrize("reduction", ["A1", "A2"])
def test_float8_state_is_the_float32_update_rounded(reduction):
    """From the same (e4m3-exact) state and scores, the fp8 update equals the fp32 update
    rounded to e4m3 entry by entry."""
    gen = torch.Generator().manual_seed(4)
    cfgs = [mk(block_size=8, reduction=reduction, state_dtype=d, ema_decay=0.75)
            for d in ("float32", "float8_e4m3fn")]
    states = [SpinState.zeros(2, 96, c) for c in cfgs]
    start = (torch.randn(2, states[0].V.shape[1], generator=gen) * 8).to(torch.float8_e4m3fn).float()
    for st in states:
        st.V.copy_(start.to(st.V.dtype))
        st.D.copy_(start.flip(-1).to(st.D.dtype))
        st.decode_steps.fill_(3)
    z = torch.randn(2, 1, 90, generator=gen) * 50
    z[0, 0, 7] = float("nan")
    mask = torch.rand(2, 12, generator=gen) < 0.6
    n, q = i64([[90], [61]]), i64([[89], [60]])
    for st, cfg in zip(states, cfgs):
        update_state(st, z, mask, n, q, i64([0, 0]), cfg, i64([5]))
    for name in ("V", "D"):
        want = getattr(states[0], name).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(want.view(torch.uint8), getattr(states[1], name).view(torch.uint8))


# ---- reset and warm-up -----------------------------------------------------------------------------
def _step(st, cfg, t, rho=0.5, z=2.0):
    """One decode step of one stream: n = 16, q = 15 (B = 4), dense scores z."""
    return decode_step(st, cfg, torch.full((st.V.shape[0], 1, 16), z),
                       i64([[16]] * st.V.shape[0]), i64([[15]] * st.V.shape[0]),
                       i64([0] * st.V.shape[0]),
                       torch.full((st.V.shape[0],), rho, dtype=torch.float64),
                       i64(list(range(st.V.shape[0]))), i64([0] * st.V.shape[0]),
                       i64([t] * st.V.shape[0]))


def test_first_step_after_zeros_is_dense_then_sparse():
    cfg = mk()                                       # warmup_steps = 1
    st = SpinState.zeros(1, 16, cfg)
    sel, _ = _step(st, cfg, 0)
    assert sel.dense.tolist() == [True] and ids(sel.mask[0]) == [0, 1, 2, 3]
    assert sel.budget.tolist() == [[4]] and sel.eligible.tolist() == [[False]]
    # the dense step initialises every slot: V = 0.5 * 0 + 0.5 * 2 = 1
    assert st.V[0].tolist() == [1.0] * 16 and st.D[0].tolist() == [1.0] * 16
    sel, _ = _step(st, cfg, 1)
    # all blocks tie at 1 -> m = 2 = forced sink + newest {0, 3}
    assert sel.dense.tolist() == [False] and ids(sel.mask[0]) == [0, 3]
    assert sel.budget.tolist() == [[2]] and sel.eligible.tolist() == [[True]]


def test_reset_zeroes_state_and_restarts_warmup():
    cfg = mk()
    st = SpinState.zeros(1, 16, cfg)
    for t in range(3):
        _step(st, cfg, t)
    assert st.decode_steps.tolist() == [3] and float(st.V.abs().sum()) > 0
    st.reset(step=5)
    assert st.V.abs().sum().item() == 0 and st.D.abs().sum().item() == 0
    assert st.decode_steps.tolist() == [0] and st.last_seen[0].tolist() == [5] * 4
    sel, _ = _step(st, cfg, 5)
    assert sel.dense.tolist() == [True] and ids(sel.mask[0]) == [0, 1, 2, 3]
    sel, _ = _step(st, cfg, 6)
    assert sel.dense.tolist() == [False] and ids(sel.mask[0]) == [0, 3]


def test_warmup_steps_two_second_step_also_dense():
    cfg = mk(warmup_steps=2)
    st = SpinState.zeros(1, 16, cfg)
    dense = [bool(_step(st, cfg, t)[0].dense) for t in range(4)]
    assert dense == [True, True, False, False]
    st.reset(step=4)
    sels = [_step(st, cfg, 4 + t)[0] for t in range(3)]
    assert [s.budget.tolist() for s in sels] == [[[4]], [[4]], [[2]]]


def test_reset_only_chosen_streams():
    cfg = mk()
    st = SpinState.zeros(3, 16, cfg)
    for t in range(2):
        _step(st, cfg, t)
    V0, D0, L0 = st.V.clone(), st.D.clone(), st.last_seen.clone()
    st.reset(torch.tensor([False, True, False]), step=9)
    assert st.V[1].abs().sum().item() == 0 and st.D[1].abs().sum().item() == 0
    assert torch.equal(st.V[[0, 2]], V0[[0, 2]]) and torch.equal(st.D[[0, 2]], D0[[0, 2]])
    assert st.decode_steps.tolist() == [2, 0, 2]
    assert st.last_seen[1].tolist() == [9] * 4
    assert torch.equal(st.last_seen[[0, 2]], L0[[0, 2]])
    sel, _ = _step(st, cfg, 2)
    assert sel.dense.tolist() == [False, True, False]


# ---- MTP masks ------------------------------------------------------------------------------------
MTP_SCORES = [
    [9.0, 1.0, 8.0, 2.0, -INF],    # row 0: n = 16 -> B = 4, m = 2 -> {0, 2}
    [1.0, 9.0, 2.0, 8.0, 7.0],     # row 1: n = 17 -> B = 5, m = ceil(2.5) = 3 -> {1, 3, 4}
    [9.0, 8.0, 1.0, 2.0, 7.0],     # row 2: n = 18 -> B = 5, m = 3 -> {0, 1, 4}
]


def test_mtp_union_mask():
    cfg = mk(keep_sink=False, keep_newest=False, mtp_mask="union")
    sel = select(cfg, MTP_SCORES, [16, 17, 18], 0.5)
    assert [ids(r) for r in sel.row_mask[0]] == [[0, 2], [1, 3, 4], [0, 1, 4]]
    assert sel.budget.tolist() == [[2, 3, 3]] and sel.n_blocks.tolist() == [[4, 5, 5]]
    assert ids(sel.mask[0]) == [0, 1, 2, 3, 4]       # union


def test_mtp_row0_mask():
    cfg = mk(keep_sink=False, keep_newest=False, mtp_mask="row0")
    sel = select(cfg, MTP_SCORES, [16, 17, 18], 0.5)
    assert [ids(r) for r in sel.row_mask[0]] == [[0, 2], [1, 3, 4], [0, 1, 4]]
    # row 0's {0, 2} + blocks only later rows see: B_0 = 4 <= j < 5 -> {4}
    assert ids(sel.mask[0]) == [0, 2, 4]


def test_mtp_row0_mask_same_context_is_row0_mask():
    cfg = mk(keep_sink=False, keep_newest=False, mtp_mask="row0")
    sel = select(cfg, [[9.0, 1.0, 8.0, 2.0], [1.0, 9.0, 2.0, 8.0]], [16, 16], 0.5)
    assert ids(sel.mask[0]) == [0, 2]


# ---- MTP deferred EMA replay ---------------------------------------------------------------------
# b = 2, rows n = [2, 3, 4], q = [1, 2, 3], alpha = 0.5, state from zero.
# z rows: r0 = [4, 8], r1 = [8, 0, 16], r2 = [0, 4, 8, 12]; slots past n_r hold junk 1000.
MTP_Z = [[4.0, 8.0, 1000.0, 1000.0], [8.0, 0.0, 16.0, 1000.0], [0.0, 4.0, 8.0, 12.0]]
# a = 0: r0 -> V = [2, 4, 0, 0]; D[1 - i]: D1 = 2, D0 = 4
# a = 1: r1 -> V0 = 1 + 4 = 5, V1 = 2 + 0 = 2, V2 = 0 + 8 = 8;
#              D2 = 0 + 4 = 4, D1 = 1 + 0 = 1, D0 = 2 + 8 = 10
# a = 2: r2 -> V0 = 2.5 + 0, V1 = 1 + 2 = 3, V2 = 4 + 4 = 8, V3 = 0 + 6 = 6;
#              D3 = 0 + 0 = 0, D2 = 2 + 2 = 4, D1 = 0.5 + 4 = 4.5, D0 = 5 + 6 = 11
MTP_EXPECTED = {
    0: ([2.0, 4.0, 0.0, 0.0], [4.0, 2.0, 0.0, 0.0]),
    1: ([5.0, 2.0, 8.0, 0.0], [10.0, 1.0, 4.0, 0.0]),
    2: ([2.5, 3.0, 8.0, 6.0], [11.0, 4.5, 4.0, 0.0]),
}


def _mtp_replay(cfg, accepted, mask=(True, True)):
    G = len(accepted)
    st = SpinState.zeros(G, 4, cfg)
    z = f32([MTP_Z] * G)
    update_state(st, z, torch.tensor([list(mask)] * G), i64([[2, 3, 4]] * G),
                 i64([[1, 2, 3]] * G), i64(accepted), cfg, i64([3] * G))
    return st


@pytest.mark.parametrize("a", [0, 1, 2])
def test_mtp_prefix_valid_replay_in_order(a):
    st = _mtp_replay(mk(block_size=2, mtp_update="prefix_valid"), [a])
    assert st.V[0].tolist() == MTP_EXPECTED[a][0]
    assert st.D[0].tolist() == MTP_EXPECTED[a][1]


def test_mtp_prefix_valid_vectorized_over_streams():
    st = _mtp_replay(mk(block_size=2, mtp_update="prefix_valid"), [2, 0, 1])
    for g, a in enumerate([2, 0, 1]):
        assert st.V[g].tolist() == MTP_EXPECTED[a][0]
        assert st.D[g].tolist() == MTP_EXPECTED[a][1]
    assert st.decode_steps.tolist() == [1, 1, 1]


def test_mtp_accepted_beyond_rows_replays_all_rows():
    st = _mtp_replay(mk(block_size=2, mtp_update="prefix_valid"), [3])
    assert st.V[0].tolist() == MTP_EXPECTED[2][0]


@pytest.mark.parametrize("a", [0, 1, 2])
def test_mtp_row0_update_uses_row0_only(a):
    st = _mtp_replay(mk(block_size=2, mtp_update="row0"), [a])
    assert st.V[0].tolist() == MTP_EXPECTED[0][0]
    assert st.D[0].tolist() == MTP_EXPECTED[0][1]


def test_mtp_prefix_valid_partial_mask():
    # only block 0 (slots 0, 1) scored, a = 2:
    # r0: V0 = 2, V1 = 4, D1 = 2, D0 = 4
    # r1 (q=2): V0 = 1 + 4 = 5, V1 = 2 + 0 = 2; D2 = 0 + 4 = 4, D1 = 1 + 0 = 1
    # r2 (q=3): V0 = 2.5 + 0 = 2.5, V1 = 1 + 2 = 3; D3 = 0 + 0 = 0, D2 = 2 + 2 = 4
    st = _mtp_replay(mk(block_size=2), [2], mask=(True, False))
    assert st.V[0].tolist() == [2.5, 3.0, 0.0, 0.0]
    assert st.D[0].tolist() == [4.0, 1.0, 4.0, 0.0]
    assert st.last_seen[0].tolist() == [3, 0]


def test_mtp_decode_step_dense_warmup_then_union():
    # decode_step with R = 2 rows end to end: warm-up step is dense for every row
    cfg = mk(keep_sink=False, keep_newest=False)
    st = SpinState.zeros(1, 20, cfg)
    z = torch.zeros(1, 2, 18)
    z[0, 0, 4] = 8.0    # row 0 likes block 1
    z[0, 1, 9] = 8.0    # row 1 likes block 2
    n, q = i64([[16, 17]]), i64([[15, 16]])
    sel, _ = decode_step(st, cfg, z, n, q, i64([1]), torch.tensor([0.5], dtype=torch.float64),
                         i64([0]), i64([0]), i64([0]))
    assert sel.dense.tolist() == [True]
    assert [ids(r) for r in sel.row_mask[0]] == [[0, 1, 2, 3], [0, 1, 2, 3, 4]]
    assert sel.budget.tolist() == [[4, 5]]
    # replay rows 0 then 1 (a = 1, alpha 0.5): V[4]: row 0 -> 0.5 * 8 = 4, row 1 (z = 0)
    # -> 0.5 * 4 = 2.  V[9]: row 0 (z = 0) -> 0, row 1 -> 0.5 * 8 = 4
    assert st.V[0, 4].item() == 2.0 and st.V[0, 9].item() == 4.0


# ---- exploration ------------------------------------------------------------------------------------
def test_exploration_count_and_not_top_scored():
    cfg = mk(exploration=0.25)
    # n = 80 -> B = 20, m = 10, e = floor(0.25 * 10) = 2; forced {0, 19} (lowest scores);
    # m - e = 8 positions: forced 2 + top-6 of the rest = blocks 1..6
    scores = [-1000.0] + [100.0 - j for j in range(1, 19)] + [-1000.0]
    sel = select(cfg, scores, 80, 0.5, step=3)
    chosen = ids(sel.mask[0])
    assert len(chosen) == 10 and sel.budget.tolist() == [[10]]
    assert {0, 1, 2, 3, 4, 5, 6, 19} <= set(chosen)
    explored = set(chosen) - {0, 1, 2, 3, 4, 5, 6, 19}
    assert len(explored) == 2 and explored <= set(range(7, 19))


def test_exploration_capped_by_room_left_after_forced():
    cfg = mk(exploration=0.9)
    # B = 4, m = 2, floor(0.9 * 2) = 1 but m - forced = 0 -> e = 0: only the forced blocks
    sel = select(cfg, [-5.0, 9.0, 8.0, -5.0], 16, 0.5)
    assert ids(sel.mask[0]) == [0, 3]


def test_exploration_floor_tolerance_age_policy():
    # B = 200, rho = 0.5 -> m = 100; gamma = 0.29: 0.29 * 100 = 28.999999999999996 in fp64,
    # floor with tolerance -> e = 29 (a plain floor would give 28).
    cfg = mk(exploration=0.29, exploration_policy="age", keep_sink=False, keep_newest=False)
    st = warm_state(cfg, 1, 800)
    st.last_seen[0] = i64([200 - j for j in range(200)])   # age = 300 - (200 - j) = 100 + j
    sel = select(cfg, [200.0 - j for j in range(200)], 800, 0.5, state=st, step=300)
    # top m - e = 71 by score: blocks 0..70; explored: the 29 oldest = 171..199
    assert ids(sel.mask[0]) == list(range(71)) + list(range(171, 200))


AGE_SCORES = [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0]   # B = 8, m = 4, e = floor(0.5*4) = 2
AGE_LAST_SEEN = [0, 0, 2, 1, 9, 2, 1, 9]                # step 10: ages of 2..7 = 8 9 1 8 9 1


def test_exploration_age_policy_least_recently_scored():
    cfg = mk(exploration=0.5, exploration_policy="age", keep_sink=False, keep_newest=False)
    st = warm_state(cfg, 1, 32)
    st.last_seen[0] = i64(AGE_LAST_SEEN)
    sel = select(cfg, AGE_SCORES, 32, 0.5, state=st, step=10)
    # top-2 by score {0, 1}; candidates 2..7 ages [8, 9, 1, 8, 9, 1] -> 9, 9 at {3, 6}
    assert ids(sel.mask[0]) == [0, 1, 3, 6]


def test_exploration_age_ties_lower_block_id():
    cfg = mk(exploration=0.5, exploration_policy="age", keep_sink=False, keep_newest=False)
    st = warm_state(cfg, 1, 32)
    st.last_seen[0] = 4                              # every age is 6 -> lowest candidate ids
    sel = select(cfg, AGE_SCORES, 32, 0.5, state=st, step=10)
    assert ids(sel.mask[0]) == [0, 1, 2, 3]


def test_exploration_staleness_policy_weights_by_importance():
    cfg = mk(exploration=0.5, exploration_policy="staleness", keep_sink=False,
             keep_newest=False)
    st = warm_state(cfg, 1, 32)
    st.last_seen[0] = i64(AGE_LAST_SEEN)
    sel = select(cfg, AGE_SCORES, 32, 0.5, state=st, step=10)
    # candidates 2..7 scores 6..1 -> s = (S - 1) / 5 = [1, .8, .6, .4, .2, 0]
    # priority = age (1 + s) = [16, 16.2, 1.6, 11.2, 10.8, 1] -> blocks 3 (16.2), 2 (16)
    assert ids(sel.mask[0]) == [0, 1, 2, 3]


def test_exploration_staleness_equal_scores_is_age():
    cfg = mk(exploration=0.5, exploration_policy="staleness", keep_sink=False,
             keep_newest=False)
    st = warm_state(cfg, 1, 32)
    st.last_seen[0] = i64(AGE_LAST_SEEN)
    # top-2 = {0, 1} (9 > 1); candidates all 1 -> s = 0 -> priority = age -> {3, 6}
    sel = select(cfg, [9.0, 9.0] + [1.0] * 6, 32, 0.5, state=st, step=10)
    assert ids(sel.mask[0]) == [0, 1, 3, 6]



def test_fmix32_reference_vectors():
    # sanity of the test's own finaliser: fmix32(0) = 0, and the mixing is a bijection on
    # a few inputs (distinct outputs)
    assert fmix32(0) == 0
    outs = {fmix32(x) for x in range(1000)}
    assert len(outs) == 1000


def test_counter_hash_matches_documented_construction_and_range():
    cases = [(0, 0, 0, 0, 0), (1, 2, 3, 4, 5), (0xFFFFFFFF, 7, 60, 123456, 8191),
             (12345, -1, 3, 2**40 + 5, 17), (2**31, 2**31 - 1, 0, 1, 2)]
    for seed, r, l, s, b in cases:
        got = counter_hash(seed, i64(r), i64(l), i64(s), i64(b))
        assert 0 <= int(got) < 2**32
        assert int(got) == _py_hash(seed, r, l, s, b)
    # broadcasting: blocks 0..99 for one (seed, request, layer, step)
    got = counter_hash(7, i64([3]), i64([1]), i64([9]), torch.arange(100))
    assert got.shape == (100,)
    assert got.tolist() == [_py_hash(7, 3, 1, 9, j) for j in range(100)]
    assert int(got.min()) >= 0 and int(got.max()) < 2**32


def _random_explored(seed=0, request=0, layer=0, step=5):
    cfg = mk(exploration=0.5, exploration_policy="random", seed=seed, keep_sink=False,
             keep_newest=False)
    # B = 40, m = 20, e = 10; top 10 by score = blocks 0..9; 10 explored from 10..39
    sel = select(cfg, [100.0 - j for j in range(40)], 160, 0.5, step=step, request=request,
                 layer=layer)
    chosen = ids(sel.mask[0])
    assert len(chosen) == 20 and set(range(10)) <= set(chosen)
    return chosen[10:]


def test_random_exploration_is_top_hash_of_candidates():
    for seed, request, layer, step in [(0, 0, 0, 5), (11, 4, 2, 77)]:
        explored = _random_explored(seed, request, layer, step)
        keys = {j: _py_hash(seed, request, layer, step, j) for j in range(10, 40)}
        expected = sorted(sorted(keys, key=lambda j: (-keys[j], j))[:10])
        assert explored == expected


def test_random_exploration_deterministic_and_counter_dependent():
    base = _random_explored(0, 0, 0, 5)
    assert _random_explored(0, 0, 0, 5) == base
    assert _random_explored(1, 0, 0, 5) != base      # seed
    assert _random_explored(0, 1, 0, 5) != base      # request
    assert _random_explored(0, 0, 1, 5) != base      # layer
    assert _random_explored(0, 0, 0, 6) != base      # step


def test_random_exploration_same_keys_for_all_mtp_rows():
    cfg = mk(exploration=0.5, keep_sink=False, keep_newest=False)
    scores = [100.0 - j for j in range(40)]
    sel = select(cfg, [scores, scores], [160, 160], 0.5)
    assert torch.equal(sel.row_mask[0, 0], sel.row_mask[0, 1])


# ---- A0 and A2 -----------------------------------------------------------------------------------------
def _slot_pred(high: dict, n: int, width: int) -> list[float]:
    return [(high.get(i, 0.0) if i < n else -INF) for i in range(width)]


@pytest.mark.parametrize("keep,expected", [(True, [0, 2, 3]), (False, [0, 2])])
def test_A0_expands_top_slots_to_blocks(keep, expected):
    cfg = mk(reduction="A0", keep_sink=keep, keep_newest=keep)
    # n = 16, B = 4, s = min(16, ceil(-4 ln 0.5 = 2.77)) = 3 slots: ties -> {1, 2, 9}
    # -> blocks {0, 2}; forced adds {0, 3}
    pred = _slot_pred({1: 5.0, 2: 5.0, 9: 5.0, 10: 5.0}, 16, 16)
    sel = select(cfg, [0.0] * 4, 16, 0.5, slot_pred=pred)
    assert ids(sel.mask[0]) == expected
    assert sel.budget.tolist() == [[len(expected)]]


def test_A0_slot_budget_follows_rho():
    cfg = mk(reduction="A0", index_topk=1, keep_sink=False, keep_newest=False)
    pred = _slot_pred({0: 9.0, 5: 8.0, 6: 7.0, 13: 6.0}, 16, 16)
    # rho = 0.5: s = ceil(-4 ln 0.5 = 2.77) = 3: slots 0, 5, 6 -> blocks {0, 1};
    # slot 13 (4th best) must not pull in block 3
    sel = select(cfg, [0.0] * 4, 16, 0.5, slot_pred=pred)
    assert ids(sel.mask[0]) == [0, 1]
    # rho = 0.25: s = ceil(-4 ln 0.25 = 5.55) = 6: slots 0, 5, 6, 13 and the tied 1, 2
    sel = select(cfg, [0.0] * 4, 16, 0.25, slot_pred=pred)
    assert ids(sel.mask[0]) == [0, 1, 3]
    # rho = 0: every slot
    sel = select(cfg, [0.0] * 4, 16, 0.0, slot_pred=pred)
    assert ids(sel.mask[0]) == [0, 1, 2, 3]


def test_A0_slot_ties_lower_slot_id():
    cfg = mk(reduction="A0", index_topk=5, keep_sink=False, keep_newest=False)
    # all slots tie; s = 3 -> slots 0..2 -> block {0}; ceil(K/b) = 2 blocks are needed for
    # K = 5 slots, so the best remaining block (all tie at 0 -> lowest id, 1) tops it up
    sel = select(cfg, [0.0] * 4, 16, 0.5, slot_pred=_slot_pred({}, 16, 16))
    assert ids(sel.mask[0]) == [0, 1]


def test_A0_exploration_on_top():
    cfg = mk(reduction="A0", exploration=0.5, keep_sink=True, keep_newest=True)
    # m0 = 3 ({0, 2, 3}); e = min(floor(1.5) = 1, B - m0 = 1) = 1 -> every block, m = 4
    pred = _slot_pred({1: 5.0, 2: 5.0, 9: 5.0, 10: 5.0}, 16, 16)
    sel = select(cfg, [0.0] * 4, 16, 0.5, slot_pred=pred)
    assert ids(sel.mask[0]) == [0, 1, 2, 3] and sel.budget.tolist() == [[4]]
    # without forced blocks: m0 = 2 ({0, 2}), e = min(1, 2) = 1; age policy picks the
    # older of {1, 3}: last_seen [0, 5, 0, 1] at step 10 -> ages 5, 9 -> block 3
    cfg = mk(reduction="A0", exploration=0.5, exploration_policy="age", keep_sink=False,
             keep_newest=False)
    st = warm_state(cfg, 1, 16)
    st.last_seen[0] = i64([0, 5, 0, 1])
    sel = select(cfg, [0.0] * 4, 16, 0.5, slot_pred=pred, state=st, step=10)
    assert ids(sel.mask[0]) == [0, 2, 3] and sel.budget.tolist() == [[3]]


def test_A2_state_is_block_level_and_prediction():
    cfg = mk(reduction="A2", block_size=2)
    st = SpinState.zeros(1, 4, cfg)                  # 4 slots -> 2 blocks of state
    assert st.V.shape == (1, 2) and st.D.shape == (1, 2)
    st.V[0] = f32([1, 5])
    st.D[0] = f32([3, 0])
    # n = 4, q = 3 -> q // b = 1; S[j] = max(V[j], D[1 - j]): S0 = max(1, 0) = 1, S1 = max(5, 3)
    blocks, slots = predict_blocks(st, i64([[4]]), i64([[3]]), cfg, 4)
    assert slots is None
    assert blocks[0, 0].tolist() == [1.0, 5.0]


@pytest.mark.parametrize("pooling,n,mask,V,D", [
    # z = [2, 6, 4, 10], alpha 0.5, V0 = [1, 5], D0 = [3, 0], q // b = 1 (q = 3)
    # max: pooled [6, 10]: V = [0.5 + 3, 2.5 + 5] = [3.5, 7.5]; D1 = 0 + 3, D0 = 1.5 + 5
    ("max", 4, [True, True], [3.5, 7.5], [6.5, 3.0]),
    # mean: pooled [4, 7]: V = [0.5 + 2, 2.5 + 3.5] = [2.5, 6]; D1 = 0 + 2, D0 = 1.5 + 3.5
    ("mean", 4, [True, True], [2.5, 6.0], [5.0, 2.0]),
    # ragged n = 3 (q = 3): block 1 pools only slot 2 = 4 -> V1 = 2.5 + 2; D0 = 1.5 + 2
    ("max", 3, [True, True], [3.5, 4.5], [3.5, 3.0]),
    # only block 0 scored: V1, D0 untouched
    ("max", 4, [True, False], [3.5, 5.0], [3.0, 3.0]),
])
def test_A2_block_level_ema(pooling, n, mask, V, D):
    cfg = mk(reduction="A2", block_size=2, pooling=pooling)
    st = SpinState.zeros(1, 4, cfg)
    st.V[0] = f32([1, 5])
    st.D[0] = f32([3, 0])
    update_state(st, f32([[[2, 6, 4, 10]]]), torch.tensor([mask]), i64([[n]]), i64([[3]]),
                 i64([0]), cfg, i64([1]))
    assert st.V[0].tolist() == V
    assert st.D[0].tolist() == D


def test_A2_selection_as_A1():
    cfg = mk(reduction="A2", block_size=2, keep_sink=False, keep_newest=False)
    st = warm_state(cfg, 1, 8)                       # 4 blocks of state
    st.V[0] = f32([1, 7, 3, 5])
    # n = 8, q = 7 -> q // b = 3; D zero -> S = V; m = ceil(0.5 * 4) = 2 -> blocks {1, 3}
    z = torch.zeros(1, 1, 8)
    sel, slots = decode_step(st, cfg, z, i64([[8]]), i64([[7]]), i64([0]),
                             torch.tensor([0.5], dtype=torch.float64), i64([0]), i64([0]),
                             i64([4]))
    assert slots is None and ids(sel.mask[0]) == [1, 3]
    # EMA with pooled z = 0: V1 = 3.5, V3 = 2.5; V0, V2 untouched
    assert st.V[0].tolist() == [1.0, 3.5, 3.0, 2.5]


# ---- block_list ----------------------------------------------------------------------------------------
def test_block_list_ascending_padded_counts():
    mask = torch.tensor([[True, False, True, False, True],
                         [False, False, False, False, False],
                         [True, True, True, True, True]])
    got, counts = block_list(mask, 5)
    assert got.dtype == torch.int32 and counts.dtype == torch.int32
    assert got.tolist() == [[0, 2, 4, -1, -1], [-1] * 5, [0, 1, 2, 3, 4]]
    assert counts.tolist() == [3, 0, 5]
    got, _ = block_list(mask, 7)                     # m_cap wider than NB: -1 padding
    assert got.tolist() == [[0, 2, 4, -1, -1, -1, -1], [-1] * 7, [0, 1, 2, 3, 4, -1, -1]]


def test_block_list_rejects_counts_above_cap():
    mask = torch.tensor([[True, False, True], [True, True, True]])
    with pytest.raises(SpinError, match="m_cap"):
        block_list(mask, 2)
    got, counts = block_list(mask[:1], 2)
    assert got.tolist() == [[0, 2]] and counts.tolist() == [2]


# ---- errors ---------------------------------------------------------------------------------------------
def test_state_capacity_errors():
    cfg = mk()
    with pytest.raises(SpinError):
        SpinState.zeros(0, 8, cfg)
    with pytest.raises(SpinError):
        SpinState.zeros(1, 0, cfg)
    st = SpinState.zeros(1, 8, cfg)
    with pytest.raises(SpinError, match="slot_capacity"):
        predict_scores(st.V, st.D, i64([[8]]), i64([[7]]), 12)        # width 12 > 8
    with pytest.raises(SpinError, match="slot_capacity"):
        predict_scores(st.V, st.D, i64([[8]]), i64([[8]]), 8)         # q = 8 past D[0..7]
    with pytest.raises(SpinError, match="slot_capacity"):
        decode_step(st, cfg, torch.zeros(1, 1, 12), i64([[12]]), i64([[11]]), i64([0]),
                    torch.tensor([0.5], dtype=torch.float64), i64([0]), i64([0]), i64([0]))
    # A2: capacity counted in blocks
    cfg2 = mk(reduction="A2")
    st2 = SpinState.zeros(1, 8, cfg2)                # 2 blocks
    with pytest.raises(SpinError, match="slot_capacity"):
        decode_step(st2, cfg2, torch.zeros(1, 1, 12), i64([[12]]), i64([[11]]), i64([0]),
                    torch.tensor([0.5], dtype=torch.float64), i64([0]), i64([0]), i64([0]))


def test_error_messages_are_one_line_spin_errors():
    cfg = mk()
    st = SpinState.zeros(1, 8, cfg)
    with pytest.raises(SpinError) as info:
        predict_scores(st.V, st.D, i64([[8]]), i64([[7]]), 12)
    assert "\n" not in str(info.value)
    with pytest.raises(SpinError):
        pool_blocks(f32([1.0, 2.0]), 2, "median")


def test_empty_context_selects_nothing():
    # n = 0 -> B = 0: there is no sink or newest block to force, m = 0
    cfg = mk()
    sel = select(cfg, [5.0, 5.0], 0, 0.5)
    assert ids(sel.mask[0]) == [] and sel.budget.tolist() == [[0]]
    assert sel.n_blocks.tolist() == [[0]]


# ---- float32 knobs and capacity errors ---------------------------------------------------
def test_block_budget_float32_rho_tolerance():
    cfg = mk()
    # spec: m = ceil((1 - 0.7) * 10) = 3 (with the float-knob tolerance)
    assert int(block_budget(i64(10), torch.tensor(0.7), cfg)) == 3


def test_update_state_query_past_capacity_is_spin_error():
    cfg = mk()
    st = SpinState.zeros(1, 8, cfg)
    # n = 8, q = 9: offsets q - i = 9..2, but D has only offsets 0..7
    with pytest.raises(SpinError, match="slot_capacity"):
        update_state(st, torch.ones(1, 1, 8), torch.tensor([[True, True]]), i64([[8]]),
                     i64([[9]]), i64([0]), cfg, i64([0]))


def test_update_state_scores_wider_than_capacity_is_spin_error():
    cfg = mk()
    st = SpinState.zeros(1, 8, cfg)
    with pytest.raises(SpinError):
        update_state(st, torch.ones(1, 1, 12), torch.tensor([[True, True, True]]), i64([[12]]),
                     i64([[11]]), i64([0]), cfg, i64([0]))


@pytest.mark.parametrize("reduction", ["A1", "A2"])
def test_non_finite_scores_never_enter_state(reduction):
    # Rule: a NaN/inf score is "not observed". Slot 1 is NaN, slot 2 is +inf, slot 3 -inf:
    # with V = D = 0 and alpha = 0.5 only slot 0 (z = 2) updates: V[0] = 1, D[q - 0] = 1.
    cfg = mk(reduction=reduction, ema_decay=0.5)
    st = SpinState.zeros(1, 8, cfg)
    z = torch.tensor([[[2.0, float("nan"), float("inf"), float("-inf"), 0, 0, 0, 0]]])
    update_state(st, z, torch.tensor([[True, False]]), i64([[4]]), i64([[3]]), i64([0]), cfg,
                 i64([0]))
    assert torch.isfinite(st.V).all() and torch.isfinite(st.D).all()
    if reduction == "A1":
        assert st.V[0].tolist() == [1.0, 0, 0, 0, 0, 0, 0, 0]
        assert st.D[0].tolist() == [0, 0, 0, 1.0, 0, 0, 0, 0]
    else:
        # block 0 pools only its finite visible slot (2.0): Vb[0] = 1, Db[3 // 4 - 0] = 1
        assert st.V[0, 0] == 1.0 and st.D[0, 0] == 1.0


def test_fp16_state_saturates_and_forced_blocks_survive_overflow():
    # Scores of 2e5 overflow fp16 (max 65504): the state saturates at 65504 instead of inf,
    # and the forced newest block 3 is kept although blocks 1-2 predict higher than it.
    cfg = mk(state_dtype="float16", target_sparsity=0.25, ema_decay=0.0)
    st = SpinState.zeros(1, 16, cfg)
    z = torch.zeros(1, 1, 16)
    z[0, 0, 4:12] = 2e5
    update_state(st, z, torch.ones(1, 4, dtype=torch.bool), i64([[16]]), i64([[15]]), i64([0]),
                 cfg, i64([0]))
    assert st.V.dtype == torch.float16 and float(st.V.max()) == 65504.0
    assert torch.isfinite(st.V).all() and torch.isfinite(st.D).all()
    # m = ceil(0.75 * 4) = 3: forced {0, 3} + the best of {1, 2} (tie at 65504 -> 1)
    sel = decode_step(st, cfg, z, i64([[16]]), i64([[15]]), i64([0]), torch.tensor([0.25]),
                      i64([0]), i64([0]), i64([1]))[0]
    assert ids(sel.mask[0]) == [0, 1, 3]
