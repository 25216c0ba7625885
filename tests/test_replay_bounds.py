"""Replay work is bounded by the data in the trace: small hostile traces are refused before any
work (exit 2, one line) or run in little memory; the estimate (replay/work.py) bounds the
measured peak; the batched and chunked code computes what the plain code did."""

import json
import resource
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from spin_trtllm import SpinConfig, TraceError
from spin_trtllm.cli import main
from spin_trtllm.replay import probe as P
from spin_trtllm.replay import work
from spin_trtllm.replay.evaluate import replay
from spin_trtllm.replay.plots import (KEPT, MISSED, SKIPPED, TOP, VISIBLE, WHITE, mask_window,
                                      topk_mask_chunks, topk_mask_image)
from spin_trtllm.replay.predictors import compare_predictors
from spin_trtllm.replay.trace import SpinTrace
from spin_trtllm.testing.traces import make_trace, random_v2_trace, scores_from_qwk

MEMORY = 3 << 30          # address space of the CLI runs below


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def cli(cwd, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "spin_trtllm.cli", *map(str, args)], cwd=cwd,
                          preexec_fn=_limit_memory, capture_output=True, text=True,
                          timeout=timeout)


def refused(proc, *words):
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, lines
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def ran(proc):
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    return proc


def one_long_row(steps, long=131072, block_size=64, at=None):
    """One row of `long` slots among `steps` one-slot steps (1 layer, next_n 1)."""
    row_len = torch.ones(steps, 1, 1, dtype=torch.int32)
    row_len[steps // 2 if at is None else at] = long
    gen = torch.Generator().manual_seed(0)
    return SpinTrace(scores=torch.randn(int(row_len.sum()), generator=gen).half(),
                     row_len=row_len, query_pos=(row_len[:, 0] - 1).contiguous(), index_topk=8,
                     block_size=block_size)


# ---- small hostile traces: refused, or run in little memory -----------------------------------
@pytest.mark.slow
def test_many_rows_per_step_are_refused_at_load(tmp_path):
    # the 344 KB trace: 8,192 next_n rows, one of 131,072 slots (8 GiB to replay)
    R = 8192
    row_len = torch.ones(1, 1, R, dtype=torch.int32)
    row_len[0, 0, 5] = 131072
    save_file({"scores": torch.zeros(int(row_len.sum()), dtype=torch.float16),
               "row_len": row_len, "query_pos": (row_len[0] - 1).contiguous(),
               "accepted": torch.zeros(1, dtype=torch.int32)},
              str(tmp_path / "rows.safetensors"),
              metadata={"format": "spin-trace", "version": "1", "index_topk": "8",
                        "block_size": "64", "next_n": str(R)})
    assert (tmp_path / "rows.safetensors").stat().st_size < 400_000
    for cmd in (["replay", "--quiet", "--mask-plot", "m.png"], ["info"],
                ["compare-predictors", "--quiet"], ["ablate", "--quiet", "--study", "mtp"]):
        refused(cli(tmp_path, cmd[0], "rows.safetensors", *cmd[1:]), "8192 rows per step",
                "at most 8")
    assert not (tmp_path / "m.png").exists()
    with pytest.raises(TraceError, match="at most 8"):
        make_trace(steps=2, next_n=9)
    make_trace(steps=2, next_n=8)                                # MTP's largest still loads


@pytest.mark.slow
def test_mask_plot_of_one_long_row_stays_small(tmp_path):
    # 600 steps x 131,072 slots: the plain float64 canvas alone was 1.9 GB (23 GiB from the
    # issue's 565 KB trace); chunks as wide as their rows draw it in a few MB
    trace = one_long_row(600)
    trace.save(tmp_path / "long.safetensors")
    est = work.estimate_mask_plot(trace, 0)
    assert est.bytes < 200 << 20
    ran(cli(tmp_path, "replay", "long.safetensors", "--quiet", "--mask-plot", "mask.png",
            "--mask-slots", "131072", "--mask-steps", "600"))        # the whole canvas
    assert (tmp_path / "mask.png").stat().st_size > 1000


@pytest.mark.slow
def test_block_size_far_above_the_rows_is_refused(tmp_path):
    # 16,000 one-slot rows with block_size 65,536: rows pad to whole blocks, 65,536x the data
    T, R = 2000, 8
    trace = SpinTrace(scores=torch.randn(T * R).half(),
                      row_len=torch.ones(T, 1, R, dtype=torch.int32),
                      query_pos=torch.zeros(T, R, dtype=torch.int32), index_topk=8,
                      block_size=65536, accepted=torch.zeros(T, dtype=torch.int32))
    trace.save(tmp_path / "pad.safetensors")
    for cmd in (["replay", "--quiet"], ["ablate", "--quiet", "--study", "reduction"]):
        line = refused(cli(tmp_path, cmd[0], "pad.safetensors", *cmd[1:], "--json", "out.json"),
                       "pad to", "block_size 65,536", "65,536x")
        assert "16,000 scores" in line
    assert not (tmp_path / "out.json").exists()
    info = ran(cli(tmp_path, "info", "pad.safetensors")).stdout
    assert "replay (3 sparsities, spin): about" in info and "refused: its 16,000 rows" in info
    # the same rows at a block size they fill replay
    small = SpinTrace(scores=trace.scores, row_len=trace.row_len, query_pos=trace.query_pos,
                      index_topk=8, block_size=1, accepted=trace.accepted)
    work.require(work.estimate_replay(small, 3, SpinConfig(block_size=1, index_topk=8)))


@pytest.mark.slow
def test_probe_block_size_from_metadata_needs_no_block_sized_temporaries(tmp_path):
    # a 75 KB v2 trace: block_size 65,536, D = 4,096, 8 rows of one slot; the partial block's
    # keys were gathered as [L, R, block_size, D] fp32 (8 GiB)
    R, D = 8, 4096
    gen = torch.Generator().manual_seed(1)
    row_len = torch.ones(1, 1, R, dtype=torch.int32)
    q = torch.randn(1, 1, R, 1, D, generator=gen).half()
    w = torch.rand(1, 1, R, 1, generator=gen)
    keys = torch.randn(1, 1, D, generator=gen).half()
    SpinTrace(scores=scores_from_qwk(q, w, keys, row_len), row_len=row_len,
              query_pos=torch.zeros(1, R, dtype=torch.int32), index_topk=8, block_size=65536,
              accepted=torch.zeros(1, dtype=torch.int32), q=q, w=w,
              keys=keys).save(tmp_path / "v2.safetensors")
    for predictor in ("quest", "probe", "gauss"):
        ran(cli(tmp_path, "replay", "v2.safetensors", "--quiet", "--predictor", predictor))


# ---- the limit: refused before any work, naming what is big -----------------------------------
def test_over_the_memory_limit_is_refused_before_any_work(tmp_path, monkeypatch, capsys):
    trace = make_trace(steps=40, layers=2, next_n=2, start=3000, block_size=16, index_topk=64)
    path = str(trace.save(tmp_path / "t.safetensors"))
    alone = work.estimate_replay(trace, 3, SpinConfig(block_size=16, index_topk=64))
    plot = work.estimate_mask_plot(trace, 0)
    assert alone.add(plot).bytes > alone.bytes
    monkeypatch.setattr(work, "REPLAY_MAX_WORK_BYTES", alone.bytes)
    assert main(["replay", path, "--quiet"]) == 0
    capsys.readouterr()
    out = tmp_path / "out.json"
    for argv, words in (
            (["replay", path, "--mask-plot", str(tmp_path / "m.png")], ["replay and --mask-plot"]),
            (["replay", path, "--sparsity", "0.3", "0.4", "0.5", "0.6"], ["replay would need"]),
            (["ablate", path, "--study", "exploration", "--sparsity", "0.3", "0.4", "0.5", "0.6"],
             ["ablate --study exploration"])):
        assert main([*argv, "--quiet", "--json", str(out)]) == 2
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and "over the limit of" in err[0] and "most of it: " in err[0], err
        for word in words:
            assert word in err[0], err[0]
    assert not out.exists() and not (tmp_path / "m.png").exists()
    monkeypatch.setattr(work, "REPLAY_MAX_WORK_BYTES", 1 << 20)
    assert main(["compare-predictors", path, "--quiet"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "compare-predictors would need" in err[0], err
    with pytest.raises(work.SpinError, match="over the limit of 1 MiB"):
        replay(trace, [0.5])


def test_info_prints_the_default_runs_estimate(tmp_path, capsys):
    path = str(make_trace(steps=5).save(tmp_path / "t.safetensors"))
    assert main(["info", path]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "; replay (" in ln]
    assert len(lines) == 1
    assert "steps, 2 layers" in lines[0] and "replay (3 sparsities, spin): about " in lines[0]
    assert "MiB of memory and " in lines[0]
    assert "(estimated; limit 8 GiB)" in lines[0] and "refused" not in lines[0]


# ---- the estimate bounds what a run takes ------------------------------------------------------
MEASURE = r"""
import json, sys, torch
from spin_trtllm import SpinConfig
from spin_trtllm.replay import work
from spin_trtllm.replay.evaluate import config_for_trace, replay
from spin_trtllm.replay.plots import plot_topk_mask
from spin_trtllm.replay.predictors import compare_predictors
from spin_trtllm.testing.traces import make_trace
what, out = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
small = make_trace(steps=3)
replay(small, [0.5], keep_masks_for_layer=0)          # first use: imports, allocator arenas
compare_predictors(small)
plot_topk_mask(small, out)
if what == "mask":
    trace = make_trace(steps=300, layers=1, start=20000, block_size=64, dtype=torch.float16)
elif what == "compare":
    trace = make_trace(steps=3, layers=8, start=131072, dtype=torch.float16)
else:
    trace = make_trace(steps=4, layers=2, next_n=2, start=131072, block_size=64,
                       index_topk=2048, dtype=torch.float16)
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
def peak():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")        # VmHWM := now
before = rss()
if what == "replay":
    est = work.estimate_replay(trace, 3, config_for_trace(trace, None))
    replay(trace, [0.3, 0.5, 0.7])
elif what == "compare":
    est = work.estimate_compare(trace)
    compare_predictors(trace)
else:
    est = work.estimate_mask_plot(trace, 0)                     # the whole canvas
    plot_topk_mask(trace, out, selected=[torch.rand(-(-int(n) // 64)) < 0.5
                                         for n in trace.row_len[:, 0, 0]],
                   max_slots=None, max_steps=None)
print(json.dumps({"used": peak() - before, "estimate": est.bytes}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
@pytest.mark.parametrize("what", ["replay", "compare", "mask"])
@pytest.mark.slow
def test_estimate_bounds_the_measured_peak(tmp_path, what):
    proc = subprocess.run([sys.executable, "-c", MEASURE, what, str(tmp_path / "m.png")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    used, estimate = got["used"], got["estimate"]
    assert used > 20 << 20                              # the run did allocate
    assert used <= estimate <= 4 * used, got


# ---- batched and chunked work computes what the plain code did --------------------------------
def _same_results(a, b):
    for x, y in zip(a, b):
        for key in ("realized_sparsity", "mean_miss", "p99_miss", "pearson", "eligible_rows",
                    "rows", "oracle_mean_miss", "random_mean_miss", "effective_sparsity"):
            if y[key] is None:                  # e.g. no Pearson for summary predictors
                assert x[key] is None, key
            else:
                assert x[key] == pytest.approx(y[key], rel=1e-12, abs=1e-12), key
        for px, py in zip(x["per_layer"], y["per_layer"]):
            assert px["mean_miss"] == pytest.approx(py["mean_miss"], rel=1e-12, abs=1e-12)
        for mx, my in zip(x.get("masks") or [], y.get("masks") or []):
            assert torch.equal(mx, my)


@pytest.mark.parametrize("kw", [{}, {"budget": "adaptive"}, {"predictor": "hybrid"},
                                {"cfg": SpinConfig(reduction="A2", exploration=0.2)}])
def test_layer_batches_give_the_one_batch_results(monkeypatch, kw):
    kw = dict(kw)
    cfg = kw.pop("cfg", SpinConfig(exploration=0.1, exploration_policy="staleness"))
    trace = random_v2_trace(steps=6, layers=3, next_n=2, start=70, block_size=8, seed=3)
    trace.turn_start = torch.tensor([3], dtype=torch.int32)
    whole = replay(trace, [0.4, 0.7], cfg, keep_masks_for_layer=1, **kw)
    assert len(work.layer_batches(trace.row_len, 4, 8)) == 1
    monkeypatch.setattr(work, "BATCH_SLOTS", 1)                  # one layer per batch
    assert work.layer_batches(trace.row_len, 4, 8) == [(0, 1), (1, 2), (2, 3)]
    _same_results(whole, replay(trace, [0.4, 0.7], cfg, keep_masks_for_layer=1, **kw))
    a = compare_predictors(trace)
    monkeypatch.setattr(work, "BATCH_SLOTS", 1 << 22)
    b = compare_predictors(trace)
    for method in a["methods"]:
        if method != "random":                                   # its draws follow the shapes
            for key in ("pearson", "recall", "pairs"):
                assert a["methods"][method][key] == pytest.approx(b["methods"][method][key],
                                                                  rel=1e-12)


def test_turns_start_from_a_fresh_state_sized_for_them():
    # a turn start resets the state: replaying each turn alone gives the same rows and misses
    # (age exploration counts steps since the reset, so it does not see the step numbers)
    cfg = SpinConfig(exploration=0.2, exploration_policy="age")
    trace = make_trace(steps=10, layers=2, next_n=2, start=300, block_size=16, index_topk=32,
                       turn_start=torch.tensor([4], dtype=torch.int32))

    def part(lo, hi):
        n = trace.row_len[lo:hi]
        off = trace.step_offsets()
        return SpinTrace(scores=trace.scores[int(off[lo]):int(off[hi])], row_len=n,
                         query_pos=trace.query_pos[lo:hi], index_topk=32, block_size=16,
                         accepted=trace.accepted[lo:hi]).validate()

    (whole,) = replay(trace, [0.6], cfg)
    (a,), (b,) = replay(part(0, 4), [0.6], cfg), replay(part(4, 10), [0.6], cfg)
    assert whole["eligible_rows"] == a["eligible_rows"] + b["eligible_rows"] > 0
    n_a, n_b = a["eligible_rows"], b["eligible_rows"]
    assert whole["mean_miss"] == pytest.approx((a["mean_miss"] * n_a + b["mean_miss"] * n_b)
                                               / (n_a + n_b), rel=1e-12)


def test_step_scores_of_layer_and_row_ranges():
    trace = make_trace(steps=4, layers=3, next_n=3, start=20)
    for t in range(4):
        full = trace.step_scores(t)
        part = trace.step_scores(t, layers=(1, 3), rows=(1, 2))
        n = trace.row_len[t, 1:3, 1:2]
        assert part.shape == (2, 1, int(n.max()))
        assert torch.equal(part, full[1:3, 1:2, :part.shape[-1]])
    off = trace.layer_offsets()
    assert torch.equal(off[:, -1] - off[:, 0], trace.row_len.sum((1, 2)).to(torch.int64))


def _plain_canvas(trace, layer, row, selected, b, k, width, steps):
    """The mask plot's canvas over its window as the plain code built it (one image), in uint8
    RGBA."""
    t0, t1, lo, W = mask_window(trace, layer, row, width, steps)
    img = topk_mask_image(trace, layer, row, width, k, max_steps=steps)
    canvas = np.empty((t1 - t0, W, 4), dtype=np.uint8)
    canvas[:] = WHITE
    top, visible = img == 1, img >= 0
    if selected is not None:
        blocks = [np.asarray(s, dtype=bool) for s in selected]
        nb = max(x.size for x in blocks)
        sel = np.stack([np.pad(x, (0, nb - x.size)) for x in blocks])[t0:t1]
        ids = (lo + np.arange(W)) // b
        slot_sel = np.zeros((t1 - t0, W), dtype=bool)
        slot_sel[:, ids < nb] = sel[:, ids[ids < nb]]
        canvas[visible & slot_sel] = KEPT
        canvas[visible & ~slot_sel] = SKIPPED
    else:
        canvas[visible] = VISIBLE
    canvas[top] = TOP
    if selected is not None:
        canvas[top & ~slot_sel] = MISSED
    return canvas


@pytest.mark.parametrize("chunk", [1 << 20, 997])
def test_mask_chunks_equal_the_plain_canvas(monkeypatch, chunk):
    monkeypatch.setattr(work, "MASK_CHUNK_PIXELS", chunk)
    monkeypatch.setattr(work, "MASK_SLACK", 64)
    gen = torch.Generator().manual_seed(7)
    for trial in range(4):
        T, R = 30, 2
        n = torch.randint(1, 90, (T, 1, R), generator=gen)
        n[int(torch.randint(0, T, (1,), generator=gen))] = 700         # one long step
        row_len = n.expand(T, 2, R).to(torch.int32).contiguous()
        trace = SpinTrace(scores=torch.randn(int(row_len.sum()), generator=gen),
                          row_len=row_len, query_pos=(n[:, 0] - 1).to(torch.int32) + 0,
                          index_topk=5, block_size=8,
                          accepted=torch.zeros(T, dtype=torch.int32)).validate()
        b = int(torch.randint(1, 20, (1,), generator=gen))
        row = trial % R
        selected = [torch.rand(-(-int(trace.row_len[t, 1].max()) // b), generator=gen) < 0.5
                    for t in range(T)]
        for sel in (None, selected, torch.stack([torch.nn.functional.pad(s, (0, 100 - s.numel()))
                                                 for s in selected])):
            for width, steps in ((None, None), (50, None), (50, 12), (None, 7)):
                t0, t1, lo, shown = mask_window(trace, 1, row, width, steps)
                plain = _plain_canvas(trace, 1, row, sel, b, 5, width, steps)
                got = np.empty_like(plain)
                got[:] = WHITE
                pixels = 0
                for c0, c1, canvas in topk_mask_chunks(trace, 1, row, width, sel, b, 5,
                                                       max_steps=steps):
                    assert t0 <= c0 < c1 <= t1
                    got[c0 - t0:c1 - t0, :canvas.shape[1]] = canvas
                    pixels += canvas.shape[0] * canvas.shape[1]
                assert np.array_equal(got, plain)
                data = int((trace.row_len[t0:t1, 1, row] - lo).clamp(0, shown).sum())
                assert pixels <= 2 * data + T * 64                # ~ the shown slots, not T x W


def _summaries_by_hand(keys, n, sub, count):
    """mean/var/min/max of each sub-block's visible keys, row by row (float64)."""
    L, R = n.shape
    D = keys.shape[-1]
    out = {k: torch.zeros(L, R, count, D, dtype=torch.float64) for k in ("mean", "var", "kmin",
                                                                         "kmax")}
    for l in range(L):
        for r in range(R):
            for u in range(count):
                x = keys[l, u * sub:min((u + 1) * sub, int(n[l, r]))].double()
                if len(x):
                    out["mean"][l, r, u] = x.mean(0)
                    out["var"][l, r, u] = x.var(0, unbiased=False)
                    out["kmin"][l, r, u], out["kmax"][l, r, u] = x.amin(0), x.amax(0)
    return out


def test_probe_chunks_equal_the_plain_summaries_and_scores(monkeypatch):
    trace = random_v2_trace(steps=2, layers=3, next_n=3, start=57, heads=3, dim=8, block_size=16,
                            seed=4)
    n = trace.row_len[1]
    count = -(-int(n.max()) // 4)
    s = P.BlockSummaries(trace.keys, 4)
    plain = {}
    for chunk in (1 << 24, 5):
        monkeypatch.setattr(P, "CHUNK_VALUES", chunk)        # partial keys in 1..4-slot pieces
        got = s.at(n, count)
        hand = _summaries_by_hand(trace.keys.float(), n, 4, count)
        for name in hand:
            assert torch.allclose(got[name].double(), hand[name], atol=1e-5), name
        for predictor, parts in (("probe", 1), ("probe", 2), ("quest", 1), ("gauss", 1)):
            qp = P.QueryProbe(trace, predictor, 16, summaries=parts)
            scores = qp.scores(1, n, count // 4 + 1)
            key = (predictor, parts)
            if key not in plain:
                plain[key] = scores
            assert torch.equal(torch.isfinite(scores), torch.isfinite(plain[key]))
            assert torch.allclose(scores, plain[key], rtol=1e-5, atol=1e-5)
            part = qp.scores(1, n[1:3], count // 4 + 1, layers=(1, 3))
            assert torch.allclose(part, scores[1:3], rtol=1e-5, atol=1e-5)
