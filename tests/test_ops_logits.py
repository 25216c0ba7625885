"""torch.ops.spin.indexer_logits: scores of the selected blocks against a naive loop, the FP8
page layout, pages outside the cache and argument checks (CPU); the kernel against the
reference (GPU: marked gpu): scales of every sign, NaN keys, long runs, many requests."""

import pytest
import torch

from spin_trtllm import SpinConfig, SpinError
from spin_trtllm import ops
from spin_trtllm import reference as ref
from spin_trtllm.testing.pages import make_cache
from spin_trtllm.testing.problems import Problem, problem_pair

# GPU tests must run the kernels (SPIN_REQUIRE_NATIVE=1), and spin's own top-K (bit for bit)
pytestmark = pytest.mark.usefixtures("require_native", "spins_own_topk")


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


@pytest.mark.gpu
def test_gpu_out_of_cache_entries_and_device_mismatch():
    p_cpu, p_gpu = problem_pair(B=2, R=2, L=1, lens=(600, 300), seed=13)
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


@pytest.mark.gpu
def test_gpu_nan_in_cache_is_never_ranked_or_observed():
    cfg = SpinConfig(index_topk=64, target_sparsity=0.3)
    p_cpu, p_gpu = problem_pair(B=2, R=2, L=1, lens=(900, 300), seed=17, cfg=cfg)
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


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2, 3, 6])
def test_gpu_logits_negative_zero_and_infinite_scales(R):
    # the kernel factors a finite scale >= 0 out of the head sum; other scales take the exact path
    p_cpu, p_gpu = problem_pair(B=2, R=R, L=1, lens=(500, 300), seed=17)
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


@pytest.mark.gpu
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


@pytest.mark.gpu
@pytest.mark.parametrize("B,blocks,min_count", [
    pytest.param(700, 6, 0, marks=pytest.mark.large),
    pytest.param(600, 100, 60, marks=pytest.mark.large),
    (900, 2, 1), (40, 150, 70)])
@pytest.mark.parametrize("R", [1, 2, 3])
def test_gpu_logits_many_requests_match_reference(B, blocks, min_count, R):
    """Shapes whose runs do not fit one wave (on an H200: more requests than resident CTAs, or
    more than 64 blocks a CTA): many waves of CTAs, requests that select nothing, ragged
    contexts, pages outside the cache. Reference: the float64 torch implementation, on the GPU
    for speed. The sanitizers run the two small shapes (900 one- or two-block requests: more
    CTAs than an H200 holds at once; 40 requests of up to 150 blocks: three runs a request);
    the large ones read ten times the pages."""
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
