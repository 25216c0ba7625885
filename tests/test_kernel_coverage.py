"""tests/gpu/kernel_coverage.py: which kernels the tests a sanitizer ran launched."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "gpu" / "kernel_coverage.py"


@pytest.fixture(scope="module")
def kc():
    spec = importlib.util.spec_from_file_location("kernel_coverage", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the profiler's spellings (kernel log) and cu++filt's (library) of the same two kernels
LOG = {"void spin::(anonymous namespace)::logits_kernel<(int)4>(spin::LogitsParams, int)":
       ["tests/a.py::test_logits[4]", "tests/b.py::test_engine"],
       "spin::(anonymous namespace)::topk_kernel<(int)2, (bool)1>(spin::TopkParams)":
       ["tests/c.py::test_topk_cluster"]}
LOG_NAMES = list(LOG)
LIBRARY = ["spin::<unnamed>::logits_kernel<4>(spin::LogitsParams, int)",
           "spin::<unnamed>::topk_kernel<2, true>(spin::TopkParams)",
           "spin::<unnamed>::update_kernel(spin::UpdateParams)"]


def times_file(path: Path, lines: list[tuple[float, str, str]]) -> str:
    path.write_text("".join(f"{s:8.1f} s  {outcome:7}  {node}\n" for s, outcome, node in lines))
    return str(path)


def test_names_match_across_spellings_and_unlaunched_kernels_have_no_tests(kc):
    got = kc.coverage(LOG, LIBRARY)
    assert got[LIBRARY[0]] == ["tests/a.py::test_logits[4]", "tests/b.py::test_engine"]
    assert got[LIBRARY[1]] == ["tests/c.py::test_topk_cluster"]
    assert got[LIBRARY[2]] == []


def test_only_tests_that_ran_under_the_tool_count(kc, tmp_path):
    # shard 0 ran the engine test and skipped the top-K one (another shard's claim, or a marker)
    ran = set(kc.known_seconds([
        times_file(tmp_path / "a.times", [(12.5, "passed", "tests/b.py::test_engine"),
                                          (0.0, "skipped", "tests/c.py::test_topk_cluster")]),
        times_file(tmp_path / "b.times", [(3.0, "failed", "tests/a.py::test_logits[4]")])]))
    got = kc.coverage(LOG, LIBRARY, ran)
    assert got[LIBRARY[0]] == ["tests/a.py::test_logits[4]", "tests/b.py::test_engine"]
    assert got[LIBRARY[1]] == []          # launched only by a test this tool skipped


@pytest.mark.parametrize("topk_ran,code", [(True, 0), (False, 1)])
def test_main_fails_when_a_kernel_went_unchecked(kc, tmp_path, monkeypatch, capsys,
                                                 topk_ran, code):
    log = tmp_path / "kernels.json"
    log.write_text(json.dumps(LOG))
    monkeypatch.setattr(kc, "library_kernels", lambda lib: LIBRARY[:2])
    monkeypatch.setattr(kc, "demangle", lambda names: names)
    times = times_file(tmp_path / "racecheck_0.times",
                       [(1.0, "passed", "tests/a.py::test_logits[4]"),
                        (1.0, "passed" if topk_ran else "skipped",
                         "tests/c.py::test_topk_cluster")])
    monkeypatch.setattr(sys, "argv", ["kernel_coverage.py", str(log), "lib.so", "--ran", times])
    assert kc.main() == code
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == (f"{2 - code} of 2 kernels launched by the "
                                    f"{1 + topk_ran} tests that ran")
    assert ("NEVER LAUNCHED" in out) == (not topk_ran)


def test_logs_of_several_processes_count_together_and_merge(kc, tmp_path, monkeypatch, capsys):
    # a plain run's processes: one saw both kernels, one test's launches are in both logs; the
    # merged log keeps the library's kernels only
    first, second = tmp_path / "kernels_0.json", tmp_path / "kernels_1.json"
    first.write_text(json.dumps({LOG_NAMES[0]: ["tests/b.py::test_engine"]}))
    second.write_text(json.dumps({LOG_NAMES[0]: ["tests/b.py::test_engine",
                                                  "tests/a.py::test_logits[4]"],
                                  LOG_NAMES[1]: ["tests/c.py::test_topk_cluster"],
                                  "void at::native::vectorized_elementwise_kernel<4>(int)":
                                      ["tests/b.py::test_engine"]}))
    merged = tmp_path / "kernels.json"
    monkeypatch.setattr(kc, "library_kernels", lambda lib: LIBRARY[:2])
    monkeypatch.setattr(kc, "demangle", lambda names: names)
    monkeypatch.setattr(sys, "argv", ["kernel_coverage.py", str(first), str(second), "lib.so",
                                      "--merged", str(merged)])
    assert kc.main() == 0
    assert capsys.readouterr().out.splitlines()[-1] == "2 of 2 kernels launched by the tests"
    assert json.loads(merged.read_text()) == {
        LOG_NAMES[0]: ["tests/a.py::test_logits[4]", "tests/b.py::test_engine"],
        LOG_NAMES[1]: ["tests/c.py::test_topk_cluster"]}


@pytest.mark.parametrize("renamed", [False, True])
def test_a_log_naming_spin_kernels_the_library_lacks_is_called_stale(kc, tmp_path, monkeypatch,
                                                                     capsys, renamed):
    # a log from before topk_kernel gained a template argument: its old instance is not in the
    # library, whose new one then reads as never launched; torch's kernels never count as stale
    log = dict(LOG)
    log["void at::native::vectorized_elementwise_kernel<4>(int)"] = ["tests/a.py::test_x"]
    library = list(LIBRARY[:2])
    if renamed:
        library[1] = "spin::<unnamed>::topk_kernel<2, true, 512>(spin::TopkParams)"
    path = tmp_path / "kernels.json"
    path.write_text(json.dumps(log))
    monkeypatch.setattr(kc, "library_kernels", lambda lib: library)
    monkeypatch.setattr(kc, "demangle", lambda names: names)
    monkeypatch.setattr(sys, "argv", ["kernel_coverage.py", str(path), "lib.so"])
    assert kc.main() == (1 if renamed else 0)
    out = capsys.readouterr().out
    assert ("STALE KERNEL LOG: 1 of its spin kernels" in out) == renamed
    assert (LOG_NAMES[1] in out) == renamed
    assert kc.not_in_library(log, library) == ([LOG_NAMES[1]] if renamed else [])


def test_a_kernel_log_started_again_on_its_file_keeps_what_it_held(tmp_path):
    # a test process restarted over its memory cap (SPIN_TEST_RESTART) writes the same file
    from spin_trtllm.testing.kernel_log import KernelLog

    path = tmp_path / "kernels.json"
    first = KernelLog(str(path))
    first.record({"k1", "k2"}, "t.py::a")
    again = KernelLog(str(path))
    again.record({"k2", "k3"}, "t.py::b")
    assert json.loads(path.read_text()) == {"k1": ["t.py::a"], "k2": ["t.py::a", "t.py::b"],
                                            "k3": ["t.py::b"]}


@pytest.mark.parametrize("marker", ["large", "own_profiler"])
def test_the_kernel_log_leaves_large_and_own_profiler_tests_unprofiled(tmp_path, marker):
    """A test that runs torch.profiler itself would fail under a second one: it runs bare, like
    the large shapes, and records nothing."""
    from types import SimpleNamespace

    from spin_trtllm.testing.kernel_log import KernelLog

    path = tmp_path / "kernels.json"
    log = KernelLog(str(path))
    item = SimpleNamespace(nodeid="t.py::c",
                           get_closest_marker=lambda name: object() if name == marker else None)
    hook = log.pytest_runtest_call(item)
    next(hook)                                   # the test runs here
    with pytest.raises(StopIteration):
        hook.send(None)
    assert not path.exists()
