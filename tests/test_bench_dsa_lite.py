"""bench_dsa_lite's driver on the CPU: every engine of a case in its own (faked) process,
round-robin over --repeats, times as medians of the runs, rows written as engines end."""

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_dsa_lite.py"
ARGS = ["--contexts", "4096", "--batches", "2", "--sparsity", "0.5", "--mtp", "0",
        "--backends", "native", "--no-auto"]


def _bench(monkeypatch, times: dict[str, list[tuple[float, float]]], calls: list[str]):
    """The module with in_fresh_process replaced: engine kind -> (step, forward) ms per run."""
    spec = importlib.util.spec_from_file_location("bench_dsa_lite_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def fake(spec: dict) -> dict:
        kind = spec["indexer"]
        run = calls.count(kind)
        calls.append(kind)
        step, forward = times[kind][run]
        return {"indexer": kind, "predictor": spec.get("predictor", "spin"),
                "rho": spec.get("rho"), "backend": spec["backend"], "state_dtype": "float16",
                "context_tokens": spec["context"], "indexer_slots": spec["context"] // 4,
                "batch": spec["batch"], "next_n": spec["mtp"] + 1, "steps": 4,
                "step_ms": step, "forward_ms": forward, "prepare_ms": 1.0 + run,
                "launch_ms": 0.2, "wait_ms": forward, "after_ms": step - forward - 1.2 - run,
                "advance_ms": 0.3, "sync_ms": 0.5 + run,
                "spin_steps": 4 if kind == "spin" else 0,
                "realized_sparsity": 0.5 if kind == "spin" else 0.0,
                "scored_gb": {"null": 0.0, "dense": 8.0, "spin": 4.0}[kind],
                "traffic_gb": {"null": 0.0, "dense": 8.4, "spin": 4.8}[kind]}

    monkeypatch.setattr(mod, "in_fresh_process", fake)
    monkeypatch.setattr(mod.torch.cuda, "is_available", lambda: True)
    return mod


def test_repeats_run_round_robin_and_report_medians(monkeypatch, tmp_path):
    times = {"null": [(20.0, 10.0), (26.0, 10.2), (21.0, 10.1)],
             "dense": [(25.0, 14.0), (24.0, 14.5), (30.0, 14.2)],
             "spin": [(40.0, 12.6), (23.0, 12.0), (22.0, 12.3)]}   # medians differ from run 1
    calls: list[str] = []
    mod = _bench(monkeypatch, times, calls)
    out = tmp_path / "rows.jsonl"
    assert mod.main(ARGS + ["--repeats", "3", "--json", str(out)]) == 0
    assert calls == ["null", "dense", "spin"] * 3
    null, dense, spin = [json.loads(line) for line in out.read_text().splitlines()]
    assert spin["step_ms_runs"] == [40.0, 23.0, 22.0] and spin["repeats"] == 3
    assert spin["step_ms"] == 23.0 and spin["forward_ms"] == 12.3
    assert spin["prepare_ms"] == 2.0                       # the median of 1, 2, 3
    assert dense["step_ms"] == 25.0 and null["forward_ms"] == 10.1
    assert spin["step_speedup"] == pytest.approx(25.0 / 23.0)
    assert spin["forward_speedup"] == pytest.approx(14.2 / 12.3)
    assert spin["indexer_ms"] == pytest.approx(12.3 - 10.1)
    assert spin["indexer_vs_dense"] == pytest.approx((12.3 - 10.1) / (14.2 - 10.1))
    assert spin["sync_ms"] == 1.5                         # the median of 0.5, 1.5, 2.5
    # all-keep's indexer time per byte moved, over SPIN's bytes
    assert spin["ceiling_traffic"] == pytest.approx(14.2 / (10.1 + 4.8 / 8.4 * (14.2 - 10.1)))
    assert spin["ceiling_kept"] == pytest.approx(14.2 / (10.1 + 0.5 * (14.2 - 10.1)))
    # per round: 25/40, 24/23, 30/22; the GPU's 14.2/12.3 lies inside
    assert spin["step_speedup_range"] == pytest.approx([25.0 / 40.0, 30.0 / 22.0])
    assert spin["wall_agrees_with_gpu"] is True
    assert "step_speedup_range" not in dense


def test_a_wall_speedup_outside_the_gpus_is_flagged(monkeypatch, tmp_path):
    """Every round's step speedup near 1 while the GPU gains 15%: host work eats the gain."""
    times = {"null": [(20.0, 10.0), (20.5, 10.0)],
             "dense": [(25.0, 14.2), (25.2, 14.2)],
             "spin": [(24.8, 12.3), (25.1, 12.3)]}
    mod = _bench(monkeypatch, times, [])
    monkeypatch.setattr(mod.torch.cuda, "get_device_name", lambda *a: "a faked GPU")
    out = tmp_path / "rows.jsonl"
    md = tmp_path / "rows.md"
    assert mod.main(ARGS + ["--repeats", "2", "--json", str(out), "--markdown", str(md)]) == 0
    spin = [json.loads(line) for line in out.read_text().splitlines()][-1]
    assert spin["step_speedup_range"] == pytest.approx([25.2 / 25.1, 25.0 / 24.8])
    assert spin["wall_agrees_with_gpu"] is False
    assert "1.004-1.008 (no)" in md.read_text()
    # ceilings kept / HBM / traffic; after the forward (advance / final sync): the median of the
    # runs, 24.8 - 12.3 - 1.2 - 0 and 25.1 - 12.3 - 1.2 - 1
    traffic = 14.2 / (10.0 + 4.8 / 8.4 * 4.2)
    assert f"| {14.2 / (10.0 + 0.5 * 4.2):.3f} / " in md.read_text()
    assert f" / {traffic:.3f} | 1.004-1.008 (no) | 10.95 (0.30 / 1.00) |" in md.read_text()
    # each engine's median and the range of its runs
    assert "| 24.95 (24.80-25.10) | 12.30 (12.30-12.30) |" in md.read_text()


def test_one_run_writes_each_engine_as_it_ends(monkeypatch, tmp_path):
    """A failing engine loses only its own row: the ones before it are already written."""
    calls: list[str] = []
    mod = _bench(monkeypatch, {"null": [(20.0, 10.0)], "dense": [(25.0, 14.0)], "spin": []},
                 calls)
    out = tmp_path / "rows.jsonl"
    with pytest.raises(IndexError):
        mod.main(ARGS + ["--json", str(out)])
    assert calls == ["null", "dense", "spin"]          # the third engine failed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["indexer"] for r in rows] == ["null", "dense"]
    assert rows[1]["step_ms_runs"] == [25.0] and rows[1]["step_ms"] == 25.0


def test_repeats_must_be_positive(monkeypatch, capsys):
    mod = _bench(monkeypatch, {}, [])
    with pytest.raises(SystemExit):
        mod.main(ARGS + ["--repeats", "0"])
    assert "--repeats must be >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="no runs"):
        mod.merge_runs([])


def test_a_failure_in_a_later_round_keeps_every_engines_earlier_runs(monkeypatch, tmp_path):
    calls: list[str] = []
    times = {"null": [(20.0, 10.0), (22.0, 10.2)], "dense": [(25.0, 14.0), (27.0, 14.4)],
             "spin": [(23.0, 12.0)]}                   # its second run fails
    mod = _bench(monkeypatch, times, calls)
    out = tmp_path / "rows.jsonl"
    with pytest.raises(IndexError):
        mod.main(ARGS + ["--repeats", "2", "--json", str(out)])
    null, dense, spin = [json.loads(line) for line in out.read_text().splitlines()]
    assert null["repeats"] == dense["repeats"] == 2 and spin["repeats"] == 1
    assert dense["step_ms"] == 26.0 and spin["step_ms_runs"] == [23.0]
    assert spin["step_speedup"] == pytest.approx(26.0 / 23.0)


def test_ctrl_c_prints_the_runs_so_far_and_writes_nothing(monkeypatch, tmp_path, capsys):
    """device_dsa_lite.sh's BENCH_LIMIT stops the benchmark with SIGINT: every engine's runs of
    the rounds that ended are printed (a file is written only by a whole run or a failure)."""
    calls: list[str] = []
    mod = _bench(monkeypatch, {"null": [(20.0, 10.0)], "dense": [(25.0, 14.0)],
                               "spin": [(23.0, 12.0)]}, calls)
    fake = mod.in_fresh_process

    def interrupted(spec: dict) -> dict:
        if len(calls) == 3:                            # round 2's first run
            raise KeyboardInterrupt
        return fake(spec)
    monkeypatch.setattr(mod, "in_fresh_process", interrupted)
    out = tmp_path / "rows.jsonl"
    with pytest.raises(KeyboardInterrupt):
        mod.main(ARGS + ["--repeats", "2", "--json", str(out)])
    printed = capsys.readouterr().out
    assert calls == ["null", "dense", "spin"]
    assert printed.count("ctx    4096 B   2") == 3 and "SPIN" in printed
    assert not out.exists()


@pytest.mark.parametrize("flags,update,select", [([], True, False),
                                                 (["--no-overlap-update"], False, False),
                                                 (["--overlap-select"], True, True)])
def test_overlap_flags_reach_every_engine(monkeypatch, flags, update, select):
    """--no-overlap-update and --overlap-select go into each engine's spec (the fresh process
    hands them to speed.measure); the defaults are SpinIndexer's."""
    specs: list[dict] = []
    mod = _bench(monkeypatch, {"null": [(20.0, 10.0)], "dense": [(25.0, 14.0)],
                               "spin": [(22.0, 12.0)]}, [])
    fake = mod.in_fresh_process
    monkeypatch.setattr(mod, "in_fresh_process", lambda spec: specs.append(spec) or fake(spec))
    assert mod.main(ARGS + flags) == 0
    assert [s["indexer"] for s in specs] == ["null", "dense", "spin"]
    assert all(s["overlap_update"] is update and s["overlap_select"] is select for s in specs)


def test_ceilings_bound_the_speedup_by_the_kept_share_and_by_peak_bandwidth(monkeypatch, tmp_path,
                                                                            capsys):
    """kept: the null step plus the kept share of the all-keep indexer; HBM: the null step plus
    the scored bytes at --peak-tbs. Only SPIN rows get them, in the JSON, the line and the table."""
    mod = _bench(monkeypatch, {"null": [(20.0, 10.0)], "dense": [(25.0, 14.0)],
                               "spin": [(22.0, 12.5)]}, [])
    monkeypatch.setattr(mod.torch.cuda, "get_device_name", lambda: "a GPU")
    out, md = tmp_path / "rows.jsonl", tmp_path / "rows.md"
    assert mod.main(ARGS + ["--peak-tbs", "4.0", "--json", str(out), "--markdown", str(md)]) == 0
    null, dense, spin = [json.loads(line) for line in out.read_text().splitlines()]
    assert "ceiling_hbm" not in null and "ceiling_kept" not in dense
    # all-keep indexer 4 ms, half of it kept: 14 / (10 + 2); 4 GB at 4 TB/s = 1 ms: 14 / 11
    assert spin["ceiling_kept"] == pytest.approx(14.0 / 12.0)
    assert spin["ceiling_hbm"] == pytest.approx(14.0 / 11.0)
    assert "ceilings x1.167 kept x1.273 HBM" in capsys.readouterr().out
    # traffic: 4.8 of all-keep's 8.4 GB at its time per byte: 14 / (10 + 4 x 4.8 / 8.4)
    assert spin["ceiling_traffic"] == pytest.approx(14.0 / (10.0 + 4.0 * 4.8 / 8.4))
    assert "| 1.167 / 1.273 / 1.140 |" in md.read_text() and "4.0 TB/s peak" in md.read_text()
    assert mod.ceilings(spin, null, dense, 2.0)["ceiling_hbm"] == pytest.approx(14.0 / 12.0)
    with pytest.raises(ValueError, match="peak_tbs"):
        mod.ceilings(spin, null, dense, 0.0)
    with pytest.raises(SystemExit):
        mod.main(ARGS + ["--peak-tbs", "-1"])
    assert "--peak-tbs must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize("name,tbs,note", [("NVIDIA H100 80GB HBM3", 3.35, False),
                                           ("NVIDIA H200", 4.8, False),
                                           ("NVIDIA H100 NVL", 3.9, False),
                                           ("a GPU", 4.8, True)])
def test_peak_bandwidth_follows_the_gpu(monkeypatch, tmp_path, capsys, name, tbs, note):
    """Without --peak-tbs the HBM ceiling takes the GPU's own peak, by its name; an unknown GPU
    gets the H200's, said on stderr."""
    mod = _bench(monkeypatch, {"null": [(20.0, 10.0)], "dense": [(25.0, 14.0)],
                               "spin": [(22.0, 12.5)]}, [])
    monkeypatch.setattr(mod.torch.cuda, "get_device_name", lambda: name)
    out, md = tmp_path / "rows.jsonl", tmp_path / "rows.md"
    assert mod.main(ARGS + ["--json", str(out), "--markdown", str(md)]) == 0
    spin = [json.loads(line) for line in out.read_text().splitlines()][-1]
    assert spin["ceiling_hbm"] == pytest.approx(14.0 / (10.0 + 4.0 / tbs))
    assert f"{tbs} TB/s peak" in md.read_text()
    assert ("not known here" in capsys.readouterr().err) is note


def test_rows_without_traffic_get_no_traffic_ceiling(monkeypatch):
    mod = _bench(monkeypatch, {}, [])
    null = {"forward_ms": 10.0}
    best = {"forward_ms": 14.0, "indexer_ms": 4.0}
    spin = {"realized_sparsity": 0.5, "scored_gb": 4.0}
    got = mod.ceilings(spin, null, best, 4.0)
    assert set(got) == {"ceiling_kept", "ceiling_hbm"}
    assert got["ceiling_hbm"] == pytest.approx(14.0 / 11.0)


def test_host_profile_gives_every_engine_and_round_its_own_file(monkeypatch, tmp_path):
    """--host-profile DIR: each run's spec names its own profile path in DIR (engine and
    round), so that no run overwrites another's."""
    specs: list[dict] = []
    mod = _bench(monkeypatch, {"null": [(20.0, 10.0)] * 2, "dense": [(25.0, 14.0)] * 2,
                               "spin": [(22.0, 12.0)] * 2}, [])
    fake = mod.in_fresh_process
    monkeypatch.setattr(mod, "in_fresh_process", lambda spec: specs.append(spec) or fake(spec))
    assert mod.main(ARGS + ["--repeats", "2", "--host-profile", str(tmp_path)]) == 0
    paths = [Path(s["host_profile"]) for s in specs]
    assert len(paths) == 6 and len(set(paths)) == 6
    assert all(p.parent == tmp_path for p in paths)
    assert [p.name for p in paths[:3]] == ["4096x2_mtp0_null_native_r0",
                                           "4096x2_mtp0_dense_native_r0",
                                           "4096x2_mtp0_spin_0p5_native_r0"]
    assert paths[5].name.endswith("_r1")


def test_without_host_profile_no_run_is_profiled(monkeypatch):
    specs: list[dict] = []
    mod = _bench(monkeypatch, {"null": [(20.0, 10.0)], "dense": [(25.0, 14.0)],
                               "spin": [(22.0, 12.0)]}, [])
    fake = mod.in_fresh_process
    monkeypatch.setattr(mod, "in_fresh_process", lambda spec: specs.append(spec) or fake(spec))
    assert mod.main(ARGS) == 0
    assert specs and not any("host_profile" in s for s in specs)


def test_host_profile_counts_only_the_timed_steps(monkeypatch, tmp_path):
    """The profiler starts once the warm-up steps end: a function called on every step shows
    the timed steps' calls alone, and the text has its per-step rows."""
    mod = _bench(monkeypatch, {}, [])
    calls = []

    def engine_step():
        calls.append(1)

    prof = mod.HostProfile(warmup=3)
    for _ in range(3 + 5):
        engine_step()
        prof.on_step()
    out = tmp_path / "sub" / "spin_0p5_native_r0"
    prof.write(out, steps=5)
    text = (tmp_path / "sub" / "spin_0p5_native_r0.txt").read_text()
    assert (tmp_path / "sub" / "spin_0p5_native_r0.pstats").stat().st_size > 0
    assert text.startswith("timed steps 5; OS threads ")
    row = next(ln for ln in text.splitlines() if ln.endswith(" engine_step"))
    assert float(row.split()[2]) == 1.0      # 5 profiled calls over 5 steps
    assert len(calls) == 8


def test_spins_own_host_time_is_its_host_time_over_all_keeps(monkeypatch, tmp_path, capsys):
    """all-keep 25 ms a step with a 14 ms forward (11 ms of host), SPIN 22 with 12 (10 of
    host): SPIN adds -1 ms of host, and without its own host time its step would be all-keep's
    less the 2 ms of GPU time it saves (23 ms); both in the JSON, the markdown and the line."""
    mod = _bench(monkeypatch, {"null": [(20.0, 10.0)], "dense": [(25.0, 14.0)],
                               "spin": [(22.0, 12.0)]}, [])
    out, md = tmp_path / "rows.jsonl", tmp_path / "rows.md"
    monkeypatch.setattr(mod.torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    assert mod.main(ARGS + ["--json", str(out), "--markdown", str(md)]) == 0
    null, dense, spin = [json.loads(line) for line in out.read_text().splitlines()]
    assert spin["host_over_dense_ms"] == pytest.approx(-1.0)
    assert spin["step_speedup_without_own_host"] == pytest.approx(25.0 / 23.0)
    assert "host_over_dense_ms" not in dense and "host_over_dense_ms" not in null
    assert "host -1.00 ms over all-keep's (x1.087 without)" in capsys.readouterr().out
    spin_row = [ln for ln in md.read_text().splitlines() if "| SPIN 0.5" in ln][0]
    assert spin_row.endswith("| -1.00 (1.087) |")
    header = md.read_text().splitlines()[2]
    assert header.count("|") == spin_row.count("|")


def test_host_profile_must_name_a_directory(monkeypatch, tmp_path, capsys):
    """A file given as --host-profile is refused before any engine runs."""
    calls: list[str] = []
    mod = _bench(monkeypatch, {}, calls)
    not_a_dir = tmp_path / "profile.txt"
    not_a_dir.write_text("x")
    with pytest.raises(SystemExit):
        mod.main(ARGS + ["--host-profile", str(not_a_dir)])
    assert "--host-profile must be a directory" in capsys.readouterr().err and calls == []


def test_host_profile_needs_a_warm_up_step(monkeypatch, capsys):
    """The profile starts after the last warm-up step (measure has no hook before the first
    step): without one it would profile the engine's set-up, so --warmup 0 is refused."""
    calls: list[str] = []
    mod = _bench(monkeypatch, {}, calls)
    with pytest.raises(SystemExit):
        mod.main(ARGS + ["--warmup", "0", "--host-profile", "prof"])
    assert "--host-profile needs --warmup >= 1" in capsys.readouterr().err and calls == []
    with pytest.raises(ValueError, match="needs a warm-up step"):
        mod.HostProfile(warmup=0)
