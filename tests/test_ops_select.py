"""torch.ops.spin.select: the reference against independent per-stream computations and its
argument checks (CPU); the kernels against the reference (GPU: marked gpu): block ids and
counts, exploration policies and pooling, warm-up and forced blocks, overflow, ties, the
kernels of many and few CTAs."""

import math

import pytest
import torch

from spin_trtllm import SpinConfig, SpinError
from spin_trtllm import ops
from spin_trtllm import reference as ref
from spin_trtllm.testing.compare import compare_step
from spin_trtllm.testing.problems import Problem, integer_state, problem_pair

# GPU tests must run the kernels (SPIN_REQUIRE_NATIVE=1), and spin's own top-K (bit for bit)
pytestmark = pytest.mark.usefixtures("require_native", "spins_own_topk")


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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
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


def test_state_slot_checks_on_cpu():
    p = Problem(B=2, L=1)
    args = _select_args(p)
    args[4] = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(SpinError, match="state slots must be in"):
        torch.ops.spin.select(*args)
    args[4] = torch.tensor([1, 1], dtype=torch.int32)
    with pytest.raises(SpinError, match="distinct"):
        torch.ops.spin.select(*args)


def test_ops_refuse_a0_a2_and_other_block_sizes():
    p = Problem(B=1, L=1)
    for cfg in (SpinConfig(reduction="A2"), SpinConfig(block_size=32)):
        with pytest.raises(SpinError, match="reduction A1 with block_size 64"):
            ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, 4, p.max_ctx)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["random", "age", "staleness"])
@pytest.mark.parametrize("pooling", ["max", "mean", "top4"])
def test_gpu_exploration_and_pooling(policy, pooling):
    cfg = SpinConfig(index_topk=64, target_sparsity=0.4, exploration=0.2,
                     exploration_policy=policy, pooling=pooling)
    p_cpu, p_gpu = problem_pair(B=3, R=2, L=2, lens=(2000, 700, 130), seed=5, cfg=cfg)
    integer_state(p_cpu, p_gpu)
    compare_step(p_cpu, p_gpu)


@pytest.mark.gpu
def test_gpu_no_forced_blocks_and_two_warmup_steps():
    cfg = SpinConfig(index_topk=128, target_sparsity=0.6, keep_sink=False, keep_newest=False,
                     warmup_steps=2, exploration=0.1, exploration_policy="age")
    p_cpu, p_gpu = problem_pair(B=3, R=2, L=2, lens=(3000, 640, 65), seed=19, cfg=cfg)
    for p in (p_cpu, p_gpu):
        p.state.decode_steps[:, 0] = 1           # layer 0 still warming up, layer 1 live
    compare_step(p_cpu, p_gpu)


@pytest.mark.gpu
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
    p_cpu, p_gpu = problem_pair(B=B, R=1, L=L, lens=(700, 64, 1500, 4100), cap=66 * 64,
                                cfg=cfg, seed=9, warm=(False, False, True))
    args = lambda p: (p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap,  # noqa: E731
                      p.max_ctx)
    ids_c, cnt_c = ops.select(*args(p_cpu))
    ids_g, cnt_g = ops.select(*args(p_gpu))
    assert torch.equal(cnt_g.cpu(), cnt_c) and torch.equal(ids_g.cpu(), ids_c)
    ids_1, cnt_1 = ops.select(*args(p_gpu), layer=1)
    assert torch.equal(cnt_1[:, 1].cpu(), cnt_c[:, 1]) and torch.equal(ids_1[:, 1].cpu(), ids_c[:, 1])
    assert (cnt_1[:, 0] == 0).all() and (ids_1[:, 2] == -1).all()


def _select_both(p_cpu, p_gpu, cfg):
    args = lambda p: (p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap,  # noqa: E731
                      p.max_ctx)
    ids_c, cnt_c = ops.select(*args(p_cpu))
    ids_g, cnt_g = ops.select(*args(p_gpu))
    assert torch.equal(cnt_g.cpu(), cnt_c)
    assert torch.equal(ids_g.cpu(), ids_c)
    return cnt_c


# 16 requests whose newest query q0 = len - 1 takes every residue mod 16: every skew of the D
# window against the state's 8- and 16-entry vectors; fp8 rows go together from tables of
# 1,024 blocks (select.cu's kRowsTogetherMinBlocksFp8)
SKEW_LENS = tuple(2000 + 67 * i for i in range(16))
FP8_SKEW_LENS = tuple(66_000 + 67 * i for i in range(16))


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype,cap_pad", [("float16", 0), ("float16", 4),
                                                 ("float8_e4m3fn", 0), ("float8_e4m3fn", 8)])
@pytest.mark.parametrize("R", [2, 4, 8])
@pytest.mark.parametrize("L", [1, 5])
def test_gpu_mtp_rows_scored_together_match_reference(state_dtype, cap_pad, R, L):
    """MTP rows at consecutive queries score their blocks from one read of V and D (each row's
    D window masked out of the shared loads): every row's blocks as the reference's, on random
    state, at every skew, with 16-byte vectors and narrower ones (a state capacity that is not
    a multiple of 16 bytes' entries), on the kernel of few CTAs (L 1) and of many (L 5: more
    CTAs than half the SMs)."""
    cfg = SpinConfig(index_topk=256, target_sparsity=0.5, exploration=0.1,
                     state_dtype=state_dtype)
    lens = FP8_SKEW_LENS if state_dtype == "float8_e4m3fn" else SKEW_LENS
    cap = 64 * math.ceil((max(lens) + R + 64) / 64) + cap_pad
    p_cpu, p_gpu = problem_pair(B=16, R=R, L=L, lens=lens, cap=cap, cfg=cfg, seed=R + L)
    cnt = _select_both(p_cpu, p_gpu, cfg)
    assert int(cnt.min()) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", ["float16", "float8_e4m3fn"])
@pytest.mark.parametrize("R", [2, 8])
def test_gpu_mtp_rows_together_window_edges_decide(state_dtype, R):
    """The same rows on state where each row's window edges decide its blocks: D is -12 but for
    a random value in [-6, -1] at q0 + r' - 64 j for every r' < 8 and block j (V below it all),
    so row r's window holds block j's spikes r' <= r and block j + 1's r' > r. A row that took
    an entry past its window's edge, or a vector it did not load (read as zero), scores the
    blocks otherwise (a window moved by one changed the top half of 61 of 64 such rows in a
    simulation) and picks other blocks than the reference."""
    cfg = SpinConfig(index_topk=256, target_sparsity=0.5, exploration=0.0,
                     state_dtype=state_dtype)
    lens = FP8_SKEW_LENS if state_dtype == "float8_e4m3fn" else SKEW_LENS
    cap = 64 * math.ceil((max(lens) + R + 64) / 64)
    L = 5
    p_cpu, p_gpu = problem_pair(B=16, R=R, L=L, lens=lens, cap=cap, cfg=cfg, seed=R)
    gen = torch.Generator().manual_seed(R)
    V = torch.full(p_cpu.state.V.shape, -14.0)
    D = torch.full(p_cpu.state.D.shape, -12.0)
    for b in range(16):
        q0 = int(p_cpu.q[b, 0])
        pos = torch.tensor([q0 + r - 64 * j for j in range(cap // 64 + 1) for r in range(8)])
        pos = pos[(pos >= 0) & (pos < cap)]
        D[int(p_cpu.slot[b]), :, pos] = torch.rand(L, len(pos), generator=gen) * 5 - 6
    for p in (p_cpu, p_gpu):
        p.state.V.copy_(V.to(p.state.V.device))
        p.state.D.copy_(D.to(p.state.D.device))
    _select_both(p_cpu, p_gpu, cfg)


@pytest.mark.gpu
@pytest.mark.own_profiler
@pytest.mark.parametrize("state_dtype,lens,R,together", [
    ("float16", SKEW_LENS, 1, False), ("float16", SKEW_LENS, 2, True),
    ("float8_e4m3fn", SKEW_LENS, 2, False), ("float8_e4m3fn", FP8_SKEW_LENS, 2, True)])
def test_gpu_mtp_rows_together_run_their_own_kernel(state_dtype, lens, R, together):
    """The rows-together instance runs where the tests above expect it (fp16 MTP rows; fp8 MTP
    rows of long tables), the one-row kernel elsewhere."""
    from torch.profiler import ProfilerActivity, profile
    cfg = SpinConfig(index_topk=256, target_sparsity=0.5, state_dtype=state_dtype)
    cap = 64 * math.ceil((max(lens[:4]) + R + 64) / 64)   # whole blocks: 16-byte vectors
    p = Problem(B=4, R=R, L=2, lens=lens[:4], cap=cap, cfg=cfg, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "select_kernel" in e.name]
    assert names and all(n.endswith(f"{str(together).lower()}>(spin::SelectParams)")
                         for n in names), names


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["queries_not_consecutive", "past_the_shared_memory"])
def test_gpu_mtp_rows_scored_one_at_a_time_match_reference(case):
    """Rows whose queries are not q0 + r (each scored from its own read), and rows too many
    for their score buffers to fit (launched on the one-row kernel) pick the reference's
    blocks."""
    cfg = SpinConfig(index_topk=256, target_sparsity=0.5, exploration=0.1,
                     state_dtype="float16")
    if case == "queries_not_consecutive":
        p_cpu, p_gpu = problem_pair(B=16, R=4, L=2, lens=SKEW_LENS, cap=64 * 64, cfg=cfg,
                                    seed=3)
        for p in (p_cpu, p_gpu):   # rows 1.. query three slots past their newest
            p.q[:, 1:] += 3
    else:  # 8 rows x 1,720 blocks: (8 x 4 + 2) B a block is past kRowsTogetherSmem
        p_cpu, p_gpu = problem_pair(B=2, R=8, L=1, lens=(110_000, 70_001), cfg=cfg, seed=4)
    _select_both(p_cpu, p_gpu, cfg)


@pytest.mark.gpu
def test_gpu_select_overflow_truncates_like_reference():
    p_cpu, p_gpu = problem_pair(B=2, R=2, L=1, lens=(1500, 300), warm=(True,))
    compare_step(p_cpu, p_gpu, m_cap=7)


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.large  # statistics over many steps; exploration also runs in the step tests
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


@pytest.mark.gpu
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


def test_select_beside_previous_needs_output_buffers_allocated_before():
    # fresh outputs could take memory the previous kernel (the top-K) still reads
    cfg = SpinConfig(index_topk=64, target_sparsity=0.5)
    p = Problem(B=2, R=1, L=2, lens=(300,), seed=5, cfg=cfg)
    with pytest.raises(SpinError, match="beside_previous writes block_ids and counts"):
        ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx,
                   layer=0, beside_previous=True)
    ids = torch.full((2, 2, p.m_cap), -1, dtype=torch.int32)
    cnt = torch.zeros(2, 2, dtype=torch.int32)
    ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, cfg, p.m_cap, p.max_ctx, ids, cnt,
               layer=0, beside_previous=True)
    assert (cnt[:, 0] > 0).all()
