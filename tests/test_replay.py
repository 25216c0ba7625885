
import numpy as np
import pytest
import torch

from spin_trtllm import SpinConfig, SpinError
from spin_trtllm.replay.evaluate import replay, run_study, study_variants
from spin_trtllm.replay.predictors import compare_predictors
from spin_trtllm.replay.trace import SpinTrace

from spin_trtllm.testing.traces import make_trace


def fixed_context_trace(patterns, n=64, block_size=8, k=8, layers=1, turn_start=None):
    """Context of n slots that does not grow (q = n - 1 every step), so D[q - i] tracks V[i]
    exactly and the prediction is V. patterns[t] = block whose slots score 10 (others 0)."""
    rows = []
    for hot in patterns:
        z = torch.zeros(n)
        z[hot * block_size:(hot + 1) * block_size] = 10.0
        rows.extend([z] * layers)
    T = len(patterns)
    return SpinTrace(scores=torch.cat(rows), row_len=torch.full((T, layers, 1), n, dtype=torch.int32),
                     query_pos=torch.full((T, 1), n - 1, dtype=torch.int32), index_topk=k,
                     block_size=block_size, turn_start=turn_start).validate()


def test_stable_pattern_no_miss():
    # 8 blocks, K = 8 -> ceil(K/b) = 1, rho = 0.5 -> m = 4: sink 0, newest 7, block 3, then
    # the lowest-id tie (block 1). The true top-8 is block 3 every step: no miss.
    trace = fixed_context_trace([3] * 5, layers=2)
    (r,) = replay(trace, [0.5], SpinConfig(exploration=0.0))
    assert r["eligible_rows"] == 2 * 4            # step 0 is warm-up
    assert r["rows"] == 2 * 4
    assert r["mean_miss"] == 0.0 and r["p99_miss"] == 0.0 and r["recall"] == 1.0
    assert r["realized_sparsity"] == pytest.approx(0.5)
    assert [p["eligible_rows"] for p in r["per_layer"]] == [4, 4]


def test_attention_shift_is_missed_without_exploration():
    # Warm-up sees block 3 hot; from step 1 block 5 is hot. Unscored blocks keep V = 0, which
    # ties with every other cold block, and ties go to the lower id: SPIN keeps {0, 1, 3, 7}
    # and never scores block 5 again (the paper's self-reinforcing failure mode).
    trace = fixed_context_trace([3, 5, 5, 5])
    (r,) = replay(trace, [0.5], SpinConfig(exploration=0.0))
    assert r["mean_miss"] == 1.0 and r["eligible_rows"] == 3


def test_age_exploration_recovers_shift_by_hand():
    # 16 blocks, rho = 0.25 -> m = 12; gamma = 0.2 -> e = floor(2.4) = 2 explored blocks.
    # Top part (10): sink 0, newest 15, block 3, then ids 1, 2, 4..8. Candidates 9..14 have
    # equal age at step 1 -> 9, 10; step 2 -> 11, 12 (older); step 3 -> 13, 14: the hot
    # block 13 is explored at step 3 and predicted (V = 5 > block 3's decayed V) from step 4
    # on, so only steps 1 and 2 of the 12 eligible rows miss (each misses everything).
    trace = fixed_context_trace([3] + [13] * 12, n=128)
    (none,) = replay(trace, [0.25], SpinConfig(exploration=0.0))
    (age,) = replay(trace, [0.25], SpinConfig(exploration=0.2, exploration_policy="age"))
    (rnd,) = replay(trace, [0.25], SpinConfig(exploration=0.2, exploration_policy="random"))
    assert none["mean_miss"] == 1.0
    assert age["mean_miss"] == pytest.approx(2 / 12)
    assert none["realized_sparsity"] == age["realized_sparsity"] == pytest.approx(0.25)
    assert rnd["mean_miss"] < 1.0


def test_miss_counts_only_committed_rows_and_turns_reset():
    trace = make_trace(steps=8, layers=2, next_n=3, start=200,
                       accepted=torch.tensor([0, 1, 2, 0, 1, 2, 0, 1], dtype=torch.int32),
                       turn_start=torch.tensor([4], dtype=torch.int32))
    (r,) = replay(trace, [0.5], SpinConfig(exploration=0.0))
    # steps 0 and 4 are warm-up (turn starts); committed rows of the others: a + 1
    committed = sum(a + 1 for t, a in enumerate([0, 1, 2, 0, 1, 2, 0, 1]) if t not in (0, 4))
    assert r["eligible_rows"] == 2 * committed
    assert r["rows"] == 2 * 6 * 3                  # realized sparsity counts every row


def test_rho_zero_and_small_context_are_not_eligible():
    trace = make_trace(start=40, block_size=8, index_topk=64)   # K > context: all blocks
    res = replay(trace, [0.0, 0.9], SpinConfig())
    for r in res:
        assert r["eligible_rows"] == 0 and r["mean_miss"] is None and r["p99_miss"] is None
        assert r["realized_sparsity"] == 0.0


def test_batched_sparsities_equal_separate_runs():
    trace = make_trace(steps=10, layers=3, next_n=2, start=300, seed=3)
    cfg = SpinConfig(exploration=0.1)
    together = replay(trace, [0.2, 0.5], cfg)
    for r in together:
        (alone,) = replay(trace, [r["target_sparsity"]], cfg)
        for key in ("realized_sparsity", "mean_miss", "p99_miss", "pearson", "eligible_rows"):
            assert alone[key] == pytest.approx(r[key]), key


def test_metrics_against_numpy_recomputation():
    # Recompute miss from first principles with the masks the replay kept for layer 0.
    trace = make_trace(steps=12, layers=1, start=500, block_size=16, index_topk=32, seed=5)
    (r,) = replay(trace, [0.6], SpinConfig(exploration=0.0), keep_masks_for_layer=0)
    masks = r["masks"]
    misses = []
    for t in range(1, trace.num_steps):
        z = trace.step_scores(t)[0, 0].numpy()
        top = np.argsort(-z, kind="stable")[:32]
        blocks = masks[t].numpy()
        if blocks[: -(-len(z) // 16)].sum() < -(-len(z) // 16):
            misses.append(np.mean(~blocks[top // 16]))
    assert r["eligible_rows"] == len(misses)
    assert r["mean_miss"] == pytest.approx(np.mean(misses))
    assert r["p99_miss"] == pytest.approx(np.percentile(misses, 99))


def test_studies():
    trace = make_trace(steps=6, layers=2, next_n=2, start=300)
    labels = [v for v, _ in study_variants("reduction", SpinConfig(), 1)]
    assert labels == ["A0", "A1-max", "A1-mean", "A1-top4", "A2-max", "A2-mean", "A2-top4"]
    res = run_study(trace, "mtp", [0.4])
    assert len(res) == 4 and all("variant" in r for r in res)
    with pytest.raises(SpinError, match="next_n > 1"):
        study_variants("mtp", SpinConfig(), 1)
    with pytest.raises(SpinError, match="unknown study"):
        study_variants("bogus", SpinConfig(), 1)
    dtypes = study_variants("state_dtype", SpinConfig(target_sparsity=0.3), 1)
    assert [(label, v.state_dtype, v.target_sparsity) for label, v in dtypes] == [
        ("float32", "float32", 0.3), ("float16", "float16", 0.3),
        ("float8_e4m3fn", "float8_e4m3fn", 0.3)]
    res = run_study(trace, "state_dtype", [0.4])
    assert [r["variant"] for r in res] == ["float32", "float16", "float8_e4m3fn"]
    assert res[1] == replay(trace, [0.4], SpinConfig(state_dtype="float16"), label="float16")[0]
    assert res[2] == replay(trace, [0.4], SpinConfig(state_dtype="float8_e4m3fn"),
                            label="float8_e4m3fn")[0]


def test_cli_study_choices_match_studies():
    from spin_trtllm.cli import build_parser
    from spin_trtllm.replay.evaluate import STUDIES

    ablate = build_parser()._subparsers._group_actions[0].choices["ablate"]
    study = next(a for a in ablate._actions if a.dest == "study")
    assert tuple(study.choices) == STUDIES


def test_bad_sparsity():
    with pytest.raises(SpinError, match="0 <= x < 1"):
        replay(make_trace(), [1.0])


def test_compare_predictors_prev_iter_wins_on_persistent_scores():
    # Layer scores persist over steps (small noise) and are unrelated across layers.
    gen = torch.Generator().manual_seed(0)
    T, L, n = 8, 3, 256
    base = torch.randn(L, n, generator=gen)
    scores = torch.cat([base[l] + 0.1 * torch.randn(n, generator=gen) for _ in range(T) for l in range(L)])
    trace = SpinTrace(scores=scores, row_len=torch.full((T, L, 1), n, dtype=torch.int32),
                      query_pos=torch.full((T, 1), n - 1, dtype=torch.int32), index_topk=16,
                      block_size=16).validate()
    m = compare_predictors(trace)["methods"]
    assert m["prev_iter"]["pearson"] > 0.95 and m["prev_iter"]["recall"] > 0.7
    assert abs(m["random"]["pearson"]) < 0.1
    assert m["prev_layer"]["recall"] < 0.3
    assert m["prev_layer_best5"]["recall"] >= m["prev_layer"]["recall"]
    assert m["prev_iter"]["pairs"] == (T - 1) * L and m["prev_layer"]["pairs"] == (T - 1) * (L - 1)
    assert m["prev_layer"]["recall_per_layer"][0] is None


def test_topk_mask_ties_go_to_lower_ids_and_respect_length():
    from spin_trtllm.replay.evaluate import topk_mask

    scores = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 9.0],
                           [5.0, 4.0, float("-inf"), 7.0, 2.0, 8.0]])
    # row 0: n = 5 (slot 5 invisible), K = 2: slots 1 and 2 (three-way tie at 3, lower ids)
    # row 1: n = 2 < K: K' = 2 -> both visible slots
    got = topk_mask(scores, torch.tensor([5, 2]), 2)
    assert got.tolist() == [[False, True, True, False, False, False],
                            [True, True, False, False, False, False]]


def test_random_and_oracle_references():
    """The true top-K sits in one block that jumps every step: the oracle (same budget) never
    misses, SPIN misses often, and random's expected miss is 1 - m/B."""
    steps, n, b, K = 30, 96, 8, 8
    g = torch.Generator().manual_seed(4)
    rows = []
    for t in range(steps):
        s = torch.rand(n, generator=g)
        hot = int(torch.randint(1, n // b - 1, (1,), generator=g)) * b
        s[hot:hot + b] += 10.0
        rows.append(s)
    trace = SpinTrace(scores=torch.cat(rows), row_len=torch.full((steps, 1, 1), n, dtype=torch.int32),
                      query_pos=torch.full((steps, 1), n - 1, dtype=torch.int32), index_topk=K,
                      block_size=b).validate()
    cfg = SpinConfig(exploration=0.0)
    r = replay(trace, [0.5], cfg)[0]
    assert r["oracle_mean_miss"] == 0.0 and r["oracle_p99_miss"] == 0.0
    assert r["mean_miss"] > 0.2
    # every eligible row keeps ceil(12 * 0.5) = 6 of 12 blocks
    assert r["random_mean_miss"] == pytest.approx(0.5)
    per = r["per_layer"][0]
    assert per["oracle_mean_miss"] == 0.0 and per["random_mean_miss"] == pytest.approx(0.5)


def test_oracle_never_worse_than_spin(small_trace):
    for r in replay(small_trace, [0.3, 0.6], SpinConfig(exploration=0.1)):
        if r["mean_miss"] is not None:
            assert r["oracle_mean_miss"] <= r["mean_miss"] + 1e-12
            assert r["oracle_mean_miss"] <= r["random_mean_miss"] + 1e-12
