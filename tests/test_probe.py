"""Query-aware predictors (probe, hybrid, quest), the adaptive per-layer budget and the byte
accounting of replay (spin_trtllm.replay.probe, issue 17)."""

import json
import math

import numpy as np
import pytest
import torch

from spin_trtllm import SpinConfig, SpinError
from spin_trtllm.cli import main
from spin_trtllm import reference as ref
from spin_trtllm.reference import SpinState, block_budget, decode_step, predict_blocks
from spin_trtllm.predictors import BUDGETS, REPLAY_PREDICTORS
from spin_trtllm.replay import probe as P
from spin_trtllm.replay.evaluate import at_effective, replay
from spin_trtllm.replay.synth import SynthConfig, synthesize
from spin_trtllm.replay.trace import SpinTrace

from spin_trtllm.testing.traces import make_trace
from spin_trtllm.testing.traces import planted_v2_trace, random_v2_trace


# ---- formulas against brute force -------------------------------------------------------------
def brute_block_scores(trace, t, layer, r, kind, parts=1):
    """Per block, the best of its `parts` sub-blocks, by loops over blocks, heads and dims
    (float64)."""
    b = trace.block_size
    n = int(trace.row_len[t, layer, r])
    q = trace.q[t, layer, r].double()
    w = trace.w[t, layer, r].double()
    keys = trace.keys[layer].double()

    def score(blk):
        total = 0.0
        if kind == "probe":
            mean = blk.mean(0)
            return sum(float(w[h]) * max(float(q[h] @ mean), 0.0) for h in range(q.shape[0]))
        if kind == "gauss":
            mean, var = blk.mean(0), blk.var(0, unbiased=False)
            for h in range(q.shape[0]):
                mu = float(q[h] @ mean)
                sd = math.sqrt(float((q[h] ** 2) @ var))
                if sd == 0:
                    e = max(mu, 0.0)
                else:                   # E[relu(X)], X ~ N(mu, sd^2), by the closed form
                    a = mu / sd
                    e = mu * 0.5 * (1 + math.erf(a / math.sqrt(2))) \
                        + sd * math.exp(-a * a / 2) / math.sqrt(2 * math.pi)
                total += float(w[h]) * e
            return total
        kmin, kmax = blk.min(0).values, blk.max(0).values
        for h in range(q.shape[0]):
            hi = sum(max(float(q[h, d] * kmin[d]), float(q[h, d] * kmax[d]))
                     for d in range(q.shape[1]))
            lo = sum(min(float(q[h, d] * kmin[d]), float(q[h, d] * kmax[d]))
                     for d in range(q.shape[1]))
            total += float(w[h]) * (max(hi, 0.0) if w[h] >= 0 else max(lo, 0.0))
        return total

    sub = b // parts
    out = []
    for j in range(math.ceil(n / b)):
        spans = [(j * b + u * sub, min(j * b + (u + 1) * sub, n)) for u in range(parts)]
        out.append(max(score(keys[lo:hi]) for lo, hi in spans if lo < hi))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("kind,parts", [("probe", 1), ("probe", 2), ("quest", 1), ("gauss", 1),
                                        ("gauss", 2)])
def test_probe_quest_and_gauss_match_brute_force(kind, parts):
    # MTP rows see different lengths, so the partial newest block differs per row
    trace = random_v2_trace(steps=4, next_n=2, start=37, block_size=8)
    qp = P.QueryProbe(trace, kind, 8, summaries=parts)
    for t in range(trace.num_steps):
        n = trace.row_len[t]
        nb = math.ceil(int(n.max()) / 8)
        got = qp.scores(t, n, nb)
        for layer in range(trace.num_layers):
            for r in range(trace.next_n):
                want = brute_block_scores(trace, t, layer, r, kind, parts)
                row = got[layer, r]
                assert torch.allclose(row[:len(want)].double(), want, rtol=1e-4, atol=1e-4)
                assert torch.isneginf(row[len(want):]).all()


def test_rank_share_and_hybrid_brute_force():
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 5, (3, 2, 9), generator=gen).float()      # ties on purpose
    y = torch.randn(3, 2, 9, generator=gen)
    nb = torch.tensor([[9, 7], [1, 4], [2, 9]])
    got = ref.hybrid_scores(x, y, nb)
    for g in range(3):
        for r in range(2):
            B = int(nb[g, r])
            for j in range(9):
                if j >= B:
                    assert got[g, r, j] == -math.inf
                    continue
                rx = sum(float(x[g, r, i]) < float(x[g, r, j]) for i in range(B)) / max(B - 1, 1)
                ry = sum(float(y[g, r, i]) < float(y[g, r, j]) for i in range(B)) / max(B - 1, 1)
                assert got[g, r, j] == pytest.approx(max(rx, ry))
    # an all-equal history (untrained V/D) leaves the ranking to the probe
    flat = ref.hybrid_scores(y, torch.zeros_like(y), nb)
    vis = torch.arange(9) < nb.unsqueeze(-1)
    assert torch.equal(flat, ref.rank_share(y, vis))
    # a NaN score ranks as -inf: below every finite score, tied with -inf
    z = torch.tensor([1.0, math.nan, -math.inf, -math.inf, 3.0, 2.0])
    share = ref.rank_share(z, torch.ones(6, dtype=torch.bool))
    assert share.tolist() == pytest.approx([3 / 5, 0.0, 0.0, 0.0, 5 / 5, 4 / 5])


def test_quest_bounds_every_blocks_true_max():
    trace = random_v2_trace(steps=5, next_n=2, start=45, negative_w=True, seed=4)
    qp = P.QueryProbe(trace, "quest", trace.block_size)
    b = trace.block_size
    for t in range(trace.num_steps):
        dense = trace.step_scores(t)                                # [L, R, W]
        n = trace.row_len[t]
        nb = math.ceil(dense.shape[-1] / b)
        bound = qp.scores(t, n, nb)
        true_max = torch.nn.functional.pad(dense, (0, nb * b - dense.shape[-1]),
                                           value=-math.inf).view(*dense.shape[:2], nb, b).amax(-1)
        vis = torch.isfinite(true_max)
        assert (bound[vis] >= true_max[vis] - 1e-4 * (1 + true_max[vis].abs())).all()
        assert torch.isneginf(bound[~vis]).all()


def test_gauss_is_the_probe_plus_the_spread_through_the_relu():
    trace = random_v2_trace(steps=3, next_n=1, start=40, block_size=8, seed=7, negative_w=False)
    gauss = P.QueryProbe(trace, "gauss", 8)
    probe = P.QueryProbe(trace, "probe", 8)
    for t in range(trace.num_steps):
        n = trace.row_len[t]
        nb = math.ceil(int(n.max()) / 8)
        g, p = gauss.scores(t, n, nb), probe.scores(t, n, nb)
        vis = torch.isfinite(p)
        assert torch.equal(vis, torch.isfinite(g))
        # Jensen: E relu(X) >= relu(E X) per head, so with w >= 0 the block scores only grow
        assert (g[vis] >= p[vis] - 1e-5 * (1 + p[vis].abs())).all()
        assert (g[vis] > p[vis] + 1e-3).any()
    # identical keys in every block: no spread, gauss equals the probe
    flat = random_v2_trace(steps=2, next_n=1, start=39, block_size=8, seed=8)
    flat.keys = flat.keys.view(flat.keys.shape[0], -1, 8, flat.keys.shape[-1])[:, :, :1] \
        .expand(-1, -1, 8, -1).reshape(flat.keys.shape).contiguous()
    g = P.QueryProbe(flat, "gauss", 8).scores(1, flat.row_len[1], 5)
    p = P.QueryProbe(flat, "probe", 8).scores(1, flat.row_len[1], 5)
    assert torch.allclose(g, p, rtol=1e-5, atol=1e-5)


def test_summaries_depend_only_on_their_own_visible_keys():
    trace = random_v2_trace(steps=1, layers=1, start=30, block_size=8)
    s = P.BlockSummaries(trace.keys, 8)
    a = s.at(torch.tensor([[20]]), 4)
    c = s.at(torch.tensor([[29]]), 4)
    # blocks 0 and 1 are complete at both lengths: unchanged; block 2 grows from 4 to 8 slots
    assert torch.equal(a["mean"][0, 0, :2], c["mean"][0, 0, :2])
    assert torch.allclose(a["mean"][0, 0, 2], trace.keys[0, 16:20].float().mean(0))
    assert torch.allclose(c["mean"][0, 0, 2], trace.keys[0, 16:24].float().mean(0))
    assert torch.allclose(c["mean"][0, 0, 3], trace.keys[0, 24:29].float().mean(0))
    assert a["visible"][0, 0].tolist() == [True, True, True, False]


# ---- the seam, forced blocks, budget ----------------------------------------------------------
def test_block_scores_seam_reproduces_spin():
    trace = make_trace(steps=4, layers=2, next_n=2)
    cfg = SpinConfig(index_topk=8, block_size=8)
    st1, st2 = SpinState.zeros(2, 64, cfg), SpinState.zeros(2, 64, cfg)
    args = dict(target_sparsity=torch.tensor([0.5, 0.5], dtype=torch.float64),
                request=torch.zeros(2, dtype=torch.int64), layer=torch.arange(2))
    for t in range(trace.num_steps):
        dense = trace.step_scores(t)
        n = trace.row_len[t].to(torch.int64)
        q = trace.query_pos[t].to(torch.int64).expand(2, -1)
        acc = trace.accepted_or_zero()[t].expand(2)
        step = torch.full((2,), t)
        a, _ = decode_step(st1, cfg, dense, n, q, acc, step=step, **args)
        blocks, _ = predict_blocks(st2, n, q, cfg, dense.shape[-1])
        c, _ = decode_step(st2, cfg, dense, n, q, acc, step=step, block_scores=blocks, **args)
        assert torch.equal(a.row_mask, c.row_mask) and torch.equal(st1.V, st2.V)
    with pytest.raises(SpinError, match="A0"):
        decode_step(st2, cfg.with_overrides(reduction="A0"), dense, n, q, acc, step=step,
                    block_scores=blocks, **args)


@pytest.mark.parametrize("predictor", REPLAY_PREDICTORS)
@pytest.mark.parametrize("budget", BUDGETS)
def test_forced_blocks_and_budget_for_every_predictor(predictor, budget):
    trace = planted_v2_trace(steps=14, start=300, block_size=16, index_topk=32)
    cfg = SpinConfig(exploration=0.1)
    rhos = [0.5, 0.7]
    per_layer = [replay(trace, rhos, cfg, pearson=False, keep_masks_for_layer=layer,
                        predictor=predictor, budget=budget) for layer in range(2)]
    for s, rho in enumerate(rhos):
        for t in range(1, trace.num_steps):                        # step 0 is warm-up
            B = math.ceil(int(trace.row_len[t, 0, 0]) / 16)
            uniform = int(block_budget(torch.tensor(B), torch.tensor(rho), cfg.with_overrides(
                index_topk=32, block_size=16)))
            counts = []
            for layer in range(2):
                mask = per_layer[layer][s]["masks"][t]
                assert mask[0] and mask[B - 1] and not mask[B:].any()
                counts.append(int(mask.sum()))
            if budget == "uniform":
                assert counts == [uniform, uniform]
            else:
                assert sum(counts) == 2 * uniform                  # R = 1: exactly


def test_adaptive_allocator_moves_blocks_to_the_layer_that_needs_them():
    cfg = SpinConfig(index_topk=8, block_size=8, exploration=0.0)
    ab = P.AdaptiveBudget(1, 2, cfg, capacity_blocks=20)
    scores = torch.randn(2, 1, 20, generator=torch.Generator().manual_seed(0))
    B = torch.tensor([20, 20])
    rho = torch.tensor([0.5, 0.5], dtype=torch.float64)
    rho0, m0 = ab.allocate(scores, B, rho)
    assert m0.tolist() == [10, 10]                     # nothing measured yet: uniform
    # layer 0's top-K spreads over its first 16 ranked blocks, layer 1's sits in the first 2
    spread = torch.zeros(2, 20, dtype=torch.int64)
    order = ab.order
    spread[0, order[0, :16]] = 1
    spread[1, order[1, :2]] = 8
    ab.observe(spread, torch.tensor([16, 16]), torch.tensor([True, True]))
    rho1, m1 = ab.allocate(scores, B, rho)
    assert int(m1.sum()) == 20 and m1[0] > 10 > m1[1] >= cfg.min_blocks
    assert torch.allclose((1 - rho1) * 20, m1.double())
    ab2 = P.AdaptiveBudget(1, 2, cfg, capacity_blocks=20)
    ab2.allocate(scores, B, rho)
    ab2.observe(spread, torch.tensor([16, 16]), torch.tensor([True, True]))
    assert torch.equal(ab2.allocate(scores, B, rho)[1], m1)


def test_adaptive_is_deterministic_and_spends_the_uniform_total():
    trace = planted_v2_trace(steps=24, start=400)
    for predictor in ("spin", "probe"):
        u = replay(trace, [0.5, 0.7], predictor=predictor)
        a1 = replay(trace, [0.5, 0.7], predictor=predictor, budget="adaptive")
        a2 = replay(trace, [0.5, 0.7], predictor=predictor, budget="adaptive")
        assert json.dumps(a1) == json.dumps(a2)
        for ru, ra in zip(u, a1):
            # R = 1: the same blocks every step, so the same realized sparsity
            assert ra["realized_sparsity"] == pytest.approx(ru["realized_sparsity"], abs=1e-12)
            assert ra["budget"] == "adaptive" and ru["budget"] == "uniform"
        layers = [[p["realized_sparsity"] for p in r["per_layer"]] for r in a1]
        assert any(abs(x[0] - x[1]) > 1e-3 for x in layers)    # it does move blocks


def test_adaptive_with_mtp_rows_runs_and_stays_near_the_total():
    trace = random_v2_trace(steps=8, next_n=2, start=120, block_size=8, index_topk=8)
    u = replay(trace, [0.5], predictor="hybrid")[0]
    a = replay(trace, [0.5], predictor="hybrid", budget="adaptive")[0]
    # later MTP rows scale with their layer's share: within a block per row per step
    rows = a["rows"]
    blocks = sum(math.ceil(int(n) / 8) for n in trace.row_len[1:].flatten())
    diff = abs(a["realized_sparsity"] - u["realized_sparsity"]) * blocks
    assert diff <= rows


# ---- quality on planted structure -------------------------------------------------------------
def test_planted_structure_probe_beats_history_and_oracle_bounds_all():
    trace = planted_v2_trace()
    res = {}
    for name, kw in (("spin", {}), ("probe", {"predictor": "probe"}),
                     ("probe2", {"predictor": "probe", "summaries": 2}),
                     ("hybrid", {"predictor": "hybrid"}), ("quest", {"predictor": "quest"}),
                     ("probe+adaptive", {"predictor": "probe", "budget": "adaptive"})):
        res[name] = replay(trace, [0.5, 0.7], SpinConfig(), **kw)
    for s in range(2):
        miss = {k: v[s]["mean_miss"] for k, v in res.items()}
        oracle = {k: v[s]["oracle_mean_miss"] for k, v in res.items()}
        assert miss["probe"] < 0.5 * miss["spin"]
        assert miss["hybrid"] < miss["spin"] and miss["quest"] < miss["spin"]
        for k in res:
            assert oracle[k] <= miss[k] + 1e-12
            assert res[k][s]["p99_miss"] >= res[k][s]["mean_miss"]
        print({k: round(v, 4) for k, v in miss.items()}, "oracle", oracle["spin"])


# ---- accounting -------------------------------------------------------------------------------
def test_probe_bytes_and_effective_sparsity():
    trace = planted_v2_trace(steps=10, start=200, block_size=16)
    live_n = trace.row_len[1:].double()                            # step 0: warm-up
    dense = float(live_n.sum())
    blocks = float(torch.ceil(live_n / 16).sum())
    out = {}
    for name, kw in (("spin", {}), ("probe", {"predictor": "probe"}),
                     ("probe2", {"predictor": "probe", "summaries": 2}),
                     ("quest", {"predictor": "quest"}), ("gauss", {"predictor": "gauss"}),
                     ("gauss2", {"predictor": "gauss", "summaries": 2})):
        (r,) = replay(trace, [0.5], **kw, keep_masks_for_layer=0)
        out[name] = r
        rows = {"spin": 0, "probe": 1, "probe2": 2, "quest": 2, "gauss": 2, "gauss2": 4}[name]
        assert r["probe_bytes_fraction"] == pytest.approx(rows * blocks / dense)
        # layer 0 by hand: visible slots of the scored blocks + summary rows
        scored = 0
        for t in range(1, trace.num_steps):
            n = int(trace.row_len[t, 0, 0])
            for j in torch.nonzero(r["masks"][t]).flatten().tolist():
                scored += min(16, max(0, n - 16 * j))
        dense0 = float(trace.row_len[1:, 0].sum())
        probe0 = rows * float(torch.ceil(trace.row_len[1:, 0].double() / 16).sum())
        assert r["per_layer"][0]["effective_sparsity"] == pytest.approx(
            1 - (scored + probe0) / dense0)
        assert r["effective_sparsity"] < r["realized_sparsity"] + 0.02
    assert out["spin"]["probe_bytes_fraction"] == 0.0


def test_at_effective_interpolates_and_refuses_to_extrapolate():
    trace = planted_v2_trace(steps=12, start=300)
    res = replay(trace, [0.4, 0.6], predictor="probe")
    x = [r["effective_sparsity"] for r in res]
    mid = (x[0] + x[1]) / 2
    (inside, outside) = at_effective(res, [mid, 0.95])
    assert inside["mean_miss"] == pytest.approx((res[0]["mean_miss"] + res[1]["mean_miss"]) / 2)
    assert inside["predictor"] == "probe" and outside["mean_miss"] is None


# ---- CLI --------------------------------------------------------------------------------------
@pytest.fixture
def v1_file(tmp_path):
    path = tmp_path / "v1.safetensors"
    synthesize(SynthConfig(steps=6, layers=1, prompt_slots=256, index_topk=16,
                           block_size=16)).save(path)
    return path


@pytest.mark.parametrize("predictor", ["probe", "hybrid", "quest"])
def test_cli_query_predictor_needs_a_v2_trace(v1_file, capsys, predictor):
    assert main(["replay", str(v1_file), "--predictor", predictor, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "needs a SPIN trace v2" in err and err.count("\n") == 1
    with pytest.raises(SpinError, match="trace v2"):
        replay(SpinTrace.load(v1_file), [0.5], predictor=predictor)


def test_cli_bad_choices_and_effective(v1_file, capsys):
    assert main(["replay", str(v1_file), "--predictor", "oracle"]) == 2
    assert main(["replay", str(v1_file), "--budget", "greedy"]) == 2
    assert main(["replay", str(v1_file), "--effective", "1.5", "--quiet"]) == 2
    assert "--effective" in capsys.readouterr().err


def test_cli_probe_on_v2_trace(tmp_path, monkeypatch, capsys):
    trace = planted_v2_trace(steps=10, start=300)
    monkeypatch.setattr(SpinTrace, "load", classmethod(lambda cls, path: trace))
    out = tmp_path / "r.json"
    assert main(["replay", "x.safetensors", "--predictor", "probe", "--budget", "adaptive",
                 "--sparsity", "0.4", "0.6", "--effective", "0.45", "--json", str(out),
                 "--quiet"]) == 0
    table = capsys.readouterr().out
    assert "probe+adaptive" in table and "effective" in table
    payload = json.loads(out.read_text())
    r = payload["results"][0]
    assert r["predictor"] == "probe" and r["budget"] == "adaptive"
    assert 0 < r["probe_bytes_fraction"] < 0.1 and r["effective_sparsity"] is not None
    assert payload["at_effective"][0]["effective_sparsity"] == 0.45
    assert np.isfinite(payload["at_effective"][0]["mean_miss"])
