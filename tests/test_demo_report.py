"""The demo: its figures (summarize), its report (what the CPU and the GPU show, numbers that
follow from the numbers beside them, the quoted GPU result against benchmarks/RESULTS.md, the
continuations), its workload defaults and CPU threads, and the progress bars of the demo,
Engine.run and ablate."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from spin_trtllm import SpinConfig
from spin_trtllm.cli import main
from spin_trtllm.costs import indexer_bytes, traffic_bytes
from spin_trtllm.harness import Engine, Request, init_weights, tiny
from spin_trtllm.harness import demo
from spin_trtllm.harness.demo import (DemoOptions, cpu_threads, run_engine,
                                      summarize, with_workload)
from spin_trtllm.harness.engine import RequestOutput, StepStats
from spin_trtllm.harness.report import GPU_RESULT, escaped, format_report, speed_lines
from spin_trtllm.limits import DEMO_WORKLOADS
from spin_trtllm.replay import evaluate

from spin_trtllm.testing.traces import make_trace

RESULTS_MD = Path(__file__).resolve().parent.parent / "benchmarks" / "RESULTS.md"


# ---- the bytes formula --------------------------------------------------------------------
def test_indexer_bytes_by_hand():
    # one request, one indexer layer: 3 visible blocks (192 slots), SPIN scores 2 (128 slots)
    # K cache: 128 slots x (128 fp8 bytes + 4 scale bytes) = 128 x 132
    # float32 state: select reads V and D of 192 slots: 192 x 8 = 1536; update reads V, D
    # (8), writes V, D (8) and reads the fp32 logit (4) of 128 slots: 128 x 20 = 2560
    assert indexer_bytes(2, 3, "float32") == (128 * 132, 192 * 8 + 128 * 20)
    # float16 state: 192 x 4 = 768 and 128 x (4 + 4 + 4) = 1536
    assert indexer_bytes(2, 3, "float16") == (16896, 768 + 1536)
    # all-keep reads the K cache of every visible block and has no state
    assert indexer_bytes(3, 3) == (192 * 132, 0)
    # the probe reads one 144-byte summary row per visible block and no V/D: its update writes
    # each scored block's int64 last step alone
    assert indexer_bytes(2, 3, "float32", "probe") == (16896 + 3 * 144, 2 * 8)
    # the hybrid reads both: the summary rows and select's V/D of the visible slots
    assert indexer_bytes(2, 3, "float32", "hybrid") == (16896 + 3 * 144, 1536 + 2560)
    assert indexer_bytes(0, 0, "float32") == (0, 0)


def test_traffic_bytes_by_hand():
    # the case above with two MTP rows: each row's fp32 logits of the 2 scored blocks (128
    # slots) are written once and read once by the top-K: 2 rows x 128 x 4 x 2
    assert traffic_bytes(2, 3, 2, "float16") == 16896 + 768 + 1536 + 2048
    # all-keep: the K cache of 3 blocks and one row's logits of their 192 slots
    assert traffic_bytes(3, 3, 1) == 192 * 132 + 192 * 8
    # 96 requests of 2,048 blocks, SPIN keeping half, fp16 state: SPIN moves 0.57 of all-keep's
    spin = traffic_bytes(96 * 1024, 96 * 2048, 1, "float16")
    dense = traffic_bytes(96 * 2048, 96 * 2048, 1)
    assert spin / dense == pytest.approx((1024 * 64 * (132 + 8 + 12) + 2048 * 64 * 4)
                                         / (2048 * 64 * (132 + 8)))
    assert 0.57 < spin / dense < 0.572
    with pytest.raises(ValueError, match="rows must be >= 1"):
        traffic_bytes(1, 1, 0)


# ---- summarize ----------------------------------------------------------------------------
def _engine(spin, steps, prefill_seconds=1.0):
    return SimpleNamespace(history=steps, spin=spin, time_indexer=True,
                           prefill_seconds=prefill_seconds, predictor="spin")


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


def test_summarize_serving_figures():
    # three steps of 2 requests, MTP: 5, 3 and 4 tokens emitted; one step much slower (a first
    # call), which the medians leave out; the shadow's time is not the step's
    hist = [StepStats(batch=2, seconds=0.9, accepted=3), StepStats(batch=2, seconds=0.1,
                                                                   accepted=1),
            StepStats(batch=2, seconds=0.25, shadow_seconds=0.05, accepted=2)]
    outs = {0: RequestOutput(0, [[7] * 7], "length"),                 # 1 prefill + 6 decode
            1: RequestOutput(1, [[8] * 4, [9] * 4], "length")}        # 2 prefills + 6 decode
    s = summarize(_engine(SpinConfig(), hist, prefill_seconds=0.6), outs, 0)
    assert s["prefills"] == 3 and s["decode_tokens"] == 12
    assert s["step_ms_median"] == pytest.approx(200.0)                # of 900, 100, 200
    assert s["tokens_per_step"] == pytest.approx(4.0) and s["mean_batch"] == 2.0
    assert s["tokens_per_s"] == pytest.approx(4.0 / 0.2)              # 20 tokens/s
    # a request gets 4 / 2 = 2 tokens a step: 100 ms each
    assert s["tpot_ms"] == pytest.approx(100.0)
    assert s["ttft_ms"] == pytest.approx(200.0)                       # 0.6 s / 3 prefills


# ---- the report ---------------------------------------------------------------------------
def _side(**kw):
    base = dict(decode_steps=14, step_ms_median=163.27, indexer_ms_median=65.98,
                cuda_graphs=False, prefill_s=30.81, prefills=5, realized_sparsity=0.291,
                mean_miss=None, p99_miss=None, miss_rows=0, mtp_acceptance=None,
                decode_tokens=36, tokens_per_step=2.57, mean_batch=2.0, tokens_per_s=15.74,
                tpot_ms=127.06, ttft_ms=6162.0, selected_blocks=10, visible_blocks=14,
                kcache_mb_per_step=0.5, state_mb_per_step=0.05, indexer_mb_per_step=0.55)
    base.update(kw)
    return base


def _res(device="cpu", spin=None, dense=None, **kw):
    res = {"model": {"compress_ratios": [0, 4, 128, 4], "index_topk": 64, "mtp_depth": 0,
                     "dtype": "float64"},
           "device": device, "device_name": "cpu" if device == "cpu" else "NVIDIA H200",
           "weights": "random (seeded)", "logits_backend": "native",
           "spin_config": {"target_sparsity": 0.5, "state_dtype": "float32"},
           "workload": {"prompt_tokens": [600, 450, 300], "turns": [1, 2, 1],
                        "new_tokens": [8, 4, 8], "arrival_steps": [0, 0, 6], "max_batch": 2},
           "spin": spin or _side(),
           "all_keep": dense or _side(realized_sparsity=None, state_mb_per_step=0.0,
                                      indexer_mb_per_step=0.7, kcache_mb_per_step=0.7,
                                      step_ms_median=150.0, tokens_per_s=17.13, tpot_ms=116.73),
           "token_agreement": 1.0, "identical_requests": 2, "requests": 2,
           "sample": {"request": 0, "prompt_tail": list(b"def f(x):\n    return"),
                      "spin": list(b" x + 1\n"), "all_keep": list(b" x + 2\n")},
           "speed": None, "trace": None}
    res.update(kw)
    return res


def _table(report):
    lines = report.splitlines()
    head = next(i for i, line in enumerate(lines) if "SPIN @" in line)
    end = next(i for i, line in enumerate(lines) if line.startswith("token agreement"))
    return lines[head], lines[head + 1:end]


def _cells(report) -> dict[str, list[str]]:
    """The table's rows: label -> value cells."""
    _, rows = _table(report)
    return {re.split(r"\s{2,}", r.strip())[0]: re.split(r"\s{2,}", r.strip())[1:] for r in rows}


def _num(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("%"))


@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
@pytest.mark.parametrize("spin", [
    _side(),                                                    # no miss measured
    _side(mean_miss=0.273, p99_miss=0.5281),                    # "27.3% (52.8%)"
    _side(mean_miss=1.0, p99_miss=1.0, step_ms_median=123456.789, decode_steps=1234567),
])
def test_report_columns_line_up(spin, device):
    header, rows = _table(format_report(_res(device, spin=spin)))
    spin_end = header.index("SPIN @ 0.50") + len("SPIN @ 0.50")
    label_width = max(len(r.split("  ")[0]) for r in rows)
    for row in [header] + rows:
        assert len(row) == len(header), row
        assert row[-1] != " " and row[spin_end - 1] != " ", row       # right-aligned values
        assert row[spin_end:spin_end + 2] == "  ", row                  # columns apart
    for row in rows:
        assert row[label_width:label_width + 2] == "  ", row


def test_cpu_report_shows_what_carries_over():
    text = format_report(_res(spin=_side(mean_miss=0.273, p99_miss=0.5281)))
    lines = text.splitlines()
    flat = " ".join(text.split())
    assert all(len(line) <= 96 for line in lines), [ln for ln in lines if len(ln) > 96]
    # the bytes figure comes before the table, and its ratio is the printed MB divided
    at = next(i for i, line in enumerate(lines) if line.startswith("indexer bytes"))
    assert at < next(i for i, line in enumerate(lines) if "SPIN @ 0.50" in line)
    m = re.search(r"SPIN ([\d.]+) MB vs all-keep ([\d.]+) MB = ([\d.]+)x", lines[at])
    assert float(m[3]) == pytest.approx(float(m[1]) / float(m[2]), abs=0.006)
    assert "SPIN: K cache 0.500 MB + state 0.050 MB" in flat
    # no CPU times in the text: they are in --json, and the report says why
    cells = _cells(text)
    assert not any("ms" in label or "prefill" in label or "tokens/s" in label for label in cells)
    assert "CPU: step and prefill times are in --json only" in flat
    assert set(cells) == {"decode steps", "tokens per decode step (all requests)*",
                          "realized block sparsity", "mean miss (p99)"}
    assert cells["mean miss (p99)"] == ["27.3% (52.8%)", "0.0%"]
    assert cells["realized block sparsity"] == ["29.1%", "0.0%"]
    assert "over the rows where it skipped any" in flat
    # what ran, and the GPU result quoted with where and when it was measured
    assert "served: 3 requests, prompts of 300-600 tokens, 1 with a second turn, 4-8 new " \
           "tokens a turn, up to 2 decoding together" in flat
    assert f"GPU speed, measured on {GPU_RESULT.machine}, {GPU_RESULT.date}" in flat
    assert "with next_n 1 this is the mean batch size" in flat
    assert "--measure-miss" not in flat
    assert "--measure-miss" in format_report(_res())            # no miss: how to get it


def test_quoted_gpu_result_is_in_results_md():
    """The report's GPU figures are benchmarks/RESULTS.md's, and its speedup follows from
    them."""
    results = " ".join(RESULTS_MD.read_text().split())
    q = GPU_RESULT
    row = re.search(r"\| dsa-lite step, ([^|]*), GPU time, all-keep / SPIN \| ([\d.]+) / "
                    r"([\d.]+) ms = \*\*([\d.]+)x\*\* \| ([\d-]+), (\w+) \|", results)
    assert row, "RESULTS.md's summary row of the dsa-lite step moved"
    assert q.shape.replace(" requests", "") == row[1]
    assert (q.all_keep_ms, q.spin_ms) == (float(row[2]), float(row[3]))
    assert q.date == row[5] and row[6] in q.commits
    suite = re.search(r"whole next_n 1 suite \(8 cases\) \| ([^|]*), never slower \| "
                      r"([\d-]+), (\w+) \|", results)
    assert suite and suite[1] == q.suite and suite[2] == q.date and suite[3] in q.commits
    machine = results[results.index("**Machine**"):results.index("**Set-up**")]
    assert all(part in machine for part in q.machine.split(", "))
    assert "H200" in q.machine
    text = " ".join(format_report(_res()).split())
    m = re.search(r"all-keep ([\d.]+) ms, SPIN at target sparsity 0.5 ([\d.]+) ms = ([\d.]+)x",
                  text)
    assert float(m[3]) == pytest.approx(float(m[1]) / float(m[2]), abs=0.006)
    assert float(m[3]) == pytest.approx(float(row[4]), abs=0.006)


def _speed(acc=0.0):
    run = lambda fwd, idx, sp: {"forward_ms": fwd, "indexer_ms": idx, "step_ms": fwd + 2,
                                "realized_sparsity": sp, "spin_steps": 12 if sp else 0,
                                "steps": 12, "accepted_per_step": acc}
    return {"batch": 96, "context_tokens": 524288, "switch": "auto",
            "null": run(20.0, 0.0, 0.0), "dense": run(32.0, 12.0, 0.0),
            "spin": run(28.0, 8.0, 0.5)}


def test_gpu_report_serving_figures_follow_from_the_rows():
    text = format_report(_res("cuda:0", speed=_speed()))
    assert all(len(line) <= 96 for line in text.splitlines())
    cells = _cells(text)
    for side in (0, 1):
        step = _num(cells["decode step, median ms"][side])
        per_step = _num(cells["tokens per decode step (all requests)*"][side])
        batch = _num(cells["mean batch (requests per step)"][side])
        assert _num(cells["decode tokens/s**"][side]) == pytest.approx(1e3 * per_step / step,
                                                                        abs=0.6)
        assert _num(cells["time per output token, ms**"][side]) == pytest.approx(
            step * batch / per_step, abs=0.02)
    assert cells["time to first token, ms**"] == ["6162.0", "6162.0"]
    flat = " ".join(text.split())
    assert "time to first token = prefill time per prompt or turn" in flat
    assert "CPU:" not in flat
    # this run measured the GPU: nothing quoted; without the step timing it is quoted
    assert "GPU speed, measured on" not in flat
    assert "GPU speed, measured on" in format_report(_res("cuda:0"))


@pytest.mark.parametrize("acc", [0.0, 0.5])
def test_speed_lines_throughput(acc):
    text = "\n".join(speed_lines(_speed(acc)))
    assert "96 requests x 524,288 tokens" in text and "131,072 indexer slots" in text
    assert "1.14x" in text and "0.67x" in text and "12/12" in text
    tokens = 96 * (1 + acc)                                     # per step, all requests
    assert re.search(rf"tokens per step\s+{tokens:.1f}\s+{tokens:.1f}", text)
    # SPIN's wall step is 30 ms, all-keep's 34 ms
    assert re.search(rf"decode tokens/s \(wall\)\s+{1e3 * tokens / 30:,.0f}\s+"
                     rf"{1e3 * tokens / 34:,.0f}", text)
    assert re.search(rf"time per output token, ms \(wall\)\s+{30 / (1 + acc):.2f}\s+"
                     rf"{34 / (1 + acc):.2f}", text)


def test_continuations_escaped_and_cut_at_whole_escapes():
    tokens = list('a"b\\c\n\x1bé'.encode()) + [0xff]
    assert escaped(tokens, 100) == 'a\\"b\\\\c\\n\\x1bé\\xff'
    # at most `limit` characters, never half an escape: 'a', '\\"' fit in 3, 'b' would be 4th
    assert escaped(tokens, 3) == 'a\\"'
    assert escaped(tokens, 4) == 'a\\"b'
    assert escaped(tokens, 5) == 'a\\"b'                       # '\\\\' takes two
    assert escaped(tokens, 7, tail=True) == "é\\xff"              # '\\x1b' would be 9
    text = format_report(_res())
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("request 0"))
    assert "the first 5 tokens agree" in lines[at]              # " x + " then 1 against 2
    assert lines[at + 1:at + 4] == ['  prompt    ..."def f(x):\\n    return"',
                                    '  SPIN      " x + 1\\n"',
                                    '  all-keep  " x + 2\\n"']
    same = _res(sample={"request": 0, "prompt_tail": [65], "spin": [66], "all_keep": [66]})
    assert "(escaped; identical)" in format_report(same)


# ---- workload, threads --------------------------------------------------------------------
def test_workload_defaults_by_device():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    o = with_workload(DemoOptions(), cpu)
    assert (o.requests, o.prompt_tokens, o.new_tokens, o.measure_miss) == (
        DEMO_WORKLOADS["cpu"].requests, DEMO_WORKLOADS["cpu"].prompt_tokens,
        DEMO_WORKLOADS["cpu"].new_tokens, DEMO_WORKLOADS["cpu"].measure_miss)
    o = with_workload(DemoOptions(new_tokens=5, measure_miss=False), gpu)
    assert (o.requests, o.prompt_tokens, o.new_tokens, o.measure_miss) == (
        DEMO_WORKLOADS["cuda"].requests, DEMO_WORKLOADS["cuda"].prompt_tokens, 5, False)
    # the GPU default is the workload the report was designed around; the CPU's is smaller
    assert DEMO_WORKLOADS["cuda"].prompt_tokens > DEMO_WORKLOADS["cpu"].prompt_tokens


def test_cpu_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with cpu_threads(torch.device("cpu")):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    monkeypatch.setenv("OMP_NUM_THREADS", "3")                   # the user's choice stands
    with cpu_threads(torch.device("cpu")):
        assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError):
        with cpu_threads(torch.device("cpu")):
            raise RuntimeError("restored after an error too")
    assert torch.get_num_threads() == before


def test_the_report_says_why_spin_equals_all_keep():
    """A switch that never ran SPIN, or a budget that kept every block, reads as such, not as
    a SPIN column equal to all-keep's with no word."""
    from spin_trtllm.harness.report import skipped_nothing_lines

    res = {"model": {"index_topk": 256},
           "spin": {"decode_steps": 30, "spin_steps": 0, "realized_sparsity": 0.0}}
    assert "the switch ran all-keep at every step" in " ".join(skipped_nothing_lines(res))
    # asked for all-keep: no cost model to blame
    assert skipped_nothing_lines(dict(res, switch="dense")) == \
        ["(--switch dense: the SPIN engine ran all-keep at every step)"]
    res["spin"]["spin_steps"] = 30
    assert "SPIN skipped no block: its budget keeps at least K = 256 slots" in \
        " ".join(skipped_nothing_lines(res))
    res["spin"]["realized_sparsity"] = 0.3
    assert skipped_nothing_lines(res) == []
    res["spin"].update(decode_steps=0, spin_steps=0, realized_sparsity=None)   # no decode step
    assert skipped_nothing_lines(res) == []


# ---- the demo end to end ------------------------------------------------------------------
@pytest.mark.slow
def test_cpu_demo_report(capsys, tmp_path):
    out_json = tmp_path / "d.json"
    assert main(["demo", "--device", "cpu", "--requests", "3", "--prompt-tokens", "600",
                 "--new-tokens", "6", "--batch", "2", "--sparsity", "0.5", "--random-weights",
                 "--json", str(out_json), "--quiet"]) == 0
    text = capsys.readouterr().out
    res = json.loads(out_json.read_text())
    lines = text.splitlines()
    at = {key: next(i for i, line in enumerate(lines) if key in line)
          for key in ("indexer bytes read+written per decode step", "SPIN @ 0.50",
                      "token agreement", "request 0, greedy continuations",
                      "GPU speed, measured on")}
    assert list(at.values()) == sorted(at.values())
    s, d = res["spin"], res["all_keep"]
    # the printed figures are the JSON's
    m = re.search(r"SPIN ([\d.]+) MB vs all-keep ([\d.]+) MB = ([\d.]+)x", text)
    assert float(m[1]) == pytest.approx(s["indexer_mb_per_step"], abs=5e-4)
    assert float(m[2]) == pytest.approx(d["indexer_mb_per_step"], abs=5e-4)
    assert float(m[3]) == pytest.approx(s["indexer_mb_per_step"] / d["indexer_mb_per_step"],
                                        abs=5e-3)
    # the CPU default measures the miss; the times stay in the JSON
    assert s["mean_miss"] is not None and "mean miss (p99)" in text
    assert s["step_ms_median"] > 0 and s["prefill_s"] > 0 and "median ms" not in text
    # the sample is request 0's, both continuations of its one turn
    assert len(res["sample"]["spin"]) == len(res["sample"]["all_keep"]) == 6
    assert res["workload"]["prompt_tokens"] == [600, 450, 300]
    assert res["workload"]["cpu_threads"] in (1, torch.get_num_threads())


# ---- progress bars ------------------------------------------------------------------------


def test_engine_run_bars_have_totals(bars):
    cfg = tiny()
    engine = Engine(cfg, None, weights=init_weights(cfg), max_batch=2)
    p0, p1, turn = b"def f(x):\n    return x\n" * 3, b"import os\n" * 5, b"# more\n"
    out = engine.run([Request(p0, max_new_tokens=4),
                      Request(p1, max_new_tokens=3, turns=[turn])], progress=True)
    prefill, decode = bars
    assert "prefill" in prefill.kw["desc"] and "decode" in decode.kw["desc"]
    # every prompt token, and each later turn's prompt with the previous turn's last token
    assert prefill.total == prefill.n == len(p0) + len(p1) + len(turn) + 1
    # each turn's first token comes from its prefill
    assert decode.total == (4 - 1) + 2 * (3 - 1)
    assert decode.n == decode.total == sum(len(o.tokens) - len(o.turns) for o in out)
    assert decode.postfix[-1] == f"step {len(engine.history)}, batch 1, requests done 2/2"
    assert engine.on_prefill is None                            # unhooked after the run


def test_demo_bars_have_totals(bars):
    cfg = tiny().with_overrides(max_context=1024)
    opts = DemoOptions(device="cpu", requests=3, prompt_tokens=300, new_tokens=5, max_batch=2,
                       measure_miss=False)
    engine, outs = run_engine(cfg, None, init_weights(cfg), torch.device("cpu"), opts,
                              "all-keep")
    prefill, decode = bars
    assert (prefill.kw["desc"], decode.kw["desc"]) == ("all-keep prefill", "all-keep decode")
    reqs = [r for _, r in demo.workload(opts, cfg)]
    assert prefill.total == prefill.n == sum(len(r.prompt) + sum(len(t) + 1 for t in r.turns)
                                             for r in reqs)
    assert decode.total == decode.n == sum((1 + len(r.turns)) * (r.max_new_tokens - 1)
                                           for r in reqs)
    assert decode.postfix[-1].endswith("requests done 3/3")


def test_gpu_step_timing_bar_counts_every_step(bars, monkeypatch):
    """run_speed's code path without a GPU: each engine's steps move one bar with a total."""
    import contextlib

    calls = []

    def fake_measure(cfg, weights, name, context, batch, warmup, steps, backend, spin,
                     on_step):
        calls.append(name)
        for _ in range(warmup + steps):
            on_step()
        fwd = {"null": 20.0, "dense": 32.0}.get(name, 28.0)
        return {"forward_ms": fwd, "steps": steps}

    monkeypatch.setattr(demo, "measure", fake_measure)
    monkeypatch.setattr(demo, "init_weights", lambda cfg: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 ** 12, 10 ** 12))
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    opts = DemoOptions(speed=(8, 32768))
    sp = demo.run_speed(SpinConfig(target_sparsity=0.5), opts, torch.device("cuda"))
    (bar,) = bars
    assert calls == ["null", "dense", "auto"]
    assert bar.total == bar.n == 3 * (4 + 12)
    assert bar.postfix == ["indexer null", "indexer dense", "indexer auto"]
    assert (sp["batch"], sp["context_tokens"], sp["switch"]) == (8, 32768, "auto")
    assert (sp["dense"]["indexer_ms"], sp["spin"]["indexer_ms"]) == (12.0, 8.0)


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
