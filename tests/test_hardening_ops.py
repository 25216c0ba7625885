"""Issue 18, ops and engine: what they cannot serve is refused with an error naming it."""

import math

import numpy as np
import pytest
import torch

from spin_trtllm import SpinConfig, SpinError, ops
from spin_trtllm.harness import Engine, Request, tiny
from spin_trtllm.harness.engine import RequestError

CFG = SpinConfig(index_topk=8)
# GPU tests must run the kernels (SPIN_REQUIRE_NATIVE=1), not the reference against itself
pytestmark = pytest.mark.usefixtures("require_native")


def _selection():
    n = torch.tensor([[100], [50]], dtype=torch.int32)
    ids = torch.tensor([[0, 1], [0, -1]], dtype=torch.int32)
    return n, ids, torch.tensor([2, 1], dtype=torch.int32)


def test_an_empty_block_table_reads_nothing():
    n, ids, cnt = _selection()
    q = torch.randn(2, 64, 128).to(torch.float8_e4m3fn)
    z = ops.indexer_logits(q, torch.zeros(4, 64, 1, 132, dtype=torch.uint8), torch.randn(2, 64),
                           n, torch.zeros(2, 0, dtype=torch.int32), ids, cnt)
    assert bool(torch.isneginf(z).all())
    table, lens = ops.compact(ids, cnt, n, torch.zeros(2, 0, dtype=torch.int32))
    assert not bool(table.any()) and lens.tolist() == [[100], [50]]


@pytest.mark.parametrize("op", ["select", "update"])
def test_state_slot_must_be_a_tensor(op):
    n, ids, cnt = _selection()
    st = ops.OpState.zeros(2, 1, 256, CFG)
    step = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(SpinError, match=f"spin::{op}: state_slot must be a tensor"):
        if op == "select":
            ops.select(st, None, n, n - 1, torch.arange(2), step, CFG, 4, 200)
        else:
            ops.update(st, None, torch.zeros(2, 256), ids, cnt, n, n - 1,
                       torch.zeros(2, dtype=torch.int32), step, 0, CFG, 200)


def test_topk_refuses_a_0_dim_block_ids():
    with pytest.raises(SpinError, match="block_ids must have 2 dims"):
        ops.topk(torch.zeros(2, 128), torch.tensor(3, dtype=torch.int32),
                 torch.tensor([2, 2], dtype=torch.int32), 1, 8)


def _invalid_ids_case():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 4 * 64, generator=g)
    ids = torch.tensor([[-3, 1, 2**31 - 1, 33554431], [2**25, 0, -1, 5]], dtype=torch.int32)
    return z, ids, torch.tensor([4, 4], dtype=torch.int32)


def test_topk_gives_minus_1_for_negative_or_overflowing_block_ids():
    z, ids, cnt = _invalid_ids_case()
    out = ops.topk(z, ids, cnt, 1, 256)
    kept = z.topk(256).indices                       # every finite position is taken (K = 256)
    for row in range(2):
        blocks = ids[row].long()[kept[row] // 64]
        slots = blocks * 64 + kept[row] % 64
        ok = (blocks >= 0) & (slots <= 2**31 - 1)
        want = sorted(slots[ok].tolist()) + [-1] * int((~ok).sum())
        assert sorted(out[row].tolist(), key=lambda s: (s < 0, s)) == want
    assert int((out[0] == -1).sum()) == 128          # block -3 and block 2^31 - 1
    assert (33554431 * 64 + 63) in out[0].tolist()   # the largest block whose slots fit int32


def _overflowing_ids_remap():
    """Positions over blocks -3, 2^25 - 1 (the last whose slots fit int32), 2^25 and 2^26
    (whose slot ids would wrap int32), 7."""
    ids = torch.tensor([[-3, 2**25 - 1, 2**25, 2**26, 7]], dtype=torch.int32)
    positions = torch.tensor([[0, 64 + 63, 128 + 5, 192, 256 + 1, -1]], dtype=torch.int32)
    return positions, ids, torch.tensor([5], dtype=torch.int32)


@pytest.mark.parametrize("ascending", [False, True])
def test_remap_gives_minus_1_for_block_ids_whose_slots_overflow_int32(ascending):
    positions, ids, cnt = _overflowing_ids_remap()
    out = ops.remap(positions, ids, cnt, 1, ascending=ascending)
    want = [-1, (2**25 - 1) * 64 + 63, -1, -1, 7 * 64 + 1, -1]
    if ascending:
        want = sorted(s for s in want if s >= 0) + [-1] * want.count(-1)
    assert out[0].tolist() == want


def _overflowing_ids_logits():
    """One request over blocks 0, 2^25 - 1 and 2^25 of a 2^25 + 1 column block table (every
    column page 0), context 100: only block 0's slots (the first 64 columns) are visible."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 64, 128, generator=gen).to(torch.float8_e4m3fn)
    cache = torch.randint(0, 120, (1, 64, 1, 132), generator=gen, dtype=torch.uint8)
    cache.view(-1)[64 * 128:].view(torch.float32).fill_(0.01)
    table = torch.zeros(1, 2**25 + 1, dtype=torch.int32)
    ids = torch.tensor([[0, 2**25 - 1, 2**25]], dtype=torch.int32)
    return (q, cache, torch.randn(1, 64, generator=gen), torch.tensor([[100]], dtype=torch.int32),
            table, ids, torch.tensor([3], dtype=torch.int32))


def test_logits_of_blocks_past_int32_slots_are_minus_inf():
    """The reference (the kernel's fix is checked against it by the GPU test below)."""
    z = ops.indexer_logits(*_overflowing_ids_logits())
    assert bool(torch.isfinite(z[0, :64]).all())
    assert bool(torch.isneginf(z[0, 64:]).all())


@pytest.mark.gpu
def test_gpu_overflowing_block_ids_match_reference():
    positions, ids, cnt = _overflowing_ids_remap()
    for ascending in (False, True):
        want = ops.remap(positions, ids, cnt, 1, ascending=ascending)
        got = ops.remap(positions.cuda(), ids.cuda(), cnt.cuda(), 1, ascending=ascending)
        assert torch.equal(got.cpu(), want)
    args = _overflowing_ids_logits()
    want = ops.indexer_logits(*args)
    got = ops.indexer_logits(*(a.cuda() for a in args))
    assert torch.equal(torch.isneginf(got.cpu()), torch.isneginf(want))
    # the logits tests' measure: FP8 tensor cores sum with fewer mantissa bits than fp32 (an
    # emulation of that gives 8e-5 here, and entries off by 0.009 of up to 130)
    diff = (got.cpu()[:, :64] - want[:, :64]).norm() / want[:, :64].norm()
    assert float(diff) < 5e-4


def test_launch_limits_are_refused_by_name():
    from spin_trtllm.limits import MAX_LAUNCH_BATCH, MAX_M_CAP

    B = MAX_LAUNCH_BATCH + 1
    n = torch.ones(B, 1, dtype=torch.int32)
    ids = torch.zeros(B, 1, dtype=torch.int32)
    cnt = torch.ones(B, dtype=torch.int32)
    refused = f"{B} requests; one launch takes at most {MAX_LAUNCH_BATCH}"
    with pytest.raises(SpinError, match=refused):             # the requests on the grid's y
        ops.indexer_logits(torch.zeros(B, 64, 128).to(torch.float8_e4m3fn),
                           torch.zeros(1, 64, 1, 132, dtype=torch.uint8), torch.zeros(B, 64), n,
                           torch.zeros(B, 1, dtype=torch.int32), ids, cnt)
    with pytest.raises(SpinError, match=refused):
        ops.select(ops.OpState.zeros(2, 1, 64, CFG), torch.zeros(B, dtype=torch.int32), n, n - 1,
                   torch.zeros(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64), CFG, 1, 1)
    table, lens = ops.compact(ids, cnt, n, torch.zeros(B, 1, dtype=torch.int32))  # grid x: fine
    assert lens.shape == (B, 1)
    wide = torch.empty(1, MAX_M_CAP + 1, dtype=torch.int32)           # pages never touched
    with pytest.raises(SpinError, match=f"m_cap {MAX_M_CAP + 1} .last dim.; at most {MAX_M_CAP}"):
        ops.topk(torch.zeros(1, 64), wide, torch.ones(1, dtype=torch.int32), 1, 8)


@pytest.mark.parametrize("op", ["topk", "compact", "remap", "indexer_logits"])
def test_a_meta_tensor_among_real_ones_is_refused(op):
    n, ids, cnt = _selection()
    with pytest.raises(SpinError, match="different devices.*meta"):
        if op == "topk":
            ops.topk(torch.zeros(2, 128), ids.to("meta"), cnt, 1, 8)
        elif op == "compact":
            ops.compact(ids, cnt, n.to("meta"), torch.zeros(2, 2, dtype=torch.int32))
        elif op == "remap":
            ops.remap(torch.zeros(2, 8, dtype=torch.int32), ids, cnt.to("meta"), 1)
        else:
            ops.indexer_logits(torch.randn(2, 64, 128).to(torch.float8_e4m3fn).to("meta"),
                               torch.zeros(4, 64, 1, 132, dtype=torch.uint8),
                               torch.randn(2, 64), n, torch.zeros(2, 2, dtype=torch.int32),
                               ids, cnt, torch.empty(2, 128))


@pytest.mark.gpu
def test_gpu_topk_invalid_block_ids_match_reference(monkeypatch):
    # spin's kernel: flashinfer's path (where installed) puts these -1 entries last in the row
    ops.set_topk_backend("spin")
    z, ids, cnt = _invalid_ids_case()
    want = ops.topk(z, ids, cnt, 1, 256)
    assert torch.equal(ops.topk(z.cuda(), ids.cuda(), cnt.cuda(), 1, 256).cpu(), want)
    # counts far below 0 (x 64 would wrap int32 to a huge row) select nothing, with and without
    # row lengths, at one CTA and a cluster a row
    for blocks in (4, 2048):
        z = torch.randn(2, blocks * 64)
        ids = torch.arange(blocks, dtype=torch.int32).repeat(2, 1)
        cnt = torch.tensor([-2**25 - 1, -2**26 + 1], dtype=torch.int32)
        for lens in (None, torch.full((2, 1), blocks * 64, dtype=torch.int32)):
            got = ops.topk(z.cuda(), ids.cuda(), cnt.cuda(), 1, 256,
                           row_lens=None if lens is None else lens.cuda())
            assert bool((got == -1).all())


@pytest.fixture(scope="module")
def engine():
    return Engine(tiny(), None, max_batch=1)


@pytest.mark.parametrize("req,needle", [
    (Request([math.inf]), "token ids must be ints, got float"),
    (Request([1.0, 2.0]), "token ids must be ints, got float"),
    (Request([True, 5]), "token ids must be ints, got bool"),
    (Request({1: 2, 3: 4}), "must be text, bytes or a list of token ids, got dict"),
    (Request({1, 2}), "got set"),
    (Request(np.array([1.5])), "1-D integer token ids"),
    (Request(torch.ones(2, 2, dtype=torch.int64)), "1-D integer token ids"),
    (Request("hi", turns=None), "turns must be a list of prompts, got NoneType"),
    (Request("hi", turns=5), "turns must be a list of prompts, got int"),
    (Request("hi", max_new_tokens=True), "max_new_tokens must be an int"),
    (Request("hi", seed=False), "seed must be an int"),
    (Request("hi", request_id=True), "request_id must be an int"),
    (Request("hi", temperature=True), "temperature must be a finite number"),
])
def test_engine_refuses_requests_it_cannot_serve(engine, req, needle):
    with pytest.raises(RequestError, match=needle):
        engine.submit(req)
    assert engine.idle                               # nothing was queued


def test_engine_still_takes_integer_arrays(engine):
    rid = engine.submit(Request(np.array([65, 66, 67]), max_new_tokens=1))
    rid2 = engine.submit(Request(torch.tensor([65, 66]), max_new_tokens=1))
    assert rid != rid2


def test_a_state_without_layers_is_refused_by_every_state_op():
    """V [slots, 0, cap]: select, update and reset name it (update's every-layer launch indexed
    logits[0] and the CPU select reduced an empty tensor)."""
    n, ids, cnt = _selection()
    st = ops.OpState.zeros(2, 1, 256, CFG)
    empty = ops.OpState(*(t[:, :0] for t in st.tensors()))
    step = torch.zeros(2, dtype=torch.int64)
    slots = torch.arange(2, dtype=torch.int32)
    with pytest.raises(SpinError, match=r"spin::select: the state has no indexer layers"):
        ops.select(empty, slots, n, n - 1, torch.arange(2), step, CFG, 4, 200)
    with pytest.raises(SpinError, match=r"spin::update: the state has no indexer layers"):
        ops.update(empty, slots, torch.zeros(0, 2, 256), ids[:, None, :0], cnt[:, None][:, :0],
                   n, n - 1, torch.zeros(2, dtype=torch.int32), step, -1, CFG, 200)
    with pytest.raises(SpinError, match=r"spin::reset: the state has no indexer layers"):
        ops.reset(empty, slots, step)


def test_sizes_past_the_kernels_int32_are_refused():
    """An expand view makes a dim of 2^31 for free; the bindings hand sizes to the kernels as
    int32, so such a dim would wrap (a block_scores width read as negative ignored every
    score). Every op's tensor check refuses it."""
    from spin_trtllm.limits import INT32_MAX
    from spin_trtllm.ops._common import check_tensor

    wide = torch.empty(1, 4, dtype=torch.int32).expand(INT32_MAX + 1, 4)
    with pytest.raises(SpinError, match=r"spin::compact: block_table has shape \[2147483648, 4\]: "
                                        r"the kernels take sizes of at most 2147483647"):
        check_tensor("compact", "block_table", wide, (torch.int32,), 2, wide.device)
    check_tensor("compact", "block_table", wide[:INT32_MAX], (torch.int32,), 2, wide.device)


def test_topk_k_and_rows_are_bounded():
    """K past MAX_INDEX_TOPK, or more rows than a launch takes (the kernels count rows and
    loop to K in int32), is an error naming the bound."""
    from spin_trtllm.limits import MAX_INDEX_TOPK, MAX_LAUNCH_BATCH, MAX_NEXT_N

    n, ids, cnt = _selection()
    z = torch.randn(2, 128)
    ops.topk(z, ids, cnt, 1, MAX_INDEX_TOPK)                # the largest K: -1 padded
    with pytest.raises(SpinError, match=rf"out must have shape \[2, 1 <= K <= {MAX_INDEX_TOPK}\]"):
        ops.topk(z, ids, cnt, 1, MAX_INDEX_TOPK + 1)
    B = MAX_LAUNCH_BATCH * MAX_NEXT_N // 2 + 1                   # x next_n 2: one row too many
    many = torch.zeros(B, 1, dtype=torch.int32)
    with pytest.raises(SpinError, match=rf"spin::topk: {B} requests x 2 rows; one launch takes "
                                        rf"at most {MAX_LAUNCH_BATCH * MAX_NEXT_N} rows"):
        ops.topk(torch.zeros(2 * B, 64), many, many[:, 0], 2, 4)
    with pytest.raises(SpinError, match=rf"spin::compact: {B} requests x 2 rows"):
        ops.compact(many, many[:, 0], many.expand(B, 2).contiguous(), many)
    with pytest.raises(SpinError, match=rf"spin::remap: {B} requests x 2 rows"):
        ops.remap(torch.zeros(2 * B, 4, dtype=torch.int32), many, many[:, 0], 2)


def test_summarize_newest_takes_at_most_a_launch_batch():
    from spin_trtllm.limits import MAX_LAUNCH_BATCH

    cache = torch.zeros(4, 64, 1, 132, dtype=torch.uint8)
    B = MAX_LAUNCH_BATCH + 1
    with pytest.raises(SpinError, match=rf"spin::summarize_newest: context_lens has {B} requests"):
        ops.summarize_newest(cache, torch.ones(B, 1, dtype=torch.int32),
                             torch.zeros(B, 1, dtype=torch.int32), 64, ops.summaries_like(cache))
