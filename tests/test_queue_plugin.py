"""SPIN_TEST_QUEUE=DIR: processes started together run each test once between them, whoever
claims it first; SPIN_TEST_ORDER starts the longest known tests first, modules kept whole;
SPIN_TEST_MEMORY_CAP stops a process that holds too much GPU memory, for a fresh one."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from spin_trtllm.testing.queue_plugin import CLAIMED, LEFT, known_seconds, longest_first

REPO = Path(__file__).resolve().parents[1]

TESTS = """
import os, time, pytest

@pytest.fixture(scope="module")
def module_setup():
    with open(os.environ["FIXTURE_LOG"], "a") as log:
        log.write(f"{os.getpid()}\\n")

@pytest.mark.parametrize("i", range(12))
def test_case(i, module_setup):
    time.sleep(0.05 * (i % 3))
    with open(os.environ["RAN_LOG"], "a") as log:
        log.write(f"{i}\\n")
"""


def run_together(pytester, processes: int, queue, env_extra=None) -> list[str]:
    env = dict(os.environ, SPIN_TEST_QUEUE=str(queue), RAN_LOG=str(pytester.path / "ran.txt"),
               FIXTURE_LOG=str(pytester.path / "fixture.txt"), **(env_extra or {}))
    env.pop("SPIN_TEST_TIMES", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p",
           "spin_trtllm.testing.queue_plugin", "test_queue_sample.py"]
    procs = [subprocess.Popen(cmd, cwd=pytester.path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(processes)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    return outputs


def passed(output: str) -> int:
    words = output.strip().splitlines()[-1].replace(",", "").split()
    return int(words[words.index("passed") - 1]) if "passed" in words else 0


def test_processes_started_together_run_each_test_once(pytester, tmp_path):
    pytester.makepyfile(test_queue_sample=TESTS)
    outputs = run_together(pytester, 3, tmp_path / "queue")
    ran = sorted(int(x) for x in (pytester.path / "ran.txt").read_text().split())
    assert ran == list(range(12))
    assert sum(passed(o) for o in outputs) == 12
    assert all(CLAIMED in o for o in outputs if passed(o) < 12)


def test_a_claimed_test_sets_up_no_fixture_in_the_other_processes(pytester, tmp_path):
    pytester.makepyfile(test_queue_sample=TESTS)
    first = run_together(pytester, 1, tmp_path / "queue")
    again = run_together(pytester, 1, tmp_path / "queue")      # every test claimed already
    assert passed(first[0]) == 12 and passed(again[0]) == 0 and "12 skipped" in again[0]
    assert len((pytester.path / "fixture.txt").read_text().split()) == 1   # the first's only
    # without the queue every process runs everything
    pytester.makepyfile(test_queue_sample=TESTS)
    env = dict(os.environ, RAN_LOG=str(pytester.path / "ran2.txt"),
               FIXTURE_LOG=str(pytester.path / "fixture2.txt"))
    env.pop("SPIN_TEST_QUEUE", None)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                          "spin_trtllm.testing.queue_plugin", "test_queue_sample.py"],
                         cwd=pytester.path, env=env, capture_output=True, text=True, timeout=120)
    assert passed(out.stdout) == 12


def test_longest_first_keeps_modules_whole(tmp_path):
    times = tmp_path / "a.times"
    times.write_text("   300.0 s  passed   m1.py::slow\n"
                     "     1.0 s  passed   m2.py::x\n"
                     "     9.0 s  skipped  m1.py::fast\n"         # skips do not count
                     "     2.0 s  failed   m1.py::fast\n"
                     "   100.0 s  passed   m2.py::y\n"
                     "garbage line\n")
    other = tmp_path / "b.times"
    other.write_text("   500.0 s  passed   m2.py::x\n")          # the longest run counts
    seconds = known_seconds([str(times), str(other)])
    assert seconds == {"m1.py::slow": 300.0, "m1.py::fast": 2.0, "m2.py::x": 500.0,
                       "m2.py::y": 100.0}
    items = [SimpleNamespace(nodeid=n) for n in
             ("m0.py::new", "m1.py::fast", "m1.py::slow", "m2.py::y", "m2.py::new", "m2.py::x")]
    order = [i.nodeid for i in longest_first(items, seconds)]
    assert order == ["m2.py::x", "m2.py::y", "m2.py::new", "m1.py::slow", "m1.py::fast",
                     "m0.py::new"]


def _fake_torch(initialized: bool, emptied: list):
    cuda = SimpleNamespace(is_available=lambda: True, is_initialized=lambda: initialized,
                           empty_cache=lambda: emptied.append(1))
    return SimpleNamespace(cuda=cuda)


def test_each_test_gives_back_the_gpu_memory_torch_keeps_cached(tmp_path, monkeypatch):
    # processes sharing a GPU hold what their current test needs, not their largest test's
    from spin_trtllm.testing.queue_plugin import TestQueue
    queue, item = TestQueue(str(tmp_path / "queue")), SimpleNamespace(nodeid="t::a")
    emptied: list = []
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(True, emptied))
    queue.pytest_runtest_teardown(item)
    queue.pytest_runtest_teardown(item)
    assert emptied == [1, 1]
    # a process that never touched the GPU does not start CUDA for it
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(False, emptied))
    queue.pytest_runtest_teardown(item)
    assert emptied == [1, 1]


LEAKY_TESTS = """
import sys, types, pytest

# each test leaves 1 GiB behind in its process, as the engine tests do under compute-sanitizer
held = [0]
cuda = types.SimpleNamespace(is_initialized=lambda: True, empty_cache=lambda: None,
                             memory_allocated=lambda: held[0] * 2**30)
sys.modules["torch"] = types.SimpleNamespace(cuda=cuda)

@pytest.mark.parametrize("i", range(10))
def test_case(i):
    held[0] += 1
    with open("ran.txt", "a") as log:
        log.write(f"{i}\\n")
"""


def test_a_process_over_its_memory_cap_stops_and_a_fresh_one_goes_on(pytester, tmp_path):
    # what device_check.sh's loop does: start again while the restart file says so
    pytester.makepyfile(test_leaky=LEAKY_TESTS)
    restart, times = tmp_path / "restart", tmp_path / "leaky.times"
    env = dict(os.environ, SPIN_TEST_QUEUE=str(tmp_path / "queue"), SPIN_TEST_MEMORY_CAP="2.5",
               SPIN_TEST_RESTART=str(restart), SPIN_TEST_TIMES=str(times),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p",
           "spin_trtllm.testing.queue_plugin", "-p", "spin_trtllm.testing.times_plugin",
           "test_leaky.py"]
    reasons, runs = [], 0
    while True:
        restart.unlink(missing_ok=True)
        out = subprocess.run(cmd, cwd=pytester.path, env=env, capture_output=True, text=True,
                             timeout=120)
        runs += 1
        if not restart.exists():
            assert out.returncode == 0, out.stdout
            break
        assert out.returncode == 2 and "Interrupted" in out.stdout, out.stdout   # not a failure
        assert LEFT in out.stdout
        reasons.append(restart.read_text())
        assert runs < 10, reasons
    ran = [int(x) for x in (pytester.path / "ran.txt").read_text().split()]
    assert sorted(ran) == list(range(10))          # each test once, none lost at a stop
    assert runs == 4                               # 3 tests a process reach 3 GiB > 2.5
    assert reasons[0].startswith("3.0 GiB of GPU memory held after 3 tests, before "
                                 "test_leaky.py::test_case[3] (cap 2.5 GiB)")
    assert "before test_leaky.py::test_case[6]" in reasons[1]
    # every test passed once in the times file (the tests that stopped a process too); the
    # other lines are skips: claimed by an earlier process, or left to the next
    lines = [line.split() for line in times.read_text().splitlines()]
    assert sorted(x[3] for x in lines if x[2] == "passed") == \
        sorted(f"test_leaky.py::test_case[{i}]" for i in range(10))
    assert {x[2] for x in lines} == {"passed", "skipped"}


@pytest.mark.parametrize("cap,restart", [("2", None), (None, "r"), ("0", "r"), ("-1", "r"),
                                         ("lots", "r"), ("nan", "r"), ("inf", "r")])
def test_a_memory_cap_needs_a_restart_file_and_a_positive_size(monkeypatch, cap, restart):
    from spin_trtllm.testing.queue_plugin import memory_cap
    for name, value in (("SPIN_TEST_MEMORY_CAP", cap), ("SPIN_TEST_RESTART", restart)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(pytest.UsageError, match="SPIN_TEST_MEMORY_CAP"):
        memory_cap()
    monkeypatch.setenv("SPIN_TEST_MEMORY_CAP", "2.5")
    monkeypatch.setenv("SPIN_TEST_RESTART", "r")
    assert memory_cap() == (2.5, "r")
