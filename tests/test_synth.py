"""Tests for the synthetic trace generator (spin_trtllm.replay.synth)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

from spin_trtllm.errors import SpinError
from spin_trtllm.replay.synth import SynthConfig, synthesize
from spin_trtllm.replay.trace import SpinTrace

SMALL = dict(steps=12, layers=2, prompt_slots=300, index_topk=64, block_size=16)


def small(**overrides) -> SynthConfig:
    return SynthConfig(**{**SMALL, **overrides})


def _same(a: SpinTrace, b: SpinTrace) -> bool:
    def eq(x, y):
        return (x is None and y is None) or (
            x is not None and y is not None and x.dtype == y.dtype and torch.equal(x, y))
    return (eq(a.scores, b.scores) and eq(a.row_len, b.row_len) and eq(a.query_pos, b.query_pos)
            and eq(a.turn_start, b.turn_start) and eq(a.accepted, b.accepted)
            and a.index_topk == b.index_topk and a.block_size == b.block_size
            and a.compress_ratio == b.compress_ratio and a.source == b.source)


def _corr(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([x.flatten(), y.flatten()]))[0, 1])


# ---- determinism --------------------------------------------------------------------------
def test_same_seed_is_bit_identical():
    cfg = small(next_n=3, turns=3, turn_slots=20, shift_prob=0.3, seed=7)
    assert _same(synthesize(cfg), synthesize(cfg))


def test_different_seed_gives_different_scores():
    a = synthesize(small(seed=1))
    b = synthesize(small(seed=2))
    assert a.scores.shape == b.scores.shape  # next_n = 1: lengths do not depend on the seed
    assert not torch.equal(a.scores, b.scores)
    assert a.source != b.source


def test_dtype_only_changes_rounding():
    half = synthesize(small(dtype="float16"))
    full = synthesize(small(dtype="float32"))
    assert half.scores.dtype == torch.float16 and full.scores.dtype == torch.float32
    assert torch.equal(full.scores.half(), half.scores)


# ---- shapes, validator, file round trip ---------------------------------------------------
@pytest.mark.parametrize("next_n,ratio,dtype", [(1, 1, "float16"), (3, 1, "float32"),
                                                 (4, 4, "float16")])
def test_shapes_and_validator(next_n, ratio, dtype):
    cfg = small(next_n=next_n, compress_ratio=ratio, dtype=dtype)
    tr = synthesize(cfg)
    T, L, R = cfg.steps, cfg.layers, cfg.next_n
    assert tuple(tr.row_len.shape) == (T, L, R) and tr.row_len.dtype == torch.int32
    assert tuple(tr.query_pos.shape) == (T, R) and tr.query_pos.dtype == torch.int32
    assert tr.scores.dim() == 1 and tr.scores.numel() == int(tr.row_len.sum())
    assert tr.scores.dtype == getattr(torch, dtype)
    assert (tr.row_len == tr.row_len[:, :1, :]).all()  # layers share row lengths
    assert tr.index_topk == cfg.index_topk and tr.block_size == cfg.block_size
    assert tr.compress_ratio == ratio and tr.next_n == R
    assert tr.source.startswith(f"synth seed={cfg.seed}")
    assert (tr.accepted is None) == (R == 1)
    assert tr.turn_start is None
    tr.validate()
    # Every row of step_scores is finite up to its length, so the packing lines up.
    dense = tr.step_scores(T - 1)
    assert torch.isfinite(dense[:, :, :int(tr.row_len[T - 1].min())]).all()


def test_save_load_round_trip(tmp_path):
    cfg = small(next_n=3, compress_ratio=4, turns=2, turn_slots=16)
    tr = synthesize(cfg)
    path = tr.save(tmp_path / "synth.safetensors")
    back = SpinTrace.load(path)
    assert _same(tr, back)
    assert back.next_n == 3 and back.turn_starts() == {0, cfg.steps // 2}


def test_scores_bounded_and_signed_even_at_max_noise():
    tr = synthesize(small(noise=10.0))
    s = tr.scores.float()
    assert torch.isfinite(s).all() and float(s.abs().max()) < 100
    assert (s < 0).any() and (s > 0).any()


# ---- row lengths and query positions ------------------------------------------------------
@pytest.mark.parametrize("next_n", [1, 3])
def test_row_lengths_ratio_1(next_n):
    cfg = small(steps=30, next_n=next_n)
    tr = synthesize(cfg)
    n = tr.row_len[:, 0, :].to(torch.int64)
    acc = tr.accepted_or_zero().to(torch.int64)
    assert int(n[0, 0]) == cfg.prompt_slots
    assert torch.equal(n[1:, 0] - n[:-1, 0], acc[:-1] + 1)  # commits accepted + 1 tokens
    assert torch.equal(n - n[:, :1], torch.arange(next_n).expand_as(n))  # row r sees r more
    assert torch.equal(tr.query_pos.to(torch.int64), n - 1)  # ratio 1: the query is the last slot


def test_row_lengths_ratio_4():
    cfg = small(steps=40, next_n=2, compress_ratio=4, accept_prob=0.5)
    tr = synthesize(cfg)
    acc = tr.accepted.to(torch.int64)
    # Tokens visible to row 0: the prompt's tokens plus everything committed before.
    tokens = cfg.prompt_slots * 4 + torch.cat([torch.zeros(1, dtype=torch.int64),
                                               (acc + 1).cumsum(0)[:-1]])
    for r in range(cfg.next_n):
        assert torch.equal(tr.row_len[:, 0, r].to(torch.int64), (tokens + r) // 4)
    q = tr.query_pos.unsqueeze(1).to(torch.int64)
    assert (q >= tr.row_len - 1).all() and (q <= tr.row_len).all()
    assert (tr.row_len[:, :, 1:] >= tr.row_len[:, :, :-1]).all()
    assert int(tr.row_len[0, 0, 0]) == cfg.prompt_slots
    # ~sum(acc + 1) / 4 new slots over the run, not one per step.
    growth = int(tr.row_len[-1, 0, 0] - tr.row_len[0, 0, 0])
    assert growth == (int((acc[:-1] + 1).sum()) + cfg.prompt_slots * 4) // 4 - cfg.prompt_slots
    assert growth < cfg.steps - 1


# ---- turns --------------------------------------------------------------------------------
@pytest.mark.parametrize("next_n,ratio", [(1, 1), (3, 1), (1, 4)])
def test_turns_append_user_message(next_n, ratio):
    cfg = small(steps=40, turns=4, turn_slots=50, next_n=next_n,
                      compress_ratio=ratio)
    tr = synthesize(cfg)
    assert tr.turn_start is not None and tr.turn_start.dtype == torch.int32
    starts = tr.turn_start.tolist()
    assert starts == sorted(set(starts)) and len(starts) == cfg.turns and starts[0] == 0
    assert starts == [0, 10, 20, 30]  # evenly spaced over 40 steps
    acc = tr.accepted_or_zero().to(torch.int64)
    tokens = tr.row_len[:, 0, 0].to(torch.int64)  # ratio 1: slots == tokens
    for t in range(1, cfg.steps):
        jump = int(tokens[t] - tokens[t - 1])
        committed = int(acc[t - 1]) + 1
        if ratio == 1:
            expect = committed + (cfg.turn_slots if t in starts else 0)
            assert jump == expect, t
        else:  # the message adds exactly turn_slots slots, commits add 0 or 1
            extra = cfg.turn_slots if t in starts else 0
            assert extra <= jump <= extra + 1, t


def test_single_turn_has_no_turn_start():
    assert synthesize(small()).turn_start is None


def test_turns_equal_steps_marks_every_step():
    tr = synthesize(small(steps=5, turns=5, turn_slots=3))
    assert tr.turn_start.tolist() == [0, 1, 2, 3, 4]


# ---- structure ----------------------------------------------------------------------------
def test_consecutive_steps_are_predictable():
    cfg = SynthConfig(steps=20, layers=2, prompt_slots=2048, index_topk=128, shift_prob=0.0)
    tr = synthesize(cfg)
    K = cfg.index_topk
    for t in range(cfg.steps - 1):
        a, b = tr.step_scores(t), tr.step_scores(t + 1)
        n = a.shape[-1]  # slots visible at both steps
        for l in range(cfg.layers):
            x, y = a[l, 0, :n], b[l, 0, :n]
            assert _corr(x, y) > 0.3
            overlap = len(set(x.topk(K).indices.tolist()) & set(y.topk(K).indices.tolist())) / K
            assert overlap > max(0.5, 4 * K / n), (t, l, overlap)


def _high_slots(cfg: SynthConfig, threshold: float = 1.5) -> int:
    tr = synthesize(cfg)
    n0 = cfg.prompt_slots
    mean = torch.stack([tr.step_scores(t)[0, 0, :n0] for t in range(cfg.steps)]).mean(0)
    return int((mean > threshold).sum())


def test_vertical_slots_stand_out():
    common = dict(steps=20, layers=1, prompt_slots=2048, diagonal_bands=0, sink_slots=0,
                  local_window=0, shift_prob=0.0)
    with_lines = _high_slots(SynthConfig(**common, vertical=64))
    without = _high_slots(SynthConfig(**common, vertical=0))
    assert 40 <= with_lines <= 90
    assert without < 15


def test_sinks_and_local_window_are_elevated():
    cfg = SynthConfig(steps=10, layers=2, prompt_slots=1024, vertical=0, diagonal_bands=0,
                      sink_slots=4, local_window=16)
    tr = synthesize(cfg)
    for t in range(cfg.steps):
        s = tr.step_scores(t)[:, 0, :]
        middle = s[:, 100:-100].mean()
        assert s[:, :4].mean() > middle + 2
        assert s[:, -4:].mean() > middle + 1  # nearest recent slots
        assert s[:, -16:].mean() > s[:, -32:-16].mean()  # decays with distance


def _lagged_residual_corr(cfg: SynthConfig, lag: int) -> tuple[float, float]:
    """Correlation of step t slot i with step t+lag at slot i+lag (same offset q - i, ratio 1,
    one token a step) and at slot i (same slot)."""
    tr = synthesize(cfg)
    n0 = cfg.prompt_slots
    s = torch.stack([tr.step_scores(t)[0, 0, :n0] for t in range(cfg.steps)])
    res = s - s.mean(0)  # remove the static (content, vertical, sink) part
    aligned = _corr(res[:-lag, :-lag], res[lag:, lag:])
    same_slot = _corr(res[:-lag, lag:], res[lag:, lag:])
    return aligned, same_slot


def test_diagonal_bands_follow_the_offset():
    common = dict(steps=30, layers=1, prompt_slots=4096, vertical=0, sink_slots=0,
                  local_window=0, shift_prob=0.0, noise=0.05)
    # After 8 steps a band (a few slots wide) has moved off its old slots but keeps its offset.
    aligned, same_slot = _lagged_residual_corr(SynthConfig(**common, diagonal_bands=3), lag=8)
    assert aligned > 0.5 and same_slot < aligned - 0.3
    aligned0, _ = _lagged_residual_corr(SynthConfig(**common, diagonal_bands=0), lag=8)
    assert abs(aligned0) < 0.1


def test_attention_shift_moves_vertical_lines():
    common = dict(steps=30, layers=1, prompt_slots=1024, diagonal_bands=0, local_window=0,
                  sink_slots=0, noise=0.05)

    def moved(shift_prob: float) -> float:
        tr = synthesize(SynthConfig(**common, shift_prob=shift_prob))
        first = set((tr.step_scores(0)[0, 0] > 1.8).nonzero().flatten().tolist())
        last = set((tr.step_scores(29)[0, 0, :1024] > 1.8).nonzero().flatten().tolist())
        return 1 - len(first & last) / max(len(first), 1)

    assert moved(0.0) < 0.1
    assert moved(1.0) > 0.5  # re-drawing half each step replaces almost everything


# ---- MTP ----------------------------------------------------------------------------------
@pytest.mark.parametrize("next_n,p", [(4, 0.7), (2, 0.3), (8, 0.9)])
def test_mtp_acceptance_is_geometric(next_n, p):
    # Ratio 4 keeps the context (which grows by ~1 + mean accepted tokens a step) small.
    cfg = SynthConfig(steps=2000, layers=1, prompt_slots=8, next_n=next_n, accept_prob=p,
                      compress_ratio=4, vertical=2, diagonal_bands=1, local_window=4, seed=3)
    acc = synthesize(cfg).accepted
    assert acc is not None and acc.dtype == torch.int32 and tuple(acc.shape) == (cfg.steps,)
    assert int(acc.min()) >= 0 and int(acc.max()) <= next_n - 1
    d = next_n - 1
    expect_mean = sum(p ** k for k in range(1, d + 1))
    var = sum((2 * k - 1) * p ** k for k in range(1, d + 1)) - expect_mean ** 2
    tol = 5 * math.sqrt(var / cfg.steps)
    assert abs(float(acc.double().mean()) - expect_mean) < tol
    # P(accepted = 0) is the first draft's rejection probability.
    assert abs(float((acc == 0).double().mean()) - (1 - p)) < 5 * math.sqrt(p * (1 - p) / cfg.steps)


@pytest.mark.parametrize("p,expect", [(0.0, 0), (1.0, 4)])
def test_mtp_acceptance_extremes(p, expect):
    acc = synthesize(small(next_n=5, accept_prob=p)).accepted
    assert (acc == expect).all()


def test_progress_bar_runs(capsys):
    tr = synthesize(small(), progress=True)
    assert tr.num_steps == SMALL["steps"]
    assert "synth" in capsys.readouterr().err


# ---- config validation --------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [
    ("steps", 0), ("steps", -3), ("steps", 2.0), ("steps", True),
    ("layers", 0), ("prompt_slots", 0), ("prompt_slots", "4096"),
    ("next_n", 0), ("next_n", 9),
    ("compress_ratio", 2), ("compress_ratio", 0), ("compress_ratio", 8),
    ("index_topk", 0), ("block_size", 0),
    ("turns", 0), ("turns", SynthConfig().steps + 1),
    ("turn_slots", -1), ("vertical", -1), ("diagonal_bands", -1),
    ("sink_slots", -1), ("local_window", -1),
    ("shift_prob", -0.1), ("shift_prob", 1.5), ("shift_prob", float("nan")),
    ("noise", -0.5), ("noise", 11.0), ("noise", float("inf")), ("noise", "0.3"),
    ("accept_prob", 1.01), ("accept_prob", -1), ("accept_prob", None),
    ("dtype", "bfloat16"), ("dtype", torch.float16),
    ("seed", -1), ("seed", 1 << 64), ("seed", 0.5),
])
def test_invalid_field_raises_naming_it(field, value):
    with pytest.raises(SpinError, match=rf"SynthConfig\.{field}\b"):
        SynthConfig(**{field: value})


@pytest.mark.parametrize("kwargs", [
    dict(next_n=8), dict(compress_ratio=4), dict(shift_prob=0, accept_prob=1), dict(noise=0),
    dict(steps=3, turns=3), dict(vertical=0, diagonal_bands=0, sink_slots=0, local_window=0),
    dict(turn_slots=0), dict(seed=(1 << 64) - 1), dict(shift_prob=1, accept_prob=0.0),
])
def test_boundary_values_are_accepted(kwargs):
    SynthConfig(**kwargs)


def test_boundary_config_synthesizes():
    tr = synthesize(SynthConfig(steps=3, layers=1, prompt_slots=1, next_n=8, compress_ratio=4,
                                turns=3, turn_slots=0, vertical=0, diagonal_bands=0,
                                sink_slots=0, local_window=0, noise=0.0, seed=(1 << 64) - 1))
    assert int(tr.row_len.min()) >= 1 and tr.turn_start.tolist() == [0, 1, 2]


def test_thread_setting_is_restored():
    before = torch.get_num_threads()
    synthesize(small(steps=2))
    assert torch.get_num_threads() == before


@settings(max_examples=25, deadline=None)
@given(steps=st.integers(1, 12), layers=st.integers(1, 3), prompt_slots=st.integers(1, 150),
       next_n=st.integers(1, 8), ratio=st.sampled_from([1, 4]), turn_frac=st.floats(0, 1),
       turn_slots=st.integers(0, 20), vertical=st.integers(0, 200), bands=st.integers(0, 4),
       sinks=st.integers(0, 200), window=st.integers(0, 300), seed=st.integers(0, 2 ** 32))
def test_any_small_config_is_a_valid_trace(steps, layers, prompt_slots, next_n, ratio,
                                            turn_frac, turn_slots, vertical, bands, sinks,
                                            window, seed):
    turns = max(1, round(turn_frac * steps))
    cfg = SynthConfig(steps=steps, layers=layers, prompt_slots=prompt_slots, next_n=next_n,
                      compress_ratio=ratio, turns=turns, turn_slots=turn_slots,
                      vertical=vertical, diagonal_bands=bands, sink_slots=sinks,
                      local_window=window, shift_prob=0.5, seed=seed)
    tr = synthesize(cfg)  # validates
    acc = tr.accepted_or_zero().to(torch.int64)
    starts = tr.turn_starts()
    assert len(starts) == turns
    # Tokens visible to row 0, rebuilt from the documented rules.
    p, expect = prompt_slots * ratio, []
    for t in range(steps):
        if t > 0 and t in starts:
            p += turn_slots * ratio
        expect.append([(p + r) // ratio for r in range(next_n)])
        p += int(acc[t]) + 1
    assert tr.row_len.tolist() == [[row] * layers for row in expect]
    q = tr.query_pos.unsqueeze(1)
    assert (q >= tr.row_len - 1).all() and (q <= tr.row_len).all()
    assert float(tr.scores.float().abs().max()) < 100
