"""torch.ops.spin.update and reset: the state update against the reference's per-stream update,
non-finite scores, every layer in one call, accepted counts, float8 state and argument checks
(CPU); the kernels bit for bit against the reference on the same logits (GPU: marked gpu)."""

import math

import pytest
import torch

from spin_trtllm import SpinConfig, SpinError
from spin_trtllm import ops
from spin_trtllm import reference as ref
from spin_trtllm.testing.compare import same
from spin_trtllm.testing.problems import Problem, problem_pair

# GPU tests must run the kernels (SPIN_REQUIRE_NATIVE=1), and spin's own top-K (bit for bit)
pytestmark = pytest.mark.usefixtures("require_native", "spins_own_topk")


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


def _counters_only_against_ema(p, layer):
    """ops.update with ema=False on p against ema=True on a copy: the same last_seen and
    decode_steps, V and D as they were."""
    ids, cnt, z = _every_layer_inputs(p, seed=layer + 7)
    if layer >= 0:
        ids, cnt, z = ids[:, layer], cnt[:, layer], z[layer]
    with_ema = p.clone_state()
    ops.update(with_ema, p.slot, z, ids, cnt, p.n, p.q, p.accepted, p.step, layer, p.cfg,
               p.max_ctx)
    before = p.clone_state()
    ops.update(p.state, p.slot, z, ids, cnt, p.n, p.q, p.accepted, p.step, layer, p.cfg,
               p.max_ctx, ema=False)
    st, want = p.state, with_ema
    assert torch.equal(st.V, before.V) and torch.equal(st.D, before.D)
    assert not torch.equal(want.V, before.V)          # the EMAs would have moved
    assert torch.equal(st.last_seen, want.last_seen) and not torch.equal(st.last_seen,
                                                                         before.last_seen)
    assert torch.equal(st.decode_steps, want.decode_steps)
    assert not torch.equal(st.decode_steps, before.decode_steps)


@pytest.mark.parametrize("R,layer", [(1, 0), (1, 1), (3, -1), (2, 1)])
def test_update_without_ema_moves_only_the_counters(R, layer):
    """ema=False (a predictor that reads no V/D history): last_seen and decode_steps as with
    the EMAs, one layer or every layer, with MTP rows; V and D untouched."""
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5)
    p = Problem(B=3, R=R, L=2, lens=(500, 90, 1000), cfg=cfg, seed=R + layer)
    _counters_only_against_ema(p, layer)


def _without_history(device, history):
    """select with given block scores, then update(ema=False), on a state with or without V/D
    (width 0: a probe or gauss state); the selection and the counters, on the CPU."""
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5, exploration=0.2)
    p = Problem(B=3, R=2, L=2, lens=(500, 90, 1000), cfg=cfg, seed=4, device=device)
    if not history:
        p.state = ops.OpState(p.state.V[:, :, :0].contiguous(), p.state.D[:, :, :0].contiguous(),
                              *p.state.tensors()[2:])
        assert p.state.capacity == math.ceil(p.cap / 64) * 64      # whole blocks
    scores = torch.randn(3, 2, p.m_cap, generator=torch.Generator().manual_seed(2))
    ids, cnt = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap,
                          p.max_ctx, block_scores=scores.to(device), layer=1)
    z = torch.randn(p.B * p.R, p.m_cap * 64, generator=torch.Generator().manual_seed(3))
    ops.update(p.state, p.slot, z.to(device), ids[:, 1], cnt[:, 1], p.n, p.q, p.accepted,
               p.step, 1, cfg, p.max_ctx, ema=False)
    return p, [t.cpu() for t in (ids[:, 1], cnt[:, 1], p.state.last_seen, p.state.decode_steps)]


def test_a_state_without_history_takes_block_scores_and_counters_only():
    """As on a full state; history ranking and EMAs are refused."""
    _, want = _without_history("cpu", True)
    bare, got = _without_history("cpu", False)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    cfg, ids, cnt = bare.cfg, got[0], got[1]
    with pytest.raises(SpinError, match="no V/D history.*block_scores"):
        ops.select(bare.state, bare.slot, bare.n, bare.q, bare.request, bare.step, cfg,
                   bare.m_cap, bare.max_ctx)
    z = torch.zeros(bare.B * bare.R, bare.m_cap * 64)
    with pytest.raises(SpinError, match="no V/D history.*ema=False"):
        ops.update(bare.state, bare.slot, z, ids, cnt, bare.n, bare.q, bare.accepted, bare.step,
                   1, cfg, bare.max_ctx)


@pytest.mark.gpu
def test_gpu_state_without_history_matches_the_cpu():
    """The kernels on V/D of width 0: the given-scores select and the counters-only update."""
    _, want = _without_history("cpu", False)
    _, got = _without_history("cuda", False)
    for a, b in zip(want, got):
        assert torch.equal(a, b)


def test_negative_accepted_counts_as_zero():
    runs = []
    for acc in (-3, 0):
        p = Problem(B=2, R=3, L=1, lens=(400, 200), seed=21)
        p.accepted.fill_(acc)
        p.run_step()
        runs.append(p.state)
    for a, b in zip(runs[0].tensors(), runs[1].tensors()):
        assert torch.equal(a, b)


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


@pytest.mark.gpu
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
    p_cpu, p_gpu = problem_pair(B=3, R=R, L=1, lens=(3000, 700, 64), cap=cap, seed=11, cfg=cfg)
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


@pytest.mark.gpu
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
        p_cpu, p_gpu = problem_pair(B=len(lens), R=R, L=1, lens=lens, cap=cap, seed=seed, cfg=cfg)
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


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", ["float32", "float16", "float8_e4m3fn"])
@pytest.mark.parametrize("R", [1, 4])
def test_gpu_update_every_layer_matches_reference(state_dtype, R):
    """One launch for every layer (grid z) against the reference one layer at a time: strided
    layers and rows, accepted 0 / some / all / negative, a request with nothing selected."""
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5, state_dtype=state_dtype)
    p_cpu, p_gpu = problem_pair(B=4, R=R, L=3, lens=(3000, 700, 64, 1500), seed=23, cfg=cfg)
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


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", ["float16", "float8_e4m3fn"])
@pytest.mark.parametrize("R,layer", [(1, 2), (2, -1)])
def test_gpu_update_without_ema_matches_reference(state_dtype, R, layer):
    """The kernel's ema=False launch (one CTA a stream) against the reference and against its
    own EMA launch's counters; a request that selected nothing in layer 0."""
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5, state_dtype=state_dtype)
    p_cpu, p_gpu = problem_pair(B=4, R=R, L=3, lens=(3000, 700, 64, 1500), seed=31, cfg=cfg)
    _counters_only_against_ema(p_gpu, layer)
    _counters_only_against_ema(p_cpu, layer)
    for a, b in zip(p_cpu.state.tensors(), p_gpu.state.tensors()):
        assert same(a, b.cpu())


@pytest.mark.gpu
def test_gpu_update_with_accepted_past_the_rows_replays_every_row():
    # accepted = 2^31 - 1 must mean "all rows", not overflow to none
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5)
    p_cpu, p_gpu = problem_pair(B=2, R=3, L=1, lens=(900, 400), seed=19, cfg=cfg)
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
