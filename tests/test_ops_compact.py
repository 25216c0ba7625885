"""torch.ops.spin.compact / remap and the logits row stride of topk/update: the reference
against brute-force loops and properties (CPU), the kernels against the reference (GPU)."""

import math

import pytest
import torch

from spin_trtllm import SpinError
from spin_trtllm import ops
from spin_trtllm import reference as ref
from spin_trtllm.testing.pages import make_cache
from spin_trtllm.testing.problems import Problem

# GPU tests must run the kernels (SPIN_REQUIRE_NATIVE=1)
pytestmark = pytest.mark.usefixtures("require_native")


# ---- random selections ----------------------------------------------------------------------------
def _lens(gen, blocks: int) -> int:
    """A context length: ragged, tiny, or exactly on a block boundary."""
    kind = int(torch.randint(0, 4, (1,), generator=gen))
    if kind == 0:
        return int(torch.randint(0, 3, (1,), generator=gen))
    if kind == 1:
        return 64 * int(torch.randint(0, blocks + 1, (1,), generator=gen))
    return int(torch.randint(0, blocks * 64 + 1, (1,), generator=gen))


def random_case(seed: int, page_slots: int = 64, B=None, R=None, m_cap=None, layers: int = 2):
    """block_ids [B, L, m_cap] ascending distinct, -1 padded (the op gets the strided layer view),
    counts [B, L] (0, below, equal to and above m_cap), context_lens [B, R] ragged,
    block_table [B, max_pages] of page_slots-slot pages, some blocks past max_pages."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=gen))  # noqa: E731
    B = B if B is not None else rnd(1, 5)
    R = R if R is not None else rnd(1, 4)
    m_cap = m_cap if m_cap is not None else rnd(1, 9)
    blocks = m_cap + rnd(0, 6)                       # blocks a context may span
    ppb = 64 // page_slots
    max_pages = max(0, blocks * ppb - rnd(0, 3))     # the last blocks may fall off the table
    ids = torch.full((B, layers, m_cap), -1, dtype=torch.int32)
    counts = torch.zeros(B, layers, dtype=torch.int32)
    for b in range(B):
        for l in range(layers):
            c = rnd(0, min(blocks, m_cap + 2))
            chosen = torch.randperm(blocks, generator=gen)[:c].sort().values
            counts[b, l] = c
            ids[b, l, :min(c, m_cap)] = chosen[:m_cap].int()
    ctx = torch.tensor([[_lens(gen, blocks) for _ in range(R)] for _ in range(B)],
                       dtype=torch.int32)
    table = torch.randint(0, 1000, (B, max_pages), generator=gen, dtype=torch.int32)
    return ids, counts, ctx, table


def brute_compact(ids, counts, ctx, table, page_slots, width):
    ppb = 64 // page_slots
    B, m_cap = ids.shape
    out = [[0] * width for _ in range(B)]
    lens = [[0] * ctx.shape[1] for _ in range(B)]
    for b in range(B):
        for k in range(min(int(counts[b]), m_cap)):
            j = int(ids[b, k])
            if j < 0:
                continue
            for p in range(ppb):
                if j * ppb + p < table.shape[1]:
                    out[b][k * ppb + p] = int(table[b, j * ppb + p])
            for r in range(ctx.shape[1]):
                lens[b][r] += min(max(int(ctx[b, r]) - j * 64, 0), 64)
    return torch.tensor(out, dtype=torch.int32).view(B, width), \
        torch.tensor(lens, dtype=torch.int32).view(B, ctx.shape[1])


def brute_remap(pos, ids, counts, next_n):
    out = torch.full_like(pos, -1)
    for row in range(pos.shape[0]):
        b = row // next_n
        for c in range(pos.shape[1]):
            x = int(pos[row, c])
            if 0 <= x < min(int(counts[b]), ids.shape[1]) * 64 and int(ids[b, x // 64]) >= 0:
                out[row, c] = int(ids[b, x // 64]) * 64 + x % 64
    return out


# ---- CPU: compact ---------------------------------------------------------------------------------
@pytest.mark.parametrize("page_slots", [64, 32])
@pytest.mark.parametrize("seed", range(12))
def test_compact_matches_brute_force(seed, page_slots):
    ids, counts, ctx, table = random_case(seed, page_slots)
    ppb = 64 // page_slots
    width = ids.shape[-1] * ppb + (seed % 3) * 5           # T > m_cap * ppb too
    for l in range(ids.shape[1]):
        got_t, got_l = ops.compact(ids[:, l], counts[:, l], ctx, table, page_slots,
                                   torch.full((ids.shape[0], width), 77, dtype=torch.int32))
        want_t, want_l = brute_compact(ids[:, l], counts[:, l], ctx, table, page_slots, width)
        assert torch.equal(got_t, want_t) and torch.equal(got_l, want_l)


def test_compact_edge_cases():
    ids = torch.tensor([[0, 1, 5, -1], [2, 3, 4, 7], [-1, -1, -1, -1]], dtype=torch.int32)
    counts = torch.tensor([3, 9, 0], dtype=torch.int32)           # 9 > m_cap: 4 used
    ctx = torch.tensor([[128, 321], [192, 0], [50, 50]], dtype=torch.int32)
    table = torch.arange(3 * 7, dtype=torch.int32).view(3, 7) + 100   # block 7 is past the table
    t, n = ops.compact(ids, counts, ctx, table, 64)
    assert t.tolist() == [[100, 101, 105, 0], [109, 110, 111, 0], [0, 0, 0, 0]]
    # row 0: blocks 0, 1 fully (128), block 5 from 321 - 320 = 1; row of 192: blocks 2 (all)
    assert n.tolist() == [[128, 129], [64, 0], [0, 0]]
    table32 = torch.arange(3 * 14, dtype=torch.int32).view(3, 14) + 100   # 32-slot pages
    t32, n32 = ops.compact(ids, counts, ctx, table32, 32)
    assert t32[0].tolist() == [100, 101, 102, 103, 110, 111, 0, 0]
    assert t32[1].tolist() == [118, 119, 120, 121, 122, 123, 0, 0] and torch.equal(n32, n)
    assert (t32[2] == 0).all()
    # no requests
    t0, n0 = ops.compact(ids[:0], counts[:0], ctx[:0], table32[:0], 32)
    assert t0.shape == (0, 8) and n0.shape == (0, 2)


def test_compact_refuses_outputs_that_share_memory_with_what_it_reads():
    """Each request's CTA writes its row of the table while the others read block_table: a
    table compacted in place, rows of one memory (expand) or lens inside the table would race
    on CUDA. The reference gives an answer for some of these; the op refuses them all."""
    ids = torch.tensor([[0, 2, 4, -1], [1, 3, 5, 6]], dtype=torch.int32)
    counts = torch.tensor([3, 4], dtype=torch.int32)
    ctx = torch.tensor([[300], [450]], dtype=torch.int32)
    table = torch.arange(2 * 8, dtype=torch.int32).view(2, 8) + 100
    lens = torch.empty(2, 1, dtype=torch.int32)
    want_t, want_n = ops.compact(ids, counts, ctx, table, 64)
    with pytest.raises(SpinError, match="compact_table must not overlap block_table"):
        ops.compact(ids, counts, ctx, table, 64, compact_table=table, compact_lens=lens)
    with pytest.raises(SpinError, match="compact_table must not overlap block_table"):
        ops.compact(ids, counts, ctx, table, 64, compact_table=table[:, 4:], compact_lens=lens)
    with pytest.raises(SpinError, match="compact_table rows overlap"):
        ops.compact(ids, counts, ctx, table, 64,
                    compact_table=torch.empty(1, 4, dtype=torch.int32).expand(2, 4),
                    compact_lens=lens)
    out = torch.empty(3, 4, dtype=torch.int32)
    with pytest.raises(SpinError, match="compact_lens must not overlap compact_table"):
        ops.compact(ids, counts, ctx, table, 64, compact_table=out[:2],
                    compact_lens=out.view(-1)[6:8].view(2, 1))
    # separate buffers, one storage: accepted, and the result is the allocated one's
    both = torch.empty(2 * 4 + 2, dtype=torch.int32)
    t, n = ops.compact(ids, counts, ctx, table, 64, compact_table=both[:8].view(2, 4),
                       compact_lens=both[8:].view(2, 1))
    assert torch.equal(t, want_t) and torch.equal(n, want_n)


def _paged_logits(q, weights, keys, table, lens, page_slots, width):
    """A tiny paged-MQA-logits reference (what DeepGEMM's fp8_paged_mqa_logits computes): row
    (b, j) scores its first lens[b, j] positions, position c reading slot c % page_slots of page
    table[b, c // page_slots]; -inf elsewhere. keys: float64 [pages, page_slots, 128]."""
    B, R = lens.shape
    out = torch.full((B * R, width), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for j in range(R):
            c = torch.arange(int(lens[b, j]))
            k = keys[table[b, c // page_slots].long(), c % page_slots]          # [n, 128]
            dots = q[b * R + j].float().double() @ k.T                                  # [64, n]
            out[b * R + j, :len(c)] = (torch.relu(dots) * weights[b * R + j].double()[:, None]).sum(0)
    return out


@pytest.mark.parametrize("page_slots", [64, 32])
@pytest.mark.parametrize("seed", range(4))
def test_compact_table_gives_spin_compact_logits(seed, page_slots):
    """Paged logits through (compact_table, compact_lens) equal SPIN's compact masked logits."""
    gen = torch.Generator().manual_seed(100 + seed)
    B, R, m_cap = 3, 1 + seed % 3, 6
    ids, counts, ctx, _ = random_case(seed, 64, B=B, R=R, m_cap=m_cap, layers=1)
    ids, counts = ids[:, 0], counts[:, 0]
    max_pages = int(ctx.max()) // 64 + m_cap + 8                # the table covers the context
    num_pages = B * max_pages + 2
    cache = make_cache(num_pages, gen)
    table = torch.randperm(num_pages, generator=gen)[:B * max_pages].view(B, max_pages).int()
    q = torch.randn(B * R, 64, 128, generator=gen).to(torch.float8_e4m3fn)
    weights = torch.randn(B * R, 64, generator=gen) * 0.1
    want = ref.masked_indexer_logits(q, cache, weights, ctx, table, ids, counts)
    keys = ref.dequantize_pages(cache).double()                 # [P, 64, 128]
    if page_slots == 32:                                        # the same slots in 32-slot pages
        perm = torch.randperm(2 * num_pages, generator=gen)
        keys32 = torch.empty(2 * num_pages, 32, 128, dtype=torch.float64)
        keys32[perm] = keys.view(2 * num_pages, 32, 128)        # half h of page P -> perm[2P + h]
        table = perm[(2 * table.long()[:, :, None] + torch.arange(2)).flatten(1)].int()
        keys = keys32
    ctable, clens = ops.compact(ids, counts, ctx, table, page_slots)
    got = _paged_logits(q, weights, keys, ctable, clens, page_slots, m_cap * 64)
    inside = torch.arange(m_cap * 64) < clens.view(-1, 1)
    assert torch.isfinite(want[inside]).all() and (want[~inside] == float("-inf")).all()
    assert torch.allclose(got[inside], want[inside], rtol=1e-10, atol=1e-12)
    assert (got[~inside] == float("-inf")).all()


# ---- CPU: remap -----------------------------------------------------------------------------------
def random_positions(seed, ids, counts, next_n, K):
    gen = torch.Generator().manual_seed(seed)
    B, m_cap = ids.shape
    pos = torch.randint(-3, m_cap * 64 + 70, (B * next_n, K), generator=gen).int()
    if seed % 2:
        pos[:, K // 2:] = -1                                    # -1 padding
    return pos


@pytest.mark.parametrize("seed", range(8))
def test_remap_matches_brute_force_and_runs_in_place(seed):
    ids, counts, _, _ = random_case(seed)
    R = 1 + seed % 4
    for l in range(ids.shape[1]):
        pos = random_positions(seed, ids[:, l], counts[:, l], R, 37)
        want = brute_remap(pos, ids[:, l], counts[:, l], R)
        assert torch.equal(ops.remap(pos, ids[:, l], counts[:, l], R), want)
        inplace = pos.clone()
        assert ops.remap(inplace, ids[:, l], counts[:, l], R, out=inplace) is inplace
        assert torch.equal(inplace, want)


def test_remap_edge_cases():
    ids = torch.tensor([[1, 4, -1], [0, 2, 3]], dtype=torch.int32)
    counts = torch.tensor([2, 5], dtype=torch.int32)                # 5 > m_cap: 3 used
    pos = torch.tensor([[0, 63, 64, 127, 128, -1], [5, 129, 191, 192, -7, 2 ** 31 - 1]],
                       dtype=torch.int32)
    out = ops.remap(pos, ids, counts, 1)
    assert out.tolist() == [[64, 127, 256, 319, -1, -1], [5, 193, 255, -1, -1, -1]]
    wide = torch.zeros(2, 9, dtype=torch.int32)                    # a row-strided view
    wide[:, :6] = pos
    assert torch.equal(ops.remap(wide[:, :6], ids, counts, 1), out)


def brute_sorted_remap(pos, vals, ids, counts, next_n):
    """brute_remap, then -1 where the value is not finite, then each row ascending, -1 last."""
    slots = brute_remap(pos, ids, counts, next_n)
    rows = []
    for row in range(pos.shape[0]):
        kept = sorted(int(s) for s, v in zip(slots[row], vals[row])
                      if s >= 0 and math.isfinite(float(v)))
        rows.append(kept + [-1] * (pos.shape[1] - len(kept)))
    return torch.tensor(rows, dtype=torch.int32).view(pos.shape)


def random_values(seed, shape):
    gen = torch.Generator().manual_seed(seed + 1000)
    vals = torch.randn(shape, generator=gen)
    pick = torch.rand(shape, generator=gen)
    vals[pick < 0.1] = float("-inf")                        # a peer's padding
    vals[(pick >= 0.1) & (pick < 0.13)] = float("nan")
    vals[(pick >= 0.13) & (pick < 0.15)] = float("inf")
    return vals


@pytest.mark.parametrize("seed", range(8))
def test_remap_values_and_ascending_match_brute_force(seed):
    ids, counts, _, _ = random_case(seed)
    R = 1 + seed % 4
    for l in range(ids.shape[1]):
        pos = random_positions(seed, ids[:, l], counts[:, l], R, 37)
        vals = random_values(seed, pos.shape)
        want = brute_sorted_remap(pos, vals, ids[:, l], counts[:, l], R)
        got = ops.remap(pos, ids[:, l], counts[:, l], R, values=vals, ascending=True)
        assert torch.equal(got, want)
        inplace = pos.clone()
        ops.remap(inplace, ids[:, l], counts[:, l], R, out=inplace, values=vals, ascending=True)
        assert torch.equal(inplace, want)
        # each option alone
        unsorted = brute_remap(pos, ids[:, l], counts[:, l], R)
        assert torch.equal(ops.remap(pos, ids[:, l], counts[:, l], R, values=vals),
                           torch.where(torch.isfinite(vals), unsorted, -1))
        assert torch.equal(ops.remap(pos, ids[:, l], counts[:, l], R, ascending=True),
                           brute_sorted_remap(pos, torch.zeros(pos.shape), ids[:, l],
                                              counts[:, l], R))


@pytest.mark.parametrize("seed", range(6))
def test_remap_scores_drop_positions_of_non_finite_logits(seed):
    """scores: the logits rows the positions index (a top-K that returned no values)."""
    ids, counts, _, _ = random_case(seed)
    R = 1 + seed % 3
    kept = dropped = 0
    for l in range(ids.shape[1]):
        pos = random_positions(seed, ids[:, l], counts[:, l], R, 37)
        scores = random_values(seed + 7, (pos.shape[0], ids.shape[2] * 64 + 9))
        unsorted = brute_remap(pos, ids[:, l], counts[:, l], R)
        at = pos.long().clamp(0, scores.shape[1] - 1)
        finite = torch.isfinite(scores.gather(1, at))
        want = torch.where(finite, unsorted, -1)
        got = ops.remap(pos, ids[:, l], counts[:, l], R, scores=scores)
        assert torch.equal(got, want)
        kept += int((want >= 0).sum())
        dropped += int((unsorted >= 0).sum() - (want >= 0).sum())
        vals = scores.gather(1, at).masked_fill(unsorted < 0, 0.0)      # the same, as values
        assert torch.equal(ops.remap(pos, ids[:, l], counts[:, l], R, scores=scores,
                                     ascending=True),
                           brute_sorted_remap(pos, vals, ids[:, l], counts[:, l], R))
    assert kept > 0 and dropped > 0
    none = torch.zeros(2, 0, dtype=torch.int32)                       # m_cap 0: nothing scored
    assert (ops.remap(torch.zeros(2, 4, dtype=torch.int32), none, torch.ones(2, dtype=torch.int32),
                      1, scores=torch.zeros(2, 0)) == -1).all()
    with pytest.raises(SpinError, match=r"scores must have shape \[2, W >= 192\]"):
        ops.remap(torch.zeros(2, 4, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32),
                  torch.ones(2, dtype=torch.int32), 1, scores=torch.zeros(2, 191))


def test_remap_ascending_edge_cases():
    ids = torch.tensor([[1, 4, -1], [0, 2, 3]], dtype=torch.int32)
    counts = torch.tensor([2, 5], dtype=torch.int32)
    pos = torch.tensor([[128, 63, -1, 127, 0, 64], [2 ** 31 - 1, 191, 5, 192, -7, 129]],
                       dtype=torch.int32)
    vals = torch.tensor([[1.0, float("-inf"), 0.0, 2.0, 3.0, float("nan")],
                         [0.0] * 6])
    out = ops.remap(pos, ids, counts, 1, values=vals, ascending=True)
    assert out.tolist() == [[64, 319, -1, -1, -1, -1], [5, 193, 255, -1, -1, -1]]
    nothing = ops.remap(pos, ids, torch.zeros(2, dtype=torch.int32), 1, ascending=True)
    assert (nothing == -1).all()                                # no block scored
    one = ops.remap(pos[:, :1], ids, counts, 1, ascending=True)  # K = 1
    assert one.tolist() == [[-1], [-1]]


@pytest.mark.parametrize("seed", range(4))
def test_topk_equals_remap_of_plain_topk_positions(seed):
    gen = torch.Generator().manual_seed(seed)
    ids, counts, ctx, _ = random_case(seed, B=3, R=2, m_cap=7, layers=1)
    ids, counts = ids[:, 0], counts[:, 0]
    B, R, m_cap, K = 3, 2, 7, 100
    z = torch.randn(B * R, m_cap * 64, generator=gen)
    scored = counts.clamp(max=m_cap).repeat_interleave(R) * 64
    cut = torch.randint(0, m_cap * 64 + 1, (B * R,), generator=gen)   # -inf past a row's lens
    z[torch.arange(m_cap * 64) >= torch.minimum(scored, cut)[:, None]] = float("-inf")
    spin = ops.topk(z, ids, counts, R, K)
    vals, pos = z.topk(K, dim=-1)
    pos = torch.where(torch.isfinite(vals), pos, -1).int()             # a plain top-K, -1 padded
    slots = ops.remap(pos, ids, counts, R)
    for row in range(B * R):
        got = {int(x) for x in slots[row] if x >= 0}
        assert got == {int(x) for x in spin[row] if x >= 0}
        assert len(got) == min(K, int(torch.isfinite(z[row]).sum()))


# ---- CPU: logits row stride -----------------------------------------------------------------------
def _strided(z, extra: int, fill=float("nan")):
    """z inside a [rows, W + extra] buffer full of `fill`: a view with row stride W + extra."""
    buf = torch.full((z.shape[0], z.shape[1] + extra), fill, dtype=z.dtype, device=z.device)
    buf[:, :z.shape[1]] = z
    return buf


def _stride_case(device, R=2):
    p = Problem(B=3, R=R, L=1, lens=(700, 64, 1500), seed=3, device=device)
    ids, cnt = ops.select(p.state, p.slot, p.n, p.q, p.request, p.step, p.cfg, p.m_cap, p.max_ctx)
    z = ops.indexer_logits(p.qfp8, p.cache[0], p.weights, p.n, p.table, ids[:, 0], cnt[:, 0])
    return p, ids[:, 0], cnt[:, 0], z


def _check_strided_topk_update(device, R):
    p, ids, cnt, z = _stride_case(device, R)
    want = ops.topk(z, ids, cnt, p.R, 128)
    state = p.clone_state()
    ops.update(state, p.slot, z, ids, cnt, p.n, p.q, p.accepted, p.step, 0, p.cfg, p.max_ctx)
    for extra, fill in ((36, float("nan")), (4, 1e30), (64, float("inf"))):
        for logits in (_strided(z, extra, fill), _strided(z, extra, fill)[:, :z.shape[1]]):
            assert torch.equal(ops.topk(logits, ids, cnt, p.R, 128), want)
            s = p.clone_state()
            ops.update(s, p.slot, logits, ids, cnt, p.n, p.q, p.accepted, p.step, 0, p.cfg,
                       p.max_ctx)
            for a, b in zip(s.tensors(), state.tensors()):
                assert torch.equal(a, b)
    return p, ids, cnt, z, want, state


@pytest.mark.parametrize("R", [1, 2])
def test_topk_and_update_read_the_first_m_cap_columns_of_strided_rows(R):
    _check_strided_topk_update("cpu", R)


def test_logits_stride_must_keep_rows_16_byte_aligned():
    p, ids, cnt, z = _stride_case("cpu")
    odd = _strided(z, 3)
    with pytest.raises(SpinError, match="logits rows must be a multiple of 4 floats apart"):
        ops.topk(odd, ids, cnt, p.R, 128)
    with pytest.raises(SpinError, match="logits rows must be a multiple of 4 floats apart"):
        ops.update(p.state, p.slot, odd, ids, cnt, p.n, p.q, p.accepted, p.step, 0, p.cfg,
                   p.max_ctx)
    with pytest.raises(SpinError, match="logits must be contiguous in its last dim"):
        ops.topk(_strided(z, 4).t().contiguous().t(), ids, cnt, p.R, 128)
    with pytest.raises(SpinError, match=r"logits must have shape \[6, W >= "):
        ops.topk(z[:, :-4], ids, cnt, p.R, 128)


# ---- validation -----------------------------------------------------------------------------------
def _compact_args():
    ids, counts, ctx, table = random_case(0, B=2, R=2, m_cap=4, layers=1)
    return [ids[:, 0], counts[:, 0], ctx, table, 64, torch.empty(2, 4, dtype=torch.int32),
            torch.empty(2, 2, dtype=torch.int32)]


@pytest.mark.parametrize("index,value,needle", [
    (4, 16, "page_slots must be 64 or 32"),
    (4, 0, "page_slots must be 64 or 32"),
    (0, lambda a: a[0].long(), "block_ids must be int32"),
    (1, lambda a: a[1][:1], "must have 2 requests"),
    (2, lambda a: a[2][:, :1].repeat(1, 9), r"next_n \(context_lens.shape\[1\]\) must be 1..8"),
    (2, lambda a: a[2].float(), "context_lens must be int32"),
    (3, lambda a: a[3][:1], "block_table has 1 rows, expected 2"),
    (3, lambda a: a[3].t(), "block_table must be contiguous in its last dim"),
    (5, lambda a: torch.empty(2, 3, dtype=torch.int32),
     r"compact_table must have shape \[2, m_cap \* 1 = 4 <= T <= 33550335\]"),
    # wider than any selection: its loop over the row's entries would pass int32
    (5, lambda a: torch.empty(1, 33550336, dtype=torch.int32).expand(2, -1),
     r"compact_table must have shape \[2, m_cap \* 1 = 4 <= T <= 33550335\]"),
    (5, lambda a: torch.empty(2, 4, dtype=torch.int64), "compact_table must be int32"),
    (6, lambda a: torch.empty(2, 1, dtype=torch.int32), "compact_lens must have shape"),
])
def test_compact_rejects_bad_arguments(index, value, needle):
    args = _compact_args()
    args[index] = value(args) if callable(value) else value
    with pytest.raises(SpinError, match=f"spin::compact: .*{needle}"):
        torch.ops.spin.compact(*args)


def test_compact_table_width_for_32_slot_pages():
    args = _compact_args()
    args[4] = 32                                                  # needs T >= 8
    with pytest.raises(SpinError, match=r"compact_table must have shape \[2, m_cap \* 2 = 8 <= T"):
        torch.ops.spin.compact(*args)


def test_remap_rejects_bad_arguments():
    ids = torch.zeros(2, 3, dtype=torch.int32)
    cnt = torch.ones(2, dtype=torch.int32)
    pos = torch.zeros(4, 5, dtype=torch.int32)
    with pytest.raises(SpinError, match="positions must have shape"):
        ops.remap(pos, ids, cnt, 1)
    with pytest.raises(SpinError, match="next_n must be 1..8"):
        ops.remap(torch.zeros(18, 5, dtype=torch.int32), ids, cnt, 9)
    with pytest.raises(SpinError, match="positions must be int32"):
        ops.remap(pos.long(), ids, cnt, 2)
    with pytest.raises(SpinError, match="out must have shape"):
        ops.remap(pos, ids, cnt, 2, torch.empty(4, 4, dtype=torch.int32))
    buf = torch.zeros(5, 5, dtype=torch.int32)
    with pytest.raises(SpinError, match="out must be positions itself"):
        ops.remap(buf[:4], ids, cnt, 2, buf[1:])
    with pytest.raises(SpinError, match="counts must be int32"):
        ops.remap(pos, ids, cnt.long(), 2)
    with pytest.raises(SpinError, match="values must be float32"):
        ops.remap(pos, ids, cnt, 2, values=torch.zeros(4, 5, dtype=torch.float16))
    with pytest.raises(SpinError, match=r"values must have shape \[4, 5\]"):
        ops.remap(pos, ids, cnt, 2, values=torch.zeros(4, 6))
    wide = torch.zeros(4, ops.MAX_SORTED_K + 1, dtype=torch.int32)
    ops.remap(wide, ids, cnt, 2)                               # order kept: any K
    with pytest.raises(SpinError, match="ascending sorts rows of at most 4096 entries, got K = 4097"):
        ops.remap(wide, ids, cnt, 2, ascending=True)


@pytest.mark.gpu
def test_gpu_compact_and_remap_reject_mismatched_devices():
    args = _compact_args()
    args[3] = args[3].cuda()
    with pytest.raises(SpinError, match="block_table is on cuda:0, expected cpu"):
        torch.ops.spin.compact(*args)
    ids = torch.zeros(2, 3, dtype=torch.int32, device="cuda")
    with pytest.raises(SpinError, match="counts is on cpu, expected cuda"):
        ops.remap(torch.zeros(2, 5, dtype=torch.int32, device="cuda"), ids,
                  torch.ones(2, dtype=torch.int32), 1)


def test_fake_impls_trace_compact_and_remap(without_data):
    with without_data:
        ids = torch.empty(2, 4, dtype=torch.int32)
        cnt = torch.empty(2, dtype=torch.int32)
        torch.ops.spin.compact(ids, cnt, torch.empty(2, 3, dtype=torch.int32),
                               torch.empty(2, 10, dtype=torch.int32), 32,
                               torch.empty(2, 8, dtype=torch.int32),
                               torch.empty(2, 3, dtype=torch.int32))
        pos = torch.empty(6, 16, dtype=torch.int32)
        torch.ops.spin.remap(pos, ids, cnt, 3, pos)


# ---- GPU: kernels against the reference -----------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("page_slots", [64, 32])
@pytest.mark.parametrize("seed", range(10))
def test_gpu_compact_and_remap_match_reference(seed, page_slots):
    sizes = [dict(), dict(B=1, R=8, m_cap=1), dict(B=40, R=3, m_cap=700)]
    ids, counts, ctx, table = random_case(seed, page_slots, **sizes[seed % 3])
    ppb = 64 // page_slots
    width = ids.shape[-1] * ppb + seed % 5
    R = ctx.shape[1]
    for l in range(ids.shape[1]):                     # strided layer views
        want = ops.compact(ids[:, l], counts[:, l], ctx, table, page_slots,
                           torch.empty(ids.shape[0], width, dtype=torch.int32))
        ig, cg = ids.cuda()[:, l], counts.cuda()[:, l]
        got = ops.compact(ig, cg, ctx.cuda(), _strided(table, 3, 5).cuda()[:, :table.shape[1]],
                          page_slots, torch.full((ids.shape[0], width), 9, dtype=torch.int32,
                                                 device="cuda"))
        assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
        pos = random_positions(seed, ids[:, l], counts[:, l], R, 2048 if seed % 3 == 2 else 33)
        want_r = ops.remap(pos, ids[:, l], counts[:, l], R)
        assert torch.equal(ops.remap(pos.cuda(), ig, cg, R).cpu(), want_r)
        inplace = pos.cuda()
        ops.remap(inplace, ig, cg, R, inplace)
        assert torch.equal(inplace.cpu(), want_r)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 37, 256, 257, 512, 1000, 2048, 4096])
def test_gpu_remap_values_ascending_match_reference(k):
    for seed in range(3):
        ids, counts, _, _ = random_case(seed, B=6, R=2, m_cap=90, layers=2)
        R = 1 + seed
        for l in range(ids.shape[1]):                 # strided layer views
            pos = random_positions(seed, ids[:, l], counts[:, l], R, k)
            vals = random_values(seed, pos.shape)
            want = ops.remap(pos, ids[:, l], counts[:, l], R, values=vals, ascending=True)
            ig, cg = ids.cuda()[:, l], counts.cuda()[:, l]
            ps, vs = _strided(pos, 3, -5).cuda()[:, :k], _strided(vals, 5, 0.0).cuda()[:, :k]
            got = ops.remap(ps, ig, cg, R, values=vs, ascending=True)
            assert torch.equal(got.cpu(), want)
            assert torch.equal(ops.remap(pos.cuda(), ig, cg, R, ascending=True).cpu(),
                               ops.remap(pos, ids[:, l], counts[:, l], R, ascending=True))
            inplace = pos.cuda()
            ops.remap(inplace, ig, cg, R, inplace, values=vals.cuda(), ascending=True)
            assert torch.equal(inplace.cpu(), want)
            scores = random_values(seed + 7, (pos.shape[0], 90 * 64 + 9))   # a row stride
            assert torch.equal(
                ops.remap(ps, ig, cg, R, ascending=True, scores=scores.cuda()).cpu(),
                ops.remap(pos, ids[:, l], counts[:, l], R, ascending=True, scores=scores))


@pytest.mark.gpu
def test_gpu_compact_remap_cuda_graph_replay():
    B, R, m_cap, K = 4, 2, 40, 256
    first = random_case(1, 32, B=B, R=R, m_cap=m_cap, layers=1)
    ids, counts, ctx, table = (t.cuda() for t in first)
    ids, counts = ids[:, 0].contiguous(), counts[:, 0].contiguous()
    pos = torch.zeros(B * R, K, dtype=torch.int32, device="cuda")
    ctable = torch.empty(B, m_cap * 2, dtype=torch.int32, device="cuda")
    clens = torch.empty(B, R, dtype=torch.int32, device="cuda")
    slots = torch.empty_like(pos)

    def step():
        torch.ops.spin.compact(ids, counts, ctx, table, 32, ctable, clens)
        torch.ops.spin.remap(pos, ids, counts, R, slots)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()                                   # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in range(3):                           # new inputs in the same buffers
        i2, c2, x2, t2 = random_case(50 + t, 32, B=B, R=R, m_cap=m_cap, layers=1)
        p2 = random_positions(t, i2[:, 0], c2[:, 0], R, K)
        for dst, src in ((ids, i2[:, 0]), (counts, c2[:, 0]), (ctx, x2), (pos, p2)):
            dst.copy_(src)
        table[:, :t2.shape[1]].copy_(t2[:, :table.shape[1]])
        graph.replay()
        want_t, want_l = ops.compact(i2[:, 0], c2[:, 0], x2, table.cpu(), 32)
        torch.cuda.synchronize()
        assert torch.equal(ctable.cpu(), want_t) and torch.equal(clens.cpu(), want_l)
        assert torch.equal(slots.cpu(), ops.remap(p2, i2[:, 0], c2[:, 0], R))


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2])
def test_gpu_topk_and_update_read_strided_logits(R):
    # R 1 takes update's one-pass path, R 2 the per-row one (and the one-pass path for requests
    # with no accepted draft)
    p, ids, cnt, z, want, state = _check_strided_topk_update("cuda", R)
    q = _stride_case("cpu", R)[0]                           # the same problem on the CPU
    assert torch.equal(ops.topk(z.cpu(), ids.cpu(), cnt.cpu(), R, 128), want.cpu())
    ops.update(q.state, q.slot, _strided(z.cpu(), 8), ids.cpu(), cnt.cpu(), q.n, q.q, q.accepted,
               q.step, 0, q.cfg, q.max_ctx)
    for a, b in zip(q.state.tensors(), state.tensors()):
        assert torch.equal(a, b.cpu())


@pytest.mark.gpu
# Two rows of 1100 blocks run the top-K in clusters of 8, which racecheck takes minutes on; the
# stride and row lengths are arguments of the same kernel instance, which test_ops_topk's
# threshold_bin_sizes[*-1-1024] cases run under racecheck (here and in the row-lengths test below)
@pytest.mark.parametrize("blocks,rows", [
    (40, 6), (300, 2), pytest.param(1100, 2, marks=pytest.mark.racecheck_slow), (1100, 70)])
def test_gpu_topk_on_strided_long_rows_matches_reference(blocks, rows):
    # one CTA per row, clusters of 4 and 8 (rows cached in shared memory) and the uncached path
    gen = torch.Generator().manual_seed(blocks + rows)
    z = torch.randn(rows, blocks * 64, generator=gen)
    ids = torch.arange(blocks, dtype=torch.int32).repeat(rows, 1)
    cnt = torch.full((rows,), blocks, dtype=torch.int32)
    cnt[0] = blocks // 3
    want = ops.topk(z, ids, cnt, 1, 2048)
    zs = _strided(z, 132, float("inf")).cuda()[:, :z.shape[1]]
    assert torch.equal(ops.topk(zs, ids.cuda(), cnt.cuda(), 1, 2048).cpu(), want)


# ---- top-K cut at each row's compact length (row_lens) ---------------------------------------------
def _row_lens_case(seed, B, R, blocks, K):
    """Compact logits whose columns past a row's length hold large finite junk (what a dense
    kernel on a compacted table leaves there), with ragged lengths: 0, not a multiple of 4,
    past the selection."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(B * R, blocks * 64, generator=gen)
    ids = torch.stack([torch.randperm(blocks * 2, generator=gen)[:blocks].sort().values
                       for _ in range(B)]).int()
    cnt = torch.randint(0, blocks + 2, (B,), generator=gen, dtype=torch.int32)
    lens = torch.randint(0, blocks * 64 + 70, (B, R), generator=gen, dtype=torch.int32)
    lens[0, 0], lens[-1, -1] = 0, 4 * int(torch.randint(1, blocks * 16, (1,), generator=gen)) + 1
    junk = torch.arange(blocks * 64) >= lens.view(-1, 1)
    return z.masked_fill(junk, 1e6), ids, cnt, lens, z.masked_fill(junk, float("-inf"))


@pytest.mark.parametrize("seed", range(6))
def test_topk_row_lens_equal_minus_inf_past_the_lengths(seed):
    z, ids, cnt, lens, masked = _row_lens_case(seed, B=3, R=2, blocks=5, K=70)
    got = ops.topk(z, ids, cnt, 2, 70, row_lens=lens)
    assert torch.equal(got, ops.topk(masked, ids, cnt, 2, 70))
    for row in range(6):                       # brute force: the top of the allowed prefix
        b = row // 2
        n = min(int(lens.view(-1)[row]), min(int(cnt[b]), 5) * 64)
        take = masked[row, :n].topk(min(70, n)).indices
        want = sorted(int(ids[b, p // 64]) * 64 + int(p) % 64 for p in take)
        assert [int(x) for x in got[row] if x >= 0] == want
    with pytest.raises(SpinError, match="row_lens must have shape"):
        ops.topk(z, ids, cnt, 2, 70, row_lens=lens[:, :1].contiguous())


@pytest.mark.gpu
@pytest.mark.parametrize("blocks,B,R", [
    (5, 3, 2), (300, 2, 1), pytest.param(1100, 1, 2, marks=pytest.mark.racecheck_slow),
    (40, 40, 2)])
def test_gpu_topk_row_lens_match_reference(blocks, B, R):
    # one CTA per row, clusters (few rows of long rows) and the uncached path
    z, ids, cnt, lens, _ = _row_lens_case(blocks + B, B, R, blocks, 2048)
    want = ops.topk(z, ids, cnt, R, 2048, row_lens=lens)
    got = ops.topk(_strided(z, 4, 7.0).cuda()[:, :z.shape[1]], ids.cuda(), cnt.cuda(), R, 2048,
                   row_lens=lens.cuda())
    assert torch.equal(got.cpu(), want)


# ---- every layer in one launch, with DeepGEMM's schedule ----------------------------------------
def brute_schedule(lens, num_sms):
    """DeepGEMM's SM90 paged-logits schedule by enumeration: every (request pair, run) in order,
    request b holding ceil(lens[b, R-1] / 256) runs for each of ceil(R / 2) pairs (1 for one
    row); SM s starts at item s * q + max(0, s - (num_sms - total % num_sms)); past the last
    item, and for the closing entry, (B * pairs, 0)."""
    B, R = lens.shape
    pairs = (R + 1) // 2 if R >= 2 else 1
    items = [(b * pairs + a, k) for b in range(B) for a in range(pairs)
             for k in range(-(-int(lens[b, -1]) // 256))]
    q, pivot = len(items) // num_sms, num_sms - len(items) % num_sms
    out = []
    for s in range(num_sms):
        at = s * q + max(0, s - pivot)
        out.append(list(items[at]) if at < len(items) else [B * pairs, 0])
    return torch.tensor(out + [[B * pairs, 0]], dtype=torch.int32)


def _schedule_lens(seed, B, R, longest):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, longest + 1, (B, R), generator=gen, dtype=torch.int32)
    lens[::3, -1] = 0                                # requests without a run
    lens[1::4, -1] = 256 * (lens[1::4, -1] // 256)   # runs ending on a split boundary
    return lens


@pytest.mark.parametrize("B,R,longest,num_sms", [
    (0, 1, 0, 4), (1, 1, 0, 4), (1, 2, 100, 132), (3, 1, 700, 2), (5, 3, 3000, 7),
    (17, 4, 9000, 132), (40, 2, 70000, 132), (300, 1, 2000, 16), (9, 8, 600, 5)])
def test_paged_logits_schedule_matches_enumeration(B, R, longest, num_sms):
    for seed in range(3):
        lens = _schedule_lens(seed, B, R, longest)
        assert torch.equal(ref.paged_logits_schedule(lens, num_sms),
                           brute_schedule(lens, num_sms))


@pytest.mark.parametrize("page_slots", [64, 32])
@pytest.mark.parametrize("seed", range(6))
def test_layered_compact_equals_each_layer_and_writes_schedules(seed, page_slots):
    ids, counts, ctx, table = random_case(seed, page_slots, layers=3)
    B, L = counts.shape
    sms = 1 + seed * 5
    schedule = torch.full((L, sms + 1, 2), 7, dtype=torch.int32)
    workspace = torch.zeros(L, dtype=torch.int32)
    tables, lens = ops.compact(ids, counts, ctx, table, page_slots, schedule=schedule,
                               workspace=workspace)
    for l in range(L):
        want_t, want_l = ops.compact(ids[:, l], counts[:, l], ctx, table, page_slots)
        assert torch.equal(tables[l], want_t) and torch.equal(lens[l], want_l)
        assert torch.equal(schedule[l], brute_schedule(want_l, sms))
    assert not workspace.any()


def test_compact_schedule_arguments_are_checked():
    ids, counts, ctx, table = random_case(3, 64, B=2, R=2, m_cap=4, layers=2)
    sched = torch.zeros(2, 9, 2, dtype=torch.int32)
    work = torch.zeros(2, dtype=torch.int32)
    tables, lens = torch.zeros(2, 2, 4, dtype=torch.int32), torch.zeros(2, 2, 2, dtype=torch.int32)
    with pytest.raises(SpinError, match="schedule needs a workspace"):
        torch.ops.spin.compact(ids, counts, ctx, table, 64, tables, lens, sched)
    cases = [
        (dict(workspace=work), "pass schedule with it"),
        (dict(schedule=sched[0], workspace=work), "schedule must have 3 dims"),
        (dict(schedule=torch.zeros(2, 1, 2, dtype=torch.int32), workspace=work),
         "num_sms >= 1"),
        (dict(schedule=sched.long(), workspace=work), "schedule must be int32"),
        (dict(schedule=sched, workspace=work[:1]), "workspace must have shape"),
        (dict(schedule=sched, workspace=torch.ones(2, dtype=torch.int32)),
         "workspace must be zero"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(SpinError, match=f"spin::compact: .*{needle}"):
            ops.compact(ids, counts, ctx, table, 64, **kwargs)
    with pytest.raises(SpinError, match=r"compact_table must have shape \[2, 2, m_cap"):
        ops.compact(ids, counts, ctx, table, 64, torch.zeros(3, 2, 4, dtype=torch.int32))
    flat = torch.zeros(2 * 4, dtype=torch.int32)
    with pytest.raises(SpinError, match="compact_table rows overlap"):
        ops.compact(ids, counts, ctx, table, 64, flat.as_strided((2, 2, 4), (4, 0, 1)))
    with pytest.raises(SpinError, match="0 layers; one launch takes 1 to"):
        ops.compact(ids[:, :0].contiguous(), counts[:, :0].contiguous(), ctx, table, 64)
    # with several layers some CTAs read while others write: no output may share an input
    inputs = {"block_table": table, "block_ids": ids, "counts": counts, "context_lens": ctx}
    for name, read in inputs.items():
        alias = read.view(-1)
        outs = [("workspace", lambda: dict(schedule=sched, workspace=alias[:2]))]
        if alias.numel() >= 8:
            outs += [("schedule", lambda: dict(schedule=alias[:8].view(2, 2, 2), workspace=work)),
                     ("compact_lens", lambda: dict(compact_lens=alias[:8].view(2, 2, 2)))]
        for out_name, kwargs in outs:
            with pytest.raises(SpinError, match=f"{out_name} must not overlap {name}"):
                ops.compact(ids, counts, ctx, table, 64, **kwargs())


@pytest.mark.gpu
@pytest.mark.parametrize("B,R,m_cap,sms", [
    (1, 1, 1, 132), (3, 2, 40, 132), (40, 1, 700, 132), (300, 2, 30, 16), (257, 1, 5, 1),
    (6, 3, 200, 8), (2, 8, 9, 132)])
def test_gpu_layered_compact_and_schedule_match_reference(B, R, m_cap, sms):
    ids, counts, ctx, table = random_case(B * 7 + m_cap, 64, B=B, R=R, m_cap=m_cap, layers=3)
    L = counts.shape[1]
    want_s = torch.zeros(L, sms + 1, 2, dtype=torch.int32)
    want_t, want_l = ops.compact(ids, counts, ctx, table, 64, schedule=want_s)
    got_s = torch.full((L, sms + 1, 2), -5, dtype=torch.int32, device="cuda")
    work = torch.zeros(L, dtype=torch.int32, device="cuda")
    for _ in range(2):                       # the workspace is left zero for the next launch
        got_t, got_l = ops.compact(ids.cuda(), counts.cuda(), ctx.cuda(), table.cuda(), 64,
                                   schedule=got_s, workspace=work)
        assert torch.equal(got_t.cpu(), want_t) and torch.equal(got_l.cpu(), want_l)
        assert torch.equal(got_s.cpu(), want_s)
        assert not work.any()


@pytest.mark.gpu
def test_gpu_compact_schedule_of_no_request_and_graph_replay():
    empty = torch.zeros(0, 2, 4, dtype=torch.int32, device="cuda")
    sched = torch.full((2, 5, 2), 3, dtype=torch.int32, device="cuda")
    ops.compact(empty, torch.zeros(0, 2, dtype=torch.int32, device="cuda"),
                torch.zeros(0, 1, dtype=torch.int32, device="cuda"),
                torch.zeros(0, 4, dtype=torch.int32, device="cuda"), 64, schedule=sched)
    assert not sched.any()
    B, R, m_cap, sms = 5, 2, 30, 132
    bufs = [t.cuda() for t in random_case(70, 64, B=B, R=R, m_cap=m_cap, layers=2)]
    tables = torch.empty(2, B, m_cap, dtype=torch.int32, device="cuda")
    lens = torch.empty(2, B, R, dtype=torch.int32, device="cuda")
    sched = torch.empty(2, sms + 1, 2, dtype=torch.int32, device="cuda")
    work = torch.zeros(2, dtype=torch.int32, device="cuda")
    step = lambda: ops.compact(*bufs, 64, tables, lens, sched, work)  # noqa: E731
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in range(3):
        new = random_case(80 + t, 64, B=B, R=R, m_cap=m_cap, layers=2)
        for dst, src in zip(bufs, new):
            dst.zero_()[tuple(slice(0, n) for n in src.shape)].copy_(src)
        graph.replay()
        want_s = torch.zeros(2, sms + 1, 2, dtype=torch.int32)
        want_t, want_l = ops.compact(*(b.cpu() for b in bufs), 64, schedule=want_s)
        torch.cuda.synchronize()
        assert torch.equal(tables.cpu(), want_t) and torch.equal(lens.cpu(), want_l)
        assert torch.equal(sched.cpu(), want_s)


@pytest.mark.gpu
@pytest.mark.parametrize("B,R", [(1, 1), (5, 2), (29, 1), (32, 2), (96, 1), (300, 2)])
def test_gpu_compact_schedule_equals_deepgemm(B, R):
    """The schedule ops.compact writes against DeepGEMM's own get_paged_mqa_logits_metadata
    (skips where deep_gemm is not importable: tests/gpu/deepgemm_env.sh builds it)."""
    from spin_trtllm.logits.deepgemm import find_module
    dg, why = find_module()
    if dg is None:
        pytest.skip(f"DeepGEMM: {why}")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ids, counts, ctx, table = random_case(B + R, 64, B=B, R=R, m_cap=1200, layers=1)
    ctx = torch.where(torch.arange(B).view(-1, 1) % 4 == 1, 0, ctx * 50).int()
    sched = torch.empty(1, sms + 1, 2, dtype=torch.int32, device="cuda")
    _, lens = ops.compact(ids.cuda(), counts.cuda(), ctx.cuda(), table.cuda(), 64,
                          schedule=sched)
    want = dg.get_paged_mqa_logits_metadata(lens[0].contiguous(), 64, sms)
    assert torch.equal(sched[0].cpu(), want.cpu())
