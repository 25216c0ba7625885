"""spin::summarize, spin::summarize_newest, spin::probe and select with given block scores
(the query-aware probe): the reference against brute force on the CPU, the kernels against the
reference on a GPU, argument checks."""

import math

import pytest
import torch

from spin_trtllm import SpinConfig, ops
from spin_trtllm import reference as ref
from spin_trtllm.errors import SpinError
from spin_trtllm.replay.probe import BlockSummaries, gauss_scores
from spin_trtllm.testing.pages import make_cache, random_mxfp4_pages
from spin_trtllm.testing.problems import Problem, integer_state

# GPU tests must run the kernels (SPIN_REQUIRE_NATIVE=1), not the reference against itself
pytestmark = pytest.mark.usefixtures("require_native")


def _summaries(cache, gen, fills=None):
    """Summaries of every page, with page fills drawn from edge values unless given."""
    P = cache.shape[0]
    if fills is None:
        fills = torch.tensor([(0, 1, 37, 63, 64, 70, -3)[i % 7] for i in range(P)],
                             dtype=torch.int32)
    S = ops.summaries_like(cache)
    ops.summarize(cache, torch.arange(P, dtype=torch.int32).to(cache.device), fills.to(cache.device),
                  S)
    return S, fills


# ---- CPU: the reference against brute force --------------------------------------------------
def assert_mean_keys(S, keys, fills, page_slots):
    """Each summary row (dequantized) is the mean of its page's first fill keys (float64
    [P, page_slots, 128]), re-quantized e4m3, and its padding is untouched."""
    got = ref.dequantize_summaries(S).double()
    for p in range(S.shape[0]):
        f = min(max(int(fills[p]), 0), page_slots)
        mean = keys[p, :f].mean(0) if f else torch.zeros(128, dtype=torch.float64)
        amax = float(mean.abs().max())
        # e4m3 keeps 3 mantissa bits: each entry within half a step (1/16 relative) of the mean,
        # steps measured against the row's scale for the subnormal range
        tol = torch.maximum(mean.abs() / 16, torch.full_like(mean, amax / 448 * 2 ** -9)) + 1e-12
        assert bool(((got[p] - mean).abs() <= tol).all()), p
        assert int(S[p, 132:].count_nonzero()) == 0          # padding untouched (zeroed table)


def test_summary_is_the_mean_key_requantized():
    gen = torch.Generator().manual_seed(0)
    cache = make_cache(9, gen)
    S, fills = _summaries(cache, gen)
    assert_mean_keys(S, ref.dequantize_pages(cache).double(), fills, 64)


def test_summarize_skips_pages_outside_the_cache():
    gen = torch.Generator().manual_seed(1)
    cache = make_cache(4, gen)
    S = ops.summaries_like(cache)
    ops.summarize(cache, torch.tensor([-1, 4, 99, 2], dtype=torch.int32),
                  torch.tensor([64, 64, 64, 5], dtype=torch.int32), S)
    assert int(S[[0, 1, 3]].count_nonzero()) == 0
    assert int(S[2].count_nonzero()) > 0


def test_probe_reference_matches_a_loop():
    gen = torch.Generator().manual_seed(2)
    P, B, R = 10, 3, 2
    cache = make_cache(P, gen)
    S, _ = _summaries(cache, gen, torch.full((P,), 64, dtype=torch.int32))
    table = torch.tensor([[3, 1, 7, -1], [0, 12, 2, 5], [9, 8, 4, 6]], dtype=torch.int32)
    ctx = torch.tensor([[130, 131], [1, 2], [256, 257]], dtype=torch.int32)
    q = torch.randn(B * R, 64, 128, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(B * R, 64, generator=gen)
    num_blocks = 6                                  # past the table's 4 columns
    got = ops.probe(q, S, w, ctx, table, num_blocks)
    keys = ref.dequantize_summaries(S).double()
    for b in range(B):
        for r in range(R):
            for j in range(num_blocks):
                page = int(table[b, j]) if j < table.shape[1] else -1
                row = got[b * R + r, j]
                if page < 0 or page >= P or 64 * j >= int(ctx[b, r]):
                    assert row == float("-inf"), (b, r, j)
                    continue
                dots = q[b * R + r].double() @ keys[page]
                want = float((dots.relu() * w[b * R + r].double()).sum())
                assert abs(float(row) - want) <= 1e-4 * (1 + abs(want)), (b, r, j)


def split_pages(cache: torch.Tensor) -> torch.Tensor:
    """64-slot pages [P, 64, 1, 132] -> 32-slot pages [2P, 32, 1, 132]: page 2i holds slots
    0..31 of page i, page 2i + 1 slots 32..63 (each half's key rows, then its scales)."""
    P = cache.shape[0]
    flat = cache.reshape(P, -1)
    keys = flat[:, :64 * 128].reshape(P, 2, 32 * 128)
    scales = flat[:, 64 * 128:].reshape(P, 2, 32 * 4)
    return torch.cat([keys, scales], -1).reshape(2 * P, 32, 1, 132).contiguous()


def test_summaries_of_32_slot_pages_are_their_mean_keys():
    gen = torch.Generator().manual_seed(11)
    cache64 = make_cache(5, gen)
    cache = split_pages(cache64)
    fills = torch.tensor([(0, 1, 17, 31, 32, 40, -2)[i % 7] for i in range(10)], dtype=torch.int32)
    S, _ = _summaries(cache, gen, fills)
    halves = ref.dequantize_pages(cache64).double().reshape(10, 32, 128)  # keys by half page
    assert_mean_keys(S, halves, fills, 32)
    with pytest.raises(SpinError, match="pages of 32 or 64 x 132 or 68 bytes"):
        ops.summarize(cache.view(20, 16, 1, 132), torch.zeros(1, dtype=torch.int32),
                      torch.ones(1, dtype=torch.int32), ops.summaries_like(cache.view(20, 16, 1, 132)))


def test_probe_of_32_slot_pages_scores_page_columns_and_blocks_take_the_best():
    gen = torch.Generator().manual_seed(12)
    P, B, R = 12, 2, 2
    cache = split_pages(make_cache(P // 2, gen))
    S, _ = _summaries(cache, gen, torch.full((P,), 32, dtype=torch.int32))
    table = torch.tensor([[3, 1, 7, -1, 0, 2], [0, 11, 2, 5, 9, 8]], dtype=torch.int32)
    ctx = torch.tensor([[95, 96], [1, 33]], dtype=torch.int32)
    q = torch.randn(B * R, 64, 128, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(B * R, 64, generator=gen)
    got = ops.probe(q, S, w, ctx, table, 6, page_slots=32)
    keys = ref.dequantize_summaries(S).double()
    for b in range(B):
        for r in range(R):
            for j in range(6):
                page, row = int(table[b, j]), got[b * R + r, j]
                if page < 0 or 32 * j >= int(ctx[b, r]):
                    assert row == float("-inf"), (b, r, j)
                    continue
                dots = q[b * R + r].double() @ keys[page]
                want = float((dots.relu() * w[b * R + r].double()).sum())
                assert abs(float(row) - want) <= 1e-4 * (1 + abs(want)), (b, r, j)
    blocks = ref.block_scores(got, 32)
    assert blocks.shape == (B * R, 3)
    assert torch.equal(blocks, torch.maximum(got[:, 0::2], got[:, 1::2]))
    with pytest.raises(SpinError, match="page_slots must be one of 32, 64, got 16"):
        ops.probe(q, S, w, ctx, table, 6, page_slots=16)


@pytest.mark.parametrize("page_slots", [32, 64])
def test_summaries_of_mxfp4_pages_are_their_mean_and_std(page_slots):
    """V4's MXFP4 key pages (68-byte slots, SM100's format): the reference reads the keys a
    table-built page holds (4-D and 2-D views), and summarize / summarize_gauss write the same
    kind of rows as for FP8 keys: the mean, and the per-dimension std."""
    gen = torch.Generator().manual_seed(31 + page_slots)
    P = 7
    cache, keys = random_mxfp4_pages(P, gen, page_slots)
    assert torch.equal(ref.dequantize_pages(cache).double(), keys)
    assert torch.equal(ref.dequantize_pages(cache.reshape(P, -1)).double(), keys)
    fills = torch.tensor([0, 1, page_slots - 1, page_slots, page_slots + 6, -3, 5],
                         dtype=torch.int32)
    S, _ = _summaries(cache, gen, fills)
    assert_mean_keys(S, keys, fills, page_slots)
    flat, _ = _summaries(cache.reshape(P, -1), gen, fills)
    assert torch.equal(flat, S)
    G = ops.gauss_summaries_like(cache)
    ops.summarize_gauss(cache, torch.arange(P, dtype=torch.int32), fills, G)
    assert torch.equal(G[:, :144], S)
    std = torch.stack([keys[p, :min(max(int(f), 0), page_slots)].std(0, unbiased=False)
                       if int(f) > 0 else torch.zeros(128, dtype=torch.float64)
                       for p, f in enumerate(fills)])
    got = ref.dequantize_summaries(G[:, 144:]).double()
    tol = std.abs() / 16 + std.abs().amax(1, keepdim=True) / 448 * 2 ** -9 + 1e-12
    assert bool(((got - std).abs() <= tol).all())
    with pytest.raises(SpinError, match="pages of 32 or 64 x 132 or 68 bytes"):
        bad = torch.zeros(P, page_slots, 1, 70, dtype=torch.uint8)
        ops.summarize(bad, torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                      ops.summaries_like(bad))


def test_an_mxfp4_query_probes_like_its_dequantized_values():
    """TensorRT-LLM's MXFP4 query (E2M1 pairs, 4 UE8M0 exponents a head) made e4m3 with a scale
    per row and head folded into the weights: the probe's scores equal those of the
    dequantized query (float64 loop) within e4m3 rounding."""
    gen = torch.Generator().manual_seed(41)
    B, R, H, P = 2, 2, 64, 5
    # a query row is a key row of random_mxfp4_pages: the same bytes, the same values
    pages, values = random_mxfp4_pages(1, gen, B * R * H)
    flat = pages.view(B * R * H * 68)
    packed = flat[:B * R * H * 64].view(B, R, H, 64)
    scales = flat[B * R * H * 64:].contiguous().view(torch.int32).view(B, R, H)
    q_true = values.view(B, R, H, 128)
    w = torch.rand(B * R, H, generator=gen)
    q8, w8 = ref.e4m3_query_of_mxfp4(packed, scales, w)
    assert q8.dtype == torch.float8_e4m3fn and q8.shape == (B, R, H, 128) and w8.shape == (B * R, H)
    cache = make_cache(P, gen)
    S, _ = _summaries(cache, gen, torch.full((P,), 64, dtype=torch.int32))
    table = torch.arange(P, dtype=torch.int32).repeat(B, 1)
    ctx = torch.full((B, R), P * 64, dtype=torch.int32)
    got = ops.probe(q8.view(B * R, H, 128), S, w8, ctx, table, P)
    keys = ref.dequantize_summaries(S).double()
    want = torch.einsum("rhd,pd->rhp", q_true.view(B * R, H, 128), keys).relu()
    want = (want * w.double().unsqueeze(-1)).sum(1)
    assert torch.allclose(got.double(), want, rtol=0.07, atol=1e-6 * float(want.abs().max()))
    assert not torch.allclose(got.double(), want.flip(1), rtol=0.07)   # the check can fail


@pytest.mark.parametrize("page_slots", [64, 32])
def test_gauss_summaries_are_mean_and_std_and_scores_match_the_replay(page_slots):
    """gauss rows: the mean row of summarize and the per-dimension std row, each within e4m3
    of the brute-force value; gauss scores equal the expected-ReLU formula on the dequantized
    rows (a loop) and the replay's gauss (replay.probe.gauss_scores on the raw keys) within the
    rows' fp8 rounding."""
    gen = torch.Generator().manual_seed(21)
    cache64 = make_cache(6, gen)
    cache = cache64 if page_slots == 64 else split_pages(cache64)
    P = cache.shape[0]
    keys = ref.dequantize_pages(cache64).double().reshape(P, page_slots, 128)
    fills = torch.tensor([(page_slots, 1, 17, page_slots, 0, 30)[i % 6] for i in range(P)],
                         dtype=torch.int32)
    G = ops.gauss_summaries_like(cache)
    ops.summarize_gauss(cache, torch.arange(P, dtype=torch.int32), fills, G)
    assert G.shape == (P, 288)
    assert torch.equal(G[:, :144], _summaries(cache, gen, fills)[0])     # the probe's mean row
    std = torch.stack([keys[p, :max(int(f), 1)].std(0, unbiased=False) if int(f) else
                       torch.zeros(128, dtype=torch.float64) for p, f in enumerate(fills)])
    got = ref.dequantize_summaries(G[:, 144:]).double()
    tol = std.abs() / 16 + std.abs().amax(1, keepdim=True) / 448 * 2 ** -9 + 1e-12
    assert bool(((got - std).abs() <= tol).all())

    # one request over every page in order, full pages, so the replay sees the same keys
    full = torch.full((P,), page_slots, dtype=torch.int32)
    ops.summarize_gauss(cache, torch.arange(P, dtype=torch.int32), full, G)
    n = P * page_slots - 5                                  # the newest page partial
    ops.summarize_gauss(cache, torch.tensor([P - 1], dtype=torch.int32),
                        torch.tensor([page_slots - 5], dtype=torch.int32), G)
    q = torch.randn(1, 64, 128, generator=gen).to(torch.float8_e4m3fn)
    w = torch.rand(1, 64, generator=gen)
    table = torch.arange(P, dtype=torch.int32).view(1, P)
    ctx = torch.tensor([[n]], dtype=torch.int32)
    z = ops.gauss(q, G, w, ctx, table, P, page_slots=page_slots)
    mean, sd = ref.dequantize_summaries(G[:, :144]).double(), ref.dequantize_summaries(G[:, 144:])
    for j in range(P):
        mu = q[0].double() @ mean[j]
        s = ((q[0].double() ** 2) @ (sd[j].double() ** 2)).sqrt()
        a = mu / s
        e = mu * 0.5 * (1 + torch.erf(a / math.sqrt(2))) + s * torch.exp(-a * a / 2) / math.sqrt(
            2 * math.pi)
        assert abs(float(z[0, j]) - float((e * w[0].double()).sum())) <= 1e-4 * abs(float(z[0, j]))
    flat = keys.reshape(1, -1, 128)[:, :n].float()
    replay = gauss_scores(q.float().view(1, 1, 64, 128), w.view(1, 1, 64),
                          BlockSummaries(flat, page_slots), torch.tensor([[n]]), P)[0, 0]
    assert torch.allclose(z[0], replay, rtol=0.02), (z[0], replay)     # 0.3-0.5% seen


def test_select_with_spins_own_scores_equals_select():
    """Given SPIN's own V/D block prediction as block_scores, one layer's selection must be
    what the all-layer select chose for it (same budget, forced blocks, exploration, MTP)."""
    for R, policy in ((1, "random"), (3, "staleness"), (2, "age")):
        cfg = SpinConfig(index_topk=128, target_sparsity=0.5, exploration=0.2,
                         exploration_policy=policy)
        p = Problem(B=4, R=R, L=3, lens=(700, 64, 1500, 33), seed=R, cfg=cfg,
                    warm=(False, True, False, False))
        ids, cnt = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx)
        layer = 1
        scores = _layer_history(p, layer, cfg)
        ids2 = torch.full_like(ids, -7)
        cnt2 = torch.full_like(cnt, -7)
        ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx,
                   ids2, cnt2, block_scores=scores.float().contiguous(), layer=layer)
        assert torch.equal(ids2[:, layer], ids[:, layer]) and torch.equal(cnt2[:, layer], cnt[:, layer])
        others = [l for l in range(3) if l != layer]
        assert bool((ids2[:, others] == -7).all())          # other layers untouched


def test_select_follows_the_given_scores():
    cfg = SpinConfig(index_topk=64, target_sparsity=0.5, exploration=0.0, keep_sink=False,
                     keep_newest=False)
    p = Problem(B=1, R=1, L=1, lens=(640,), seed=3, cfg=cfg)
    scores = torch.full((1, 1, 10), -1.0)
    scores[0, 0, [2, 5, 7, 8, 9]] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    ids, cnt = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx,
                          block_scores=scores, layer=0)
    assert int(cnt[0, 0]) == 5
    assert ids[0, 0, :5].tolist() == [2, 5, 7, 8, 9]


@pytest.mark.parametrize("keep_sink,keep_newest", [(True, False), (True, True), (False, True)])
def test_select_ranks_every_unforced_block_before_the_forced_ones(keep_sink, keep_newest):
    """Given scores narrower than the blocks (-inf past them), a NaN (ranks as -inf) and a
    -inf: the budget's blocks are the forced ones plus the best of the rest by (score
    descending, id ascending), -inf ones included, so exactly m blocks however few are finite
    (a forced block must not take a rank among the -inf ones)."""
    cfg = SpinConfig(index_topk=64, target_sparsity=0.5, exploration=0.0, keep_sink=keep_sink,
                     keep_newest=keep_newest)
    p = Problem(B=1, R=1, L=1, lens=(640,), seed=3, cfg=cfg)            # 10 blocks, m = 5
    for given in ([0.5, 2.0], [1.0, math.nan, 3.0, -math.inf, 2.0, 0.0]):
        scores = torch.tensor(given).view(1, 1, -1)
        ids, cnt = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap,
                              p.max_ctx, block_scores=scores, layer=0)
        forced = {0} if keep_sink else set()
        forced |= {9} if keep_newest else set()
        key = {j: given[j] if j < len(given) and given[j] == given[j] else -math.inf
               for j in range(10)}
        rest = sorted((j for j in range(10) if j not in forced), key=lambda j: (-key[j], j))
        want = sorted(forced | set(rest[:5 - len(forced)]))
        assert int(cnt[0, 0]) == 5
        assert ids[0, 0, :5].tolist() == want, (given, ids[0, 0, :5].tolist(), want)


def test_staleness_ranks_blocks_without_a_finite_score_by_age():
    """Exploration by staleness normalizes over the candidates' finite scores: with none (every
    candidate past the given scores: -inf) there is no span, so every candidate's priority is its
    age, as under the age policy (a -inf score must not make a NaN priority)."""
    picks = {}
    for policy in ("staleness", "age"):
        cfg = SpinConfig(index_topk=64, target_sparsity=0.2, exploration=0.5,
                         exploration_policy=policy, keep_newest=False)
        p = Problem(B=1, R=1, L=1, lens=(1280,), seed=5, cfg=cfg)        # 20 blocks
        scores = torch.tensor([[[3.0, 2.0, 1.0]]])                        # -inf past block 2
        ids, cnt = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap,
                              p.max_ctx, block_scores=scores, layer=0)
        picks[policy] = ids[0, 0, :int(cnt[0, 0])].tolist()
    assert picks["staleness"] == picks["age"]
    assert len(picks["age"]) == 16 and set(picks["age"]) >= {0, 1, 2}


def test_staleness_normalizes_over_the_finite_candidate_scores():
    """Exploration candidates with finite given scores and with -inf ones (past the scores'
    width): the priority is age * (1 + s), s min-max normalized over the finite candidates and
    0 for the others, computed here by hand."""
    cfg = SpinConfig(index_topk=64, target_sparsity=0.2, exploration=0.5,
                     exploration_policy="staleness", keep_newest=False)
    p = Problem(B=1, R=1, L=1, lens=(1280,), seed=6, cfg=cfg)             # 20 blocks, m = 16
    given = [9.0, 0.5, 7.0, 3.0, 8.0, 1.5, 6.0, 2.5, 5.0, 4.0, 1.0, 2.0]    # -inf from block 12
    ids, cnt = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx,
                          block_scores=torch.tensor(given).view(1, 1, -1), layer=0)
    score = {j: given[j] if j < len(given) else -math.inf for j in range(20)}
    top = sorted(range(1, 20), key=lambda j: (-score[j], j))[:7]          # 16 - 8 explored - sink
    candidates = [j for j in range(20) if j != 0 and j not in top]
    finite = [score[j] for j in candidates if math.isfinite(score[j])]
    lo, hi = min(finite), max(finite)
    last_seen = p.state.last_seen[int(p.slot[0]), 0]
    step = int(p.step[0])

    def priority(j):
        norm = (score[j] - lo) / (hi - lo) if math.isfinite(score[j]) else 0.0
        age = max(step - int(last_seen[j]), 0)
        return float(torch.tensor(age, dtype=torch.float32) * (1 + torch.tensor(norm)))

    explored = sorted(candidates, key=lambda j: (-priority(j), j))[:8]
    assert int(cnt[0, 0]) == 16
    assert ids[0, 0, :16].tolist() == sorted([0] + top + explored)


def _layer_history(p, layer, cfg):
    """SPIN's V/D block prediction of one layer, as the reference computes it."""
    idx = p.slot.long()
    state = ref.SpinState(p.state.V[idx, layer], p.state.D[idx, layer],
                          p.state.last_seen[idx, layer], p.state.decode_steps[idx, layer])
    scores, _ = ref.predict_blocks(state, p.n.long(), p.q.long(), cfg, int(p.n.max()))
    return scores


def test_hybrid_select_ranks_by_the_hybrid_scores():
    """merge_history must select what the given hybrid scores (max of both rank shares) select."""
    gen = torch.Generator().manual_seed(12)
    for R, policy in ((1, "random"), (3, "staleness"), (2, "age")):
        cfg = SpinConfig(index_topk=128, target_sparsity=0.5, exploration=0.2,
                         exploration_policy=policy)
        p = Problem(B=4, R=R, L=2, lens=(700, 64, 1500, 33), seed=R, cfg=cfg,
                    warm=(False, True, False, False))
        nb = math.ceil(int(p.n.max()) / 64)
        probe = torch.randn(4, R, nb, generator=gen)
        probe[1, 0, :3] = 2.0                                # ties
        history = _layer_history(p, 1, cfg)[:, :, :nb]
        hybrid = ref.hybrid_scores(probe, history, ref.block_count(p.n.long(), 64))
        want = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx,
                          block_scores=hybrid.contiguous(), layer=1)
        got = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx,
                         block_scores=probe, layer=1, merge_history=True)
        assert torch.equal(got[0][:, 1], want[0][:, 1]) and torch.equal(got[1][:, 1], want[1][:, 1])
        if policy != "staleness":                            # a flat probe leaves SPIN's order
            flat = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap,
                              p.max_ctx, block_scores=torch.zeros(4, R, nb), layer=1,
                              merge_history=True)
            spin = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx)
            assert torch.equal(flat[0][:, 1], spin[0][:, 1])


@pytest.mark.parametrize("case", ["cache", "summaries", "q", "table", "out"])
def test_probe_and_summarize_reject_bad_arguments(case):
    gen = torch.Generator().manual_seed(4)
    cache = make_cache(4, gen)
    S = ops.summaries_like(cache)
    q = torch.randn(2, 64, 128).to(torch.float8_e4m3fn)
    w = torch.randn(2, 64)
    ctx = torch.tensor([[100], [64]], dtype=torch.int32)
    table = torch.zeros(2, 2, dtype=torch.int32)
    out = torch.empty(2, 2)
    pages = torch.arange(4, dtype=torch.int32)
    if case == "cache":
        with pytest.raises(SpinError, match="kv_cache must be uint8 pages"):
            ops.summarize(cache.view(4, -1)[:, :100].contiguous(), pages, pages, S)
    elif case == "summaries":
        with pytest.raises(SpinError, match="summaries must be uint8"):
            ops.summarize(cache, pages, pages, torch.zeros(4, 132, dtype=torch.uint8))
        with pytest.raises(SpinError, match="one summary per page"):
            ops.summarize(cache, pages, pages, torch.zeros(5, 144, dtype=torch.uint8))
    elif case == "q":
        with pytest.raises(SpinError, match="q must be float8_e4m3fn"):
            ops.probe(q.float(), S, w, ctx, table, 2, out)
    elif case == "table":
        with pytest.raises(SpinError, match="block_table has 1 rows"):
            ops.probe(q, S, w, ctx, table[:1], 2, out)
    else:
        with pytest.raises(SpinError, match="out must have shape"):
            ops.probe(q, S, w, ctx, table, 2, torch.empty(3, 2))


def test_select_rejects_scores_of_the_wrong_shape_or_without_their_layer():
    cfg = SpinConfig(index_topk=64, target_sparsity=0.5)
    p = Problem(B=2, R=1, L=2, lens=(300,), seed=5, cfg=cfg)
    with pytest.raises(SpinError, match="block_scores must have shape"):
        ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx,
                   block_scores=torch.zeros(2, 2, 5), layer=0)
    with pytest.raises(SpinError, match="layer must be in"):
        ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx,
                   block_scores=torch.zeros(2, 1, 5), layer=2)
    with pytest.raises(SpinError, match="block_scores rank one layer; pass its layer"):
        ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx,
                   block_scores=torch.zeros(2, 1, 5))
    with pytest.raises(SpinError, match="merge_history merges the V/D history"):
        ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx,
                   merge_history=True)
    big = ops.MAX_HYBRID_BLOCKS * 64 + 1
    state = ops.OpState.zeros(1, 1, big, cfg)
    one = torch.zeros(1, dtype=torch.int32)
    ctx = torch.tensor([[big]], dtype=torch.int32)
    with pytest.raises(SpinError, match="merge_history ranks at most 8192 blocks"):
        ops.select(state, one, ctx, ctx - 1, one.long(), one.long(), cfg, 8, big,
                   block_scores=torch.zeros(1, 1, 5), layer=0, merge_history=True)


# ---- the newest pages of a decode step (summarize_newest) -------------------------------------
def written_pages(ctx, table, page_slots, max_len):
    """Brute force: per request, (page, fill) of each distinct page column holding a slot its
    step writes (slots max(n - R, 0) .. n - 1, n = clamp(last row's length, 0, max_len)),
    fill = its slots below n; columns past the table are not listed."""
    B, R = ctx.shape
    out = []
    for b in range(B):
        n = min(max(int(ctx[b, -1]), 0), max_len)
        columns = sorted({s // page_slots for s in range(max(n - R, 0), n)})
        out.append([(int(table[b, c]), min(n - c * page_slots, page_slots))
                    for c in columns if c < table.shape[1]])
    return out


def newest_case(gen, B, R, page_slots, num_pages, width, max_len):
    """Lengths at the page edges (and 0, negative, past max_len) and a table of distinct pages
    with -1 and out-of-cache entries."""
    S = page_slots
    edges = [0, -5, 1, R - 1, R, S - 1, S, S + 1, S + R - 1, 2 * S, width * S, width * S + 3,
             max_len + 40]
    last = torch.tensor([edges[b] if b < len(edges) else
                         int(torch.randint(0, width * S + 1, (1,), generator=gen))
                         for b in range(B)], dtype=torch.int32)
    ctx = (last.view(-1, 1) - R + 1 + torch.arange(R, dtype=torch.int32)).contiguous()
    table = torch.randperm(max(B * width, num_pages), generator=gen)[:B * width].view(B, width)
    table = torch.where(table % 7 == 3, -1, table).to(torch.int32)
    table[1, 0] = num_pages + 3                     # a page outside the cache
    return ctx, table


@pytest.mark.parametrize("page_slots", [64, 32])
def test_newest_pages_are_the_pages_the_step_writes(page_slots):
    gen = torch.Generator().manual_seed(80 + page_slots)
    for R in (1, 2, 5, 8):
        for max_len in (10 ** 6, 3 * page_slots + 7):
            ctx, table = newest_case(gen, 24, R, page_slots, 200, 6, max_len)
            pages, fill = ref.newest_pages(ctx, table, page_slots, max_len)
            assert pages.dtype == fill.dtype == torch.int32 and pages.shape == (48,)
            want = written_pages(ctx, table, page_slots, max_len)
            for b in range(24):
                listed = [(int(pages[2 * b + j]), int(fill[2 * b + j])) for j in range(2)
                          if int(fill[2 * b + j]) > 0]
                assert listed == want[b], (R, max_len, b, ctx[b].tolist())
                for j in range(2):                    # not listed: no page, no fill
                    if int(fill[2 * b + j]) <= 0:
                        assert (int(pages[2 * b + j]), int(fill[2 * b + j])) == (-1, 0)


@pytest.mark.parametrize("gauss", [False, True])
def test_summarize_newest_writes_the_summaries_of_the_written_pages(gauss):
    """The op's rows equal summarize's of the brute-force page list; every other row untouched."""
    gen = torch.Generator().manual_seed(90 + gauss)
    P, R = 100, 3
    cache = make_cache(P, gen)
    ctx, table = newest_case(gen, 24, R, 64, P, 5, 10 ** 6)
    like = ops.gauss_summaries_like if gauss else ops.summaries_like
    got, want = like(cache), like(cache)
    ops.summarize_newest(cache, ctx, table, 10 ** 6, got, gauss=gauss)
    listed = [pf for request in written_pages(ctx, table, 64, 10 ** 6) for pf in request]
    pages = torch.tensor([p for p, _ in listed], dtype=torch.int32)
    fills = torch.tensor([f for _, f in listed], dtype=torch.int32)
    (ops.summarize_gauss if gauss else ops.summarize)(cache, pages, fills, want)
    assert torch.equal(got, want)
    assert int(got.any(1).sum()) == len({p for p in pages.tolist() if 0 <= p < P}) > 10


@pytest.mark.parametrize("case", ["lens", "table", "max_len", "summaries"])
def test_summarize_newest_rejects_bad_arguments(case):
    gen = torch.Generator().manual_seed(5)
    cache = make_cache(4, gen)
    S = ops.summaries_like(cache)
    ctx = torch.tensor([[100], [64]], dtype=torch.int32)
    table = torch.zeros(2, 2, dtype=torch.int32)
    if case == "lens":
        with pytest.raises(SpinError, match="context_lens must be"):
            ops.summarize_newest(cache, ctx.long(), table, 128, S)
    elif case == "table":
        with pytest.raises(SpinError, match="block_table has 1 rows"):
            ops.summarize_newest(cache, ctx, table[:1], 128, S)
    elif case == "max_len":
        with pytest.raises(SpinError, match="max_len must be in"):
            ops.summarize_newest(cache, ctx, table, -1, S)
    else:
        with pytest.raises(SpinError, match="summaries must be uint8 \\[num_pages >= 1, 288\\]"):
            ops.summarize_newest(cache, ctx, table, 128, S, gauss=True)


# ---- GPU: the kernels against the reference ----------------------------------------------------
@pytest.mark.gpu
def test_gpu_summarize_equals_reference_bytes():
    gen = torch.Generator().manual_seed(6)
    cache = make_cache(40, gen)
    cache.view(40, -1)[3, :128] = 0                      # an all-zero key row
    S_cpu, fills = _summaries(cache, gen)
    S_gpu, _ = _summaries(cache.cuda(), gen, fills)
    assert torch.equal(S_gpu.cpu(), S_cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("page_slots", [64, 32])
def test_gpu_summarize_mxfp4_pages_equals_reference_bytes(page_slots):
    """V4's MXFP4 key pages: the kernel's summary rows equal the reference's byte for byte, 4-D
    and 2-D views, edge fills, pages outside the cache skipped, a page of subnormal scales."""
    gen = torch.Generator().manual_seed(60 + page_slots)
    P = 30
    cache, _ = random_mxfp4_pages(P, gen, page_slots)
    exps = cache.view(P, -1)[:, page_slots * 64:]
    exps[4] = torch.randint(0, 6, exps[4].shape, generator=gen).to(torch.uint8)  # 2^-127..2^-122
    cache.view(P, -1)[5, :64] = 0                                             # an all-zero key
    fills = torch.tensor([(0, 1, page_slots - 1, page_slots, page_slots + 9, -2, 7)[i % 7]
                          for i in range(P)], dtype=torch.int32)
    pages = torch.arange(P, dtype=torch.int32)
    pages[3], pages[9] = -1, P + 4
    for view in (cache, cache.reshape(P, -1)):
        want = ops.summaries_like(view)
        ops.summarize(view, pages, fills, want)
        got = ops.summaries_like(view.cuda())
        ops.summarize(view.cuda(), pages.cuda(), fills.cuda(), got)
        assert torch.equal(got.cpu(), want)
        assert bool(want[[0, 1, 2, 4]].any()) and not bool(want[3].any())   # written / skipped


@pytest.mark.gpu
@pytest.mark.usefixtures("require_native")
@pytest.mark.parametrize("keys,page_slots", [("fp8", 64), ("fp8", 32), ("mxfp4", 64),
                                             ("mxfp4", 32)])
def test_gpu_native_summarize_gauss_equals_reference(keys, page_slots):
    """The gauss summary kernel (spin::summarize_gauss's CUDA path) against the reference: the
    mean row byte for byte, the std row within one e4m3 step (fp64 sums of squares in another
    order may round the fp32 std apart); edge fills, pages outside the cache skipped."""
    if not ops.NATIVE:
        pytest.skip("needs the native library")
    gen = torch.Generator().manual_seed(70 + page_slots + len(keys))
    P = 28
    if keys == "mxfp4":
        cache, _ = random_mxfp4_pages(P, gen, page_slots)
    else:
        cache = make_cache(P, gen) if page_slots == 64 else split_pages(make_cache(P // 2, gen))
    cache.view(P, -1)[6, :64] = 0                          # an all-zero key row
    fills = torch.tensor([(0, 1, 2, page_slots - 1, page_slots, page_slots + 5, -1)[i % 7]
                          for i in range(P)], dtype=torch.int32)
    pages = torch.arange(P, dtype=torch.int32)
    pages[5], pages[12] = -3, P
    want = ops.gauss_summaries_like(cache)
    ops.summarize_gauss(cache, pages, fills, want)
    got = ops.gauss_summaries_like(cache.cuda())
    torch.ops.spin_native.summarize_gauss(cache.cuda(), pages.cuda(), fills.cuda(), got)
    got = got.cpu()
    assert_gauss_rows_match(got, want)
    assert not bool(got[[5, 12]].any())                     # skipped: left as they were
    assert bool(ref.dequantize_summaries(want[3:4, 144:]).abs().max() > 0)   # deviations held


def assert_gauss_rows_match(got, want):
    """gauss rows of the kernel against the reference's: the mean rows byte for byte, the std
    rows within one e4m3 step (fp64 sums of squares in another order may round the fp32 std
    apart)."""
    assert torch.equal(got[:, :144], want[:, :144])
    std_got = ref.dequantize_summaries(got[:, 144:]).double()
    std_want = ref.dequantize_summaries(want[:, 144:]).double()
    step = std_want.abs() / 8 + std_want.abs().amax(1, keepdim=True) / 448 * 2 ** -9 + 1e-30
    assert bool(((std_got - std_want).abs() <= step).all())


@pytest.mark.gpu
@pytest.mark.usefixtures("require_native")
@pytest.mark.parametrize("keys,page_slots,R,gauss", [
    ("fp8", 64, 1, False), ("fp8", 64, 4, True), ("fp8", 32, 8, False), ("fp8", 32, 3, True),
    ("mxfp4", 64, 2, False), ("mxfp4", 32, 5, True)])
def test_gpu_native_summarize_newest_matches_reference(keys, page_slots, R, gauss):
    """The kernel finding each request's newest pages from its lengths (spin::summarize_newest's
    CUDA path) against the reference: lengths at the page edges, 0, negative and past max_len;
    -1 and out-of-cache table entries; a table that is a column slice of a wider one; then a
    CUDA graph captured once follows new lengths written into the same buffer."""
    if not ops.NATIVE:
        pytest.skip("needs the native library")
    gen = torch.Generator().manual_seed(100 + page_slots + R + 7 * gauss + len(keys))
    P, B, width = 300, 40, 6
    if keys == "mxfp4":
        cache, _ = random_mxfp4_pages(P, gen, page_slots)
    else:
        cache = make_cache(P, gen) if page_slots == 64 else split_pages(make_cache(P // 2, gen))
    # max_len inside the table for these, past it for the even rows' edge lengths (width * S
    # + 3): their second page column is past the table's width
    max_len = width * page_slots - 5 if R % 2 else 10 ** 6
    ctx, table = newest_case(gen, B, R, page_slots, P, width, max_len)
    like = ops.gauss_summaries_like if gauss else ops.summaries_like
    native = getattr(torch.ops.spin_native,
                     "summarize_newest_gauss" if gauss else "summarize_newest")
    wide = torch.full((B, width + 3), 7, dtype=torch.int32, device="cuda")
    wide[:, :width] = table.cuda()
    table_gpu = wide[:, :width]                            # stride width + 3
    ctx_gpu, cache_gpu = ctx.cuda(), cache.cuda()

    def compare(ctx_now):
        want = like(cache)
        ops.summarize_newest(cache, ctx_now, table, max_len, want, gauss=gauss)
        return want

    got = like(cache_gpu)
    native(cache_gpu, ctx_gpu, table_gpu, max_len, got)
    want = compare(ctx)
    assert int(want.any(1).sum()) > B // 2                 # most requests summarize pages
    if gauss:
        assert_gauss_rows_match(got.cpu(), want)
    else:
        assert torch.equal(got.cpu(), want)
    # captured once; the replay reads the lengths the buffer holds then
    got.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        native(cache_gpu, ctx_gpu, table_gpu, max_len, got)
    later = ctx + torch.randint(0, 2 * page_slots, (B, 1), generator=gen, dtype=torch.int32)
    ctx_gpu.copy_(later)
    got.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = compare(later)
    if gauss:
        assert_gauss_rows_match(got.cpu(), want)
    else:
        assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
def test_gpu_summarize_32_slot_pages_equals_reference_bytes():
    gen = torch.Generator().manual_seed(16)
    cache = split_pages(make_cache(20, gen))
    fills = torch.tensor([(0, 1, 17, 31, 32, 40, -2)[i % 7] for i in range(40)], dtype=torch.int32)
    S_cpu, _ = _summaries(cache, gen, fills)
    S_gpu, _ = _summaries(cache.cuda(), gen, fills)
    assert torch.equal(S_gpu.cpu(), S_cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("R,page_slots", [(1, 32), (3, 32)])
def test_gpu_probe_of_32_slot_pages_matches_reference(R, page_slots):
    gen = torch.Generator().manual_seed(17 + R)
    B, P = 3, 180
    cache = split_pages(make_cache(P // 2, gen))
    S, _ = _summaries(cache, gen, torch.full((P,), 32, dtype=torch.int32))
    ctx = torch.tensor([[l + r for r in range(R)] for l in (1, 2000, 4100)], dtype=torch.int32)
    table = torch.randint(-1, P + 2, (B, 140), generator=gen, dtype=torch.int32)
    q = torch.randn(B * R, 64, 128, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(B * R, 64, generator=gen)
    want = ops.probe(q, S, w, ctx, table, 150, page_slots=page_slots)
    got = ops.probe(q.cuda(), S.cuda(), w.cuda(), ctx.cuda(), table.cuda(), 150,
                    page_slots=page_slots).cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert int(fin.sum()) > 100
    err = (got[fin].double() - want[fin].double()).norm() / want[fin].double().norm()
    assert err < 5e-4, err


@pytest.mark.gpu
@pytest.mark.usefixtures("require_native")
@pytest.mark.parametrize("R,page_slots", [(1, 64), (2, 64), (5, 64), (1, 32), (3, 32)])
def test_gpu_native_gauss_matches_reference(R, page_slots):
    """The gauss score kernel (spin::gauss's CUDA path) against reference.gauss_scores in
    float64: the same -inf columns (pages outside the table or the summaries, no visible slot,
    past the table), the finite scores within the FP8 tile product's error, and a check that a
    wrong variance would fail."""
    if not ops.NATIVE:
        pytest.skip("needs the native library")
    gen = torch.Generator().manual_seed(90 + R + page_slots)
    B, P = 3, 150
    cache = make_cache(P, gen) if page_slots == 64 else split_pages(make_cache(P // 2, gen))
    fills = torch.tensor([(page_slots, 1, 7, page_slots - 3, 0)[i % 5] for i in range(P)],
                         dtype=torch.int32)
    G = ops.gauss_summaries_like(cache)
    ops.summarize_gauss(cache, torch.arange(P, dtype=torch.int32), fills, G)
    ctx = torch.tensor([[l + r for r in range(R)] for l in (1, 2000, 4100)], dtype=torch.int32)
    table = torch.randint(-1, P + 2, (B, 120), generator=gen, dtype=torch.int32)   # -1, outside
    q = torch.randn(B * R, 64, 128, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(B * R, 64, generator=gen)
    columns = 130                                            # two CTAs, past the table's 120
    want = ref.gauss_scores(q, G, w, ctx, table, columns, page_slots=page_slots)
    got = torch.full((B * R, columns), 7.0, device="cuda")
    torch.ops.spin_native.gauss(q.cuda(), G.cuda(), w.cuda(), ctx.cuda(), table.cuda(),
                                page_slots, got)
    got = got.cpu().double()
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and not bool(torch.isnan(got).any())
    fin = torch.isfinite(want)
    assert int(fin.sum()) > 60
    err = (got[fin] - want[fin]).norm() / want[fin].norm()
    assert err < 5e-4, err
    no_std = G.clone()
    no_std[:, 144:] = 0                                      # the probe's scores, weighted relu
    wrong = ref.gauss_scores(q, no_std, w, ctx, table, columns, page_slots=page_slots)
    assert (wrong[fin] - want[fin]).norm() / want[fin].norm() > 10 * err


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2, 3, 5])
def test_gpu_probe_matches_reference(R):
    gen = torch.Generator().manual_seed(7 + R)
    B, P = 3, 90
    cache = make_cache(P, gen)
    S, _ = _summaries(cache, gen, torch.full((P,), 64, dtype=torch.int32))
    lens = (1, 2000, 4100)
    ctx = torch.tensor([[l + r for r in range(R)] for l in lens], dtype=torch.int32)
    table = torch.randint(-1, P + 2, (B, 70), generator=gen, dtype=torch.int32)   # -1, outside
    q = torch.randn(B * R, 64, 128, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(B * R, 64, generator=gen)
    num_blocks = 75                                       # past the table; ragged last tile
    want = ops.probe(q, S, w, ctx, table, num_blocks)
    got = ops.probe(q.cuda(), S.cuda(), w.cuda(), ctx.cuda(), table.cuda(), num_blocks).cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert int(fin.sum()) > 50
    err = (got[fin].double() - want[fin].double()).norm() / want[fin].double().norm()
    assert err < 5e-4, err


@pytest.mark.gpu
@pytest.mark.parametrize("policy,R", [("random", 1), ("staleness", 2), ("age", 4)])
@pytest.mark.parametrize("narrow", [False, True])
def test_gpu_select_with_block_scores_matches_reference(policy, R, narrow):
    """narrow: scores that end 18 blocks short (-inf past them; 24 blocks of the longest
    request), a NaN and a -inf among them, at a sparsity that takes more blocks than have
    finite scores."""
    cfg = SpinConfig(index_topk=128, target_sparsity=0.1 if narrow else 0.4, exploration=0.2,
                     exploration_policy=policy)
    p_cpu = Problem(B=4, R=R, L=3, lens=(700, 64, 1500, 33), seed=8, cfg=cfg,
                    warm=(False, True, False, False))
    p_gpu = Problem(B=4, R=R, L=3, lens=(700, 64, 1500, 33), seed=8, cfg=cfg,
                    warm=(False, True, False, False), device="cuda")
    gen = torch.Generator().manual_seed(9)
    nb = math.ceil(p_cpu.max_ctx / 64)
    scores = torch.randn(4, R, nb - 18 if narrow else nb + 3, generator=gen)
    scores[0, 0, 3] = scores[0, 0, 4]                     # a tie: the lower id wins
    if narrow:
        scores[:, :, 1] = math.nan
        scores[:, :, 2] = -math.inf
    out = []
    for p, s in ((p_cpu, scores), (p_gpu, scores.cuda())):
        out.append([t.cpu() for t in ops.select(p.state, p.slot, p.n, p.q, p.request, p.step,
                                                cfg, p.m_cap, p.max_ctx, block_scores=s,
                                                layer=2)])
    assert torch.equal(out[0][0][:, 2], out[1][0][:, 2])
    assert torch.equal(out[0][1][:, 2], out[1][1][:, 2])


def _wide_block_score_selections(policy, R, device):
    """select with given scores over rows of up to 2,188 blocks, scores of 8 values (ties at
    the threshold span every warp of the 1024-thread launch, two blocks a thread)."""
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5, exploration=0.2,
                     exploration_policy=policy)
    p = Problem(B=4, R=R, L=2, lens=(140000 - R, 64, 70001, 1), cap=140000, seed=17, cfg=cfg,
                warm=(False,), device=device)
    gen = torch.Generator().manual_seed(21)
    scores = torch.randint(0, 8, (4, R, math.ceil(p.max_ctx / 64)), generator=gen).float()
    ids, cnt = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx,
                          block_scores=scores.to(device), layer=1)
    return ids[:, 1].cpu(), cnt[:, 1].cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("policy,R", [("staleness", 1), ("random", 2), ("age", 1)])
def test_gpu_select_with_wide_block_scores_matches_reference(policy, R):
    want = _wide_block_score_selections(policy, R, "cpu")
    assert int(want[1][0]) > 1000                      # the long request takes half its blocks
    got = _wide_block_score_selections(policy, R, "cuda")
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


@pytest.mark.gpu
@pytest.mark.parametrize("policy,R,dtype,cap,extra", [
    ("random", 1, "float32", 1600, {}),
    ("staleness", 2, "float16", 1600, {}),
    ("age", 3, "float32", None, {"pooling": "mean", "mtp_mask": "row0"}),
    ("random", 1, "float16", 140000, {}),
    ("random", 1, "float16", 524288, {}),                # 8,192 blocks: the largest sort
])
def test_gpu_hybrid_select_matches_reference(policy, R, dtype, cap, extra):
    """The in-kernel rank sort and merge: vectorized and paired V/D paths, scores narrower
    than the blocks, NaN and tied probe scores, up to kMaxHybridBlocks blocks."""
    cfg = SpinConfig(index_topk=128, target_sparsity=0.4, exploration=0.2,
                     exploration_policy=policy, state_dtype=dtype, **extra)
    lens = {1600: (700, 64, 1500, 33), None: (700, 64, 1500, 33),
            140000: (139000, 64, 70001, 1), 524288: (524288 - R, 900)}[cap]
    B, L = len(lens), 1 if cap == 524288 else 2
    kw = dict(B=B, R=R, L=L, lens=lens, cap=cap, seed=13, cfg=cfg,
              warm=(False,) if cap == 140000 else (False, True, False, False))
    p_cpu, p_gpu = Problem(**kw), Problem(**kw, device="cuda")
    if cfg.pooling != "max":
        integer_state(p_cpu, p_gpu)
    if cap == 524288:
        assert math.ceil(p_cpu.max_ctx / 64) == ops.MAX_HYBRID_BLOCKS
    gen = torch.Generator().manual_seed(14)
    nb = math.ceil(p_cpu.max_ctx / 64)
    width = nb - 5 if policy == "staleness" else nb + 3  # narrower: -inf past the given ones
    scores = torch.randn(B, R, width, generator=gen)
    scores[0, 0, 3:9] = scores[0, 0, 2]                   # ties in the probe
    scores[0, 0, 10] = math.nan                           # ranks as -inf
    layer = L - 1
    out = []
    for p, s in ((p_cpu, scores), (p_gpu, scores.cuda())):
        out.append([t.cpu() for t in ops.select(p.state, p.slot, p.n, p.q, p.request, p.step,
                                                cfg, p.m_cap, p.max_ctx, block_scores=s,
                                                layer=layer, merge_history=True)])
    assert torch.equal(out[0][1][:, layer], out[1][1][:, layer])
    assert torch.equal(out[0][0][:, layer], out[1][0][:, layer])

@pytest.mark.gpu
def test_gpu_probe_and_select_capture_in_a_cuda_graph():
    gen = torch.Generator().manual_seed(10)
    cfg = SpinConfig(index_topk=64, target_sparsity=0.5)
    p = Problem(B=2, R=2, L=1, lens=(900, 300), seed=11, cfg=cfg, device="cuda")
    S = ops.summaries_like(p.cache[0])
    pages = p.table.flatten().contiguous()
    fills = torch.full_like(pages, 64)
    nb = p.m_cap
    scores = torch.empty(2 * 2, nb, device="cuda")
    ids = torch.empty(2, 1, p.m_cap, dtype=torch.int32, device="cuda")
    cnt = torch.empty(2, 1, dtype=torch.int32, device="cuda")

    def step():
        ops.summarize(p.cache[0], pages, fills, S)
        ops.probe(p.qfp8, S, p.weights, p.n, p.table, nb, scores)
        ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx,
                   ids, cnt, block_scores=scores.view(2, 2, nb), layer=0)
    step()
    eager = (scores.clone(), ids.clone(), cnt.clone())
    S.zero_()
    scores.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(scores, eager[0]) and torch.equal(ids, eager[1]) and torch.equal(cnt, eager[2])
