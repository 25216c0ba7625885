"""Nothing the user had is lost: every output is written whole or not at all, never onto an
input, another output, the package or through a planted link (spin_trtllm/_outputs.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spin_trtllm._outputs import PACKAGE_DIR, check_plan, write_output
from spin_trtllm.errors import SpinError
from spin_trtllm.harness.pretrained import STDLIB_CHECKPOINT

CLI = [sys.executable, "-m", "spin_trtllm.cli"]


def run_cli(argv, cwd, timeout=120, **kw):
    proc = subprocess.run([*CLI, *map(str, argv)], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, **kw)
    return proc.returncode, proc.stdout, proc.stderr


def hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (links as their target text)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            out[str(p)] = "link:" + os.readlink(p)
        elif p.is_file():
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_refused(rc, err, *words):
    assert rc == 2, err
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    for w in words:
        assert w in err, err


def mknod(path: Path, minor: int) -> Path:
    """A private node of the kernel's mem driver (3: null, 7: full), never the system's."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, minor))
    except (PermissionError, OSError) as err:
        pytest.skip(f"cannot make a device node here ({err.strerror})")
    return path


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trace")
    rc, _, err = run_cli(["synth", folder / "t.safetensors", "--steps", 6, "--layers", 1,
                          "--prompt-slots", 256, "--quiet"], folder)
    assert rc == 0, err
    return folder / "t.safetensors"


# ---- the writer -------------------------------------------------------------------------------
def test_new_file_gets_umask_mode_and_replaced_file_keeps_its_mode(tmp_path):
    old = os.umask(0o027)
    try:
        write_output(tmp_path / "new.json", "--json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "new.json").st_mode) == 0o640
    keep = tmp_path / "keep.json"
    keep.write_text("old")
    os.chmod(keep, 0o604)
    write_output(keep, "--json", "new")
    assert keep.read_text() == "new"
    assert stat.S_IMODE(os.stat(keep).st_mode) == 0o604
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.json", "new.json"]


def test_symlink_stays_a_link_and_its_target_is_replaced(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to("real.json")
    write_output(link, "--json", "new")
    assert link.is_symlink() and os.readlink(link) == "real.json"
    assert target.read_text() == "new"


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"), RuntimeError("x"),
                                   KeyboardInterrupt()])
def test_failed_or_interrupted_writer_leaves_the_old_file(tmp_path, error):
    path = tmp_path / "plot.png"
    path.write_bytes(b"good old image")

    def writer(tmp):
        Path(tmp).write_bytes(b"half")
        raise error

    with pytest.raises((SpinError, RuntimeError, KeyboardInterrupt)):
        write_output(path, "--plot", writer=writer)
    assert path.read_bytes() == b"good old image"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]


def test_interrupt_right_after_the_temporary_is_created_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C lands once the temporary exists but before its descriptor is kept (inside
    tempfile.mkstemp it could): the temporary is still removed and the old file stays."""
    path = tmp_path / "r.json"
    path.write_text("old")
    real_open = os.open

    def open_then_interrupt(name, flags, *args):
        fd = real_open(name, flags, *args)
        if str(name).endswith(".partial"):
            os.close(fd)
            raise KeyboardInterrupt
        return fd

    monkeypatch.setattr(os, "open", open_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_output(path, "--json", "new")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_ctrl_c_during_an_import_is_delivered_after_it(tmp_path, monkeypatch):
    """The CLI's SIGINT handler raises KeyboardInterrupt, except inside an import (a C extension
    running it there may abort the process): then it sends SIGINT again shortly, one retry at a
    time; a second Ctrl-C while one is pending leaves at once (exit 130)."""
    from spin_trtllm import cli

    timers = []

    class Timer:
        def __init__(self, delay, fn):
            self.delay, self.fn, self.started, self.daemon = delay, fn, False, False
            timers.append(self)

        def start(self):
            self.started = True

    class Left(Exception):
        pass

    def early(signum, frame):
        raise Left

    monkeypatch.setattr(cli.threading, "Timer", Timer)
    monkeypatch.setattr(cli, "_early_interrupt", early)
    monkeypatch.setattr(cli, "_retry", None)
    sent = []
    monkeypatch.setattr(cli.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    (tmp_path / "interrupted_import.py").write_text(
        "import sys\nfrom spin_trtllm import cli\ncli._on_interrupt(2, sys._getframe())\n"
        "try:\n    cli._on_interrupt(2, sys._getframe())\nexcept Exception as e:\n"
        "    second = type(e).__name__\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import interrupted_import                       # the handler runs twice inside the import
    assert len(timers) == 1 and timers[0].started and timers[0].delay == cli._RETRY_S
    assert interrupted_import.second == "Left"
    timers[0].fn()                                  # the retry fires: SIGINT again, none pending
    assert sent == [(os.getpid(), signal.SIGINT)] and cli._retry is None
    with pytest.raises(KeyboardInterrupt):
        cli._on_interrupt(2, sys._getframe())       # outside an import: at once
    assert len(timers) == 1


def test_device_is_written_through_and_its_errors_reported(tmp_path):
    null = mknod(tmp_path / "null", 3)
    write_output(null, "--json", "x" * 100_000)
    assert stat.S_ISCHR(os.stat(null).st_mode)           # still the device
    write_output(null, "trace", writer=lambda tmp: Path(tmp).write_bytes(b"y" * 3_000_000))
    full = mknod(tmp_path / "full", 7)
    with pytest.raises(SpinError, match="No space left on device"):
        write_output(full, "--json", "{}")
    with pytest.raises(SpinError, match="No space left on device"):
        write_output(full, "trace", writer=lambda tmp: Path(tmp).write_bytes(b"y" * 1000))
    assert stat.S_ISCHR(os.stat(full).st_mode)


@pytest.mark.parametrize("kind", ["dir", "fifo", "socket", "slash", "under-file"])
def test_non_files_are_refused(tmp_path, kind):
    path = tmp_path / "x"
    if kind == "dir":
        path.mkdir()
    elif kind == "slash":
        path = str(tmp_path / "new.json") + "/"
    elif kind == "under-file":
        path.write_text("a file")
        path = path / "x.json"
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        import socket

        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
    with pytest.raises(SpinError, match="cannot write"):
        write_output(path, "--json", "{}")


def test_plan_refuses_aliases_collisions_and_the_package(tmp_path):
    src = tmp_path / "in.safetensors"
    src.write_bytes(b"data")
    (tmp_path / "hard").hardlink_to(src)
    (tmp_path / "soft").symlink_to(src)
    for alias in (src, tmp_path / "hard", tmp_path / "soft", tmp_path / "." / "in.safetensors"):
        with pytest.raises(SpinError, match="is the input TRACE"):
            check_plan([("--json", alias)], [("TRACE", src)])
    with pytest.raises(SpinError, match="is also --json"):
        check_plan([("--json", tmp_path / "a"), ("--plot", tmp_path / "sub" / ".." / "a")])
    (tmp_path / "sub").mkdir()
    with pytest.raises(SpinError, match="installed spin_trtllm package"):
        check_plan([("--out", PACKAGE_DIR / "data" / "new.safetensors")])
    null = mknod(tmp_path / "null", 3)
    check_plan([("--json", null), ("--plot", null)], [("TRACE", src)])   # a device may be shared


# ---- the CLI: data-loss cases, each with every pre-existing file hashed before and after -------
@pytest.mark.slow
def test_cli_never_writes_onto_an_input(tmp_path, trace):
    shutil.copy(trace, tmp_path / "t.safetensors")
    shutil.copy(STDLIB_CHECKPOINT, tmp_path / "ck.safetensors")
    (tmp_path / "prompt.txt").write_text("def f(x):\n    return x\n" * 200)
    (tmp_path / "soft.safetensors").symlink_to("t.safetensors")
    (tmp_path / "hard.safetensors").hardlink_to(tmp_path / "t.safetensors")
    before = hashes(tmp_path)
    cases = [
        (["replay", "t.safetensors", "--json", "t.safetensors"], "is the input TRACE"),
        (["replay", "soft.safetensors", "--json", "hard.safetensors"], "is the input TRACE"),
        (["trace", "ck.safetensors", "--checkpoint", "ck.safetensors", "--device", "cpu"],
         "is the input --checkpoint"),
        (["demo", "--device", "cpu", "--checkpoint", "ck.safetensors", "--dump-trace",
          "ck.safetensors"], "is the input --checkpoint"),
        (["trace", "prompt.txt", "--prompt-file", "prompt.txt", "--device", "cpu"],
         "is the input --prompt-file"),
        (["demo", "--device", "cpu", "--dump-trace", STDLIB_CHECKPOINT], "installed spin_trtllm"),
        (["synth", PACKAGE_DIR / "cli" / "__init__.py"], "installed spin_trtllm"),
        (["train-tiny", "--device", "cpu", "--out", STDLIB_CHECKPOINT], "installed spin_trtllm"),
        (["replay", "t.safetensors", "--json", "q.png", "--plot", "q.png"], "is also --json"),
        (["replay", "t.safetensors", "--plot", "p.png", "--mask-plot", "p"], "is also --plot"),
        (["train-tiny", "--device", "cpu", "--out", "m.st", "--json", "m.st"], "is also --out"),
    ]
    for argv, words in cases:
        rc, _, err = run_cli(argv, tmp_path, timeout=60)
        assert_refused(rc, err, words)
        assert hashes(tmp_path) == before, argv
    # the same trace twice (by a link) is two inputs, not an output: still allowed
    rc, out, err = run_cli(["info", "t.safetensors", "hard.safetensors"], tmp_path)
    assert rc == 0, err
    assert hashes(tmp_path) == before


def test_cli_mask_plots_of_traces_with_one_stem_collide(tmp_path, trace):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    shutil.copy(trace, tmp_path / "a" / "t.safetensors")
    shutil.copy(trace, tmp_path / "b" / "t.safetensors")
    rc, _, err = run_cli(["replay", "a/t.safetensors", "b/t.safetensors", "--mask-plot", "m",
                          "--quiet"], tmp_path)
    assert_refused(rc, err, "m-t.png", "is also --mask-plot")
    assert not list(tmp_path.glob("m*"))


@pytest.mark.slow
def test_cli_output_to_devices(tmp_path, trace):
    null = mknod(tmp_path / "null", 3)
    full = mknod(tmp_path / "full", 7)
    rc, _, err = run_cli(["replay", trace, "--json", null, "--plot", null, "--sparsity", "0.5",
                          "--quiet"], tmp_path)
    assert rc == 0, err
    rc, _, err = run_cli(["replay", trace, "--json", full, "--sparsity", "0.5", "--quiet"],
                         tmp_path)
    assert_refused(rc, err, "No space left on device")
    rc, _, err = run_cli(["synth", full, "--steps", 2, "--layers", 1, "--prompt-slots", 64,
                          "--quiet"], tmp_path)
    assert_refused(rc, err, "No space left on device")
    assert stat.S_ISCHR(os.stat(null).st_mode) and stat.S_ISCHR(os.stat(full).st_mode)


@pytest.mark.slow
def test_cli_full_disk_keeps_the_old_file(tmp_path, trace):
    """A small tmpfs that the new JSON does not fit: the old JSON stays valid."""
    rc, _, err = run_cli(["replay", trace, "--json", tmp_path / "r.json", "--quiet"], tmp_path)
    assert rc == 0, err
    new_size = (tmp_path / "r.json").stat().st_size
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
            capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        old = {"results": "small"}
        (disk / "r.json").write_text(json.dumps(old))
        vfs = os.statvfs(disk)
        (disk / "filler").write_bytes(b"x" * (vfs.f_bavail * vfs.f_frsize - new_size // 2))
        before = hashes(disk)
        rc, _, err = run_cli(["replay", trace, "--json", disk / "r.json", "--quiet"], tmp_path)
        assert_refused(rc, err, "No space left on device")
        assert hashes(disk) == before
        assert json.loads((disk / "r.json").read_text()) == old
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.slow
def test_build_force_never_writes_outside_the_bundle(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.yaml").write_text("keep me")
    bundle = tmp_path / "B"
    bundle.mkdir()
    (bundle / "llm_api_options.yaml").symlink_to(outside / "secret.yaml")
    before = hashes(tmp_path)
    rc, _, err = run_cli(["build", "org/model", "-o", bundle, "--force"], tmp_path)
    assert_refused(rc, err, "symbolic link")
    assert hashes(tmp_path) == before
    (bundle / "llm_api_options.yaml").unlink()
    (bundle / "triton_model_repo").symlink_to(outside)          # a folder link this time
    before = hashes(tmp_path)
    rc, _, err = run_cli(["build", "org/model", "-o", bundle, "--force"], tmp_path)
    assert_refused(rc, err, "symbolic link")
    assert hashes(tmp_path) == before and sorted(outside.iterdir()) == [outside / "secret.yaml"]
    (bundle / "triton_model_repo").unlink()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    before = hashes(tmp_path)
    rc, _, err = run_cli(["build", model, "-o", model, "--force", "--config",
                          model / "config.json"], tmp_path)
    assert rc == 0, err                       # the bundle's own names do not clash here
    assert (model / "config.json").read_text() == "{}"


@pytest.mark.slow
def test_build_empty_model_and_one_line_only(tmp_path):
    rc, _, err = run_cli(["build", "", "-o", tmp_path / "x"], tmp_path)
    assert_refused(rc, err, "model ''")
    assert not (tmp_path / "x").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("x")
    (tmp_path / "empty").mkdir()
    rc, _, err = run_cli(["build", tmp_path / "empty", "-o", tmp_path / "full"], tmp_path)
    assert_refused(rc, err, "not empty")                # and no warning line before it


# ---- interrupts and pipes ---------------------------------------------------------------------
WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from spin_trtllm._outputs import write_output

    def writer(tmp):
        with open(tmp, "wb") as f:
            f.write(b"partial")
            f.flush()
            print("writing", flush=True)
            time.sleep(30)

    write_output(sys.argv[1], "--plot", writer=writer)
""")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_a_write_leaves_the_old_file(tmp_path, signum):
    path = tmp_path / "plot.png"
    path.write_bytes(b"good old image")
    script = tmp_path / "w.py"
    script.write_text(WRITER)
    env = dict(os.environ)
    if signum == signal.SIGTERM:       # what the CLI's main() installs
        script.write_text("import signal, sys\nsignal.signal(signal.SIGTERM, lambda s, f: "
                          "sys.exit(143))\n" + WRITER)
    proc = subprocess.Popen([sys.executable, str(script), str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signum)
    proc.wait(timeout=30)
    assert proc.returncode != 0
    assert path.read_bytes() == b"good old image"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png", "w.py"]


@settings(max_examples=8, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.floats(0.3, 3.0))
@pytest.mark.slow
def test_cli_interrupted_at_any_time_exits_130_with_one_line(tmp_path_factory, trace, delay):
    """Ctrl-C while torch loads, during the replay or while outputs are written: exit 130
    and one line, or the run finished first; the old JSON is intact or wholly new."""
    tmp_path = tmp_path_factory.mktemp("sigint")
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"old": True}))
    proc = subprocess.Popen([*CLI, "replay", str(trace), "--json", str(out), "--plot",
                             str(tmp_path / "p.png"), "--quiet"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 130:           # after the outputs written before the interrupt
        *before, last = err.splitlines()
        assert last == "spin-trtllm: interrupted", err
        assert all(line.startswith("wrote ") for line in before), err
    else:
        assert proc.returncode == 0, err
    data = json.loads(out.read_text())
    assert data == {"old": True} or isinstance(data, list)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.slow
def test_closed_stdout_exits_quietly(tmp_path, trace):
    read, write = os.pipe()
    os.close(read)                             # the reader is gone before anything is printed
    try:
        proc = subprocess.run([*CLI, "info", str(trace)], stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 141
    assert proc.stderr == ""


# ---- fuzz: any mix of outputs and inputs ------------------------------------------------------
JSON_NAMES = ["t.safetensors", "link.safetensors", "hard.safetensors", "old.json", "new.json",
              "null", "old.png"]
# images: an image name can alias the trace through a link
PLOT_NAMES = ["new.png", "old.png", "null", "tlink.png", "thard.png", "b.svg"]
INPUT_ALIASES = {"t.safetensors", "link.safetensors", "hard.safetensors", "tlink.png",
                 "thard.png"}


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.none() | st.sampled_from(JSON_NAMES), st.none() | st.sampled_from(PLOT_NAMES),
       st.none() | st.sampled_from(PLOT_NAMES))
@pytest.mark.slow
def test_fuzz_outputs_never_touch_inputs(tmp_path_factory, trace, json_name, plot, mask_plot):
    from spin_trtllm.cli import main

    folder = tmp_path_factory.mktemp("fuzz")
    shutil.copy(trace, folder / "t.safetensors")
    for link in ("link.safetensors", "tlink.png"):
        (folder / link).symlink_to("t.safetensors")
    for hard in ("hard.safetensors", "thard.png"):
        (folder / hard).hardlink_to(folder / "t.safetensors")
    (folder / "old.json").write_text("{}")
    (folder / "old.png").write_bytes(b"png")
    chosen = [(f, n) for f, n in (("--json", json_name), ("--plot", plot),
                                  ("--mask-plot", mask_plot)) if n is not None]
    try:
        os.mknod(folder / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except OSError:
        chosen = [(f, n) for f, n in chosen if n != "null"]
    argv = ["replay", str(folder / "t.safetensors"), "--sparsity", "0.5", "--quiet"]
    for flag, name in chosen:
        argv += [flag, str(folder / name)]
    before = hashes(folder)
    files = [os.path.realpath(folder / n) for _, n in chosen if n != "null"]
    refused = any(n in INPUT_ALIASES for _, n in chosen) or len(set(files)) < len(files)
    rc = main(argv)
    after = hashes(folder)
    if refused:
        assert rc == 2
        assert after == before
    else:
        assert rc == 0
        written = set(files)
        assert {k: v for k, v in after.items() if os.path.realpath(k) not in written} == \
            {k: v for k, v in before.items() if os.path.realpath(k) not in written}
        assert not any(p.name.startswith(".") for p in folder.iterdir())


# ---- names and configs a user may give --------------------------------------------------------
@pytest.mark.slow
def test_names_that_are_not_utf8_work_end_to_end(tmp_path):
    trace = b"t\xff\xfe.safetensors"
    run = lambda *argv: subprocess.run([sys.executable, "-m", "spin_trtllm.cli", *argv],
                                       cwd=tmp_path, capture_output=True, timeout=120)
    proc = run(b"synth", trace, b"--steps", b"4", b"--layers", b"1", b"--prompt-slots", b"128",
               b"--quiet")
    assert proc.returncode == 0, proc.stderr
    proc = run(b"info", trace)
    assert proc.returncode == 0, proc.stderr
    assert b"t\\udcff\\udcfe.safetensors" in proc.stdout          # printed escaped
    proc = run(b"replay", trace, b"--sparsity", b"0.5", b"--quiet", b"--json", b"r\xff.json",
               b"--plot", b"p\xfe", b"--mask-plot", b"m\xfd.png")
    assert proc.returncode == 0, proc.stderr
    made = set(os.listdir(os.fsencode(tmp_path)))
    assert {b"r\xff.json", b"p\xfe.png", b"m\xfd.png"} <= made
    assert isinstance(json.loads((tmp_path / os.fsdecode(b"r\xff.json")).read_text()), list)


@pytest.mark.parametrize("block", ["5", "true", "[1, 2]", "'ab'", "null"])
def test_serve_spin_block_must_be_a_mapping(tmp_path, block, capsys):
    from spin_trtllm.cli import main

    cfg = tmp_path / "opts.yaml"
    cfg.write_text(f"sparse_attention_config:\n  algorithm: dsa\n  index_topk: 2048\n"
                   f"  spin: {block}\n")
    rc = main(["serve", "org/model", "--config", str(cfg)])
    err = capsys.readouterr().err
    if block == "null":              # no spin block: made from the flags, then tensorrt_llm
        assert rc == 2 and "tensorrt" in err.lower(), err
        return
    assert_refused(rc, err, "sparse_attention_config.spin must be a mapping")
