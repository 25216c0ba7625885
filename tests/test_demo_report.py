"""The demo report (bytes figure first, aligned table, footnotes) and the progress bars of the
demo, Engine.run and ablate."""

from types import SimpleNamespace

import pytest
import tqdm as tqdm_module

from spin_trtllm import SpinConfig
from spin_trtllm.cli import main
from spin_trtllm.harness import Engine, Request, init_weights, tiny
from spin_trtllm.costs import indexer_bytes
from spin_trtllm.harness.demo import summarize
from spin_trtllm.harness.report import format_report
from spin_trtllm.harness.engine import RequestOutput, StepStats
from spin_trtllm.replay import evaluate

from spin_trtllm.testing.traces import make_trace


# ---- the bytes formula --------------------------------------------------------------------
def test_indexer_bytes_by_hand():
    # one request, one indexer layer: 3 visible blocks (192 slots), SPIN scores 2 (128 slots)
    # K cache: 128 slots x (128 fp8 bytes + 4 scale bytes) = 128 x 132
    assert indexer_bytes(2, 3, "float32") == (16896, 4096)
    # float32 state: select reads V and D of 192 slots: 192 x 8 = 1536; update reads V, D
    # (8), writes V, D (8) and reads the fp32 logit (4) of 128 slots: 128 x 20 = 2560
    assert 1536 + 2560 == 4096
    # float16 state: 192 x 4 = 768 and 128 x (4 + 4 + 4) = 1536
    assert indexer_bytes(2, 3, "float16") == (16896, 768 + 1536)
    # all-keep reads the K cache of every visible block and has no state
    assert indexer_bytes(3, 3) == (192 * 132, 0)
    # the probe reads one 144-byte summary row per visible block and no V/D in select
    assert indexer_bytes(2, 3, "float32", "probe") == (16896 + 3 * 144, 2 * 64 * 20)
    # the hybrid reads both: the summary rows and select's V/D of the visible slots
    assert indexer_bytes(2, 3, "float32", "hybrid") == (16896 + 3 * 144, 1536 + 2560)
    assert indexer_bytes(0, 0, "float32") == (0, 0)


def _engine(spin, steps):
    return SimpleNamespace(history=steps, spin=spin, time_indexer=True, prefill_seconds=1.0,
                           predictor="spin")


def test_summarize_per_step_traffic_and_tokens_per_step():
    spin = SpinConfig(state_dtype="float16")
    hist = [StepStats(batch=1, seconds=0.1, selected_blocks=2, visible_blocks=3),
            StepStats(batch=1, seconds=0.1, selected_blocks=4, visible_blocks=4)]
    hist[0].spin, hist[1].spin = True, False   # step 1 an engine ran all-keep: no state
    outs = {0: RequestOutput(0, [[1, 2, 3]], "length"),              # 2 decode tokens
            1: RequestOutput(1, [[4], [5]], "length")}                # 0: both from prefills
    s = summarize(_engine(spin, hist), outs, 1)
    assert s["kcache_mb_per_step"] == pytest.approx((2 + 4) * 64 * 132 / 1e6 / 2)
    assert s["state_mb_per_step"] == pytest.approx((768 + 1536) / 1e6 / 2)
    assert s["indexer_mb_per_step"] == pytest.approx(s["kcache_mb_per_step"]
                                                     + s["state_mb_per_step"])
    assert s["realized_sparsity"] == pytest.approx(1 - 6 / 7)
    # next_n 1: tokens per decode step is the mean batch
    assert s["tokens_per_step"] == s["mean_batch"] == 1.0
    dense = summarize(_engine(None, [StepStats(batch=1, seconds=0.1, selected_blocks=3,
                                               visible_blocks=3)]), {}, 0)
    assert dense["state_mb_per_step"] == 0 and dense["realized_sparsity"] is None
    assert dense["kcache_mb_per_step"] == pytest.approx(3 * 64 * 132 / 1e6)


# ---- the report ---------------------------------------------------------------------------
def _side(**kw):
    base = dict(decode_steps=14, step_ms_median=163.27, indexer_ms_median=65.98,
                indexer_share=0.225, cuda_graphs=False, prefill_s=30.81,
                realized_sparsity=0.291, mean_miss=None, p99_miss=None, miss_rows=0,
                mtp_acceptance=None, tokens_per_step=2.57, mean_batch=2.0,
                selected_blocks=10, visible_blocks=14, kcache_mb_per_step=0.5,
                state_mb_per_step=0.05, indexer_mb_per_step=0.55)
    base.update(kw)
    return base


def _res(device="cpu", spin=None, dense=None):
    return {"model": {"compress_ratios": [0, 4, 128, 4], "index_topk": 64, "mtp_depth": 0,
                      "dtype": "float64"},
            "device": device, "device_name": "cpu" if device == "cpu" else "NVIDIA H200",
            "weights": "random (seeded)", "logits_backend": "native",
            "spin_config": {"target_sparsity": 0.5, "state_dtype": "float32"},
            "spin": spin or _side(), "all_keep": dense or _side(realized_sparsity=None,
                                                                 state_mb_per_step=0.0,
                                                                 indexer_mb_per_step=0.7),
            "token_agreement": 1.0, "identical_requests": 2, "requests": 2, "trace": None}


def _table(report):
    lines = report.splitlines()
    head = next(i for i, line in enumerate(lines) if "SPIN @" in line)
    end = next(i for i, line in enumerate(lines) if line.startswith("token agreement"))
    return lines[head], lines[head + 1:end]


@pytest.mark.parametrize("spin", [
    _side(),                                                    # no miss measured
    _side(mean_miss=0.273, p99_miss=0.5281),                    # "27.3% (52.8%)"
    _side(mean_miss=1.0, p99_miss=1.0, step_ms_median=123456.789, decode_steps=1234567),
])
def test_report_columns_line_up(spin):
    header, rows = _table(format_report(_res(spin=spin)))
    assert len(rows) == 9
    spin_end = header.index("SPIN @ 0.50") + len("SPIN @ 0.50")
    label_width = max(len(r.split("  ")[0]) for r in rows)
    for row in [header] + rows:
        assert len(row) == len(header), row
        assert row[-1] != " " and row[spin_end - 1] != " ", row       # right-aligned values
        assert row[spin_end:spin_end + 2] == "  ", row                  # columns apart
    for row in rows:
        assert row[label_width:label_width + 2] == "  ", row


def test_report_bytes_first_and_cpu_note():
    text = format_report(_res())
    lines = text.splitlines()
    first = lines[1]
    assert first.startswith("indexer bytes read+written per decode step (mean): SPIN 0.550 MB "
                            "(K cache 0.500 MB + state 0.050 MB) vs all-keep 0.700 MB = 0.79x")
    assert "not measured" in lines[2]
    flat = " ".join(text.split())                               # notes wrap at 96 columns
    assert all(len(line) <= 96 for line in lines if line.startswith(("  (", "* ")))
    assert "CPU: the step times below come from reference ops in plain PyTorch and are not " \
           "the point; the bytes figure is what carries over to a GPU" in flat
    assert "tokens per decode step (all requests)*" in text
    assert "with next_n 1 this is the mean batch size" in flat
    assert "with MTP it includes the accepted drafts" in flat
    assert "run with --measure-miss" in text
    assert "not the point" not in " ".join(format_report(_res(device="cuda:0")).split())


def test_cpu_demo_report(capsys):
    assert main(["demo", "--device", "cpu", "--requests", "2", "--prompt-tokens", "600",
                 "--new-tokens", "4", "--batch", "2", "--sparsity", "0.5", "--random-weights",
                 "--quiet"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = {key: next(i for i, line in enumerate(lines) if key in line)
          for key in ("indexer bytes read+written per decode step", "step time, median ms",
                      "CPU: the step times", "tokens per decode step")}
    assert at["indexer bytes read+written per decode step"] < at["step time, median ms"]
    assert at["CPU: the step times"] < at["step time, median ms"]
    assert "SPIN" in lines[at["indexer bytes read+written per decode step"]]


# ---- progress bars ------------------------------------------------------------------------
class _Bar:
    made: list = []

    def __init__(self, iterable=None, **kw):
        self.iterable, self.kw, self.n, self.postfix = iterable, kw, 0, []
        _Bar.made.append(self)

    def __iter__(self):
        for x in self.iterable:
            yield x
            self.n += 1

    def update(self, n=1):
        self.n += n

    def set_postfix_str(self, s):
        self.postfix.append(s)

    def set_postfix(self, **kw):
        self.postfix.append(str(kw))

    def close(self):
        pass


@pytest.fixture
def bars(monkeypatch):
    _Bar.made = []
    monkeypatch.setattr(tqdm_module, "tqdm", _Bar)
    monkeypatch.setattr(evaluate, "tqdm", _Bar)
    return _Bar.made


def test_engine_run_counts_decode_steps(bars):
    cfg = tiny()
    engine = Engine(cfg, None, weights=init_weights(cfg), max_batch=2)
    engine.run([Request(b"def f(x):\n    return x\n" * 3, max_new_tokens=4),
                Request(b"import os\n" * 5, max_new_tokens=3)], progress=True)
    (bar,) = bars
    assert bar.kw["unit"] == "step" and "decode" in bar.kw["desc"]
    assert bar.n == len(engine.history) > 0
    assert bar.postfix[-1].startswith("requests done 2/2")


def test_ablate_bars_name_the_variant(bars):
    trace = make_trace(steps=4, layers=2, start=60, block_size=8, index_topk=8)
    evaluate.run_study(trace, "reduction", [0.5], progress=True)
    names = [v for v, _ in evaluate.study_variants("reduction", SpinConfig(), 1)]
    assert [b.kw["desc"] for b in bars] == [f"reduction {v} ({i}/{len(names)})"
                                            for i, v in enumerate(names, 1)]


@pytest.mark.parametrize("study,needle", [
    ("reduction", "exploration forced to 0 in every variant (the config's 0.05 is not used)"),
    ("exploration", "exploration 0.05, 0 in variant none"),
    ("state_dtype", "exploration 0.05 in every variant"),
])
def test_ablate_prints_exploration(tmp_path, capsys, study, needle):
    path = str(make_trace(steps=4, layers=2, start=60, block_size=8, index_topk=8).save(
        tmp_path / "t.safetensors"))
    assert main(["ablate", path, "--study", study, "--sparsity", "0.5", "--quiet"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert needle in out[0] and out[1].startswith("trace")
