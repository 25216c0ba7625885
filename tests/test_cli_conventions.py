"""The command line follows the conventions users know: --version, every option's default in
its help (in words of the command it is shown for), a --help that imports nothing heavy,
`build` saying what to run next, `train-tiny` within --seconds with a progress bar, outputs
with the usual mode, and a Triton client that runs with what the `triton` extra installs."""

import argparse
import ast
import dataclasses
import os
import re
import runpy
import stat
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from spin_trtllm.cli import build_parser, main
from spin_trtllm.limits import LLMAPI_MODEL_ENV

ROOT = Path(__file__).resolve().parents[1]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"spin-trtllm": parser, **action.choices}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


# ---- --version ----------------------------------------------------------------------------------
def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"spin-trtllm {metadata.version('spin-trtllm')}\n"
    assert main(["--version"]) == 0


def test_the_version_has_one_home():
    import spin_trtllm

    project = pyproject()
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "spin_trtllm.__version__"}
    assert metadata.version("spin-trtllm") == spin_trtllm.__version__


# ---- help ---------------------------------------------------------------------------------------
def shown(value) -> str:
    if isinstance(value, (list, tuple)):
        return " ".join(shown(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


@pytest.mark.parametrize("command", list(subcommands()))
def test_every_option_states_its_default(command):
    """Each option that takes a value says what it is when left out; one with a value default
    names that value."""
    parser = subcommands()[command]
    checked = 0
    for action in parser._actions:
        if not action.option_strings or action.required or action.nargs == 0:
            continue                     # positionals, required options, on/off flags
        text = action.help or ""
        flag = action.option_strings[-1]
        assert re.search(r"\bdefault\b", text, re.IGNORECASE), f"{command} {flag}: {text!r}"
        if action.default is not None:
            assert shown(action.default) in text, f"{command} {flag}: {text!r}"
        checked += 1
    assert checked or command in ("info", "spin-trtllm")


def test_help_belongs_to_its_command():
    """The config flags are shared: K comes from the trace only where there is one."""
    helps = {name: p.format_help() for name, p in subcommands().items()}
    for name in ("replay", "ablate", "compare-predictors"):
        assert "trace's metadata" in helps[name]
    for name in ("demo", "build", "serve", "train-tiny", "trace", "synth"):
        assert "trace's metadata" not in helps[name], name
    assert "--spin-config's" in helps["serve"] and "--config's, else" not in helps["serve"]


def test_synth_flags_are_the_dataclass_fields():
    """synth's flags come from SynthConfig (its torch-free module): they must be the
    dataclass's fields, types and defaults."""
    from spin_trtllm.replay.synth import SynthConfig

    synth = subcommands()["synth"]
    flags = [(a.dest, a.type, a.default) for a in synth._actions
             if a.option_strings and a.dest not in ("help", "quiet")]
    assert flags == [(f.name, type(f.default), f.default) for f in dataclasses.fields(SynthConfig)]


def test_help_imports_nothing_heavy():
    """--help builds the parser: torch, pydantic and matplotlib take seconds to import."""
    code = ("import sys\nfrom spin_trtllm.cli import build_parser\nbuild_parser()\n"
            "print(sorted(m for m in ('torch', 'pydantic', 'matplotlib', 'numpy') "
            "if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["--help"], ["train-tiny", "--help"], ["build", "--help"]])
def test_help_exits_0(argv, capsys):
    assert main(argv) == 0
    assert "usage: spin-trtllm" in capsys.readouterr().out


# ---- build ---------------------------------------------------------------------------------------
@pytest.fixture
def no_trtllm(monkeypatch):
    import spin_trtllm.integrations.trtllm.bundle as bundle

    monkeypatch.setattr(bundle, "find_llmapi_model", lambda: "")
    monkeypatch.delenv(LLMAPI_MODEL_ENV, raising=False)


def test_build_prints_the_next_commands_and_what_model_py_needs(tmp_path, capsys, no_trtllm,
                                                                monkeypatch):
    out = tmp_path / "bundle"
    assert main(["build", "org/model", "-o", str(out), "--name", "m1"]) == 0
    printed, err = capsys.readouterr()
    assert f"spin-trtllm serve org/model --config {out / 'llm_api_options.yaml'}" in printed
    triton = next(line for line in printed.splitlines()
                  if "tritonserver --model-repository" in line)
    assert f"{LLMAPI_MODEL_ENV}=" in triton and str(out / "triton_model_repo") in triton
    assert "--model m1" in printed and "client.py" in printed
    warning = [line for line in err.splitlines() if "warning" in line]
    assert len(warning) == 1 and LLMAPI_MODEL_ENV in warning[0] and "Triton load" in warning[0]

    # model.py's own error says which variable to set, and where
    deferred = type(sys)("deferred")
    deferred.activate_on_import = lambda: None
    monkeypatch.setitem(sys.modules, "spin_trtllm.integrations.trtllm.deferred", deferred)
    with pytest.raises(RuntimeError) as err:
        runpy.run_path(str(out / "triton_model_repo" / "m1" / "1" / "model.py"))
    assert LLMAPI_MODEL_ENV in str(err.value) and "tritonserver's environment" in str(err.value)


def test_build_with_the_llmapi_model_needs_no_variable(tmp_path, capsys, no_trtllm):
    upstream = tmp_path / "model.py"
    upstream.write_text("class TritonPythonModel:\n    pass\n")
    assert main(["build", "org/model", "-o", str(tmp_path / "b"),
                 "--llmapi-model", str(upstream)]) == 0
    printed, err = capsys.readouterr()
    assert "tritonserver --model-repository" in printed and LLMAPI_MODEL_ENV not in printed
    assert "warning" not in err


# ---- train-tiny ----------------------------------------------------------------------------------
@pytest.fixture
def one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)             # a busy 2-core machine slows 2 threads down 10x
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_train_tiny_ends_within_seconds(tmp_path, capsys, monkeypatch, one_thread):
    """Each forward sleeps, so the held-out evaluation (8 forwards) costs as much as several
    training steps: it must come out of --seconds, not be added to it. Outputs get 0666 less
    the umask."""
    import json

    import spin_trtllm.harness.train as train_mod

    forward, run = train_mod.sequence_forward, train_mod.train

    def slow_forward(*args, **kw):
        time.sleep(0.15)
        return forward(*args, **kw)

    took = []

    def timed(*args, **kw):
        start = time.monotonic()
        try:
            return run(*args, **kw)
        finally:
            took.append(time.monotonic() - start)

    import torch

    # torch's first optimizer imports torch._dynamo (seconds): a one-time cost of the process
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    monkeypatch.setattr(train_mod, "sequence_forward", slow_forward)
    monkeypatch.setattr(train_mod, "train", timed)
    seconds = 3.0
    old = os.umask(0o027)
    try:
        rc = main(["train-tiny", "--seconds", str(seconds), "--seq-len", "64", "--batch", "1",
                   "--limit-bytes", "100000", "--device", "cpu",
                   "--out", str(tmp_path / "m.safetensors"), "--card", str(tmp_path / "m.md"),
                   "--json", str(tmp_path / "r.json")])
    finally:
        os.umask(old)
    out, err = capsys.readouterr()
    assert rc == 0, err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["steps"] >= 2 and report["train"]["eval_batches"] >= 1
    assert took[0] <= seconds + 0.5, (took, report["seconds"], report["eval_seconds"])
    assert re.search(r"train: .*\d+/3 s, step \d+, (dense|sparse), loss [0-9.]+ bpb", err), err
    for name in ("m.safetensors", "m.md", "r.json"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o640, name


def test_synth_output_gets_the_umask_mode(tmp_path, capsys):
    old = os.umask(0o027)
    try:
        rc = main(["synth", str(tmp_path / "t.safetensors"), "--steps", "2", "--layers", "1",
                   "--prompt-slots", "64", "--quiet"])
    finally:
        os.umask(old)
    assert rc == 0, capsys.readouterr().err
    assert stat.S_IMODE(os.stat(tmp_path / "t.safetensors").st_mode) == 0o640


# ---- the Triton client ---------------------------------------------------------------------------
def test_the_client_imports_what_the_triton_extra_installs():
    """examples/trtllm/client.py's tritonclient protocol modules are extras of the
    tritonclient that `pip install "spin-trtllm[triton]"` asks for."""
    extras = set()
    for req in pyproject()["project"]["optional-dependencies"]["triton"]:
        m = re.fullmatch(r"tritonclient\[([\w,\s]+)\].*", req)
        if m:
            extras |= {e.strip() for e in m.group(1).split(",")}
    client = ROOT / "examples" / "trtllm" / "client.py"
    tree = ast.parse(client.read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
    protocols = {name.split(".")[1] for name in names
                 if name.startswith("tritonclient.") and name.split(".")[1] in ("grpc", "http")}
    assert protocols and protocols <= (extras if "all" not in extras else {"grpc", "http"})
    # and the commands shown use the port of that protocol (gRPC 8001, HTTP 8000)
    port = {"grpc": "8001", "http": "8000"}[protocols.pop()]
    for doc in (client, ROOT / "docs" / "trtllm.md"):
        assert re.findall(r"client\.py --url localhost:(\d+)", doc.read_text()) == [port], doc
