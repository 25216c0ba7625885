"""torch.ops.spin.topk: the top-K slots of the selected blocks against a naive ranking (CPU);
the kernels against the reference on ties, long rows, threshold bins of every size, rows split
over clusters and rows ranked through the filter (GPU: marked gpu)."""

import math

import pytest
import torch

from spin_trtllm import SpinError, ops
from spin_trtllm.testing.triton_pdl import triton_with_pdl

# GPU tests must run the kernels (SPIN_REQUIRE_NATIVE=1), and spin's own top-K (bit for bit)
pytestmark = pytest.mark.usefixtures("require_native", "spins_own_topk")
# Cases racecheck takes 100-500 s on (cluster kernels, all-tied rows, 1024+ blocks; 100x
# memcheck's time): it runs their smaller twins instead, the same kernel instance (cluster size,
# cached share) and path
_RACECHECK_SLOW = [pytest.mark.racecheck_slow]


@pytest.fixture(autouse=True)
def one_cta_topk(monkeypatch):
    """The one-CTA (and cluster) kernel, which these tests are about; the filter's tests switch
    to the filter (SPIN_TOPK_FILTER, read by the binding at every call)."""
    monkeypatch.setenv("SPIN_TOPK_FILTER", "0")


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


@pytest.mark.parametrize("mode", ["2", "on", "AUTO"])
def test_topk_rejects_an_unknown_filter_mode(monkeypatch, mode):
    monkeypatch.setenv("SPIN_TOPK_FILTER", mode)
    ids, cnt = torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    with pytest.raises(SpinError, match="SPIN_TOPK_FILTER must be 0, 1 or auto, got"):
        ops.topk(torch.zeros(1, 64), ids, cnt, 1, 4)
    with pytest.raises(SpinError, match="SPIN_TOPK_FILTER must be 0, 1 or auto, got"):
        ops.topk_filters(96, 1 << 17, 512)       # the routing and the cost model ask it
    with ops.using_topk_backend("flashinfer"), \
            pytest.raises(SpinError, match="SPIN_TOPK_FILTER must be 0, 1 or auto, got"):
        ops.topk(torch.zeros(1, 64), ids, cnt, 1, 4)   # refused before any path is chosen


def test_topk_refuses_an_out_of_another_k():
    ids, cnt = torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    out = torch.empty(1, 8, dtype=torch.int32)
    with pytest.raises(SpinError, match=r"topk: out must have K = 4 columns, got \[1, 8\]"):
        ops.topk(torch.zeros(1, 64), ids, cnt, 1, 4, out)


@pytest.mark.parametrize("mode", ["", "auto", "0", "1"])
def test_topk_takes_every_filter_mode_and_an_empty_one(monkeypatch, mode):
    # an empty value (a container's `ENV SPIN_TOPK_FILTER=`) means auto, as unset does
    monkeypatch.setenv("SPIN_TOPK_FILTER", mode)
    logits = torch.arange(64.0).view(1, 64)
    ids, cnt = torch.tensor([[2]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    assert ops.topk(logits, ids, cnt, 1, 4).tolist() == [[188, 189, 190, 191]]


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


# 4 rows of 1100 blocks run clusters of 8 (700: of 4), each CTA's share cached. Under racecheck
# they take 210-300 s a kind: threshold_bin_sizes' 1 x 1024 rows run that instance with ties
# there; the sanitizers' other tools keep ties at K (zeros) and non-finite entries (wide)
@pytest.mark.gpu
@pytest.mark.parametrize("blocks,k,kind", [
    pytest.param(blocks, k, kind, id=f"{blocks}-{k}-{kind}",
                 marks=([pytest.mark.large] if kind not in ("zeros", "wide") else _RACECHECK_SLOW)
                 if blocks == 1100 else [])
    for blocks, k in [(1, 512), (40, 512), (40, 2048), (700, 512), (1100, 2048)]
    for kind in ["randn", "zeros", "narrow", "few_ties", "wide"]])
def test_gpu_topk_matches_reference_on_ties_and_long_rows(kind, blocks, k):
    # 700 / 1100 blocks (44.8K / 70.4K slots): where no clusters run (sm_89), one CTA a row holds
    # the first in shared memory and reads the second from global memory
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


def _whole_rows_match_reference(z: torch.Tensor, ids: torch.Tensor, k: int) -> None:
    """One row a request, every block of its table selected, K entries taken in each."""
    cnt = torch.full((z.shape[0],), ids.shape[1], dtype=torch.int32)
    want = ops.topk(z, ids, cnt, 1, k)
    assert (want >= 0).all()
    got = ops.topk(z.cuda(), ids.cuda(), cnt.cuda(), 1, k)
    assert torch.equal(got.cpu(), want)


def _threshold_bin_cases():
    """Racecheck runs one bin of each path per cluster size: counting (40, 25), radix over the
    candidates (257, 100) and over the whole row (5000, 60); at clusters of 8 (1 x 1024), where
    it is slowest, counting and the whole row only."""
    cases = []
    for rows, blocks in [(1, 1024), (3, 1024), (20, 256), (20, 1024), (40, 128), (40, 1024),
                         (140, 300)]:
        racechecked = ({(40, 25), (5000, 60)} if rows == 1 else
                       {(40, 25), (257, 100), (5000, 60)} if blocks < 1024 else set())
        for in_bin, tied in [(1, 0), (40, 0), (40, 25), (256, 256), (257, 100), (1000, 0),
                             (5000, 60)]:
            marks = [] if (in_bin, tied) in racechecked else _RACECHECK_SLOW
            cases.append(pytest.param(in_bin, tied, rows, blocks, marks=marks))
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("in_bin,tied,rows,blocks", _threshold_bin_cases())
def test_gpu_topk_threshold_bin_sizes_match_reference(rows, blocks, in_bin, tied):
    # on 132 SMs clusters of 8, 4, 2 and 1 CTA per row (140 rows: of 512 threads, two an SM,
    # the share cached); bins up to 256 entries are ranked by counting (gathered over the
    # cluster), larger ones by radix passes (over the candidates, or over the whole row past
    # 4096)
    gen = torch.Generator().manual_seed(rows * 13 + in_bin + tied)
    k = 512
    z = _threshold_bin_rows(rows, blocks * 64, in_bin, tied, k, gen)
    ids = torch.stack([torch.randperm(blocks + 50, generator=gen)[:blocks].sort().values
                       for _ in range(rows)]).int()
    _whole_rows_match_reference(z, ids, k)


@pytest.mark.gpu
@pytest.mark.parametrize("rows,blocks", [(8, 6400), (20, 3200), (40, 1600)])
def test_gpu_topk_cluster_shares_past_shared_memory_match_reference(rows, blocks):
    # on 132 SMs clusters of 8 (8 rows), 4 (20 rows) and 2 (40 rows) whose shares (51.2K
    # slots, 200 KB) exceed the 192 KB cache: the uncached instances, the only way those rows
    # run (too few rows for the filter)
    gen = torch.Generator().manual_seed(rows * blocks)
    z = _topk_rows("zeros", rows, blocks * 64, gen)
    ids = torch.arange(blocks, dtype=torch.int32).repeat(rows, 1)
    cnt = torch.full((rows,), blocks, dtype=torch.int32)
    cnt[1] = blocks // 3
    want = ops.topk(z, ids, cnt, 1, 2048)
    got = ops.topk(z.cuda(), ids.cuda(), cnt.cuda(), 1, 2048)
    assert torch.equal(got.cpu(), want)


# The K taken slots in one dense run (a window of recent slots scoring highest): whole words of
# the bitmap, a lane writing 32 positions in a row. On 132 SMs: clusters of 4 (4 rows); more
# rows than SMs, one CTA of 512 threads a row, two an SM, with its share cached (140 x 19.2K
# slots) or not (140 x 25.6K and 70.4K); one CTA of 1024 a row, not cached (100 x 70.4K); the
# filter (20 rows).
@pytest.mark.gpu
@pytest.mark.parametrize("rows,blocks,filter_mode", [
    (4, 300, "0"), pytest.param(140, 300, "0", marks=_RACECHECK_SLOW), (140, 400, "0"),
    pytest.param(140, 1100, "0", marks=_RACECHECK_SLOW),
    pytest.param(100, 1100, "0", marks=_RACECHECK_SLOW),
    pytest.param(20, 1100, "1", marks=_RACECHECK_SLOW)])
def test_gpu_topk_dense_windows_match_reference(monkeypatch, rows, blocks, filter_mode):
    monkeypatch.setenv("SPIN_TOPK_FILTER", filter_mode)
    gen = torch.Generator().manual_seed(rows + blocks)
    k = 2048
    z = torch.randn(rows, blocks * 64, generator=gen)
    starts = torch.randint(0, blocks * 64 - k + 1, (rows,), generator=gen)
    for r, start in enumerate(starts.tolist()):
        z[r, start:start + k] = 100.0 + torch.rand(k, generator=gen)
    z[0, -k:] = 200.0                                        # and the row's last slots
    ids = torch.stack([torch.randperm(2 * blocks, generator=gen)[:blocks].sort().values
                       for _ in range(rows)]).int()
    _whole_rows_match_reference(z, ids, k)


def _sampled_rows(kind: str, rows: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """Rows for the one-CTA kernel's sampled pass (A'), which reads one float4 in 8 (positions
    whose pos // 4 is a multiple of 8) first: `sampled_high` makes the sample overestimate the
    threshold, `between_samples` puts taken entries where no sample looks."""
    sampled = (torch.arange(width) // 4) % 8 == 0
    if kind == "sampled_high":    # only the sampled entries are large: too few listed (full rows)
        z = torch.randn(rows, width, generator=gen)
        z[:, sampled] += 50.0
        return z
    if kind == "between_samples":  # 300 of the largest where no sample looks: listed all the same
        z = torch.randn(rows, width, generator=gen)
        hidden = (~sampled).nonzero().flatten()
        for r in range(rows):
            pick = hidden[torch.randperm(hidden.numel(), generator=gen)[:300]]
            z[r, pick] = 20.0 + torch.rand(300, generator=gen)
        return z
    if kind.startswith("finite_"):   # -inf but for N finite entries: the sample finds few
        n = int(kind.split("_")[1])
        z = torch.full((rows, width), float("-inf"))
        for r in range(rows):
            z[r, torch.randperm(width, generator=gen)[:n]] = torch.randn(n, generator=gen)
        return z
    return _topk_rows(kind, rows, width, gen)


# One CTA a row with K <= 512 and a row not cached in shared memory lists its candidates above a
# threshold from a sample first, and starts over where that lists fewer than min(K, finite) or
# more than it keeps (ReLU-like, narrow and wide rows: too many; sampled_high's full rows: too
# few). On 132 SMs: 100 rows, one CTA of 1024 threads a row; 140 rows, of 512 threads, two an
# SM; 200 blocks cached (no sample), 1100 not. Two rows a request, the second request's table
# half selected.
def _sampled_marks(rows, blocks, kind):
    """Racecheck runs 140 x 400 rows listed (randn), tied (few_ties) and started again
    (sampled_high), and the 100 x 200 cached ones; the others are its slow twins."""
    if (rows, blocks) == (140, 400):
        return [] if kind in ("randn", "few_ties", "sampled_high") else _RACECHECK_SLOW
    return _RACECHECK_SLOW if blocks > 200 or rows > 100 else []


@pytest.mark.gpu
@pytest.mark.parametrize("rows,blocks,k,kind", [
    pytest.param(rows, blocks, k, kind, id=f"{rows}-{blocks}-{k}-{kind}",
                 marks=_sampled_marks(rows, blocks, kind))
    for rows, blocks in [(100, 200), (100, 1100), (140, 200), (140, 400), (140, 1100)]
    for k, kind in [(512, "randn"), (512, "zeros"), (512, "narrow"), (512, "few_ties"),
                    (512, "wide"), (512, "sampled_high"), (512, "between_samples"),
                    (512, "finite_300"), (512, "finite_900"), (100, "randn"),
                    (513, "randn")]])
def test_gpu_topk_sampled_candidates_match_reference(rows, blocks, k, kind):
    gen = torch.Generator().manual_seed(rows * blocks + k + len(kind))
    R = 2
    m_cap = blocks + 3
    z = _sampled_rows(kind, rows, m_cap * 64, gen)
    ids = torch.stack([torch.randperm(2 * m_cap, generator=gen)[:m_cap].sort().values
                       for _ in range(rows // R)]).int()
    cnt = torch.tensor([blocks if b % 2 == 0 else blocks // 2 for b in range(rows // R)],
                       dtype=torch.int32)
    want = ops.topk(z, ids, cnt, R, k)
    got = ops.topk(z.cuda(), ids.cuda(), cnt.cuda(), R, k)
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.racecheck_slow
@pytest.mark.parametrize("kind", ["randn", "zeros"])
def test_gpu_topk_shares_without_room_for_their_bitmap_match_reference(kind):
    # one row of 200,000 blocks (12.8M slots) and one of a third: on 132 SMs clusters of 8
    # whose 1.6M-slot shares leave no room for their 200 KB bitmap beside the kernel's static
    # shared memory (227 KB a CTA), so the warps write what they take (without clusters, one
    # CTA a row, the same)
    gen = torch.Generator().manual_seed(200_000)
    blocks = 200_000
    z = _topk_rows(kind, 2, blocks * 64, gen)
    ids = torch.arange(blocks, dtype=torch.int32).repeat(2, 1)
    cnt = torch.tensor([blocks, blocks // 3], dtype=torch.int32)
    want = ops.topk(z, ids, cnt, 1, 2048)
    got = ops.topk(z.cuda(), ids.cuda(), cnt.cuda(), 1, 2048)
    assert torch.equal(got.cpu(), want)


def _split_marks(rows, blocks, kind):
    """Racecheck runs clusters of 4 and 2 (randn; all-tied rows at 2 only); clusters of 8 in
    the threshold-bin test."""
    if kind == "few_ties":
        return [pytest.mark.large]
    return _RACECHECK_SLOW if blocks > 400 or (rows, kind) == (20, "zeros") else []


@pytest.mark.gpu
@pytest.mark.parametrize("kind,rows,blocks", [
    pytest.param(kind, rows, blocks, marks=_split_marks(rows, blocks, kind))
    for rows, blocks in [(3, 1024), (3, 4096), (20, 400), (20, 1536), (40, 1536), (40, 1507),
                         (40, 300)]
    for kind in ["randn", "zeros", "few_ties"]])
def test_gpu_topk_split_over_clusters_matches_reference(rows, blocks, kind):
    # on 132 SMs: clusters of 8 (3 rows), 4 (20 rows), 2 (40 rows: 1536 blocks make shares of
    # 768, just past the 754 cached with their bitmap; 1507 make 754, just inside; 300) CTAs a row;
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


# The filter's passes take 16384 slots (256 blocks) a CTA: 257 blocks leave a second slice of
# one block, 3 blocks (the first batch row) one slice. randn ranks the K-th value's bin by
# counting, few_ties by radix passes over the candidates (ties split); zeros, narrow and wide
# put more than 4096 entries in it, and those rows are ranked whole after the passes. 1024
# blocks: racecheck runs the same kernels on the smaller cases. 140 rows (more than 132 SMs):
# one CTA of 512 threads a row ranks them, two an SM.
def _filter_cases():
    """Racecheck leaves out the 1024-block rows, and narrow and wide at 140 rows (zeros runs
    the whole-row rank there)."""
    cases = []
    for rows, blocks, k in [(4, 257, 512), (6, 300, 100), (4, 1024, 512), (4, 1024, 2048),
                            (5, 300, 1), (40, 1024, 512), (140, 300, 512)]:
        for kind in ["randn", "zeros", "narrow", "few_ties", "wide"]:
            slow = blocks == 1024 or (rows == 140 and kind in ("narrow", "wide"))
            cases.append(pytest.param(rows, blocks, k, kind, id=f"{kind}-{rows}-{blocks}-{k}",
                                      marks=_RACECHECK_SLOW if slow else []))
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("rows,blocks,k,kind", _filter_cases())
def test_gpu_topk_through_the_filter_matches_reference(monkeypatch, rows, blocks, k, kind):
    monkeypatch.setenv("SPIN_TOPK_FILTER", "1")
    gen = torch.Generator().manual_seed(rows * blocks + k)
    R = 2 if rows % 2 == 0 else 1
    B = rows // R
    m_cap = blocks + 5
    z = _topk_rows(kind, rows, m_cap * 64, gen)
    z[-1] = float("-inf")                                    # no finite score
    ids = torch.stack([torch.randperm(2 * m_cap, generator=gen)[:m_cap].sort().values
                       for _ in range(B)]).int()
    cnt = torch.full((B,), blocks, dtype=torch.int32)
    cnt[0] = 3                                               # K above the finite count, one slice
    if B > 2:
        cnt[1] = 0                                           # nothing selected
        cnt[2] = blocks // 2 + 1
    lens = torch.randint(0, m_cap * 64, (B, R), generator=gen, dtype=torch.int32)
    lens[-1, 0] = m_cap * 64
    for row_lens in (None, lens):
        want = ops.topk(z, ids, cnt, R, k, row_lens=row_lens)
        zg, ig, cg = z.cuda(), ids.cuda(), cnt.cuda()
        lg = None if row_lens is None else row_lens.cuda()
        got = ops.topk(zg, ig, cg, R, k, row_lens=lg)
        assert torch.equal(got.cpu(), want), f"row_lens {row_lens is not None}"
    out = torch.empty_like(got)                              # the workspace inside a capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.topk(zg, ig, cg, R, k, out, row_lens=lg)
    graph.replay()
    assert torch.equal(out.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("in_bin,tied", [(1, 0), (40, 25), (257, 100), (5000, 60)])
def test_gpu_topk_filter_threshold_bins_match_reference(monkeypatch, in_bin, tied):
    # the K-th value's bin spread over the slices, ties among it crossing their edges: ranked by
    # counting (40), by radix passes over the candidates (257), whole (5000: over 4096)
    monkeypatch.setenv("SPIN_TOPK_FILTER", "1")
    gen = torch.Generator().manual_seed(in_bin + tied)
    rows, blocks, k = 4, 400, 512
    z = _threshold_bin_rows(rows, blocks * 64, in_bin, tied, k, gen)
    ids = torch.arange(blocks, dtype=torch.int32).repeat(rows, 1)
    cnt = torch.full((rows,), blocks, dtype=torch.int32)
    want = ops.topk(z, ids, cnt, 1, k)
    got = ops.topk(z.cuda(), ids.cuda(), cnt.cuda(), 1, k)
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.racecheck_slow
def test_gpu_topk_auto_filter_equals_one_cta(monkeypatch):
    # SPIN_TOPK_FILTER=auto at 32 rows of 256K slots (the filter), against the one-CTA kernel
    gen = torch.Generator().manual_seed(96)
    rows, blocks = 32, 4096
    z = torch.randn(rows, blocks * 64, generator=gen).cuda()
    ids = torch.arange(blocks, dtype=torch.int32).repeat(rows, 1).cuda()
    cnt = torch.full((rows,), blocks, dtype=torch.int32).cuda()
    one_cta = ops.topk(z, ids, cnt, 1, 512)
    monkeypatch.setenv("SPIN_TOPK_FILTER", "auto")
    assert torch.equal(ops.topk(z, ids, cnt, 1, 512), one_cta)


def _allocations(fn) -> int:
    """Allocation requests torch's CUDA allocator saw during fn() (the filter's workspace is
    one); no profiler, so it also works under the sanitizers and inside the kernel log's."""
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    fn()
    return torch.cuda.memory_stats()["allocation.all.allocated"] - before


@pytest.mark.gpu
def test_gpu_topk_filter_edge_rows_match_reference(monkeypatch):
    # every finite entry taken across both slices (T == finite < K, and T == finite == K), a
    # row ending exactly at the first slice's edge, a full row
    monkeypatch.setenv("SPIN_TOPK_FILTER", "1")
    gen = torch.Generator().manual_seed(7)
    blocks, k = 300, 2048
    z = torch.full((4, blocks * 64), float("-inf"))
    for row, finite in [(0, k), (1, 1000)]:
        at = torch.randperm(blocks * 64, generator=gen)[:finite]
        z[row, at] = torch.randn(finite, generator=gen)
    z[2:] = torch.randn(2, blocks * 64, generator=gen)
    ids = torch.arange(blocks, dtype=torch.int32).repeat(4, 1)
    cnt = torch.tensor([blocks, blocks, 256, blocks], dtype=torch.int32)
    want = ops.topk(z, ids, cnt, 1, k)
    zg, ig, cg = z.cuda(), ids.cuda(), cnt.cuda()
    got = ops.topk(zg, ig, cg, 1, k)
    assert torch.equal(got.cpu(), want)


# (SPIN_TOPK_FILTER, rows, blocks, whether the binding ranks them through the filter at K 512)
FILTER_MODE_CASES = [
    ("1", 4, 300, True), ("1", 4, 256, False),            # 1: any rows of more than 16K slots
    (None, 16, 4096, True), (None, 15, 4096, False),      # unset is auto: 16-32 rows of >= 256K
    (None, 16, 4095, False), (None, 32, 4096, True), (None, 33, 4096, False),
    ("auto", 32, 2048, False), ("auto", 32, 8192, True), ("0", 32, 4096, False),
    ("", 32, 4096, True),                                 # empty is auto
    ("1", 4, 8192, True), ("1", 4, 8193, False),          # at most 512K slots
    ("1", 2048, 300, True), ("1", 2049, 300, False)]      # at most 2048 rows


def _set_filter_mode(monkeypatch, mode):
    if mode is None:
        monkeypatch.delenv("SPIN_TOPK_FILTER", raising=False)
    else:
        monkeypatch.setenv("SPIN_TOPK_FILTER", mode)


@pytest.mark.parametrize("mode,rows,blocks,filters", FILTER_MODE_CASES)
def test_topk_filters_states_the_bindings_rule(monkeypatch, mode, rows, blocks, filters):
    """ops.topk_filters (the auto routing and the cost model ask it) against the rule the GPU
    test below checks on the binding; K past 2048 is ranked whole."""
    _set_filter_mode(monkeypatch, mode)
    assert ops.topk_filters(rows, blocks * 64, 512) == filters
    assert ops.topk_filters(rows, blocks * 64) == filters
    assert not ops.topk_filters(rows, blocks * 64, 2049)


def _early_release_copy():
    """A Triton kernel that lets the kernel after it start at once (griddepcontrol
    .launch_dependents), then copies src into dst after a delay of `spins` dependent FMAs: the
    producer a top-K launched beside its predecessor must wait for. None without Triton 3.6
    (triton_with_pdl), where this test was seen to fail against a top-K without its wait."""
    found = triton_with_pdl()
    if isinstance(found, str):
        return None
    triton, tl = found

    @triton.jit
    def copy_late(src, dst, n, spins, BLOCK: tl.constexpr):
        tl.extra.cuda.gdc_launch_dependents()
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        x = tl.load(src + offs, mask=mask)
        acc = x
        for _ in range(spins):
            acc = acc * 0.5 + x
        tl.store(dst + offs, x + acc * 0.0, mask=mask)   # after the delay: it depends on acc

    def run(src, dst, spins=20000):
        n = src.numel()
        copy_late[(triton.cdiv(n, 1024),)](src, dst, n, spins, BLOCK=1024)
    return run


# (rows, blocks): on 132 SMs a cluster of 4 a row, one CTA a row, one CTA of 512 threads a row
# (more rows than SMs); the rank after the filter follows the filter's own kernels
FOLLOWING_CASES = [pytest.param(8, 512, marks=_RACECHECK_SLOW), (96, 512), (140, 300)]


@pytest.mark.gpu
@pytest.mark.parametrize("rows,blocks", FOLLOWING_CASES)
@pytest.mark.parametrize("graph", [False, True])
def test_gpu_topk_ranks_what_the_kernel_before_it_wrote(monkeypatch, rows, blocks, graph):
    """The top-K may be scheduled before the kernel ahead of it in the stream ends (programmatic
    dependent launch). Its predecessor here lets it start at once and writes the logits late,
    over stale ones: the top-K must rank what it wrote, eagerly and in a CUDA graph."""
    copy_late = _early_release_copy()
    if copy_late is None:
        pytest.skip("needs Triton 3.6 or later (tl.extra.cuda.gdc_launch_dependents)")
    monkeypatch.setenv("SPIN_TOPK_FILTER", "0")
    torch.manual_seed(rows + blocks)
    fresh = torch.randn(rows, blocks * 64, device="cuda")
    z = torch.empty_like(fresh)
    ids = torch.arange(blocks, dtype=torch.int32, device="cuda").repeat(rows, 1)
    cnt = torch.full((rows,), blocks, dtype=torch.int32, device="cuda")
    out = torch.empty(rows, 512, dtype=torch.int32, device="cuda")

    def step():
        copy_late(fresh, z)
        ops.topk(z, ids, cnt, 1, 512, out)

    def stale():   # no slot may be taken from these logits; -2 is no output
        z.fill_(float("-inf"))
        out.fill_(-2)

    with ops.using_topk_backend("spin"):
        step()                                        # warm-up (Triton compiles)
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                step()
            stale()
            g.replay()
        else:
            stale()
            step()
    torch.cuda.synchronize()
    assert torch.equal(z, fresh)
    want = ops.topk(fresh.cpu(), ids.cpu(), cnt.cpu(), 1, 512)
    assert (want >= 0).all()
    assert torch.equal(out.cpu(), want)


@pytest.mark.gpu
@pytest.mark.parametrize("mode,rows,blocks,filters", FILTER_MODE_CASES)
def test_gpu_topk_filter_runs_where_its_mode_says(monkeypatch, mode, rows, blocks, filters):
    _set_filter_mode(monkeypatch, mode)
    assert ops.topk_filters(rows, blocks * 64, 512) == filters
    z = torch.randn(rows, blocks * 64, device="cuda")
    ids = torch.arange(blocks, dtype=torch.int32, device="cuda").repeat(rows, 1)
    cnt = torch.full((rows,), blocks, dtype=torch.int32, device="cuda")
    out = torch.empty(rows, 512, dtype=torch.int32, device="cuda")

    def run():   # spin's kernel, wherever flashinfer is installed too
        with ops.using_topk_backend("spin"):
            ops.topk(z, ids, cnt, 1, 512, out)

    run()
    with monkeypatch.context() as one_cta:               # the same call ranked whole
        one_cta.setenv("SPIN_TOPK_FILTER", "0")
        whole = _allocations(run)
    assert (_allocations(run) > whole) == filters
