"""Issue 18, ops and engine: what they cannot serve is refused with an error naming it."""

import math

import numpy as np
import pytest
import torch

from spin_trtllm import SpinConfig, SpinError, ops
from spin_trtllm.harness import Engine, Request, tiny
from spin_trtllm.harness.engine import RequestError

CFG = SpinConfig(index_topk=8)


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
