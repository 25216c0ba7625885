"""Issue 18: every hostile or careless CLI input exits 2 with exactly one stderr line (no
traceback), in bounded time and memory; output paths are checked before the work."""

import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from spin_trtllm import SpinConfig
from spin_trtllm._inputs import (CHECKPOINT_MAX_BYTES, CONFIG_MAX_BYTES, MAX_MESSAGE_CHARS,
                                 PROMPT_MAX_BYTES, TRACE_V2_MAX_BYTES, one_line, safe_yaml)
from spin_trtllm.cli import main
from spin_trtllm.config import MAX_INDEX_TOPK
from spin_trtllm.errors import SpinConfigError, SpinError

from spin_trtllm.testing.traces import make_trace

HUGE = "9223372036854775808"          # 2^63: the first int64 overflow


@pytest.fixture
def trace_file(tmp_path):
    return str(make_trace(steps=4, layers=1, start=40, block_size=8, index_topk=8).save(
        tmp_path / "t.safetensors"))


def run(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def bad(capsys, argv, needle=None):
    """rc 2, exactly one stderr line, no traceback; returns that line."""
    rc, _, err = run(capsys, argv)
    lines = err.splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    assert len(lines[0]) < MAX_MESSAGE_CHARS + 100, lines[0][:300]
    if needle is not None:
        assert needle in lines[0], lines[0]
    return lines[0]


def yaml_file(tmp_path, content, name="c.yaml"):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return str(path)


# ---- Config YAML --------------------------------------------------------------------------------
BAD_YAML = [
    ("1: 2\n", "keys must be strings"),
    ("null: 1\n", "keys must be strings"),
    ("true: 1\n", "keys must be strings"),
    ("0.5: 1\n", "keys must be strings"),
    ("spin:\n  1: 2\n", "keys must be strings"),
    ("? [a, b]\n: 1\n", "keys must be strings"),
    ("&a {spin: *a}\n", "aliases"),
    ("spin: &x {seed: 1}\nother: *x\n", "aliases"),
    ("[" * 5000 + "]" * 5000 + "\n", "nested deeper"),
    ("a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 200)), "nested deeper"),
    ("algorithm: [dsa]\n", "unknown key"),
    ("sparse_attention_config:\n  algorithm: [dsa]\n", "algorithm"),
    ("sparse_attention_config:\n  algorithm: {a: 1}\n", "algorithm"),
    ("seed: " + "9" * 5000 + "\n", "number of 5,000 characters"),
    ("ema_decay: 0." + "1" * 5000 + "\n", "number of"),
    ("index_topk: " + HUGE + "\n", "index_topk"),
    ("warmup_steps: " + HUGE + "\n", "warmup_steps"),
    ("seed: 1\n---\nseed: 2\n", "single document"),
    (b"seed: \xff\xfe\n", "not UTF-8"),
    ("seed: 1\n".encode("utf-16"), "UTF-16 LE"),
    (b"\xfe\xff" + "seed: 1\n".encode("utf-16-be"), "UTF-16 BE"),
    ("seed: 1\n".encode("utf-32"), "UTF-32 LE"),
    ("seed: \x00\n", "not valid YAML"),
    ("seed: !!python/object:os.system x\n", "not valid YAML"),
]


@pytest.mark.parametrize("content,needle", BAD_YAML)
def test_config_yaml_is_refused_in_one_line(tmp_path, trace_file, capsys, content, needle):
    path = yaml_file(tmp_path, content)
    bad(capsys, ["replay", trace_file, "--config", path, "--quiet"], needle)
    with pytest.raises(SpinConfigError, match=needle.split(" (")[0]):
        SpinConfig.from_yaml(path)


def test_a_utf8_bom_is_fine(tmp_path):
    path = yaml_file(tmp_path, b"\xef\xbb\xbfseed: 3\n")
    assert SpinConfig.from_yaml(path).seed == 3


@pytest.mark.parametrize("flag", ["--config", "--spin-config"])
def test_serve_yaml_inputs_are_checked(tmp_path, capsys, flag):
    path = yaml_file(tmp_path, "seed: 1\n".encode("utf-16"))
    bad(capsys, ["serve", "org/model", flag, path, "--algorithm", "dsa"], "UTF-16")
    path = yaml_file(tmp_path, "sparse_attention_config:\n  algorithm: [dsa]\n", "s.yaml")
    if flag == "--config":
        bad(capsys, ["serve", "org/model", flag, path], "algorithm")


def test_yaml_alias_expansion_is_bounded(tmp_path, trace_file, capsys):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 12)]
    lines += ["spin: {seed: *a11}"]
    path = yaml_file(tmp_path, "\n".join(lines) + "\n")
    t0 = time.monotonic()
    line = bad(capsys, ["replay", trace_file, "--config", path, "--quiet"], "aliases")
    assert time.monotonic() - t0 < 10 and len(line) < 400


def test_safe_yaml_accepts_plain_configs():
    assert safe_yaml("a: [1, 2.5, {b: c}]\n<<: {d: 1}\n", "x") == {"a": [1, 2.5, {"b": "c"}],
                                                                 "d": 1}
    with pytest.raises(SpinError, match="keys must be strings"):
        safe_yaml("{1: a}", "x")


def test_config_from_dict_rejects_non_string_keys():
    with pytest.raises(SpinConfigError, match="keys must be strings"):
        SpinConfig.from_dict({1: 2})
    with pytest.raises(SpinConfigError, match="keys must be strings"):
        SpinConfig.from_dict({"sparse_attention_config": {"algorithm": "dsa", "spin": {None: 1}}})
    with pytest.raises(SpinConfigError, match="algorithm"):
        SpinConfig.from_dict({"sparse_attention_config": {"algorithm": ["dsa"]}})


# ---- huge integers ------------------------------------------------------------------------------
def test_index_topk_upper_bound():
    assert SpinConfig(index_topk=MAX_INDEX_TOPK).index_topk == 1 << 20
    with pytest.raises(SpinConfigError, match="index_topk"):
        SpinConfig(index_topk=MAX_INDEX_TOPK + 1)
    with pytest.raises(SpinConfigError, match="warmup_steps"):
        SpinConfig(warmup_steps=1 << 31)


@pytest.mark.parametrize("argv", [
    ["replay", "{t}", "--index-topk", HUGE],
    ["replay", "{t}", "--index-topk", "1" + "0" * 40],
    ["replay", "{t}", "--index-topk", str(MAX_INDEX_TOPK + 1)],
    ["ablate", "{t}", "--study", "reduction", "--index-topk", HUGE + "0000"],
    ["compare-predictors", "{t}", "--index-topk", HUGE],
    ["compare-predictors", "{t}", "--index-topk", str(1 << 31)],
    ["replay", "{t}", "--mask-plot", "{d}/m.png", "--mask-slots", HUGE],
    ["replay", "{t}", "--mask-plot", "{d}/m.png", "--mask-layer", HUGE],
    ["replay", "{t}", "--block-size", HUGE],
    ["replay", "{t}", "--seed", HUGE],
    ["synth", "{d}/s.safetensors", "--steps", "2", "--index-topk", HUGE],
    ["synth", "{d}/s.safetensors", "--steps", "2", "--block-size", HUGE],
    ["synth", "{d}/s.safetensors", "--steps", "2", "--diagonal-bands", HUGE],
    ["demo", "--requests", HUGE],
    ["demo", "--prompt-tokens", HUGE],
    ["demo", "--new-tokens", HUGE],
    ["demo", "--batch", HUGE],
    ["demo", "--index-topk", HUGE],
    ["trace", "{d}/o.safetensors", "--held-out", HUGE],
    ["trace", "{d}/o.safetensors", "--prompt-tokens", HUGE],
    ["trace", "{d}/o.safetensors", "--steps", HUGE],
    ["trace", "{d}/o.safetensors", "--seed", HUGE],
    ["train-tiny", "--seq-len", HUGE],
    ["train-tiny", "--batch", HUGE],
    ["train-tiny", "--limit-bytes", "-5"],
    ["build", "org/m", "-o", "{d}/b", "--max-seq-len", HUGE],
    ["replay", "{t}", "--index-topk", "9" * 5000],
])
def test_huge_integers_exit_2(tmp_path, trace_file, capsys, argv):
    argv = [a.format(t=trace_file, d=tmp_path) for a in argv]
    extra = ["--quiet"] if argv[0] in ("replay", "ablate", "compare-predictors", "synth") else []
    bad(capsys, argv + extra)


def _trace_with_meta(tmp_path, **changes):
    t = make_trace(steps=3, layers=1, start=20)
    meta = {**t.metadata(), **changes}
    path = tmp_path / "meta.safetensors"
    save_file({"scores": t.scores, "row_len": t.row_len, "query_pos": t.query_pos}, str(path),
              metadata=meta)
    return str(path)


@pytest.mark.parametrize("key,value,needle", [
    ("index_topk", HUGE, "index_topk must be a positive integer <= 1048576"),
    ("index_topk", "9" * 5000, "index_topk must be an integer"),
    ("index_topk", "-1", "index_topk must be an integer"),
    ("index_topk", "1_000", "index_topk must be an integer"),
    ("index_topk", "\u0661\u0662", "index_topk must be an integer"),
    ("block_size", str(1 << 17), "block_size must be a positive integer <= 65536"),
    ("compress_ratio", HUGE, "compress_ratio"),
    ("next_n", HUGE, "next_n"),
    ("format", "x\ny" * 10000, "format"),
])
def test_trace_metadata_is_bounded(tmp_path, capsys, key, value, needle):
    path = _trace_with_meta(tmp_path, **{key: value})
    for cmd in (["info", path], ["replay", path, "--quiet"],
                ["compare-predictors", path, "--quiet"]):
        bad(capsys, cmd, needle)


def test_info_escapes_metadata(tmp_path, capsys):
    path = _trace_with_meta(tmp_path, source="line one\nline two")
    rc, out, _ = run(capsys, ["info", path])
    assert rc == 0 and "source=line one\\nline two" in out and len(out.splitlines()) == 2


# ---- device names -------------------------------------------------------------------------------
DEVICES = ["foo", "", "meta", "cuda:x", "cuda:-1", "cpu:0", "CPU", "cuda:99999", "cuda\n"]


@pytest.mark.parametrize("device", DEVICES + ["cuda"])
@pytest.mark.parametrize("cmd", [["demo", "--quiet"], ["trace", "{d}/o.safetensors"],
                                 ["train-tiny", "--seconds", "1"]])
def test_device_names(tmp_path, capsys, monkeypatch, device, cmd):
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("has CUDA")
    monkeypatch.chdir(tmp_path)
    line = bad(capsys, [a.format(d=tmp_path) for a in cmd] + ["--device", device], "--device")
    if device == "cuda":
        assert "no CUDA device" in line
    else:
        assert "use auto, cpu, cuda or cuda:N" in line


# ---- train-tiny ---------------------------------------------------------------------------------
@pytest.mark.parametrize("seconds", ["nan", "inf", "-inf", "0", "-1", "1e9"])
def test_train_tiny_seconds(tmp_path, capsys, monkeypatch, seconds):
    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    bad(capsys, ["train-tiny", "--seconds", seconds, "--device", "cpu"], "--seconds")
    assert time.monotonic() - t0 < 5


def _no_work(monkeypatch, module, name):
    def boom(*a, **k):
        raise AssertionError(f"{name} ran before the outputs were checked")
    monkeypatch.setattr(module, name, boom)


@pytest.mark.parametrize("extra,needle", [
    (["--json", "{d}/no/dir/r.json"], "--json"),
    (["--card", "{d}/no/dir/c.md"], "--card"),
    (["--out", "{d}/no/dir/m.safetensors"], "--out"),
    (["--out", "{d}"], "--out"),
    (["--out", "{d}/f/m.safetensors"], "--out"),      # under a regular file
    (["--out", "{d}/m.safetensors", "--card", "{d}/m.safetensors"], "--card"),
    (["--json", ""], "--json: empty path"),
])
def test_train_tiny_checks_outputs_before_training(tmp_path, capsys, monkeypatch, extra, needle):
    import spin_trtllm.harness.train as train_mod

    monkeypatch.chdir(tmp_path)
    (tmp_path / "f").write_text("x")
    _no_work(monkeypatch, train_mod, "train")
    _no_work(monkeypatch, train_mod, "stdlib_corpus")
    bad(capsys, ["train-tiny", "--seconds", "1", "--device", "cpu",
                 *[a.format(d=tmp_path) for a in extra]], needle)


def test_train_tiny_writes_to_the_working_directory(tmp_path, capsys, monkeypatch):
    from spin_trtllm.harness.pretrained import STDLIB_CHECKPOINT, train_outputs

    before = hashlib.sha256(STDLIB_CHECKPOINT.read_bytes()).hexdigest()
    monkeypatch.chdir(tmp_path)
    rc, out, _ = run(capsys, ["train-tiny", "--seconds", "1", "--seq-len", "64", "--batch", "1",
                              "--limit-bytes", "100000", "--device", "cpu"])
    assert rc == 0 and "wrote dsa_lite_stdlib.safetensors and MODEL_CARD.md" in out
    assert (tmp_path / "dsa_lite_stdlib.safetensors").is_file()
    assert (tmp_path / "MODEL_CARD.md").is_file()
    assert hashlib.sha256(STDLIB_CHECKPOINT.read_bytes()).hexdigest() == before
    ckpt, card = train_outputs(4)
    assert ckpt == Path("dsa_lite_stdlib_c4a.safetensors") and card == Path("MODEL_CARD_c4a.md")


# ---- output paths before the work ---------------------------------------------------------------
@pytest.mark.parametrize("argv,module,name", [
    (["replay", "{t}", "--json", "{d}/no/r.json"], "spin_trtllm.replay.evaluate", "replay"),
    (["replay", "{t}", "--plot", "{d}/no/p.png"], "spin_trtllm.replay.evaluate", "replay"),
    (["replay", "{t}", "--mask-plot", "{d}/no/m"], "spin_trtllm.replay.evaluate", "replay"),
    (["replay", "{t}", "--json", "{d}"], "spin_trtllm.replay.evaluate", "replay"),
    (["ablate", "{t}", "--study", "reduction", "--json", "{d}/no/a.json"],
     "spin_trtllm.replay.evaluate", "run_study"),
    (["ablate", "{t}", "--study", "reduction", "--plot", "{d}/no/a.png"],
     "spin_trtllm.replay.evaluate", "run_study"),
    (["ablate", "{t}", "{d}/missing.safetensors", "--study", "reduction"],
     "spin_trtllm.replay.evaluate", "run_study"),
    (["compare-predictors", "{t}", "--json", "{d}/no/c.json"],
     "spin_trtllm.replay.predictors", "compare_predictors"),
    (["compare-predictors", "{t}", "{d}/missing.safetensors"],
     "spin_trtllm.replay.predictors", "compare_predictors"),
    (["demo", "--json", "{d}/no/d.json", "--device", "cpu"],
     "spin_trtllm.harness.demo", "run_demo"),
    (["demo", "--dump-trace", "{d}/no/d.safetensors", "--device", "cpu"],
     "spin_trtllm.harness.demo", "run_demo"),
    (["trace", "{d}/no/o.safetensors", "--device", "cpu"], "spin_trtllm.harness.model",
     "load_checkpoint"),
    (["synth", "{d}/no/s.safetensors", "--steps", "2"], "spin_trtllm.replay.synth", "synthesize"),
])
def test_outputs_are_checked_before_the_work(tmp_path, trace_file, capsys, monkeypatch, argv,
                                             module, name):
    import importlib

    _no_work(monkeypatch, importlib.import_module(module), name)
    argv = [a.format(t=trace_file, d=tmp_path) for a in argv]
    bad(capsys, argv + (["--quiet"] if argv[0] != "trace" else []), "cannot")


@pytest.mark.parametrize("argv,needle", [
    (["replay", "{t}", "--json", ""], "--json: empty path"),
    (["replay", "{t}", "--config", ""], "--config: empty path"),
    (["replay", "{t}", "--plot", ""], "--plot: empty path"),
    (["replay", "{t}", "--mask-plot", ""], "--mask-plot: empty path"),
    (["ablate", "{t}", "--study", "reduction", "--json", ""], "--json: empty path"),
    (["compare-predictors", "{t}", "--json", ""], "--json: empty path"),
    (["replay", ""], "empty path"),
    (["demo", "--checkpoint", ""], "--checkpoint: empty path"),
    (["demo", "--dump-trace", ""], "--dump-trace: empty path"),
    (["demo", "--json", ""], "--json: empty path"),
    (["trace", "", "--device", "cpu"], "output: empty path"),
    (["trace", "{d}/o.safetensors", "--prompt-file", ""], "--prompt-file: empty path"),
    (["trace", "{d}/o.safetensors", "--checkpoint", ""], "--checkpoint: empty path"),
    (["synth", "", "--steps", "2"], "output: empty path"),
    (["build", "org/m", "-o", ""], "--output: empty path"),
    (["build", "org/m", "-o", "{d}/b", "--llmapi-model", ""], "--llmapi-model: empty path"),
    (["serve", "org/m", "--config", ""], "--config: empty path"),
    (["serve", "org/m", "--spin-config", ""], "--spin-config: empty path"),
])
def test_empty_paths_are_errors(tmp_path, trace_file, capsys, argv, needle):
    bad(capsys, [a.format(t=trace_file, d=tmp_path) for a in argv], needle)


# ---- plot paths ---------------------------------------------------------------------------------
def test_plot_paths_without_an_extension_print_the_file_written(tmp_path, trace_file, capsys):
    rc, _, err = run(capsys, ["replay", trace_file, "--sparsity", "0.5", "--quiet",
                              "--plot", str(tmp_path / "miss"),
                              "--mask-plot", str(tmp_path / "mask")])
    assert rc == 0
    for name in ("miss.png", "mask.png"):
        assert (tmp_path / name).stat().st_size > 1000
        assert f"wrote {tmp_path / name}" in err.splitlines()
    assert not (tmp_path / "miss").exists() and not (tmp_path / "mask").exists()
    bad(capsys, ["replay", trace_file, "--quiet", "--plot", str(tmp_path / "x.nope")],
        "unknown image format")


# ---- device files, fifos and sizes --------------------------------------------------------------
@pytest.fixture
def fifo(tmp_path):
    if not hasattr(os, "mkfifo"):
        pytest.skip("no fifos here")
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return str(path)


@pytest.mark.parametrize("argv,needle", [
    (["trace", "{d}/o.safetensors", "--prompt-file", "/dev/zero", "--device", "cpu"],
     "character device"),
    (["trace", "{d}/o.safetensors", "--prompt-file", "{fifo}", "--device", "cpu"], "a fifo"),
    (["replay", "{t}", "--config", "/dev/zero", "--quiet"], "character device"),
    (["replay", "{t}", "--config", "{fifo}", "--quiet"], "a fifo"),
    (["replay", "{fifo}", "--quiet"], "a fifo"),
    (["info", "/dev/zero"], "character device"),
    (["demo", "--checkpoint", "{fifo}", "--quiet", "--device", "cpu"], "a fifo"),
    (["serve", "org/m", "--config", "{fifo}"], "a fifo"),
    (["replay", "{t}", "--config", "{d}", "--quiet"], "a directory"),
    (["replay", "{t}", "--json", "{fifo}", "--quiet"], "a fifo"),
])
@pytest.mark.slow
def test_device_files_and_fifos_exit_2_quickly(tmp_path, trace_file, fifo, argv, needle):
    """In a subprocess with a timeout: a regression here would block or eat memory."""
    argv = [a.format(d=tmp_path, t=trace_file, fifo=fifo) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "spin_trtllm.cli", *argv], capture_output=True,
                          text=True, timeout=60)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, \
        proc.stderr[-2000:]
    assert needle in lines[0], lines[0]


def _sparse(path, size):
    with open(path, "wb") as f:
        f.truncate(size)
    return str(path)


def test_size_limits(tmp_path, trace_file, capsys):
    cfg = _sparse(tmp_path / "big.yaml", CONFIG_MAX_BYTES + 1)
    bad(capsys, ["replay", trace_file, "--config", cfg, "--quiet"], "over the limit of 256 KiB")
    prompt = _sparse(tmp_path / "big.txt", PROMPT_MAX_BYTES + 1)
    bad(capsys, ["trace", str(tmp_path / "o.safetensors"), "--prompt-file", prompt,
                 "--device", "cpu"], "over the limit of 16 MiB")
    ckpt = _sparse(tmp_path / "big.safetensors", CHECKPOINT_MAX_BYTES + 1)
    bad(capsys, ["demo", "--checkpoint", ckpt, "--device", "cpu"], "over the limit of 4 GiB")
    # over the larger (v2) limit: refused before the header is read (the v1 limit, 32 GiB, is
    # applied once the version is known: test_trace_v2.test_size_limit_depends_on_the_version)
    trace = _sparse(tmp_path / "huge.safetensors", TRACE_V2_MAX_BYTES + 1)
    bad(capsys, ["info", trace], "over the limit of 64 GiB")


# ---- newlines and long names in error text ------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["replay", "{t}", "--config", "{d}/no\nsuch.yaml", "--quiet"],
    ["replay", "{d}/no\nsuch.safetensors", "--quiet"],
    ["replay", "{t}", "--json", "{d}/no\ndir/x.json", "--quiet"],
    ["replay", "{t}", "--sparsity", "a\nb", "--quiet"],
    ["replay", "{t}", "--bogus\nflag", "--quiet"],
    ["demo", "--device", "cpu\n"],
    ["demo", "--checkpoint", "{d}/x\r\n\x1b[2Jy"],
    ["build", "org/m", "-o", "{d}/b", "--name", "a\nb"],
    ["build", "./x\ny", "-o", "{d}/b"],
])
def test_names_with_newlines_are_escaped(tmp_path, trace_file, capsys, argv):
    line = bad(capsys, [a.format(t=trace_file, d=tmp_path) for a in argv])
    assert "\\n" in line and "\x1b" not in line


def test_yaml_key_with_a_newline_is_escaped(tmp_path, trace_file, capsys):
    path = yaml_file(tmp_path, '"bad\\nkey": 1\n')
    line = bad(capsys, ["replay", trace_file, "--config", path, "--quiet"], "unknown key")
    assert "bad\\nkey" in line


def test_errors_are_never_megabytes(tmp_path, trace_file, capsys):
    path = yaml_file(tmp_path, "seed: '" + "x" * 200_000 + "'\n")
    line = bad(capsys, ["replay", trace_file, "--config", path, "--quiet"], "seed")
    assert len(line) < 400
    bad(capsys, ["replay", trace_file, "--sparsity", "x" * 1_000_000, "--quiet"],
        "characters in all")


def test_one_line():
    assert one_line("a\nb\r\tc\x00\u2028") == "a\\nb\\r\\tc\\x00\\u2028"
    long = one_line("\n" * 5000)
    assert len(long) < MAX_MESSAGE_CHARS + 40 and long.endswith("(5,000 characters in all)")


# ---- build --------------------------------------------------------------------------------------
def test_build_warns_on_a_model_folder_without_config_json(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()
    upstream = tmp_path / "model.py"            # else build warns that model.py needs it
    upstream.write_text("")
    known = ["--llmapi-model", str(upstream)]
    rc, _, err = run(capsys, ["build", str(empty), "-o", str(tmp_path / "b1"), *known])
    assert rc == 0 and len(err.splitlines()) == 1 and "warning" in err and "empty" in err
    (tmp_path / "org").mkdir()
    rc, _, err = run(capsys, ["build", "org/missing", "-o", str(tmp_path / "b2"), *known])
    assert rc == 0 and "warning" in err and "no such folder" in err
    (empty / "config.json").write_text("{}")
    rc, _, err = run(capsys, ["build", str(empty), "-o", str(tmp_path / "b3"), *known])
    assert rc == 0 and err == ""
    rc, _, err = run(capsys, ["build", "deepseek-ai/DeepSeek-V4-Flash", "-o", str(tmp_path / "b4"),
                              *known])
    assert rc == 0 and err == ""
    (tmp_path / "file").write_text("x")
    bad(capsys, ["build", str(tmp_path / "file"), "-o", str(tmp_path / "b5")], "not a folder")
    bad(capsys, ["build", "org/m", "-o", str(tmp_path / "file")], "not a directory")


# ---- work that grows with products of valid numbers ---------------------------------------------
@pytest.mark.parametrize("argv,module,name,needle", [
    (["demo", "--device", "cpu", "--batch", "256", "--prompt-tokens", "131072"],
     "spin_trtllm.harness.demo", "run_demo", "caches grow"),
    (["train-tiny", "--device", "cpu", "--batch", "1024", "--seq-len", "16384"],
     "spin_trtllm.harness.train", "train", "attention memory"),
    (["replay", "{t}", "--quiet", "--sparsity", *["0.5"] * 17],
     "spin_trtllm.replay.evaluate", "replay", "at most 16 values"),
])
def test_products_of_valid_numbers_are_bounded(tmp_path, trace_file, capsys, monkeypatch, argv,
                                               module, name, needle):
    import importlib

    monkeypatch.chdir(tmp_path)
    _no_work(monkeypatch, importlib.import_module(module), name)
    bad(capsys, [a.format(t=trace_file) for a in argv], needle)
