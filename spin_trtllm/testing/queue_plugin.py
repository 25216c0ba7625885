"""A pytest plugin that shares tests out among processes started together (the sanitizer runs).

SPIN_TEST_QUEUE=DIR: the processes running the same tests with the same DIR share them. Each test
runs in the first process that claims it (creates its file in DIR, O_EXCL); the others skip it.
So the processes finish together however unevenly the tests' times are spread, where fixed
shards can leave one idle while another runs past its limit.

SPIN_TEST_ORDER=FILE[:FILE...] (SPIN_TEST_TIMES files of an earlier run) starts the longest
first. Modules are ordered by their known total, and tests within a module by their own. A module
stays contiguous, so its module-scoped fixtures are set up once per process that runs any of it.

SPIN_TEST_MEMORY_CAP=GIB with SPIN_TEST_RESTART=FILE (and SPIN_TEST_QUEUE): a process that
holds more than GIB of GPU memory (torch's live tensors, those of the module fixtures the next
test shares included) before a test it would claim leaves that test unclaimed, stops, and writes
why to FILE, so that its caller starts a fresh process on the same queue (device_check.sh does).
Every process runs at least one test, so a restarted run always gets on. A guard: under
compute-sanitizer with host backtraces the dsa-lite engine tests left tensors alive that a plain
run frees (on an H100, memcheck: 3.3 GiB after one engine test, 6.6 after two; without it 0.06),
locals of Python frames that the saved backtraces hold, which gc.collect() cannot free
(tests/gpu/sanitizer_frames_repro.py); device_check.sh runs every tool but initcheck (whose
suppressions match host frames) with device backtraces only. Only a new process gives such
memory back.
"""

from __future__ import annotations

import hashlib
import os
import sys

import pytest

from .times_plugin import LINE as TIMES_LINE

CLAIMED = "run by another process of SPIN_TEST_QUEUE"
LEFT = "left to a fresh process of SPIN_TEST_QUEUE (this one is over SPIN_TEST_MEMORY_CAP)"


def known_seconds(paths: list[str]) -> dict[str, float]:
    """Each test's seconds in SPIN_TEST_TIMES files (its longest run; skips do not count)."""
    seconds: dict[str, float] = {}
    for path in paths:
        with open(path) as lines:
            for line in lines:
                match = TIMES_LINE.fullmatch(line.rstrip("\n"))
                if match and match.group(2) != "skipped":
                    node = match.group(3)
                    seconds[node] = max(seconds.get(node, 0.0), float(match.group(1)))
    return seconds


def longest_first(items: list, seconds: dict[str, float]) -> list:
    """Modules by their known total seconds, each module's tests by their own, longest first
    (stable: unknown tests keep their order, after the known ones of their module)."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)

    def total(tests: list) -> float:
        return sum(seconds.get(t.nodeid, 0.0) for t in tests)

    ordered = []
    for name in sorted(modules, key=lambda m: -total(modules[m])):
        ordered += sorted(modules[name], key=lambda t: -seconds.get(t.nodeid, 0.0))
    return ordered


def torch_on_gpu():
    """torch if this process has started CUDA, else None (a process that never touched the GPU
    does not start CUDA for the queue's checks)."""
    torch = sys.modules.get("torch")
    return torch if torch is not None and torch.cuda.is_initialized() else None


class TestQueue:
    __test__ = False      # not a test class

    def __init__(self, directory: str, memory_cap_gib: float | None = None,
                 restart_file: str | None = None):
        self.directory = directory
        self.memory_cap_gib, self.restart_file = memory_cap_gib, restart_file
        self.ran = 0      # tests this process claimed: a fresh one runs at least one
        os.makedirs(directory, exist_ok=True)

    def claim(self, nodeid: str) -> bool:
        path = os.path.join(self.directory, hashlib.sha1(nodeid.encode()).hexdigest())
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        return True

    # first, as the skip marks: a test another process claimed sets up no fixture here. A
    # process over its memory cap claims no more: this test is left to a fresh process, and
    # pytest, stopping, tears every fixture down in this test's teardown (errors reported there)
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item) -> None:
        if self.ran and self.over_memory_cap(item):
            pytest.skip(LEFT)
        if not self.claim(item.nodeid):
            pytest.skip(CLAIMED)
        self.ran += 1

    def over_memory_cap(self, item) -> bool:
        """Whether this process holds more GPU memory than its cap before `item`; if so, the
        reason goes to the restart file and the session stops after `item`'s teardown."""
        torch = torch_on_gpu()
        if self.memory_cap_gib is None or torch is None:
            return False
        held = torch.cuda.memory_allocated() / 2**30
        if held <= self.memory_cap_gib:
            return False
        reason = (f"{held:.1f} GiB of GPU memory held after {self.ran} tests, before "
                  f"{item.nodeid} (cap {self.memory_cap_gib:g} GiB): a fresh process goes on")
        with open(self.restart_file, "w") as note:
            note.write(reason + "\n")
        item.session.shouldstop = reason
        return True

    # The processes share one GPU: each gives back the memory torch's allocator keeps cached
    # after a test, so that a process holds about what its current test needs, not the most
    # any test it ran needed (12 sanitized processes ran an H100's 79 GiB out of memory so)
    @pytest.hookimpl(trylast=True)
    def pytest_runtest_teardown(self, item) -> None:
        torch = torch_on_gpu()
        if torch is not None:
            torch.cuda.empty_cache()


def pytest_configure(config) -> None:
    directory = os.environ.get("SPIN_TEST_QUEUE")
    if directory and not config.pluginmanager.has_plugin("spin_test_queue"):
        config.pluginmanager.register(TestQueue(directory, *memory_cap()), "spin_test_queue")


def memory_cap() -> tuple[float | None, str | None]:
    """(SPIN_TEST_MEMORY_CAP in GiB, SPIN_TEST_RESTART), both or neither: a process that stopped
    with no caller to start another would leave its share of the queue unrun."""
    cap, restart = os.environ.get("SPIN_TEST_MEMORY_CAP"), os.environ.get("SPIN_TEST_RESTART")
    if cap is None and restart is None:
        return None, None
    if cap is None or not restart:
        raise pytest.UsageError("SPIN_TEST_MEMORY_CAP and SPIN_TEST_RESTART go together (a cap "
                                "stops the process; the restart file tells its caller to go on)")
    try:
        gib = float(cap)
    except ValueError:
        gib = float("nan")
    if not gib > 0 or gib == float("inf"):
        raise pytest.UsageError(f"SPIN_TEST_MEMORY_CAP={cap!r}: a positive number of GiB")
    return gib, restart


def pytest_collection_modifyitems(config, items) -> None:
    order = os.environ.get("SPIN_TEST_ORDER")
    if order:
        items[:] = longest_first(items, known_seconds(order.split(os.pathsep)))
