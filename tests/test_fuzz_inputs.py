"""Property tests (issue 18): config YAML text, trace headers and CLI numbers. Whatever the
input, the CLI exits 0 (valid) or 2 with exactly one stderr line and no traceback, within a
time limit per run and without a large memory peak. Fixed example budgets keep CI fast."""

import contextlib
import io
import resource
import signal
import sys
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import save_file

from spin_trtllm.cli import main

from spin_trtllm.testing.traces import make_trace

SECONDS_PER_RUN = 20        # a run that takes longer counts as a hang
MAX_RSS_GROWTH = 1 << 30    # bytes the peak RSS may grow over a whole property test
FUZZ = settings(max_examples=150, deadline=10_000, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.function_scoped_fixture])


class Hang(BaseException):
    """Not an Exception (so the CLI cannot swallow it, as it does OSError/TimeoutError)."""


def _alarm(signum, frame):
    raise Hang(f"a CLI run took longer than {SECONDS_PER_RUN} s")


def _max_rss() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def check_cli(argv):
    """Runs main(argv) in bounded time; asserts exit 0, or 2 with one stderr line."""
    out, err = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, SECONDS_PER_RUN)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    text = err.getvalue()
    assert "Traceback" not in text, text[-2000:]
    if rc == 0:
        return rc, text
    assert rc == 2, (rc, text[-2000:])
    lines = text.splitlines()
    assert len(lines) == 1 and lines[0].startswith("spin-trtllm"), text[-2000:]
    assert len(lines[0]) < 1200
    return rc, lines[0]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    make_trace(steps=3, layers=1, start=20, block_size=8, index_topk=8).save(d / "t.safetensors")
    return d


@pytest.fixture(autouse=True)
def bounded_memory():
    before = _max_rss()
    yield
    assert _max_rss() - before < MAX_RSS_GROWTH


# ---- config YAML --------------------------------------------------------------------------------
FIELDS = ["block_size", "target_sparsity", "ema_decay", "exploration", "exploration_policy",
          "index_topk", "warmup_steps", "seed", "reduction", "pooling", "spin",
          "sparse_attention_config", "algorithm", "keep_sink", "state_dtype"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
                    st.sampled_from(["dsa", "deepseek_v4", "A0", "max", "random", "float16"]))
keys = st.one_of(st.sampled_from(FIELDS), st.text(max_size=10), st.integers(), st.none(),
                 st.booleans(), st.floats(allow_nan=False))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)), max_leaves=12)
documents = st.dictionaries(keys, values, max_size=5).map(
    lambda d: yaml.safe_dump(d, allow_unicode=True))
snippets = st.lists(st.sampled_from([
    "spin:", "  ", "&a ", "*a", "[", "]", "{", "}", ": ", "\n", "- ", "9" * 200, "!!binary ",
    "? ", "<<: ", "seed: ", "index_topk: ", "'", '"', "\t", "\x00", "\ufeff", "#", "---\n",
    "sparse_attention_config:\n  algorithm: ", "dsa", "1e999", ".nan", "0x1F", "2001-12-14"]),
    max_size=25).map("".join)
raw = st.binary(max_size=200)


@FUZZ
@given(st.one_of(documents, snippets, st.text(max_size=200), raw))
@pytest.mark.slow
def test_config_yaml(workdir, text):
    path = workdir / "fuzz.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    check_cli(["replay", str(workdir / "t.safetensors"), "--config", str(path), "--sparsity",
               "0.5", "--quiet"])


# ---- trace headers ------------------------------------------------------------------------------
META_KEYS = ["format", "version", "index_topk", "block_size", "next_n", "compress_ratio",
             "source"]
meta_values = st.one_of(
    st.integers(-2 ** 80, 2 ** 80).map(str), st.text(max_size=30),
    st.sampled_from(["spin-trace", "1", "8", "0", "-1", " 8", "8 ", "1_0", "\u0668", "9" * 5000,
                     "x\ny", "9223372036854775808", "18446744073709551616"]))


@FUZZ
@given(st.dictionaries(st.one_of(st.sampled_from(META_KEYS), st.text(max_size=8)), meta_values,
                       max_size=8),
       st.booleans())
@pytest.mark.slow
def test_trace_headers(workdir, changes, drop_defaults):
    t = make_trace(steps=2, layers=1, start=12, block_size=8, index_topk=8)
    meta = {} if drop_defaults else t.metadata()
    meta.update(changes)
    path = workdir / "h.safetensors"
    save_file({"scores": t.scores, "row_len": t.row_len, "query_pos": t.query_pos}, str(path),
              metadata=meta)
    check_cli(["info", str(path)])
    check_cli(["compare-predictors", str(path), "--quiet"])


# ---- CLI numbers --------------------------------------------------------------------------------
numbers = st.one_of(st.integers(-2 ** 70, 2 ** 70), st.integers(-3, 70000),
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from(["nan", "inf", "-inf", "1e999", "0x10", "1_0", "", " 1",
                                     "9" * 5000, "\u0661", "1.5", "-0"])).map(str)
REPLAY_FLAGS = ["--index-topk", "--block-size", "--seed", "--exploration", "--sparsity",
                "--mask-slots", "--mask-layer"]
SYNTH_FLAGS = ["--index-topk", "--block-size", "--diagonal-bands", "--seed", "--noise",
               "--accept-prob", "--shift-prob", "--sink-slots", "--local-window", "--vertical"]
# (command, flag): validated before any work; the command itself is replaced by a stub
STUBBED = [("demo", f) for f in ["--requests", "--prompt-tokens", "--new-tokens", "--batch"]] + \
    [("train-tiny", f) for f in ["--seconds", "--seq-len", "--batch", "--limit-bytes",
                                 "--seed"]] + \
    [("trace", f) for f in ["--held-out", "--prompt-tokens", "--steps", "--seed"]] + \
    [("build", f) for f in ["--tp", "--max-batch-size", "--max-seq-len"]]


@FUZZ
@given(st.sampled_from(REPLAY_FLAGS), numbers)
@pytest.mark.slow
def test_replay_numbers(workdir, flag, value):
    extra = ["--mask-plot", str(workdir / "m.png")] if flag.startswith("--mask") else []
    check_cli(["replay", str(workdir / "t.safetensors"), flag, value, "--quiet", *extra])


@FUZZ
@given(numbers)
def test_compare_predictors_numbers(workdir, value):
    check_cli(["compare-predictors", str(workdir / "t.safetensors"), "--index-topk", value,
               "--quiet"])


@FUZZ
@given(st.sampled_from(SYNTH_FLAGS), numbers)
def test_synth_numbers(workdir, flag, value):
    check_cli(["synth", str(workdir / "s.safetensors"), "--steps", "2", "--layers", "1",
               "--prompt-slots", "64", flag, value, "--quiet"])


@FUZZ
@given(st.sampled_from(STUBBED), numbers)
@pytest.mark.slow
def test_numbers_of_long_commands(workdir, command_flag, value):
    command, flag = command_flag
    argv = {"demo": ["demo", "--device", "cpu"],
            "train-tiny": ["train-tiny", "--device", "cpu", "--out", str(workdir / "m.st")],
            "trace": ["trace", str(workdir / "o.safetensors"), "--device", "cpu"],
            "build": ["build", "org/model", "-o", str(workdir / "bundle"), "--force"]}[command]
    module = "deploy" if command == "build" else "engine"    # where build_parser finds it
    stub = mock.patch(f"spin_trtllm.cli.{module}.cmd_{command.replace('-', '_')}",
                      return_value=0)
    with stub:
        check_cli([*argv, flag, value])
