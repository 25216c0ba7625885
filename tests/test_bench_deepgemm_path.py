"""bench_deepgemm_path's table on the CPU: every row has the header's columns, SPIN through
DeepGEMM as SpinIndexer runs it (the update beside the top-K) beside the sum, older rows too."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_deepgemm_path.py"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))   # the module adds benchmarks/
    spec = importlib.util.spec_from_file_location("bench_deepgemm_path_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def row(beside: bool | None) -> dict:
    r = {"batch": 96, "slots": 131072, "next_n": 1 if beside is not False else 2,
         "target_sparsity": 0.5, "realized_sparsity": 0.5, "dense_logits_us": 420.0,
         "dense_logits_tbs": 3.9, "dense_topk_us": 60.0, "dense_schedule_us": 3.0,
         "select_per_layer_us": 15.0, "spin_dg_logits_us": 225.0, "spin_topk_us": 58.0,
         "update_us": 23.0, "spin_dg_us": 321.0, "spin_native_us": 318.0,
         "spin_dg_over_dense": 321.0 / 480.0, "spin_native_over_dense": 318.0 / 480.0,
         "topk_sets_equal_native_vs_dg": 1.0, "update_in_sequence_us": 20.0,
         "select_update_over_dense_logits": 35.0 / 420.0}
    if beside is not None:      # rows written before the as-run columns lack them
        r.update(update_beside_topk=beside, topk_update_us=66.0 if beside else 81.0,
                 spin_dg_as_run_us=306.0 if beside else 321.0,
                 spin_dg_as_run_over_dense=(306.0 if beside else 321.0) / 480.0)
    return r


def test_every_row_has_the_headers_columns(bench):
    table = bench.markdown([row(True), row(False), row(None)], 3.9).splitlines()
    cells = table[2].count("|")
    assert [line.count("|") for line in table[3:]] == [cells] * 4


def test_compact_and_schedule_in_the_logits_cell(bench):
    timed = dict(row(True), compact_us=4.2, spin_dg_schedule_us=3.1)
    table = bench.markdown([timed, row(None)], 3.9).splitlines()
    assert "+ 225.0 (compact 4.2, schedule 3.1) + 58.0 +" in table[4]
    assert "+ 225.0 + 58.0 +" in table[5]        # rows of older files: no breakdown


def test_as_run_columns(bench):
    assert bench.as_run_cells(row(True)) == "66.0 | 0.64"
    assert bench.as_run_cells(row(False)) == "81.0 (after) | 0.67"
    assert bench.as_run_cells(row(None)) == "- | -"


def test_floor_and_topk_bound_columns(bench):
    r = dict(row(True), logits_floor_over_dense=225.0 / 480.0, spin_topk_bound_us=2.9,
             dense_topk_bound_us=6.0)
    assert bench.floor_cells(r) == "0.47 | 20.0x / 10.0x"
    assert bench.floor_cells(row(True)) == "- | -"     # rows of older files
    table = bench.markdown([r, row(None)], 3.9).splitlines()
    assert table[4].endswith("| 0.47 | 20.0x / 10.0x | - | - |")


def test_traffic_columns(bench):
    r = dict(row(True), spin_traffic_mb=1000.0, dense_traffic_mb=1750.0,
             traffic_floor_spin_us=330.0, traffic_floor_dense_us=580.0,
             dense_us=609.0, spin_dg_as_run_us=346.5)
    assert bench.traffic_cells(r) == "0.571 | 1.05x / 1.05x"
    assert bench.traffic_cells(row(True)) == "- | -"       # rows of older files
    table = bench.markdown([r, row(True)], 3.0).splitlines()
    assert table[4].endswith("| 0.571 | 1.05x / 1.05x |")
    assert table[5].endswith("| - | - |")
