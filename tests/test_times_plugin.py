"""SPIN_TEST_TIMES=FILE: every test's line is in the file as the test ends, outcome included."""

import re


def test_each_test_is_logged_as_it_ends_with_its_outcome(pytester, monkeypatch, tmp_path):
    log = tmp_path / "times.txt"
    monkeypatch.setenv("SPIN_TEST_TIMES", str(log))
    pytester.makepyfile(test_sample="""
        import time, pytest

        @pytest.fixture
        def broken():
            raise RuntimeError("setup fails")

        def test_slow():
            time.sleep(0.2)

        def test_fails():
            assert False

        def test_errors(broken):
            pass

        @pytest.mark.skip(reason="not here")
        def test_skipped():
            pass

        def test_reads_the_log_so_far():
            # the earlier tests' lines are on disk while the session still runs
            import os
            assert len(open(os.environ["SPIN_TEST_TIMES"]).read().splitlines()) == 4
    """)
    result = pytester.runpytest("-p", "spin_trtllm.testing.times_plugin")
    result.assert_outcomes(passed=2, failed=1, errors=1, skipped=1)
    lines = log.read_text().splitlines()
    parsed = [re.fullmatch(r"\s*([\d.]+) s  (\w+)\s+(\S+)", line).groups() for line in lines]
    outcome = {node.split("::")[1]: kind for _, kind, node in parsed}
    assert outcome == {"test_slow": "passed", "test_fails": "failed", "test_errors": "error",
                       "test_skipped": "skipped", "test_reads_the_log_so_far": "passed"}
    seconds = {node.split("::")[1]: float(s) for s, _, node in parsed}
    assert seconds["test_slow"] >= 0.2 and seconds["test_skipped"] < 0.2


def test_without_the_variable_the_plugin_stays_off(pytester, monkeypatch):
    monkeypatch.delenv("SPIN_TEST_TIMES", raising=False)
    pytester.makepyfile(test_one="""
        def test_one(request):
            assert not request.config.pluginmanager.has_plugin("spin_test_times")
    """)
    pytester.runpytest("-p", "spin_trtllm.testing.times_plugin").assert_outcomes(passed=1)
