"""A pytest plugin: SPIN_TEST_TIMES=FILE appends each test's seconds (setup, call and teardown)
and outcome to FILE as the test ends, so a run cut off at its limit (the device scripts' GPU and
sanitizer runs) still shows which tests ran and where the time went."""

import os
import re

import pytest

LINE = re.compile(r"\s*([\d.]+) s\s+(\w+)\s+(.+)")   # seconds, outcome, node id: as written below


class TimesLog:
    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)
        self.seconds: dict[str, float] = {}
        self.outcome: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        node = report.nodeid
        self.seconds[node] = self.seconds.get(node, 0.0) + report.duration
        if report.when == "call":
            self.outcome[node] = report.outcome
        elif report.outcome == "failed":          # in a fixture's setup or teardown
            self.outcome[node] = "error"
        elif report.outcome == "skipped":
            self.outcome.setdefault(node, "skipped")
        if report.when == "teardown":
            self.file.write(f"{self.seconds.pop(node):8.1f} s  "
                            f"{self.outcome.pop(node, 'passed'):7}  {node}\n")

    def pytest_unconfigure(self, config) -> None:
        self.file.close()


def pytest_configure(config) -> None:
    path = os.environ.get("SPIN_TEST_TIMES")
    if path and not config.pluginmanager.has_plugin("spin_test_times"):
        config.pluginmanager.register(TimesLog(path), "spin_test_times")
