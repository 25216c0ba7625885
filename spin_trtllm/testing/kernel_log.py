"""A pytest plugin: SPIN_KERNEL_LOG=FILE records each CUDA kernel that the tests not marked large
(the ones tests/gpu/device_check.sh sanitizes) launched, with the tests that launched it, as JSON
for tests/gpu/kernel_coverage.py (torch.profiler: kernels inside CUDA graphs included). The file
is rewritten after every test, so a run cut off at its limit leaves what it saw, and a process
started again on the same file (SPIN_TEST_RESTART, queue_plugin.py) goes on from what it holds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


class KernelLog:
    def __init__(self, path: str):
        self.path = Path(path)
        self.tests: dict[str, list[str]] = (json.loads(self.path.read_text())
                                            if self.path.exists() else {})

    def record(self, kernels: set[str], nodeid: str) -> None:
        """`kernels` were launched by test `nodeid`: added, and the file rewritten."""
        for name in kernels:
            self.tests.setdefault(name, []).append(nodeid)
        self.path.write_text(json.dumps(self.tests, indent=1, sort_keys=True))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        import torch
        from torch.profiler import ProfilerActivity, profile

        # large: not sanitized, not counted; own_profiler: a second profiler would fail it
        if item.get_closest_marker("large") or item.get_closest_marker("own_profiler"):
            yield
            return
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            yield
            torch.cuda.synchronize()
        # the raw events: prof.events() builds a Python tree of every launch, minutes for the
        # engine tests' thousands of steps
        cuda = torch.autograd.DeviceType.CUDA
        self.record({e.name() for e in prof.profiler.kineto_results.events()
                     if e.device_type() == cuda}, item.nodeid)


def pytest_configure(config) -> None:
    path = os.environ.get("SPIN_KERNEL_LOG")
    if not path or config.pluginmanager.has_plugin("spin_kernel_log"):
        return
    import torch

    if torch.cuda.is_available():
        config.pluginmanager.register(KernelLog(path), "spin_kernel_log")
