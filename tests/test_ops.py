"""torch.ops.spin.*: contracts, validation and the reference (CPU); native kernels vs the
reference on the GPU (marked gpu, skipped without CUDA)."""

import math
import subprocess
import sys

import pytest
import torch

from spin_trtllm import SpinConfig, SpinError
from spin_trtllm import ops
from spin_trtllm import reference as ref

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _native_when_required(request):
    """SPIN_REQUIRE_NATIVE=1 (set by tests/gpu/device_check.sh): GPU tests must exercise the
    kernels, not compare the reference with itself."""
    import os

    if CUDA and os.environ.get("SPIN_REQUIRE_NATIVE") == "1":
        assert ops.NATIVE, "the native library did not load"


@pytest.fixture(autouse=True)
def _spins_own_topk(monkeypatch):
    """These tests hold spin's kernels to the reference bit for bit, ties included. Where
    flashinfer is installed ops.topk may hand rows to its top-K, which breaks ties at the K-th
    value its own way (tests/test_topk_peer.py checks that path)."""
    monkeypatch.setenv("SPIN_TOPK", "spin")


def test_a_stale_native_library_is_not_used(tmp_path, monkeypatch, caplog):
    """A library built before an op changed meaning under the same schema (update's layer -1)
    would misread the call: its ABI version must match, else the reference runs."""
    import logging

    (tmp_path / "libspin_native_old.so").write_bytes(b"")
    monkeypatch.setattr(torch.ops, "load_library", lambda path: None)
    monkeypatch.setattr(ops, "_native_abi", lambda: ops.NATIVE_ABI - 1)
    with caplog.at_level(logging.WARNING, logger="spin_trtllm"):
        assert ops._load_native(tmp_path) is False
    assert f"libspin_native_old.so is stale (kernel ABI {ops.NATIVE_ABI - 1}, these ops need " \
           f"{ops.NATIVE_ABI})" in caplog.text
    monkeypatch.setattr(ops, "_native_abi", lambda: ops.NATIVE_ABI)
    assert ops._load_native(tmp_path) is True
    assert ops._load_native(tmp_path / "empty") is False          # no library there


def test_native_abi_of_a_library_without_the_version_op():
    if ops.NATIVE:
        assert ops._native_abi() == ops.NATIVE_ABI
    else:
        assert ops._native_abi() == 1      # nothing loaded: spin_native has no abi_version


# ---- random problem ------------------------------------------------------------------------------
def make_cache(num_pages, gen, device="cpu"):
    """Random FP8 pages in the TRT-LLM/DeepGEMM layout: 64 rows of 128 fp8, then 64 fp32 scales."""
    rows = (torch.randn(num_pages, 64 * 128, generator=gen) * 2).to(torch.float8_e4m3fn)
    scales = torch.rand(num_pages, 64, generator=gen) * 0.02 + 0.005
    pages = torch.cat([rows.view(torch.uint8), scales.view(torch.uint8)], dim=1)
    return pages.view(num_pages, 64, 1, 132).to(device)


def same(a, b):
    """Bit-for-bit equality of two tensors, float8 ones included (torch.equal lacks them)."""
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def integer_state(*problems):
    """Integer-valued V/D: mean and top4 pooling then sum exactly in any order (the kernels'
    order differs from torch's)."""
    for p in problems:
        g = torch.Generator().manual_seed(9)
        p.state.V.copy_(torch.randint(-20, 20, p.state.V.shape, generator=g).to(p.state.V.dtype))
        p.state.D.copy_(torch.randint(-20, 20, p.state.D.shape, generator=g).to(p.state.D.dtype))


class Problem:
    """A batch of B requests x R rows over L layers with mixed lengths and shuffled pages."""

    def __init__(self, B=3, R=1, L=2, lens=(700, 64, 1500), cap=None, seed=0, cfg=None,
                 warm=(False,), device="cpu", slots=None):
        gen = torch.Generator().manual_seed(seed)
        self.cfg = cfg or SpinConfig(index_topk=128, target_sparsity=0.5, exploration=0.0)
        self.B, self.R, self.L = B, R, L
        lens = [lens[i % len(lens)] for i in range(B)]
        self.cap = cap or max(lens) + R + 64
        self.max_ctx = max(lens) + R - 1
        n = torch.tensor([[l + r for r in range(R)] for l in lens], dtype=torch.int32)
        self.n, self.q = n, (n - 1).clone()
        S = B + 2
        self.state = ops.OpState.zeros(S, L, self.cap, self.cfg)
        self.state.V.copy_(torch.randn(S, L, self.cap, generator=gen))
        self.state.D.copy_(torch.randn(S, L, self.cap, generator=gen))
        self.state.last_seen.copy_(torch.randint(0, 50, self.state.last_seen.shape, generator=gen))
        self.state.decode_steps.copy_(torch.tensor(
            [[0 if warm[i % len(warm)] else 9] * L for i in range(S)]))
        self.slot = (torch.randperm(S, generator=gen)[:B] if slots is None
                     else torch.tensor(slots)).to(torch.int32)
        self.request = torch.randint(0, 1000, (B,), generator=gen)
        self.step = torch.full((B,), 60, dtype=torch.int64)
        pages_per_req = math.ceil(self.cap / 64)
        self.num_pages = B * pages_per_req + 3
        self.cache = [make_cache(self.num_pages, gen) for _ in range(L)]
        self.table = torch.randperm(self.num_pages, generator=gen)[:B * pages_per_req].view(
            B, pages_per_req).to(torch.int32)
        self.qfp8 = (torch.randn(B * R, 64, 128, generator=gen)).to(torch.float8_e4m3fn)
        self.weights = torch.randn(B * R, 64, generator=gen) * 0.1
        self.accepted = torch.randint(0, R, (B,), generator=gen, dtype=torch.int32)
        self.m_cap = math.ceil(self.cap / 64)
        self.to(device)

    def to(self, device):
        for name in ("n", "q", "slot", "request", "step", "table", "qfp8", "weights", "accepted"):
            setattr(self, name, getattr(self, name).to(device))
        self.cache = [c.to(device) for c in self.cache]
        st = self.state
        self.state = ops.OpState(*(t.to(device) for t in st.tensors()))
        return self

    def clone_state(self):
        return ops.OpState(*(t.clone() for t in self.state.tensors()))

    def run_step(self, state=None, m_cap=None):
        """select -> per layer logits, topk, update. Returns (ids, counts, [logits], [topk])."""
        state = state or self.state
        m_cap = m_cap or self.m_cap
        ids, cnt = ops.select(state, self.slot, self.n, self.q, self.request, self.step, self.cfg,
                              m_cap, self.max_ctx)
        logits, tops = [], []
        for l in range(self.L):
            z = ops.indexer_logits(self.qfp8, self.cache[l], self.weights, self.n, self.table,
                                   ids[:, l], cnt[:, l])
            tops.append(ops.topk(z, ids[:, l], cnt[:, l], self.R, self.cfg.index_topk))
            ops.update(state, self.slot, z, ids[:, l], cnt[:, l], self.n, self.q, self.accepted,
                       self.step, l, self.cfg, self.max_ctx)
            logits.append(z)
        return ids, cnt, logits, tops


# ---- CPU: the reference ops against independent per-stream computations ----------------------------
def test_select_matches_per_stream_reference():
    p = Problem(B=3, R=2, L=2, cfg=SpinConfig(index_topk=128, target_sparsity=0.4,
                                              exploration=0.1), warm=(False, True, False))
    ids, cnt = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, p.cfg, p.m_cap, p.max_ctx)
    for b in range(p.B):
        for l in range(p.L):
            s = int(p.slot[b])
            st = ref.SpinState(p.state.V[s, l][None].clone(), p.state.D[s, l][None].clone(),
                               p.state.last_seen[s, l][None].clone(),
                               p.state.decode_steps[s, l][None].clone())
            n, q = p.n[b][None].long(), p.q[b][None].long()
            blocks, slot_pred = ref.predict_blocks(st, n, q, p.cfg, int(n.max()))
            sel = ref.select_blocks(blocks, slot_pred, n, st, p.cfg, torch.tensor([0.4]),
                                    p.request[b:b + 1], torch.tensor([l]), p.step[b:b + 1])
            want = sel.mask[0].nonzero().flatten().tolist()
            got = ids[b, l][: int(cnt[b, l])].tolist()
            assert got == want and int(cnt[b, l]) == len(want)
            assert (ids[b, l][len(want):] == -1).all()
    # request 1 is in warm-up: every block of its longest row
    assert cnt[1, 0] == math.ceil(int(p.n[1].max()) / 64)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
@pytest.mark.parametrize("R,mtp_mask,policy", [(1, "union", "random"), (2, "union", "age"),
                                               (2, "row0", "staleness")])
def test_select_one_layer_writes_the_all_layer_calls_slice(device, R, mtp_mask, policy):
    """select(layer=l) (how SpinIndexer selects beside the previous layer's top-K) writes the
    ids and counts the all-layer call writes for l, exploration draws, warm-up and MTP rows
    included, and leaves the other layers alone."""
    cfg = SpinConfig(index_topk=128, target_sparsity=0.4, exploration=0.2, mtp_mask=mtp_mask,
                     exploration_policy=policy)
    p = Problem(B=3, R=R, L=3, lens=(700, 64, 1500), cfg=cfg, warm=(False, True, False),
                seed=7, device=device)
    ids, cnt = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx)
    assert int(cnt.min()) > 0
    for layer in range(p.L):
        ids_l, cnt_l = torch.full_like(ids, -5), torch.full_like(cnt, -5)
        ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx,
                   ids_l, cnt_l, layer=layer, beside_previous=True)
        assert torch.equal(ids_l[:, layer], ids[:, layer]), layer
        assert torch.equal(cnt_l[:, layer], cnt[:, layer]), layer
        others = [k for k in range(p.L) if k != layer]
        assert (ids_l[:, others] == -5).all() and (cnt_l[:, others] == -5).all()


def test_select_rejects_a_layer_outside_the_state():
    p = Problem(B=2, L=2)
    for layer in (2, -2):
        with pytest.raises(SpinError, match=f"layer {layer} is outside"):
            ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, p.cfg, p.m_cap, p.max_ctx,
                       layer=layer)


def test_select_overflow_keeps_lowest_ids_and_true_count():
    p = Problem(B=1, L=1, lens=(1500,), warm=(True,))
    ids, cnt = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, p.cfg, 5, p.max_ctx)
    assert int(cnt[0, 0]) == math.ceil(1500 / 64) and ids[0, 0].tolist() == [0, 1, 2, 3, 4]


def test_logits_match_naive_loop():
    p = Problem(B=2, R=2, L=1, lens=(200, 130))
    ids = torch.tensor([[3, 0, 1, -1], [2, 0, 1, 1]], dtype=torch.int32)
    cnt = torch.tensor([3, 2], dtype=torch.int32)
    out = ops.indexer_logits(p.qfp8, p.cache[0], p.weights, p.n, p.table, ids, cnt)
    keys = ref.dequantize_pages(p.cache[0]).double()
    for b in range(2):
        for r in range(2):
            row = b * 2 + r
            for c in range(4):
                for s in (0, 17, 63):
                    got = float(out[row, c * 64 + s])
                    j = int(ids[b, c])
                    i = j * 64 + s
                    if c >= int(cnt[b]) or i >= int(p.n[b, r]):
                        assert got == float("-inf")
                        continue
                    k = keys[int(p.table[b, j]), s]
                    qd = p.qfp8[row].float().double()
                    want = float((p.weights[row].double() * torch.relu(qd @ k)).sum())
                    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_dequantize_layout_rows_then_scales():
    cache = torch.zeros(1, 64 * 132, dtype=torch.uint8)
    one = torch.tensor([1.0]).to(torch.float8_e4m3fn).view(torch.uint8)
    cache[0, 5 * 128 + 7] = one                       # slot 5, dim 7 (rows first)
    cache[0, 8192 + 5 * 4: 8192 + 6 * 4] = torch.tensor([3.0]).view(torch.uint8)  # scale of slot 5
    keys = ref.dequantize_pages(cache.view(1, 64, 1, 132))
    assert keys[0, 5, 7] == 3.0 and keys.abs().sum() == 3.0


def test_out_of_cache_block_table_entries_score_minus_inf():
    p = Problem(B=1, R=1, L=1, lens=(300,))
    table = p.table.clone()
    table[0, 1] = p.num_pages + 100          # outside the cache
    table[0, 2] = -7
    ids = torch.tensor([[0, 1, 2, 3]], dtype=torch.int32)
    out = ops.indexer_logits(p.qfp8, p.cache[0], p.weights, p.n, table, ids,
                             torch.tensor([4], dtype=torch.int32))
    assert torch.isfinite(out[0, :64]).all() and torch.isfinite(out[0, 192:256]).all()
    assert (out[0, 64:192] == float("-inf")).all()


def test_topk_slots_match_naive():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3 * 64, generator=gen)
    logits[0, 5] = logits[0, 6] = 99.0                       # tie at the top
    logits[1, 64:] = float("-inf")
    ids = torch.tensor([[2, 7, 9], [0, 4, 1]], dtype=torch.int32)   # ascending, as select writes
    cnt = torch.tensor([3, 2], dtype=torch.int32)
    out = ops.topk(logits, ids, cnt, 2, 40)
    for row in range(4):
        b = row // 2
        vals = [(float(logits[row, pos]), pos) for pos in range(int(cnt[b]) * 64)
                if math.isfinite(float(logits[row, pos]))]
        vals.sort(key=lambda x: (-x[0], x[1]))
        want = sorted(int(ids[b, pos // 64]) * 64 + pos % 64 for _, pos in vals[:40])
        got = out[row].tolist()
        assert got[: len(want)] == want and all(x == -1 for x in got[len(want):])
    assert out[1].tolist().count(-1) == 0 and (out[1] < 3 * 64).all()


def test_topk_k_larger_than_context():
    logits = torch.full((1, 64), float("-inf"))
    logits[0, :10] = torch.arange(10.0)
    out = ops.topk(logits, torch.tensor([[3]], dtype=torch.int32),
                   torch.tensor([1], dtype=torch.int32), 1, 512)
    assert out[0, :10].tolist() == list(range(192, 202)) and (out[0, 10:] == -1).all()


def test_update_matches_reference_state_update():
    p = Problem(B=3, R=3, L=2, lens=(500, 90, 1000))
    before = p.clone_state()
    ids, cnt, logits, _ = p.run_step()
    for b in range(p.B):
        s = int(p.slot[b])
        for l in range(p.L):
            st = ref.SpinState(before.V[s, l][None].clone(), before.D[s, l][None].clone(),
                               before.last_seen[s, l][None].clone(),
                               before.decode_steps[s, l][None].clone())
            n = p.n[b][None].long()
            W = int(n.max())
            dense = torch.full((1, p.R, math.ceil(W / 64) * 64), float("-inf"))
            mask = torch.zeros(1, math.ceil(W / 64), dtype=torch.bool)
            for c in range(int(cnt[b, l])):
                j = int(ids[b, l, c])
                mask[0, j] = True
                for r in range(p.R):
                    dense[0, r, j * 64:(j + 1) * 64] = logits[l][b * p.R + r, c * 64:(c + 1) * 64]
            ref.update_state(st, dense[:, :, :W], mask, n, p.q[b][None].long(),
                             p.accepted[b:b + 1].long(), p.cfg, p.step[b:b + 1])
            assert torch.equal(p.state.V[s, l], st.V[0]) and torch.equal(p.state.D[s, l], st.D[0])
            assert torch.equal(p.state.last_seen[s, l], st.last_seen[0])
            assert int(p.state.decode_steps[s, l]) == int(st.decode_steps[0])
    untouched = [s for s in range(p.B + 2) if s not in p.slot.tolist()]
    for s in untouched:
        assert torch.equal(p.state.V[s], before.V[s]) and torch.equal(p.state.D[s], before.D[s])


def test_update_ignores_non_finite_scores():
    p = Problem(B=1, R=1, L=1, lens=(128,))
    ids = torch.tensor([[0, 1]], dtype=torch.int32)
    cnt = torch.tensor([2], dtype=torch.int32)
    logits = torch.randn(1, 128)
    logits[0, 3], logits[0, 70], logits[0, 71] = float("nan"), float("inf"), float("-inf")
    before = p.clone_state()
    ops.update(p.state, p.slot, logits, ids, cnt, p.n, p.q, p.accepted, p.step, 0, p.cfg, p.max_ctx)
    s = int(p.slot[0])
    assert torch.isfinite(p.state.V).all() and torch.isfinite(p.state.D).all()
    for i in (3, 70, 71):
        assert p.state.V[s, 0, i] == before.V[s, 0, i]
        assert p.state.D[s, 0, 127 - i] == before.D[s, 0, 127 - i]
    assert p.state.V[s, 0, 4] != before.V[s, 0, 4]


def _every_layer_inputs(p, rows_spare=2, width_spare=128, seed=0):
    """select's ids/counts and random compact logits [L, B*R, W] for every layer, cut from a
    larger buffer as SpinIndexer keeps them (spare rows and columns: strided layers and rows),
    with non-finite scores and one request that selected nothing in layer 0."""
    ids, cnt = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, p.cfg, p.m_cap,
                          p.max_ctx)
    cnt[0, 0] = 0
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn(p.L, p.B * p.R + rows_spare, p.m_cap * 64 + width_spare, generator=gen)
    buf[:, 0, 3], buf[:, 1, 70], buf[:, -1, 9] = float("nan"), float("inf"), float("-inf")
    return ids, cnt, buf.to(p.slot.device)[:, :p.B * p.R]


def test_update_every_layer_equals_one_layer_at_a_time():
    """layer -1 (MTP's deferred updates in one call) against one call per layer."""
    for mtp_update in ("prefix_valid", "row0"):
        cfg = SpinConfig(index_topk=128, target_sparsity=0.5, mtp_update=mtp_update)
        p = Problem(B=3, R=3, L=3, lens=(500, 90, 1000), cfg=cfg)
        p.accepted.copy_(torch.tensor([0, 2, -1], dtype=torch.int32))
        ids, cnt, z = _every_layer_inputs(p)
        want = p.clone_state()
        for l in range(p.L):
            ops.update(want, p.slot, z[l], ids[:, l], cnt[:, l], p.n, p.q, p.accepted, p.step, l,
                       cfg, p.max_ctx)
        before = p.clone_state()
        ops.update(p.state, p.slot, z, ids, cnt, p.n, p.q, p.accepted, p.step, -1, cfg, p.max_ctx)
        for a, b, old in zip(p.state.tensors(), want.tensors(), before.tensors()):
            assert torch.equal(a, b) and not torch.equal(a, old)


def test_reset_zeroes_chosen_slots_only():
    p = Problem(B=2, L=2)
    before = p.clone_state()
    ops.reset(p.state, torch.tensor([1, 3]), torch.tensor([11, 12]))
    for s in range(p.B + 2):
        if s in (1, 3):
            assert (p.state.V[s] == 0).all() and (p.state.D[s] == 0).all()
            assert (p.state.decode_steps[s] == 0).all()
            assert (p.state.last_seen[s] == (11 if s == 1 else 12)).all()
        else:
            assert torch.equal(p.state.V[s], before.V[s])


# ---- validation ------------------------------------------------------------------------------------
def _select_args(p):
    return [*p.state.tensors(), p.slot, p.n, p.q, p.request, p.step,
            torch.empty(p.B, p.L, p.m_cap, dtype=torch.int32), torch.empty(p.B, p.L, dtype=torch.int32),
            0.4, 0.05, 0, 512, 1, True, True, 0, True, 0, p.max_ctx]


@pytest.mark.parametrize("index,value,needle", [
    (4, lambda p: p.slot.float(), "state_slot must be int32"),
    (5, lambda p: p.n.long(), "context_lens must be int32"),
    (5, lambda p: p.n[:, None], "context_lens must have 2 dims"),
    (6, lambda p: p.q[:1], "query_pos must have shape"),
    (9, lambda p: torch.empty(p.B, p.L + 1, 4, dtype=torch.int32), "counts must have shape"),
    (0, lambda p: p.state.V.double(), "V must be float32/float16"),
    (1, lambda p: p.state.D[:, :, :-1].contiguous(), "D must have shape"),
    (1, lambda p: p.state.D.transpose(0, 1), "D must be contiguous"),
    (11, 1.0, "target_sparsity"),
    (12, -0.1, "exploration"),
    (13, 7, "policy must be in"),
    (21, 10 ** 9, "max_context_len"),
])
def test_select_rejects_bad_arguments(index, value, needle):
    p = Problem(B=2, L=2)
    args = _select_args(p)
    args[index] = value(p) if callable(value) else value
    with pytest.raises(SpinError, match=needle):
        torch.ops.spin.select(*args)


def test_context_beyond_max_is_rejected_on_cpu():
    p = Problem(B=2, L=1)
    args = _select_args(p)
    args[21] = 100
    with pytest.raises(SpinError, match="context_lens must be in"):
        torch.ops.spin.select(*args)


def test_logits_rejects_bad_cache_and_q():
    p = Problem(B=1, L=1, lens=(100,))
    ids = torch.zeros(1, 2, dtype=torch.int32)
    cnt = torch.ones(1, dtype=torch.int32)
    out = torch.empty(1, 128)
    with pytest.raises(SpinError, match="kv_cache must be uint8 pages"):
        torch.ops.spin.indexer_logits(p.qfp8, p.cache[0].view(-1)[:-4].view(-1, 2), p.weights,
                                      p.n, p.table, ids, cnt, out)
    with pytest.raises(SpinError, match="q must be float8_e4m3fn"):
        torch.ops.spin.indexer_logits(p.qfp8.float(), p.cache[0], p.weights, p.n, p.table, ids,
                                      cnt, out)
    with pytest.raises(SpinError, match="out must have shape"):
        torch.ops.spin.indexer_logits(p.qfp8, p.cache[0], p.weights, p.n, p.table, ids, cnt,
                                      torch.empty(1, 64))
    w_off = torch.zeros(p.weights.numel() + 1)[1:].view_as(p.weights)
    with pytest.raises(SpinError, match="weights must start at a 16-byte aligned"):
        torch.ops.spin.indexer_logits(p.qfp8, p.cache[0], w_off, p.n, p.table, ids, cnt, out)


def test_ops_refuse_a0_a2_and_other_block_sizes():
    p = Problem(B=1, L=1)
    for cfg in (SpinConfig(reduction="A2"), SpinConfig(block_size=32)):
        with pytest.raises(SpinError, match="reduction A1 with block_size 64"):
            ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, 4, p.max_ctx)


def test_fake_impls_trace_without_data():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        V = torch.empty(2, 3, 128)
        ids = torch.empty(1, 3, 2, dtype=torch.int32)
        torch.ops.spin.select(V, torch.empty_like(V), torch.empty(2, 3, 2, dtype=torch.int64),
                              torch.empty(2, 3, dtype=torch.int64), torch.empty(1, dtype=torch.int32),
                              torch.empty(1, 1, dtype=torch.int32), torch.empty(1, 1, dtype=torch.int32),
                              torch.empty(1, dtype=torch.int64), torch.empty(1, dtype=torch.int64),
                              ids, torch.empty(1, 3, dtype=torch.int32), 0.4, 0.05, 0, 512, 1, True,
                              True, 0, True, 0, 100)


def test_kernel_sources_compile_for_sm90a():
    """Where nvcc exists (this machine and CI), every .cu file must compile for sm_90a/sm_90."""
    res = subprocess.run([sys.executable, "-m", "spin_trtllm._build", "--check"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


# ---- GPU: native kernels against the reference ------------------------------------------------------
def _compare_step(p_cpu, p_gpu, m_cap=None, exact_select=True):
    ids_c, cnt_c, z_c, top_c = p_cpu.run_step(m_cap=m_cap)
    ids_g, cnt_g, z_g, top_g = p_gpu.run_step(m_cap=m_cap)
    if exact_select:
        assert torch.equal(ids_g.cpu(), ids_c) and torch.equal(cnt_g.cpu(), cnt_c)
    for l in range(p_cpu.L):
        zc, zg = z_c[l], z_g[l].cpu()
        assert torch.equal(torch.isinf(zc), torch.isinf(zg))
        fin = torch.isfinite(zc)
        err = (zg[fin].double() - zc[fin].double()).norm() / zc[fin].double().norm().clamp(min=1e-30)
        # FP8 tensor-core accumulation (as DeepGEMM's): about 1.4e-4 of the row norm measured
        assert err < 5e-4, err
        # top-K of the GPU kernel equals the reference top-K on the same logits
        assert torch.equal(ops.topk(z_g[l].cpu(), ids_c[:, l], cnt_c[:, l], p_cpu.R,
                                    p_cpu.cfg.index_topk), top_g[l].cpu())
    for a, b in zip(p_cpu.state.tensors(), p_gpu.state.tensors()):
        b = b.cpu()
        if a.dtype.is_floating_point:
            # each path feeds its own logits (equal to ~1e-4 of the row norm, FP8 tensor cores);
            # fp8 state may round them to neighbouring values (e4m3: 2^-3 apart relative)
            tol = 2e-3 if a.element_size() > 1 else 0.13
            assert torch.allclose(b.float(), a.float(), rtol=tol, atol=tol)
        else:
            assert torch.equal(a, b)


def _gpu_problem(**kw):
    return Problem(**kw), Problem(**kw, device="cuda")


@gpu
@pytest.mark.parametrize("seed", [0, 1, 2])
# the logits kernel takes rows in tensor-core groups of 1, 2 or 4: R 3, 5 and 8 pad or split them
@pytest.mark.parametrize("R", [1, 2, 3, 4, 5, 8])
def test_gpu_step_matches_reference(seed, R):
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5, exploration=0.0)
    p_cpu, p_gpu = _gpu_problem(B=4, R=R, L=3, lens=(700, 64, 1500, 33), seed=seed, cfg=cfg,
                                warm=(False, True, False, False))
    _compare_step(p_cpu, p_gpu)


@gpu
@pytest.mark.parametrize("state_dtype", ["float32", "float16", "float8_e4m3fn"])
@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("cap", [4096, 4100, 4104])
def test_gpu_step_vector_state_path_matches_reference(state_dtype, R, cap):
    """Max pooling reads V/D in vectors: 4 entries (fp32; fp16 when cap % 8 == 4, as with cap
    4100), 8 (fp16 when cap % 8 == 0; fp8 when cap % 16 == 8, as with 4104) or 16 (fp8 when
    cap % 16 == 0); fp8 with cap 4100 reads entry by entry. A block's D window starts at
    q - 64j - 63, so contexts of 3993-4008 put it at every alignment mod 16; 1, 63 and 65 slots
    leave no or one interior block."""
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5, exploration=0.1,
                     state_dtype=state_dtype)
    lens = (4001, 1, 63, 65, 4002, 4003, 2052, 3997, 3998, 3999, 4000, 3993, 3994, 3995, 3996,
            4005, 4006, 4007, 4008)
    p_cpu, p_gpu = _gpu_problem(B=len(lens), R=R, L=2, lens=lens, cap=cap, seed=7 + R, cfg=cfg)
    _compare_step(p_cpu, p_gpu)


@gpu
@pytest.mark.parametrize("policy", ["random", "age", "staleness"])
@pytest.mark.parametrize("pooling", ["max", "mean", "top4"])
def test_gpu_exploration_and_pooling(policy, pooling):
    cfg = SpinConfig(index_topk=64, target_sparsity=0.4, exploration=0.2,
                     exploration_policy=policy, pooling=pooling)
    p_cpu, p_gpu = _gpu_problem(B=3, R=2, L=2, lens=(2000, 700, 130), seed=5, cfg=cfg)
    integer_state(p_cpu, p_gpu)
    _compare_step(p_cpu, p_gpu)


@gpu
def test_gpu_row0_mtp_mask_fp16_state_and_k2048():
    cfg = SpinConfig(index_topk=2048, target_sparsity=0.3, mtp_mask="row0", mtp_update="row0",
                     state_dtype="float16")
    p_cpu, p_gpu = _gpu_problem(B=2, R=3, L=1, lens=(9000, 2100), seed=3, cfg=cfg)
    _compare_step(p_cpu, p_gpu)


@gpu
@pytest.mark.parametrize("state_dtype,decay", [("float32", 0.5), ("float32", 0.9),
                                               ("float16", 0.95), ("float32", 0.0),
                                               ("float8_e4m3fn", 0.5)])
# R 1 takes the kernel's one-pass path (V and D per scored slot), R 4 the per-row one (rows with
# 0 accepted drafts take the one-pass path too); the per-row path reads cap 3068 in vectors of 4;
# caps 3065 and 3072 vary the alignment of the state rows for the one-pass path
@pytest.mark.parametrize("R,cap", [(4, 3068), (1, 3065), (1, 3072)])
def test_gpu_update_bit_exact_on_same_logits(state_dtype, decay, R, cap):
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5, state_dtype=state_dtype,
                     ema_decay=decay)
    p_cpu, p_gpu = _gpu_problem(B=3, R=R, L=1, lens=(3000, 700, 64), cap=cap, seed=11, cfg=cfg)
    ids, cnt = ops.select(p_gpu.state, p_gpu.slot, p_gpu.n, p_gpu.q, p_gpu.request, p_gpu.step,
                          cfg, p_gpu.m_cap, p_gpu.max_ctx)
    z = ops.indexer_logits(p_gpu.qfp8, p_gpu.cache[0], p_gpu.weights, p_gpu.n, p_gpu.table,
                           ids[:, 0], cnt[:, 0])
    z[0, 5] = float("nan")                        # never observed, on both paths
    for p, zz, ii, cc in ((p_gpu, z, ids, cnt), (p_cpu, z.cpu(), ids.cpu(), cnt.cpu())):
        ops.update(p.state, p.slot, zz, ii[:, 0], cc[:, 0], p.n, p.q, p.accepted, p.step, 0, cfg,
                   p.max_ctx)
    for a, b in zip(p_cpu.state.tensors(), p_gpu.state.tensors()):
        assert same(a, b.cpu())


@gpu
@pytest.mark.parametrize("state_dtype", ["float32", "float16", "float8_e4m3fn"])
@pytest.mark.parametrize("cap", [4096, 4100])
@pytest.mark.parametrize("seed", [0, 1])
def test_gpu_one_row_update_vectors_match_reference(state_dtype, cap, seed):
    """The one-row update walks interior blocks in vectors (8 fp16 or fp8 entries, or 4 fp32,
    when cap allows): contexts 3993-4000 and 2049-2052 put q + 1 at every residue mod 8, so D's
    vectors meet the blocks' windows at every skew; random block ids in random order (seed 0)
    or ascending (seed 1: kept neighbours share a D vector, which one lane stores whole),
    non-finite logits inside interior blocks, 1-65 slot contexts, a row with accepted 0 among
    R 2 (it takes the one-row path), a request with nothing kept, block ids -1 and past the
    context inside a count, and query positions ahead of the context."""
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5, state_dtype=state_dtype)
    lens = (3993, 3994, 3995, 3996, 3997, 3998, 3999, 4000, 2049, 2050, 2051, 2052, 1, 65, 640)
    gen = torch.Generator().manual_seed(100 + seed)
    for R in (1, 2):
        p_cpu, p_gpu = _gpu_problem(B=len(lens), R=R, L=1, lens=lens, cap=cap, seed=seed, cfg=cfg)
        if R == 2:
            for p in (p_cpu, p_gpu):
                p.accepted.copy_(torch.zeros(len(lens), dtype=torch.int32))
        m_cap = p_cpu.m_cap
        ids = torch.full((len(lens), m_cap), -1, dtype=torch.int32)
        cnt = torch.zeros(len(lens), dtype=torch.int32)
        for b, length in enumerate(lens):
            blocks = -(-(length + R - 1) // 64)
            keep = torch.randperm(blocks, generator=gen)[:max(1, (blocks * 3) // 5)]
            if seed == 1:  # ascending, as select writes them: kept neighbours side by side
                keep = keep.sort().values
            if b == len(lens) - 1:
                keep = keep[:0]
            ids[b, :len(keep)] = keep.to(torch.int32)
            cnt[b] = len(keep)
        ids[2, 1], ids[3, 2] = -1, m_cap + 3                 # skipped by both paths
        for p in (p_cpu, p_gpu):
            p.q[4:6] += torch.tensor([[3], [21]], dtype=torch.int32, device=p.q.device)
        z = torch.randn(len(lens) * R, m_cap * 64, generator=gen)
        bad = torch.rand(z.shape, generator=gen) < 0.02
        z[bad] = torch.tensor([float("nan"), float("inf"), -float("inf")])[
            torch.randint(0, 3, (int(bad.sum()),), generator=gen)]
        before = p_gpu.clone_state()
        for p, dev in ((p_gpu, "cuda"), (p_cpu, "cpu")):
            ops.update(p.state, p.slot, z.to(dev), ids.to(dev), cnt.to(dev), p.n, p.q,
                       p.accepted, p.step, 0, cfg, p.max_ctx)
        for a, b, old in zip(p_cpu.state.tensors(), p_gpu.state.tensors(), before.tensors()):
            assert same(a, b.cpu()) and not same(b, old)


@gpu
@pytest.mark.parametrize("state_dtype", ["float32", "float16", "float8_e4m3fn"])
def test_gpu_update_vector_path_equals_scalar_path_over_several_passes(state_dtype):
    """96 requests x 70K slots with 60% of the blocks kept: each thread of the vector path makes
    two passes (its prefetch of the next pass runs). The same update on state rows that cannot
    be read in vectors (capacity not a multiple of the vector) takes the scalar path; both
    must leave identical V and D."""
    cfg = SpinConfig(index_topk=512, target_sparsity=0.4, state_dtype=state_dtype)
    B, slots = 96, 70000
    vec = 4 if state_dtype == "float32" else 8
    gen = torch.Generator(device="cuda").manual_seed(3)
    m_cap = -(-slots // 64)
    keep = (torch.rand(B, m_cap, generator=gen, device="cuda") < 0.6).to(torch.int32)
    keep[:, -1] = 1
    cnt = keep.sum(1).to(torch.int32)
    order = torch.sort(keep, dim=1, descending=True, stable=True).indices.to(torch.int32)
    ids = torch.where(torch.arange(m_cap, device="cuda") < cnt.view(-1, 1), order, -1)
    z = torch.randn(B, m_cap * 64, generator=gen, device="cuda")
    z[torch.rand(z.shape, generator=gen, device="cuda") < 0.01] = float("nan")
    n = torch.full((B, 1), slots, dtype=torch.int32, device="cuda")
    n[::7] = slots - 1000                            # some shorter rows
    slot = torch.arange(B, dtype=torch.int32, device="cuda")
    acc = torch.zeros(B, dtype=torch.int32, device="cuda")
    step = torch.full((B,), 10, device="cuda")
    states = []
    for cap in (slots + 16, slots + vec // 2 + 8 * (vec == 4)):
        state = ops.OpState.zeros(B, 1, cap, cfg, device="cuda")
        g = torch.Generator(device="cuda").manual_seed(5)
        state.V[:, :, :slots].copy_(torch.randn(B, 1, slots, generator=g, device="cuda"))
        state.D[:, :, :slots].copy_(torch.randn(B, 1, slots, generator=g, device="cuda"))
        ops.update(state, slot, z, ids, cnt, n, n - 1, acc, step, 0, cfg, slots)
        states.append(state)
    assert states[1].V.shape[2] % vec != 0               # the second really is scalar
    for a, b in ((states[0].V, states[1].V), (states[0].D, states[1].D)):
        assert same(a[:, :, :slots], b[:, :, :slots])


@gpu
@pytest.mark.parametrize("state_dtype", ["float32", "float16", "float8_e4m3fn"])
@pytest.mark.parametrize("R", [1, 4])
def test_gpu_update_every_layer_matches_reference(state_dtype, R):
    """One launch for every layer (grid z) against the reference one layer at a time: strided
    layers and rows, accepted 0 / some / all / negative, a request with nothing selected."""
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5, state_dtype=state_dtype)
    p_cpu, p_gpu = _gpu_problem(B=4, R=R, L=3, lens=(3000, 700, 64, 1500), seed=23, cfg=cfg)
    for p in (p_cpu, p_gpu):
        p.accepted.copy_(torch.tensor([0, R - 1, 2**31 - 1, -1], dtype=torch.int32))
    ids, cnt, z = _every_layer_inputs(p_gpu, seed=5)
    before = p_gpu.clone_state()
    ops.update(p_gpu.state, p_gpu.slot, z, ids, cnt, p_gpu.n, p_gpu.q, p_gpu.accepted,
               p_gpu.step, -1, cfg, p_gpu.max_ctx)
    ids, cnt, z = ids.cpu(), cnt.cpu(), z.cpu()
    for l in range(p_cpu.L):
        ops.update(p_cpu.state, p_cpu.slot, z[l], ids[:, l], cnt[:, l], p_cpu.n, p_cpu.q,
                   p_cpu.accepted, p_cpu.step, l, cfg, p_cpu.max_ctx)
    for a, b, old in zip(p_cpu.state.tensors(), p_gpu.state.tensors(), before.tensors()):
        assert same(a, b.cpu()) and not same(b, old)


@gpu
def test_gpu_long_context_256k_and_tiny():
    cfg = SpinConfig(index_topk=512, target_sparsity=0.5)
    p_cpu, p_gpu = _gpu_problem(B=2, R=1, L=1, lens=(262144, 1), seed=4, cfg=cfg)
    _compare_step(p_cpu, p_gpu)


@gpu
@pytest.mark.parametrize("state_dtype", ["float16", "float8_e4m3fn"])
def test_gpu_select_kernels_of_many_and_few_ctas_match_reference(state_dtype):
    """An all-layer launch of more CTAs than half the SMs runs the 4-CTAs-an-SM kernel, one
    layer of few requests the wide one (one CTA an SM): both pick the reference's blocks. The
    state's rows are 16-byte aligned (cap a multiple of 64), so both read whole vectors."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    L = 3
    B = sms // (2 * L) + 2
    assert 2 * B * L > sms and 2 * B <= sms
    cfg = SpinConfig(index_topk=128, target_sparsity=0.4, exploration=0.1,
                     state_dtype=state_dtype)
    p_cpu, p_gpu = _gpu_problem(B=B, R=1, L=L, lens=(700, 64, 1500, 4100), cap=66 * 64,
                                cfg=cfg, seed=9, warm=(False, False, True))
    args = lambda p: (p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap,  # noqa: E731
                      p.max_ctx)
    ids_c, cnt_c = ops.select(*args(p_cpu))
    ids_g, cnt_g = ops.select(*args(p_gpu))
    assert torch.equal(cnt_g.cpu(), cnt_c) and torch.equal(ids_g.cpu(), ids_c)
    ids_1, cnt_1 = ops.select(*args(p_gpu), layer=1)
    assert torch.equal(cnt_1[:, 1].cpu(), cnt_c[:, 1]) and torch.equal(ids_1[:, 1].cpu(), ids_c[:, 1])
    assert (cnt_1[:, 0] == 0).all() and (ids_1[:, 2] == -1).all()


@gpu
def test_gpu_select_overflow_truncates_like_reference():
    p_cpu, p_gpu = _gpu_problem(B=2, R=2, L=1, lens=(1500, 300), warm=(True,))
    _compare_step(p_cpu, p_gpu, m_cap=7)


@gpu
@pytest.mark.parametrize("state_dtype", ["float16", "float8_e4m3fn"])
@pytest.mark.parametrize("values", ["distinct", "few", "one"])
@pytest.mark.parametrize("policy,R", [("random", 1), ("staleness", 1), ("random", 2)])
def test_gpu_select_ties_and_whole_bins_match_reference(state_dtype, values, policy, R):
    """The top-m blocks by 16-bit keys (fp16 or fp8 state) and the exploration's 32-bit
    priorities: block scores all distinct (fp16: the threshold's bin is taken whole, the passes
    may stop early; fp8: drawn from its 254 finite encodings, so with ties), from 5 values (the
    first `need` of many ties, in index order, across the warps' ranges), or one value (every
    block tied). Up to 2600 blocks a row, so each warp's range spans several rounds and a ragged
    end. V is constant within a block and D below it, so the block scores are exactly the drawn
    values."""
    cfg = SpinConfig(index_topk=512, target_sparsity=0.45, exploration=0.1,
                     exploration_policy=policy, state_dtype=state_dtype)
    lens = (166_400, 64 * 300 + 17, 64 * 9, 100_001)
    B, L, cap = len(lens), 2, 166_400
    gen = torch.Generator().manual_seed(11 + R)
    state = ops.OpState.zeros(B, L, cap, cfg)
    blocks = cap // 64
    if values == "distinct" and state_dtype == "float8_e4m3fn":  # every finite e4m3 value
        finite = torch.tensor([x for x in range(256) if x & 0x7F != 0x7F], dtype=torch.uint8)
        pool = finite.view(torch.float8_e4m3fn).half()
        per_block = pool[torch.randint(0, len(pool), (B, L, blocks), generator=gen)]
    elif values == "distinct":  # consecutive fp16 bit patterns from 1.0 up, shuffled per row
        pool = torch.arange(0x3C00, 0x3C00 + blocks, dtype=torch.int16).view(torch.float16)
        per_block = pool[torch.argsort(torch.rand(B, L, blocks, generator=gen), -1)]
    elif values == "few":
        per_block = torch.randint(0, 5, (B, L, blocks), generator=gen).half() - 2
    else:
        per_block = torch.full((B, L, blocks), 1.5, dtype=torch.float16)
    state.V.copy_(per_block.repeat_interleave(64, -1))
    # at or below every drawn value; -448 is e4m3's lowest (older torch casts -500 to NaN)
    state.D.copy_(torch.full(state.D.shape, -448.0))
    state.last_seen.copy_(torch.randint(0, 8, state.last_seen.shape, generator=gen))
    state.decode_steps.fill_(5)
    n = torch.tensor([[c - R + 1 + r for r in range(R)] for c in lens], dtype=torch.int32)
    slot = torch.arange(B, dtype=torch.int32)
    req, step = torch.arange(B) + 40, torch.full((B,), 9)
    m_cap = -(-max(lens) // 64)
    ids_c, cnt_c = ops.select(state, slot, n, n - 1, req, step, cfg, m_cap, max(lens))
    gpu_state = ops.OpState(*(t.cuda() for t in state.tensors()))
    ids_g, cnt_g = ops.select(gpu_state, slot.cuda(), n.cuda(), (n - 1).cuda(), req.cuda(),
                              step.cuda(), cfg, m_cap, max(lens))
    assert torch.equal(cnt_g.cpu(), cnt_c)
    assert torch.equal(ids_g.cpu(), ids_c)


@gpu
def test_gpu_random_exploration_distribution():
    # Exploration picks e blocks uniformly among the candidates: count over many steps.
    cfg = SpinConfig(index_topk=64, target_sparsity=0.5, exploration=0.25, keep_sink=False,
                     keep_newest=False)
    p = Problem(B=1, R=1, L=1, lens=(64 * 40,), cfg=cfg, device="cuda")
    p.state.V.zero_()
    p.state.V[..., : 64 * 15] = 5.0          # blocks 0..14 predicted high: always in the top part
    p.state.D.fill_(-10.0)
    hits = torch.zeros(40)
    trials = 2000
    for t in range(trials):
        p.step.fill_(t)
        ids, cnt = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, 40, p.max_ctx)
        hits[ids[0, 0][: int(cnt[0, 0])].long().cpu()] += 1
    # m = 20, e = 5: 15 top blocks always, 5 of the 25 others uniformly -> p = 0.2 each
    assert (hits[:15] == trials).all()
    freq = hits[15:] / trials
    assert (freq - 0.2).abs().max() < 0.04, freq


@gpu
def test_gpu_cuda_graph_step_matches_eager():
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5, exploration=0.1)
    p = Problem(B=3, R=2, L=2, lens=(900, 400, 1200), seed=7, cfg=cfg, device="cuda")
    q = Problem(B=3, R=2, L=2, lens=(900, 400, 1200), seed=7, cfg=cfg, device="cuda")
    ids = torch.empty(3, 2, p.m_cap, dtype=torch.int32, device="cuda")
    cnt = torch.empty(3, 2, dtype=torch.int32, device="cuda")
    zs = [torch.empty(6, p.m_cap * 64, device="cuda") for _ in range(2)]
    tops = [torch.empty(6, 128, dtype=torch.int32, device="cuda") for _ in range(2)]

    def step():
        torch.ops.spin.select(*p.state.tensors(), p.slot, p.n, p.q, p.request, p.step, ids, cnt,
                              0.5, 0.1, 0, 128, 1, True, True, 0, True, 0, p.max_ctx)
        for l in range(2):
            torch.ops.spin.indexer_logits(p.qfp8, p.cache[l], p.weights, p.n, p.table,
                                          ids[:, l], cnt[:, l], zs[l])
            torch.ops.spin.topk(zs[l], ids[:, l], cnt[:, l], 2, tops[l])
            torch.ops.spin.update(*p.state.tensors(), p.slot, zs[l], ids[:, l], cnt[:, l], p.n,
                                  p.q, p.accepted, p.step, l, 0.5, False, p.max_ctx)

    saved = p.clone_state()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()                                   # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    for a, b in zip(p.state.tensors(), saved.tensors()):
        a.copy_(b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in range(3):                           # replay with new inputs in the same buffers
        new_n = torch.tensor([[900 + 2 * t + r for r in range(2)], [400 + t, 401 + t],
                              [1200 - t, 1201 - t]], dtype=torch.int32, device="cuda")
        for prob in (p, q):
            prob.n.copy_(new_n)
            prob.q.copy_(new_n - 1)
            prob.step.fill_(60 + t)
        graph.replay()
        ids_e, cnt_e, z_e, top_e = q.run_step()
        torch.cuda.synchronize()
        assert torch.equal(ids, ids_e) and torch.equal(cnt, cnt_e)
        for l in range(2):
            assert torch.equal(zs[l], z_e[l]) and torch.equal(tops[l], top_e[l])
        for a, b in zip(p.state.tensors(), q.state.tensors()):
            assert torch.equal(a, b)


@gpu
def test_gpu_out_of_cache_entries_and_device_mismatch():
    p_cpu, p_gpu = _gpu_problem(B=2, R=2, L=1, lens=(600, 300), seed=13)
    for p in (p_cpu, p_gpu):
        p.table[0, 2] = p.num_pages + 5            # outside the cache: never read, scores -inf
        p.table[1, 0] = -1
    ids = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 4]], dtype=torch.int32)
    cnt = torch.tensor([4, 3], dtype=torch.int32)
    outs = [ops.indexer_logits(p.qfp8, p.cache[0], p.weights, p.n, p.table, ids.to(p.n.device),
                               cnt.to(p.n.device)).cpu() for p in (p_cpu, p_gpu)]
    assert torch.equal(torch.isinf(outs[0]), torch.isinf(outs[1]))
    assert (outs[1][0:2, 128:192] == float("-inf")).all() and (outs[1][2:4, 0:64] == float("-inf")).all()
    fin = torch.isfinite(outs[0])
    assert (outs[1][fin] - outs[0][fin]).norm() / outs[0][fin].norm() < 5e-4
    with pytest.raises(SpinError, match="is on cpu, expected cuda"):
        ops.indexer_logits(p_gpu.qfp8, p_gpu.cache[0], p_gpu.weights, p_gpu.n, p_gpu.table, ids,
                           cnt.cuda())



def test_negative_accepted_counts_as_zero():
    runs = []
    for acc in (-3, 0):
        p = Problem(B=2, R=3, L=1, lens=(400, 200), seed=21)
        p.accepted.fill_(acc)
        p.run_step()
        runs.append(p.state)
    for a, b in zip(runs[0].tensors(), runs[1].tensors()):
        assert torch.equal(a, b)


def test_state_slot_checks_on_cpu():
    p = Problem(B=2, L=1)
    args = _select_args(p)
    args[4] = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(SpinError, match="state slots must be in"):
        torch.ops.spin.select(*args)
    args[4] = torch.tensor([1, 1], dtype=torch.int32)
    with pytest.raises(SpinError, match="distinct"):
        torch.ops.spin.select(*args)


def test_topk_and_update_reject_bad_arguments():
    p = Problem(B=1, R=2, L=1, lens=(100,))
    ids = torch.zeros(1, 2, dtype=torch.int32)
    cnt = torch.ones(1, dtype=torch.int32)
    with pytest.raises(SpinError, match="logits must have shape"):
        ops.topk(torch.zeros(2, 64), ids, cnt, 2, 8)
    with pytest.raises(SpinError, match="logits must be float32"):
        ops.topk(torch.zeros(2, 128, dtype=torch.float16), ids, cnt, 2, 8)
    with pytest.raises(SpinError, match="accepted must be int32"):
        ops.update(p.state, p.slot, torch.zeros(2, 128), ids, cnt, p.n, p.q,
                   p.accepted.long(), p.step, 0, p.cfg, p.max_ctx)
    with pytest.raises(SpinError, match="layer 3 is outside"):
        ops.update(p.state, p.slot, torch.zeros(2, 128), ids, cnt, p.n, p.q, p.accepted,
                   p.step, 3, p.cfg, p.max_ctx)
    misaligned = torch.zeros(2 * 128 + 1)[1:].view(2, 128)      # contiguous, 4 bytes off
    with pytest.raises(SpinError, match="logits must start at a 16-byte aligned"):
        ops.topk(misaligned, ids, cnt, 2, 8)
    with pytest.raises(SpinError, match="logits must start at a 16-byte aligned"):
        ops.update(p.state, p.slot, misaligned, ids, cnt, p.n, p.q, p.accepted, p.step, 0,
                   p.cfg, p.max_ctx)
    # layer -1 (every layer): layered block ids and counts, logits [L, B*R, W]
    ids3, cnt2 = ids.view(1, 1, 2), cnt.view(1, 1)
    with pytest.raises(SpinError, match="logits must have 3 dims"):
        ops.update(p.state, p.slot, torch.zeros(2, 128), ids3, cnt2, p.n, p.q, p.accepted,
                   p.step, -1, p.cfg, p.max_ctx)
    with pytest.raises(SpinError, match="block_ids must have 3 dims"):
        ops.update(p.state, p.slot, torch.zeros(1, 2, 128), ids, cnt, p.n, p.q, p.accepted,
                   p.step, -1, p.cfg, p.max_ctx)
    with pytest.raises(SpinError, match=r"layer -1 \(every layer\) needs logits \[1, B\*R, W\]"):
        ops.update(p.state, p.slot, torch.zeros(2, 2, 128), ids3, cnt2, p.n, p.q, p.accepted,
                   p.step, -1, p.cfg, p.max_ctx)
    with pytest.raises(SpinError, match="layer -2 is outside"):
        ops.update(p.state, p.slot, torch.zeros(1, 2, 128), ids3, cnt2, p.n, p.q, p.accepted,
                   p.step, -2, p.cfg, p.max_ctx)
    p2 = Problem(B=1, R=2, L=2, lens=(100,))
    ids3, cnt2 = torch.zeros(1, 2, 2, dtype=torch.int32), torch.ones(1, 2, dtype=torch.int32)
    odd_layers = torch.zeros(2, 258)[:, :256].unflatten(1, (2, 128))  # layers 258 floats apart
    with pytest.raises(SpinError, match="logits layers must be a multiple of 4 floats apart"):
        ops.update(p2.state, p2.slot, odd_layers, ids3, cnt2, p2.n, p2.q, p2.accepted, p2.step,
                   -1, p2.cfg, p2.max_ctx)


@gpu
def test_gpu_nan_in_cache_is_never_ranked_or_observed():
    cfg = SpinConfig(index_topk=64, target_sparsity=0.3)
    p_cpu, p_gpu = _gpu_problem(B=2, R=2, L=1, lens=(900, 300), seed=17, cfg=cfg)
    for p in (p_cpu, p_gpu):
        pages = p.cache[0].view(p.num_pages, -1)
        pages[:, 8192 + 4 * 3: 8192 + 4 * 4] = torch.tensor([float("nan")]).view(torch.uint8).to(pages.device)
    ids, cnt, z, top = p_gpu.run_step()
    _, _, z_c, top_c = p_cpu.run_step()
    assert torch.equal(torch.isnan(z[0].cpu()), torch.isnan(z_c[0])) and torch.isnan(z_c[0]).any()
    assert torch.equal(top[0].cpu(), top_c[0])
    for t in top[0].cpu().flatten().tolist():
        assert t < 0 or t % 64 != 3                # the NaN slot is never in the top-K
    for a, b in zip(p_cpu.state.tensors(), p_gpu.state.tensors()):
        assert torch.isfinite(b.float()).all() if b.dtype.is_floating_point else True


@gpu
def test_gpu_out_of_range_state_slot_is_skipped():
    p = Problem(B=2, R=1, L=2, lens=(500, 300), device="cuda")
    p.slot[1] = 99
    before = p.clone_state()
    ids, cnt, _, _ = p.run_step()
    assert cnt[1].tolist() == [0, 0] and (ids[1] == -1).all()
    s0 = int(p.slot[0])
    for a, b in zip(p.state.tensors(), before.tensors()):
        keep = [s for s in range(a.shape[0]) if s != s0]
        assert torch.equal(a[keep], b[keep])


@gpu
def test_gpu_no_forced_blocks_and_two_warmup_steps():
    cfg = SpinConfig(index_topk=128, target_sparsity=0.6, keep_sink=False, keep_newest=False,
                     warmup_steps=2, exploration=0.1, exploration_policy="age")
    p_cpu, p_gpu = _gpu_problem(B=3, R=2, L=2, lens=(3000, 640, 65), seed=19, cfg=cfg)
    for p in (p_cpu, p_gpu):
        p.state.decode_steps[:, 0] = 1           # layer 0 still warming up, layer 1 live
    _compare_step(p_cpu, p_gpu)


@gpu
def test_gpu_long_context_256k_mtp():
    cfg = SpinConfig(index_topk=2048, target_sparsity=0.4)
    p_cpu, p_gpu = _gpu_problem(B=1, R=2, L=1, lens=(262143,), seed=23, cfg=cfg)
    _compare_step(p_cpu, p_gpu)


def _topk_rows(kind: str, rows: int, width: int, gen: torch.Generator) -> torch.Tensor:
    z = torch.randn(rows, width, generator=gen)
    if kind == "zeros":            # ReLU-like: most scores exactly 0, the K-th value among them
        z = torch.where(torch.rand(rows, width, generator=gen) < 0.995, torch.zeros(()), z.abs())
    elif kind == "narrow":         # distinct values inside one fp16 bin
        z = 1.0 + torch.rand(rows, width, generator=gen) * 1e-4
    elif kind == "few_ties":       # a handful of values, heavily repeated
        z = torch.randint(0, 40, (rows, width), generator=gen).float()
    elif kind == "wide":           # beyond fp16 range, +-0.0, non-finite entries
        z = z * 1e6
        z[:, ::7] = 0.0
        z[:, 3::11] = -0.0
        z[:, 5::13] = float("nan")
        z[:, 6::17] = float("inf")
        z[:, 9::19] = float("-inf")
    return z


@gpu
@pytest.mark.parametrize("kind", ["randn", "zeros", "narrow", "few_ties", "wide"])
@pytest.mark.parametrize("blocks,k", [(1, 512), (40, 512), (40, 2048), (700, 512), (1100, 2048)])
def test_gpu_topk_matches_reference_on_ties_and_long_rows(kind, blocks, k):
    # 700 / 1100 blocks (44.8K / 70.4K slots): rows cached in shared memory and read from global
    gen = torch.Generator().manual_seed(blocks * 7 + k)
    B, R = 2, 2
    m_cap = blocks + 3
    z = _topk_rows(kind, B * R, m_cap * 64, gen)
    ids = torch.stack([torch.randperm(2 * m_cap, generator=gen)[:m_cap].sort().values
                       for _ in range(B)]).int()
    cnt = torch.tensor([blocks, max(1, blocks // 2)], dtype=torch.int32)
    want = ops.topk(z, ids, cnt, R, k)
    got = ops.topk(z.cuda(), ids.cuda(), cnt.cuda(), R, k)
    assert torch.equal(got.cpu(), want)


def _threshold_bin_rows(rows: int, width: int, in_bin: int, tied: int, k: int,
                        gen: torch.Generator) -> torch.Tensor:
    """Rows whose K-th value lies in a coarse (fp16) bin of exactly `in_bin` entries, `tied` of
    them equal, at random positions (so across the CTAs of a cluster): K - t larger values above
    it (t = in_bin // 3 taken from the bin, at least 1, at most K / 2), the rest far below, and a
    few non-finite entries."""
    z = torch.rand(rows, width, generator=gen) * 4
    z[:, 7::101] = float("nan")
    z[:, 11::103] = float("-inf")
    take = max(1, min(in_bin // 3, k // 2))
    for r in range(rows):
        perm = torch.randperm(width, generator=gen)
        z[r, perm[:k - take]] = 100.0 + torch.arange(k - take, dtype=torch.float32)
        # [50.25, 50.75]: one bin (fp16 spacing 1/32 there, bins of 32 fp16 values = 1.0)
        vals = 50.25 + torch.rand(in_bin, generator=gen) * 0.5
        vals[:tied] = 50.5
        z[r, perm[k - take:k - take + in_bin]] = vals[torch.randperm(in_bin, generator=gen)]
    return z


@gpu
@pytest.mark.parametrize("rows,blocks", [(3, 1024), (20, 1024), (40, 1024), (140, 300)])
@pytest.mark.parametrize("in_bin,tied", [(1, 0), (40, 0), (40, 25), (256, 256), (257, 100),
                                         (1000, 0), (5000, 60)])
def test_gpu_topk_threshold_bin_sizes_match_reference(rows, blocks, in_bin, tied):
    # on 132 SMs clusters of 8, 4, 2 and 1 CTA per row; bins up to 256 entries are ranked by
    # counting (gathered over the cluster), larger ones by radix passes (over the candidates, or
    # over the whole row past 4096)
    gen = torch.Generator().manual_seed(rows * 13 + in_bin + tied)
    k = 512
    z = _threshold_bin_rows(rows, blocks * 64, in_bin, tied, k, gen)
    ids = torch.stack([torch.randperm(blocks + 50, generator=gen)[:blocks].sort().values
                       for _ in range(rows)]).int()
    cnt = torch.full((rows,), blocks, dtype=torch.int32)
    want = ops.topk(z, ids, cnt, 1, k)
    assert (want >= 0).all()
    got = ops.topk(z.cuda(), ids.cuda(), cnt.cuda(), 1, k)
    assert torch.equal(got.cpu(), want)


@gpu
@pytest.mark.parametrize("R", [1, 2, 3, 6])
def test_gpu_logits_negative_zero_and_infinite_scales(R):
    # the kernel factors a finite scale >= 0 out of the head sum; other scales take the exact path
    p_cpu, p_gpu = _gpu_problem(B=2, R=R, L=1, lens=(500, 300), seed=17)
    for p in (p_cpu, p_gpu):
        scales = p.cache[0].view(p.cache[0].shape[0], -1)[:, 64 * 128:].view(torch.float32)
        scales[0, 0] = -0.02
        scales[0, 1] = 0.0
        scales[1, 2] = float("inf")
        scales[2, 3:9] = -scales[2, 3:9]
    B, nb = 2, (500 + 63) // 64
    ids = torch.arange(nb, dtype=torch.int32).repeat(B, 1)
    cnt = torch.tensor([nb, (300 + 63) // 64], dtype=torch.int32)
    outs = [ops.indexer_logits(p.qfp8, p.cache[0], p.weights, p.n, p.table, ids.to(p.n.device),
                               cnt.to(p.n.device)).cpu() for p in (p_cpu, p_gpu)]
    assert torch.equal(torch.isnan(outs[0]), torch.isnan(outs[1]))
    assert torch.equal(torch.isinf(outs[0]), torch.isinf(outs[1]))
    fin = torch.isfinite(outs[0])
    assert (outs[1][fin] - outs[0][fin]).norm() / outs[0][fin].norm() < 5e-4


@gpu
@pytest.mark.parametrize("R", [1, 2, 3])
def test_gpu_logits_long_runs_refill_every_stage(R):
    """Enough blocks that each CTA scores a long run of pages (16 on an H200 at this size: more
    than twice the pipeline's stages), so every stage is refilled several times and its barriers
    go through both parities; pages outside the cache sit inside runs, and one request's
    selection ends mid-run."""
    gen = torch.Generator().manual_seed(31)
    B, blocks = 2, 2900
    num_pages = B * blocks + 5
    cache = make_cache(num_pages, gen)
    table = torch.randperm(num_pages, generator=gen)[:B * blocks].view(B, blocks).to(torch.int32)
    table[0, 5], table[0, 21], table[1, 100] = -1, num_pages + 3, -7   # never read: -inf
    n = torch.tensor([[blocks * 64 - R + 1 + r for r in range(R)]] * B, dtype=torch.int32)
    q = torch.randn(B * R, 64, 128, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(B * R, 64, generator=gen) * 0.1
    ids = torch.full((B, blocks), -1, dtype=torch.int32)
    ids[0] = torch.arange(blocks, dtype=torch.int32)
    subset = torch.randperm(blocks, generator=gen)[:2011].sort().values.to(torch.int32)
    ids[1, :2011] = subset
    cnt = torch.tensor([blocks, 2011], dtype=torch.int32)
    outs = [ops.indexer_logits(*(t.to(dev) for t in (q, cache, w, n, table, ids, cnt))).cpu()
            for dev in ("cpu", "cuda")]
    assert torch.equal(torch.isinf(outs[0]), torch.isinf(outs[1]))
    assert (outs[1][0:R, 5 * 64:6 * 64] == float("-inf")).all()
    assert (outs[1][R:2 * R, 2011 * 64:] == float("-inf")).all()
    fin = torch.isfinite(outs[0])
    assert fin.sum() > R * 4800 * 64          # both requests, all but a few blocks
    assert (outs[1][fin] - outs[0][fin]).norm() / outs[0][fin].norm() < 5e-4


def _many_requests(B, blocks, R, seed, min_count):
    """B requests of `blocks` selected-block slots each: random counts in [min_count, blocks]
    with every fifth request selecting nothing, random block ids and pages, some pages outside
    the cache, ragged context lengths."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = B * blocks + 7
    cache = make_cache(num_pages, gen)
    table = torch.randperm(num_pages, generator=gen)[:B * blocks].view(B, blocks).to(torch.int32)
    table[3, 1], table[B // 2, blocks - 1], table[B - 1, 0] = -1, num_pages + 2, -9
    ids = torch.stack([torch.randperm(blocks, generator=gen) for _ in range(B)]).to(torch.int32)
    cnt = torch.randint(min_count, blocks + 1, (B,), generator=gen).to(torch.int32)
    cnt[::5] = 0
    n = torch.randint(1, blocks * 64 + 1, (B, 1), generator=gen) - torch.arange(R).flip(0)
    q = torch.randn(B * R, 64, 128, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(B * R, 64, generator=gen) * 0.1
    return q, cache, w, n.clamp(min=1).to(torch.int32), table, ids, cnt


@gpu
@pytest.mark.parametrize("B,blocks,min_count", [(700, 6, 0), (600, 100, 60)])
@pytest.mark.parametrize("R", [1, 2, 3])
def test_gpu_logits_many_requests_match_reference(B, blocks, min_count, R):
    """Shapes whose runs do not fit one wave (on an H200: more requests than resident CTAs, or
    more than 64 blocks a CTA): many waves of CTAs, requests that select nothing, ragged
    contexts, pages outside the cache. Reference: the float64 torch implementation, on the GPU
    for speed."""
    args = [t.cuda() for t in _many_requests(B, blocks, R, B + blocks + R, min_count)]
    want = ref.masked_indexer_logits(*args, dtype=torch.float64, chunk=8).float().cpu()
    got = ops.indexer_logits(*args).cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert not torch.isnan(got).any()
    cnt = args[-1].cpu()
    for b in (0, 1, B - 1):                       # past the selection: -inf (request 0: all)
        assert (got[b * R:(b + 1) * R, int(cnt[b]) * 64:] == float("-inf")).all()
    fin = torch.isfinite(want)
    assert fin.sum() > B * R * blocks * 64 // 8
    assert (got[fin] - want[fin]).norm() / want[fin].norm() < 5e-4


@gpu
def test_gpu_update_with_accepted_past_the_rows_replays_every_row():
    # accepted = 2^31 - 1 must mean "all rows", not overflow to none
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5)
    p_cpu, p_gpu = _gpu_problem(B=2, R=3, L=1, lens=(900, 400), seed=19, cfg=cfg)
    ids, cnt = ops.select(p_gpu.state, p_gpu.slot, p_gpu.n, p_gpu.q, p_gpu.request, p_gpu.step,
                          cfg, p_gpu.m_cap, p_gpu.max_ctx)
    z = ops.indexer_logits(p_gpu.qfp8, p_gpu.cache[0], p_gpu.weights, p_gpu.n, p_gpu.table,
                           ids[:, 0], cnt[:, 0])
    for p, zz, ii, cc in ((p_gpu, z, ids, cnt), (p_cpu, z.cpu(), ids.cpu(), cnt.cpu())):
        p.accepted.fill_(2**31 - 1)
        ops.update(p.state, p.slot, zz, ii[:, 0], cc[:, 0], p.n, p.q, p.accepted, p.step, 0, cfg,
                   p.max_ctx)
    for a, b in zip(p_cpu.state.tensors(), p_gpu.state.tensors()):
        assert torch.equal(a, b.cpu())


@gpu
@pytest.mark.parametrize("rows,blocks", [(3, 4096), (20, 1536), (40, 1536), (40, 300)])
@pytest.mark.parametrize("kind", ["randn", "zeros", "few_ties"])
def test_gpu_topk_split_over_clusters_matches_reference(rows, blocks, kind):
    # on 132 SMs: clusters of 8, 4, 2 (48K-slot shares: the largest cached) and 2 CTAs per row;
    # ties and the whole-row fallback cross the CTAs' shares
    gen = torch.Generator().manual_seed(rows + blocks)
    z = _topk_rows(kind, rows, blocks * 64, gen)
    z[0] = float("-inf")                                   # no finite score
    ids = torch.arange(blocks, dtype=torch.int32).repeat(rows, 1)
    cnt = torch.full((rows,), blocks, dtype=torch.int32)
    cnt[1] = 3                                             # K above the finite count
    for k in (512, 2048):
        want = ops.topk(z, ids, cnt, 1, k)
        zg, ig, cg = z.cuda(), ids.cuda(), cnt.cuda()
        got = ops.topk(zg, ig, cg, 1, k)
        assert torch.equal(got.cpu(), want)
        out = torch.empty_like(got)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ops.topk(zg, ig, cg, 1, k, out)
        graph.replay()
        assert torch.equal(out.cpu(), want)


def test_float8_state_through_the_cpu_ops():
    """select, update and reset on float8_e4m3fn state (the CPU ops run the reference): the
    update changes only scored entries, reset zeroes the chosen slots and leaves the others."""
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5, exploration=0.0,
                     state_dtype="float8_e4m3fn")
    p = Problem(B=3, R=2, L=2, cfg=cfg)
    assert p.state.V.dtype == torch.float8_e4m3fn
    before = p.clone_state()
    ids, cnt, _, _ = p.run_step()
    assert not same(p.state.V, before.V) and not same(p.state.D, before.D)
    assert int(cnt.min()) < math.ceil(p.max_ctx / 64)       # blocks were skipped
    slots = p.slot[:1].long()
    pre = p.clone_state()
    ops.reset(p.state, slots.to(torch.int32), torch.full((1,), 77, dtype=torch.int64))
    assert p.state.V[slots].float().abs().sum() == 0 and p.state.D[slots].float().abs().sum() == 0
    assert pre.V[slots].float().abs().sum() > 0
    others = torch.ones(p.state.V.shape[0], dtype=torch.bool)
    others[slots] = False
    assert same(pre.V[others], p.state.V[others]) and same(pre.D[others], p.state.D[others])
    assert (p.state.last_seen[slots] == 77).all()
