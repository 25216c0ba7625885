import json
import subprocess
import sys

import pytest

from spin_trtllm.cli import main
from spin_trtllm.replay.trace import SpinTrace

from spin_trtllm.testing.traces import make_trace


@pytest.fixture
def trace_file(tmp_path):
    return str(make_trace(steps=8, layers=2, start=300, block_size=16, index_topk=32).save(
        tmp_path / "t.safetensors"))


def test_replay_json_table_and_plots(tmp_path, trace_file, capsys):
    out = tmp_path / "r.json"
    rc = main(["replay", trace_file, "--sparsity", "0.3", "0.5", "--json", str(out), "--quiet",
               "--plot", str(tmp_path / "miss.png"), "--mask-plot", str(tmp_path / "mask.png")])
    assert rc == 0
    table = capsys.readouterr().out
    assert "realized" in table and "p99 miss" in table
    data = json.loads(out.read_text())
    assert [d["target_sparsity"] for d in data] == [0.3, 0.5]
    for d in data:
        assert d["trace"] == trace_file
        for key in ("realized_sparsity", "mean_miss", "p99_miss", "recall", "eligible_rows", "per_layer"):
            assert key in d
        # K and block size come from the trace's metadata
        assert d["config"]["index_topk"] == 32 and d["config"]["block_size"] == 16
    assert (tmp_path / "miss.png").stat().st_size > 1000
    assert (tmp_path / "mask.png").stat().st_size > 1000


def test_config_target_sparsity_used_when_no_flag(tmp_path, trace_file):
    cfg = tmp_path / "ts.yaml"
    cfg.write_text("target_sparsity: 0.2\n")
    out = tmp_path / "r.json"
    assert main(["replay", trace_file, "--config", str(cfg), "--json", str(out), "--quiet"]) == 0
    assert [d["target_sparsity"] for d in json.loads(out.read_text())] == [0.2]
    assert main(["replay", trace_file, "--config", str(cfg), "--sparsity", "0.5", "--json",
                 str(out), "--quiet"]) == 0
    assert [d["target_sparsity"] for d in json.loads(out.read_text())] == [0.5]


def test_replay_overrides(tmp_path, trace_file):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("spin:\n  index_topk: 64\n  ema_decay: 0.25\n")
    out = tmp_path / "r.json"
    assert main(["replay", trace_file, "--sparsity", "0.4", "--config", str(cfg),
                 "--exploration", "0", "--json", str(out), "--quiet"]) == 0
    (d,) = json.loads(out.read_text())
    assert d["config"]["index_topk"] == 64 and d["config"]["ema_decay"] == 0.25
    assert d["config"]["exploration"] == 0.0 and d["config"]["block_size"] == 16


@pytest.mark.parametrize("argv,needle", [
    (["replay", "{missing}"], "no such file"),
    (["replay", "{trace}", "--sparsity", "1.5"], "target sparsity 1.5"),
    (["replay", "{trace}", "--exploration", "2"], "exploration"),
    (["replay", "{trace}", "--config", "{badcfg}"], "unknown key"),
    (["replay", "{junk}"], "not a readable safetensors"),
    (["replay", "{trace}", "--sparsity", "abc"], "invalid float value"),
    (["ablate", "{trace}", "--study", "mtp"], "next_n > 1"),
    (["compare-predictors", "{missing}"], "no such file"),
    (["synth", "{tmp}/x.safetensors", "--steps", "0"], "steps"),
    (["bogus"], "invalid choice"),
    (["replay", "{trace}", "--mask-plot", "{tmp}/m.png", "--mask-slots", "0"], "--mask-slots"),
    (["replay", "{trace}", "--mask-plot", "{tmp}/m.png", "--mask-layer", "7"], "--mask-layer 7"),
    (["compare-predictors", "{trace}", "--index-topk", "-3"], "index_topk must be >= 1"),
    (["ablate", "{trace}", "--study", "exploration", "--exploration", "0"], "exploration > 0"),
    (["synth", "{tmp}/no/dir/x.safetensors", "--steps", "2", "--prompt-slots", "8"], "cannot write"),
    (["synth", "{tmp}/x.safetensors", "--steps", "3", "--prompt-slots", "100000000000"], "exceed the limit"),
])
@pytest.mark.slow
def test_bad_input_exit_2_one_line(tmp_path, trace_file, argv, needle):
    (tmp_path / "bad.yaml").write_text("spin: {target_sparsty: 0.3}\n")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    fill = {"missing": str(tmp_path / "nope.safetensors"), "trace": trace_file,
            "badcfg": str(tmp_path / "bad.yaml"), "junk": str(tmp_path / "junk.safetensors"),
            "tmp": str(tmp_path)}
    argv = [a.format(**fill) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "spin_trtllm.cli", *argv, "--quiet"]
                          if argv[0] in ("replay", "ablate", "compare-predictors", "synth")
                          else [sys.executable, "-m", "spin_trtllm.cli", *argv],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_synth_info_compare_ablate(tmp_path, capsys):
    path = tmp_path / "s.safetensors"
    assert main(["synth", str(path), "--steps", "12", "--layers", "2", "--prompt-slots", "600",
                 "--next-n", "2", "--seed", "3", "--quiet"]) == 0
    trace = SpinTrace.load(path)
    assert (trace.num_steps, trace.num_layers, trace.next_n) == (12, 2, 2)
    assert main(["info", str(path)]) == 0
    assert "12 steps" in capsys.readouterr().out
    out = tmp_path / "p.json"
    assert main(["compare-predictors", str(path), "--json", str(out), "--quiet"]) == 0
    assert "prev_iter" in json.loads(out.read_text())[0]["methods"]
    out = tmp_path / "a.json"
    assert main(["ablate", str(path), "--study", "mtp", "--sparsity", "0.5", "--json", str(out),
                 "--quiet"]) == 0
    assert len(json.loads(out.read_text())) == 4


@pytest.mark.slow
def test_demo_runs_dsa_lite_side_by_side(capsys, tmp_path):
    trace = tmp_path / "demo.safetensors"
    out_json = tmp_path / "demo.json"
    assert main(["demo", "--device", "cpu", "--requests", "3", "--prompt-tokens", "1400",
                 "--new-tokens", "12", "--batch", "2", "--mtp", "1", "--sparsity", "0.4",
                 "--measure-miss", "--dump-trace", str(trace), "--json", str(out_json),
                 "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "SPIN @ 0.40" in out and "all-keep" in out and "token agreement" in out
    res = json.loads(out_json.read_text())
    assert res["requests"] == 3 and res["spin"]["decode_steps"] > 0
    assert 0 < res["spin"]["realized_sparsity"] < 0.4
    assert res["spin"]["mean_miss"] is not None and res["all_keep"]["realized_sparsity"] is None
    # the bytes figure, each side from its own run: SPIN skipped blocks, all-keep has no state
    s, d = res["spin"], res["all_keep"]
    assert 0 < s["kcache_mb_per_step"] < d["kcache_mb_per_step"]
    assert s["state_mb_per_step"] > 0 and d["state_mb_per_step"] == 0
    assert d["selected_blocks"] == d["visible_blocks"] > 0
    assert d["kcache_mb_per_step"] == pytest.approx(
        d["visible_blocks"] * 64 * 132 / 1e6 / d["decode_steps"])
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if "indexer bytes" in line)
    assert first < next(i for i, line in enumerate(lines) if "SPIN @ 0.40" in line)
    flat = " ".join(out.split())
    assert "CPU: step and prefill times are in --json only" in flat
    assert "MTP it includes the accepted drafts" in flat and "MTP draft acceptance" in out
    assert "median ms" not in out and s["step_ms_median"] > 0
    assert main(["info", str(trace)]) == 0


@pytest.mark.parametrize("argv,msg", [
    (["demo", "--requests", "0"], "--requests must be >= 1"),
    (["demo", "--device", "cuda", "--quiet"], "no CUDA device"),
    (["demo", "--checkpoint", "/nonexistent.safetensors", "--quiet"], "not a readable"),
    # GPU-only flags on a CPU run are refused, not ignored
    (["demo", "--device", "cpu", "--cuda-graphs", "--quiet"],
     "--cuda-graphs needs a CUDA device (this run is on cpu)"),
    (["demo", "--device", "cpu", "--speed-size", "8", "4096", "--quiet"],
     "--speed-size needs a CUDA device"),
])
def test_demo_bad_options(argv, msg, capsys):
    if "cuda" in argv and __import__("torch").cuda.is_available():
        pytest.skip("has CUDA")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err
