"""spin.topk through flashinfer's top-K (ops.topk_peer): the same contract as spin's kernel.

On the CPU a stand-in flashinfer module ranks the rows with torch.topk and returns positions
in a scrambled order, -1 padded, as flashinfer's top_k_varlen and top_k_ragged_transform do;
the result must equal the reference top-K (spin_trtllm.reference). On a GPU with flashinfer
installed the real one is compared with spin's kernel."""

import sys
import types

import pytest
import torch

from spin_trtllm import SpinError, ops
from spin_trtllm.limits import BLOCK_SLOTS, TOPK_FILTER_AUTO_MAX_ROWS, TOPK_FILTER_MAX_SLOTS
from spin_trtllm.ops import _topk
from spin_trtllm import reference as ref

BLOCK = BLOCK_SLOTS


def fake_top_k_varlen(x, seq_lens, k, return_values=False, **_):
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (x.shape[0],)
    assert x.is_contiguous() and bool((seq_lens <= x.shape[1]).all())
    rows = x.shape[0]
    pos = torch.full((rows, k), -1, dtype=torch.int32)
    vals = torch.full((rows, k), float("-inf"))
    g = torch.Generator().manual_seed(rows)
    for r in range(rows):
        n = min(int(seq_lens[r]), x.shape[1])
        take = min(k, n)
        if take:
            v, i = torch.topk(x[r, :n], take)
            perm = torch.randperm(k, generator=g)[:take]      # positions come unordered
            pos[r, perm] = i.to(torch.int32)
            vals[r, perm] = v
    return pos, (vals if return_values else None)


def fake_top_k_ragged_transform(x, offsets, lengths, k, **_):
    assert offsets.dtype == torch.int32 and lengths.dtype == torch.int32
    pos, _ = fake_top_k_varlen(x, lengths, k)
    return torch.where(pos >= 0, pos + offsets.view(-1, 1), -1)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.top_k_varlen = fake_top_k_varlen
    mod.top_k_ragged_transform = fake_top_k_ragged_transform
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    _topk._flashinfer_topk.cache_clear()
    yield
    _topk._flashinfer_topk.cache_clear()


def case(seed, B, R, m_cap, k, with_row_lens):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, m_cap + 1, (B,), generator=g, dtype=torch.int32)
    ids = torch.full((B, m_cap), -1, dtype=torch.int32)
    for b in range(B):
        n = int(counts[b])
        ids[b, :n] = torch.randperm(3 * m_cap, generator=g)[:n].sort().values.to(torch.int32)
    logits = torch.randn(B * R, m_cap * BLOCK + 8, generator=g)     # wider rows (DeepGEMM's)
    # compact lengths per row: the last selected block partly visible, one more slot a row
    ragged = torch.randint(1, BLOCK + 1, (B,), generator=g)
    base = (counts.long() - 1).clamp(min=0) * BLOCK + ragged
    lens = torch.stack([torch.minimum(base + j - (R - 1), counts.long() * BLOCK).clamp(min=0)
                        for j in range(R)], 1).to(torch.int32)
    past = torch.arange(logits.shape[1]) >= lens.view(-1, 1)
    if not with_row_lens:
        logits = logits.masked_fill(past, float("-inf"))     # what the native kernel writes
    return logits, ids, counts, lens if with_row_lens else None


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("R", [1, 2, 3])
@pytest.mark.parametrize("with_row_lens", [False, True])
@pytest.mark.parametrize("k", [7, 64, 150])         # 150: more than most rows hold
@pytest.mark.parametrize("entry", ["ragged", "varlen"])
@pytest.mark.parametrize("layout", ["wide", "strided"])
def test_peer_path_equals_the_reference(fake_flashinfer, monkeypatch, seed, R, with_row_lens, k,
                                        entry, layout):
    ops.set_topk_backend("flashinfer")
    monkeypatch.setattr(_topk, "TOPK_RAGGED_MAX_ROWS", 64 if entry == "ragged" else 0)
    called = []
    fake = getattr(sys.modules["flashinfer"], f"top_k_{entry}" + ("_transform" if entry ==
                                                                    "ragged" else ""))
    monkeypatch.setattr(sys.modules["flashinfer"], fake.__name__.replace("fake_", ""),
                        lambda *a, **kw: called.append(1) or fake(*a, **kw))
    _topk._flashinfer_topk.cache_clear()
    logits, ids, counts, row_lens = case(seed, 4, R, 3, k, with_row_lens)
    if layout == "strided":                   # a view into wider rows: ranked from a copy
        logits = torch.cat([logits, torch.full_like(logits, float("nan"))], 1)[:, :logits.shape[1]]
        assert not logits.is_contiguous()
    assert ops.topk_peer(logits, ids, k) == "flashinfer"
    out = torch.full((logits.shape[0], k), 7, dtype=torch.int32)
    ops.topk(logits, ids, counts, R, k, out, row_lens=row_lens)
    want = ref.topk_slots(logits[:, :ids.shape[1] * BLOCK], ids, counts, R, k, row_lens=row_lens)
    assert torch.equal(out, want) and called


@pytest.mark.parametrize("entry", ["ragged", "varlen"])
def test_peer_path_never_returns_a_nan_slot(fake_flashinfer, monkeypatch, entry):
    # a peer may rank NaN first (torch.topk does): the slot is dropped, so the row can hold
    # fewer ids than the reference's, never a NaN one, every other one the reference's
    ops.set_topk_backend("flashinfer")
    monkeypatch.setattr(_topk, "TOPK_RAGGED_MAX_ROWS", 64 if entry == "ragged" else 0)
    logits, ids, counts, _ = case(5, 4, 1, 3, 16, False)
    counts[0] = 2
    logits[0, 5] = logits[0, 70] = float("nan")
    out = ops.topk(logits, ids, counts, 1, 16)
    want = ref.topk_slots(logits[:, :ids.shape[1] * BLOCK], ids, counts, 1, 16)
    nan_slots = {int(ids[0, 0]) * BLOCK + 5, int(ids[0, 1]) * BLOCK + 6}
    got0 = [s for s in out[0].tolist() if s >= 0]
    assert len(got0) == 14 and not nan_slots & set(got0) and set(got0) <= set(want[0].tolist())
    assert torch.equal(out[1:], want[1:])


def test_peer_choice(fake_flashinfer, monkeypatch):
    logits, ids, counts, _ = case(0, 2, 1, 3, 16, False)
    ops.set_topk_backend("auto")
    assert ops.topk_peer(logits, ids, 16) is None          # auto: CUDA and large shapes only
    ops.set_topk_backend("spin")
    assert ops.topk_peer(logits, ids, 16) is None
    ops.set_topk_backend("flashinfer")
    assert ops.topk_peer(logits, ids, 16) == "flashinfer"
    assert ops.topk_peer(logits, ids, 4 * BLOCK) is None   # K wider than the rows
    with pytest.raises(SpinError, match="SPIN_TOPK must be auto, spin or flashinfer"):
        ops.set_topk_backend("fastest")
    monkeypatch.setenv("SPIN_TOPK", "fastest")           # read once, at the next top-K
    ops.set_topk_backend(None)
    with pytest.raises(SpinError, match="SPIN_TOPK must be auto, spin or flashinfer"):
        ops.topk(logits, ids, counts, 1, 16)


def test_without_flashinfer_spin_ranks(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)    # import fails
    _topk._flashinfer_topk.cache_clear()
    try:
        ops.set_topk_backend("flashinfer")
        logits, ids, counts, _ = case(1, 2, 1, 3, 16, False)
        assert ops.topk_peer(logits, ids, 16) is None
    finally:
        _topk._flashinfer_topk.cache_clear()


def test_peer_path_checks_its_arguments(fake_flashinfer, monkeypatch):
    ops.set_topk_backend("flashinfer")
    logits, ids, counts, _ = case(2, 2, 1, 3, 16, False)
    with pytest.raises(SpinError, match="out"):
        ops.topk(logits, ids, counts, 1, 16, torch.empty(2, 16, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("with_row_lens", [False, True])
@pytest.mark.parametrize("B", [8, 96])     # 8 or 16 rows: the ragged entry; 96 or 192: varlen
def test_flashinfer_matches_spins_kernel_on_gpu(monkeypatch, R, with_row_lens, B):
    _topk._flashinfer_topk.cache_clear()
    if _topk._flashinfer_topk() is None:
        pytest.skip("flashinfer is not installed")
    m_cap, k = 512, 512
    for seed in range(3):
        logits, ids, counts, row_lens = case(seed, B, R, m_cap, k, with_row_lens)
        counts[0], counts[1] = 3, 0       # fewer entries than K, none
        if row_lens is not None:
            row_lens[:2] = torch.minimum(row_lens[:2], counts[:2, None] * BLOCK)
        else:
            logits[:2 * R, 3 * BLOCK:] = float("-inf")
        logits, ids, counts = logits.cuda(), ids.cuda(), counts.cuda()
        row_lens = row_lens.cuda() if row_lens is not None else None
        outs = []
        for choice in ("spin", "flashinfer"):
            ops.set_topk_backend(choice)
            out = torch.empty(B * R, k, dtype=torch.int32, device="cuda")
            outs.append(ops.topk(logits, ids, counts, R, k, out, row_lens=row_lens))
        assert torch.equal(outs[0], outs[1])
        # and under a captured graph
        ops.set_topk_backend("flashinfer")
        out = torch.empty(B * R, k, dtype=torch.int32, device="cuda")
        ops.topk(logits, ids, counts, R, k, out, row_lens=row_lens)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ops.topk(logits, ids, counts, R, k, out, row_lens=row_lens)
        out.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, outs[0])


@pytest.mark.gpu
def test_auto_hands_flashinfer_only_shapes_past_spins_bounds(monkeypatch):
    _topk._flashinfer_topk.cache_clear()
    if _topk._flashinfer_topk() is None:
        pytest.skip("flashinfer is not installed")
    ops.set_topk_backend("auto")
    widest = ops.TOPK_SPIN_MAX_WIDTH // BLOCK      # blocks of the widest table spin keeps
    wider = widest + 1
    few = ops.TOPK_SPIN_MAX_ROWS
    many = few + 1
    past_filter = TOPK_FILTER_MAX_SLOTS // BLOCK + 1
    cases = {"0": ((many, wider, "flashinfer"), (many, widest, None), (192, widest, None),
                   (few, wider, None), (few, 4 * wider, None), (96, 2 * wider, "flashinfer"),
                   (8, 16, None)),
             # the rows spin's filter ranks stay with spin; wider ones and more rows do not
             "auto": ((many, wider, None), (TOPK_FILTER_AUTO_MAX_ROWS, wider, None),
                      (TOPK_FILTER_AUTO_MAX_ROWS + 1, wider, "flashinfer"), (few, wider, None),
                      (96, past_filter, "flashinfer"))}
    for mode, shapes in cases.items():
        monkeypatch.setenv("SPIN_TOPK_FILTER", mode)
        for rows, m_cap, want in shapes:
            logits = torch.zeros(rows, m_cap * BLOCK, device="cuda")
            ids = torch.zeros(rows, m_cap, dtype=torch.int32, device="cuda")
            assert ops.topk_peer(logits, ids, 512) == want, (mode, rows, m_cap)
    monkeypatch.setenv("SPIN_TOPK_FILTER", "0")     # the layouts below, without the filter
    wide = torch.zeros(many, wider * BLOCK + 4, device="cuda")
    ids = torch.zeros(many, wider, dtype=torch.int32, device="cuda")
    assert ops.topk_peer(wide, ids, 512) == "flashinfer"    # wider rows, contiguous: in place
    strided = torch.zeros(many, 2 * wider * BLOCK, device="cuda")[:, :wider * BLOCK + 4]
    assert ops.topk_peer(strided, ids, 512) is None          # would need a copy: spin's kernel
    assert ops.topk_peer(wide[:, :wider * BLOCK].contiguous(), ids, ops.MAX_SORTED_K + 1) is None


def test_no_rows_never_reach_the_peer(fake_flashinfer, monkeypatch):
    ops.set_topk_backend("flashinfer")
    logits, ids, counts, _ = case(3, 2, 1, 3, 16, False)
    assert ops.topk_peer(logits[:0], ids[:0], 16) is None
    assert ops.topk(logits[:0], ids[:0], counts[:0], 1, 16).shape == (0, 16)


def test_using_a_backend_switches_the_one_read_once(monkeypatch):
    # bench_topk's flashinfer-path column: setting SPIN_TOPK would not switch it
    monkeypatch.setattr(_topk, "_backend", None)   # restored after: other tests read SPIN_TOPK
    monkeypatch.setenv("SPIN_TOPK", "spin")
    ops.topk_backend()                     # read SPIN_TOPK, as the spin column's first call does
    before = ops.topk_backend()
    with ops.using_topk_backend("flashinfer"):
        assert ops.topk_backend() == "flashinfer"
    assert ops.topk_backend() == before
    with pytest.raises(RuntimeError), ops.using_topk_backend("flashinfer"):
        raise RuntimeError("a failed call")
    assert ops.topk_backend() == before
