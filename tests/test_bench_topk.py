"""bench_topk's bandwidth bound on the CPU: the bound from the bytes and the copy bandwidth, the
target's cases, and the table's columns; and the paged keys it draws its inputs from."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_topk.py"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setenv("SPIN_TOPK", "")   # the module sets it and sys.path: both restored after
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("bench_topk_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def row(bench, rows, slots, spin_us, score_bytes, copy_tbs=4.0, fi_us=None):
    r = {"batch": rows, "slots": slots, "next_n": 1, "k": 512, "target_sparsity": 0.5,
         "realized_sparsity": 0.5, "width": slots // 2, "rows": rows, "score_bytes": score_bytes,
         "bound_us": bench.bound_us(score_bytes, copy_tbs), "spin_us": spin_us,
         "spin_mode": "graph", "fi_varlen_us": fi_us, "fi_varlen_mode": "graph",
         "via_fi_us": None, "via_fi_mode": None, "fi_ragged_us": None, "fi_ragged_mode": None,
         "fi_ragged_algo": None, "torch_us": 50.0, "sets_eq": 1.0, "kth_eq": 1.0,
         "kth_eq_torch": 1.0, "trtllm_us": 40.0, "trtllm_mode": "graph", "trtllm_kth_eq": 1.0}
    r["spin_over_bound"] = bench.over(spin_us, r["bound_us"])
    r["fi_over_bound"] = bench.over(fi_us, r["bound_us"])
    return r


def test_bound_is_the_bytes_at_the_copy_bandwidth(bench):
    # 96 rows of 65,536 fp32 scores: 25.2 MB at 4 TB/s = 6.29 us
    assert bench.bound_us(96 * 65536 * 4, 4.0) == pytest.approx(96 * 65536 * 4 / 4e6)
    with pytest.raises(ValueError, match="copy bandwidth must be > 0"):
        bench.bound_us(1024, 0.0)


def test_target_cases_are_the_large_ones_over_twice_the_bound(bench):
    rows = [row(bench, 96, 131072, 60.0, 96 * 65536 * 4),    # 9.5x: over
            row(bench, 96, 131072, 12.0, 96 * 65536 * 4),    # 1.9x: met
            row(bench, 8, 131072, 60.0, 8 * 65536 * 4),      # 8 rows: not a target case
            row(bench, 32, 16384, 60.0, 32 * 8192 * 4),      # 16K slots: not a target case
            row(bench, 32, 32768, None, 32 * 16384 * 4)]     # not timed: over
    assert bench.over_target(rows) == [rows[0], rows[4]]


def test_every_line_has_the_headers_columns(bench):
    rows = [row(bench, 96, 131072, 60.0, 96 * 65536 * 4, fi_us=36.0),
            row(bench, 32, 32768, None, 32 * 16384 * 4)]
    table = bench.markdown(rows, "head").splitlines()
    cells = table[2].count("|")
    assert [line.count("|") for line in table[3:]] == [cells] * 3
    assert table[4].split("|")[-4:-1] == [" 6.29 ", " 9.54 ", " 5.72 "]
    assert table[2].split("|")[9] == " trtllm us (kth eq) "    # TensorRT-LLM's own top-K
    assert table[4].split("|")[9] == " 40.0 (1.000) "


# bench_decode_indexer.make_inputs, which bench_topk and the other benchmarks draw their paged fp8
# cache from, a chunk of pages at a time: the layout the kernels read (a page's 64 fp8 keys, then
# its 64 fp32 scales), keys of the intended spread in every chunk, the same draw for a seed.
@pytest.fixture
def inputs_module(bench):
    import bench_decode_indexer     # on the path bench_topk added (restored after)
    return bench_decode_indexer


def split(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    flat = cache.view(cache.shape[0], -1)
    keys = flat[:, :64 * 128].contiguous().view(torch.float8_e4m3fn).float()
    scales = flat[:, 64 * 128:].contiguous().view(torch.float32)
    return keys, scales


@pytest.mark.parametrize("batch,slots,next_n", [(1, 1, 1), (2, 100, 2), (3, 64 * 70 + 5, 1)])
def test_inputs_cache_layout_and_spread_across_chunks(inputs_module, monkeypatch, batch, slots,
                                                      next_n):
    monkeypatch.setattr(inputs_module, "KEY_DRAW_PAGES", 16)   # many chunks at a small size
    (cache, table, q, w), = inputs_module.make_inputs(batch, slots, next_n, 1, seed=4,
                                                      device="cpu")[0]
    pages = -(-slots // 64)
    assert cache.shape == (batch * pages, 64, 1, 132) and cache.dtype == torch.uint8
    assert sorted(table.flatten().tolist()) == list(range(batch * pages))
    assert q.shape == (batch * next_n, 64, 128) and w.shape == (batch * next_n, 64)
    keys, scales = split(cache)
    assert ((scales >= 0.005) & (scales <= 0.025)).all()
    for at in range(0, keys.shape[0], 16):          # every chunk drawn, none left at zero
        chunk = keys[at:at + 16]
        assert 1.5 < chunk.std().item() < 2.5 and (chunk != 0).float().mean() > 0.99


def test_inputs_lengths_and_the_same_draw_for_the_same_seed(inputs_module):
    (a, _, _, _), = inputs_module.make_inputs(2, 300, 3, 1, seed=7, device="cpu")[0]
    inputs, n = inputs_module.make_inputs(2, 300, 3, 2, seed=7, device="cpu")
    assert torch.equal(inputs[0][0], a) and not torch.equal(inputs[1][0], a)
    assert n.tolist() == [[298, 299, 300]] * 2
