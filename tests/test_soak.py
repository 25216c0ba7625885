"""benchmarks/soak.py: dsa-lite serves a stream of requests with no leakage between them, no
lost state slots and no step raising; and the checks catch a planted leak."""

import importlib.util
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from spin_trtllm.errors import SpinError
from spin_trtllm.state import StatePool

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak_under_test", SOAK)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod             # dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


@pytest.fixture
def one_thread():
    """The tiny model's ops are too small to share out: a second thread only contends (on a
    busy 2-core machine a step took 8x longer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_clean(r):
    assert r["errors"] == []
    assert r["checks"] == {"steps": True, "slots": True, "switch": True, "leakage": True,
                           "memory": None if r["device"] == "cpu" else True,
                           "longest_prompt": True}, r["checks"]
    assert r["ok"]


@pytest.mark.slow
def test_cpu_soak_serves_200_requests_without_leaks(soak, one_thread):
    r = soak.run_soak(soak.SoakOptions(requests=200, progress=False))
    assert_clean(r)
    assert r["requests"] == 200 and r["unfinished"] == 0 and r["wrong_lengths"] == 0
    assert [e["mtp_depth"] for e in r["engines"]] == [0, 1]
    leak = r["leakage"]
    assert leak["compared"] == 100 and leak["schedules_same"]
    assert leak["token_mismatches"] == leak["block_mismatches"] == 0
    for e in r["engines"]:
        assert e["multi_turn"] > 0 and e["one_token_prompts"] > 0 and e["longest_prompts"] > 0
        first = e["runs"][0]
        # the switch flipped both ways, requests came and went on most steps
        assert first["spin_steps"] > 0 and first["all_keep_steps"] > 0
        assert first["switch_flips"] >= 2
        assert first["join_steps"] > first["steps"] / 3
        assert first["leave_steps"] > first["steps"] / 2
        assert first["pool_full"] and first["pages_full"]
    assert r["memory_drift_bytes"] is None and r["requests_per_s"] > 0


@pytest.mark.slow
def test_a_state_slot_that_is_not_reset_is_caught_as_leakage(soak, one_thread, monkeypatch):
    """A new request inherits the previous owner's SPIN state: the kept requests' selected
    blocks then depend on what the replaced requests were."""
    monkeypatch.setattr(StatePool, "reset", lambda self, request_ids, step=0: None)
    r = soak.run_soak(soak.SoakOptions(requests=40, max_batch=4, progress=False))
    assert r["errors"] == [] and r["checks"]["steps"] and r["checks"]["slots"]
    assert r["leakage"]["schedules_same"]
    assert r["leakage"]["block_mismatches"] > 0
    assert r["checks"]["leakage"] is False and not r["ok"]


def test_a_slot_never_given_back_is_caught(soak, one_thread, monkeypatch):
    release = StatePool.release

    def keep_one(self, request_id):
        if request_id != 3:
            release(self, request_id)
        else:
            self._slot_of.pop(request_id)      # gone from the pool, never free again

    monkeypatch.setattr(StatePool, "release", keep_one)
    r = soak.run_soak(soak.SoakOptions(requests=12, mtp=0, leakage=False, progress=False))
    assert r["errors"] == [] and r["checks"]["steps"]
    assert r["checks"]["slots"] is False and not r["ok"]


def timeless(r):
    """The result without what depends on time or --jobs."""
    if isinstance(r, dict):
        return {k: timeless(v) for k, v in r.items()
                if "seconds" not in k and k not in ("requests_per_s", "jobs")}
    return [timeless(v) for v in r] if isinstance(r, list) else r


def test_jobs_run_the_runs_in_processes_with_the_same_results(soak, one_thread, monkeypatch):
    """--jobs 2: the four runs (two engines, each with its leakage rerun) in two spawned
    processes give the tokens, block digests, schedules and checks of --jobs 1, merged in the
    same order; a run that raises (here or in a worker) is that run's error, not a hang."""
    run_all, done = soak.run_all, {}

    def with_a_failing_run(opts, tasks, loaded):
        *out, (bad, longest) = run_all(opts, tasks + [(-1, False)], loaded)  # no MTP depth -1
        assert bad.label == "mtp -1" and "mtp_depth" in bad.error and longest is None
        done[opts.jobs] = out
        return out

    monkeypatch.setattr(soak, "run_all", with_a_failing_run)
    opts = soak.SoakOptions(requests=8, max_batch=4, max_context=128, max_new_tokens=4,
                            progress=False)
    r = {jobs: soak.run_soak(replace(opts, jobs=jobs)) for jobs in (1, 2)}
    assert [run.label for run, _ in done[2]] == ["mtp 0", "mtp 0, replaced", "mtp 1",
                                                "mtp 1, replaced"]
    for (one, longest1), (two, longest2) in zip(done[1], done[2]):
        assert one.label == two.label and longest1 == longest2
        assert one.outputs == two.outputs and len(one.outputs) == one.requests
        assert one.blocks == two.blocks and one.schedule == two.schedule
    assert r[2]["config"]["jobs"] == 2 and r[2]["wall_seconds"] > 0
    assert r[1]["errors"] == r[2]["errors"] == []
    assert r[1]["checks"] == r[2]["checks"] and r[2]["checks"]["leakage"]
    assert r[2]["leakage"]["compared"] == 4
    assert timeless(r[1]) == timeless(r[2])
    assert "wall time" in soak.report(r[2]) and "with 2 jobs" in soak.report(r[2])
    with pytest.raises(SpinError, match="--jobs must be >= 1"):
        soak.run_soak(replace(opts, jobs=0))


@pytest.mark.slow
def test_command_line_prints_the_checks_and_writes_json(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(SOAK), "--requests", "6", "--mtp", "0",
                           "--no-leakage", "--threads", "1", "--quiet", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert "requests/s" in proc.stdout and "memory drift (max)   n/a" in proc.stdout
    r = json.loads(out.read_text())
    assert r["requests"] == 6 and r["checks"]["slots"] and r["checks"]["steps"]
    assert proc.returncode == (0 if r["ok"] else 1)
    bad = subprocess.run([sys.executable, str(SOAK), "--requests", "1"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--requests must be >= 2" in bad.stderr


@pytest.mark.gpu
@pytest.mark.large  # the engine's kernels run under the sanitizers in tests/test_harness_gpu.py
def test_gpu_soak_with_the_shipped_model(soak):
    """The shipped checkpoint, CUDA graphs, 1,000 requests (benchmarks/soak.py --device cuda
    serves 5,000), its four runs in four processes."""
    r = soak.run_soak(soak.SoakOptions(device="cuda", requests=1000, progress=False, jobs=4))
    assert_clean(r)
    assert r["memory_drift_bytes"] is not None
    assert all(run["memory_samples"] >= 2 for e in r["engines"] for run in e["runs"])
