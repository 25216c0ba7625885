"""dsa-lite on 32-slot indexer K-cache pages (DeepSeek-V4 with tokens_per_block 128: a 64-slot
SPIN block spans two pages) against 64-slot pages: the paged reference logits, the engine's
tokens and selections (the keys are the same, only their paging differs), the probe's page
summaries and ranking, and the errors of a bad page size."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from spin_trtllm import SpinError
from spin_trtllm import logits as logits_backends
from spin_trtllm import reference as ref
from spin_trtllm.harness import Engine, Request, init_weights, tiny
from spin_trtllm.indexer import DenseIndexer
from spin_trtllm.harness.engine import EngineOptions
from spin_trtllm.harness.engine.options import resolve_backend
from spin_trtllm.harness.model import Caches, PrefillIndexer
from standin_modules import standin_deep_gemm
from spin_trtllm.logits import DeepGemmLogits
from spin_trtllm.testing.harness import copy_drafter, prompt, spin_cfg
from spin_trtllm.testing.pages import pack_pages, random_fp8_keys

DSA = (0, 1, 128, 1)          # an indexer slot a token: many blocks from short prompts
CSA = (0, 4, 128, 4)          # four tokens a slot, the last row writing a partial group


def config(ratios, mtp=0):
    return tiny().with_overrides(dtype="float32", compress_ratios=ratios, mtp_depth=mtp)


# ---- the reference paged logits -------------------------------------------------------------
def repaged(rows, scales, g):
    """The keys of 64-slot pages (fp8 rows [P, 64, 128], scales [P, 64]) as 32-slot pages in a
    random order: (kv32 [2P, 32, 1, 132], where [P, 2]: 64-slot page p's half h is at
    where[p, h])."""
    P = rows.shape[0]
    halves = [pack_pages(rows[:, h * 32:(h + 1) * 32], scales[:, h * 32:(h + 1) * 32])
              for h in range(2)]
    in_order = torch.stack(halves, 1).reshape(2 * P, 32, 1, 132)    # half h of p at 2p + h
    where = torch.randperm(2 * P, generator=g)
    kv32 = torch.empty_like(in_order)
    kv32[where] = in_order
    return kv32, where.view(P, 2)


def brute_logits(q, kv32, w, ctx, table32, ids, counts):
    """Slot by slot: sum_h w_h ReLU(q_h . k) for compact position c*64 + s (block ids[b, c],
    slot s in page table32[b, 2 ids + s // 32]), -inf where the slot cannot be read."""
    B, R = ctx.shape
    m_cap = ids.shape[1]
    keys = ref.dequantize_pages(kv32).double()                     # [P, 32, 128]
    out = torch.full((B * R, m_cap * 64), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for c in range(min(int(counts[b]), m_cap)):
            j = int(ids[b, c])
            for s in range(64):
                col = 2 * j + s // 32
                if j < 0 or col >= table32.shape[1]:
                    continue
                page = int(table32[b, col])
                if not 0 <= page < kv32.shape[0]:
                    continue
                k = keys[page, s % 32]
                for r in range(R):
                    if j * 64 + s < int(ctx[b, r]):
                        row = b * R + r
                        dots = q[row].double() @ k
                        out[row, c * 64 + s] = (w[row].double() * dots.relu()).sum()
    return out


def random_case(seed, B=3, R=2, blocks=6, m_cap=5):
    g = torch.Generator().manual_seed(seed)
    rows, scales = random_fp8_keys(B * blocks + 2, g)              # two pages nobody reads
    kv64 = pack_pages(rows, scales)
    kv32, where = repaged(rows, scales, g)
    table64 = torch.randperm(B * blocks, generator=g).view(B, blocks).to(torch.int32)
    table32 = where[table64.long()].reshape(B, 2 * blocks).to(torch.int32)
    q = (torch.randn(B * R, 64, 128, generator=g) * 2).to(torch.float8_e4m3fn)
    w = torch.randn(B * R, 64, generator=g) * 0.1
    last = torch.randint(1, blocks * 64 + 1, (B,), generator=g)
    ctx = (last.view(-1, 1) - R + 1 + torch.arange(R)).clamp(min=0).to(torch.int32)
    ids = torch.full((B, m_cap), -1, dtype=torch.int32)
    counts = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        # a random ascending choice, some past the table; a count below m_cap for some
        pick = torch.randperm(blocks + 2, generator=g)[:m_cap].sort().values
        n = int(torch.randint(1, m_cap + 1, (1,), generator=g))
        ids[b, :n] = pick[:n].to(torch.int32)
        counts[b] = n
    return q, w, ctx, kv64, table64, kv32, table32, ids, counts


def kill(want, ids, counts, R, b, block, half):
    """-inf at the 32 slots of `block`'s half `half` in request b's compact rows."""
    for c in range(min(int(counts[b]), ids.shape[1])):
        if int(ids[b, c]) == block:
            at = c * 64 + half * 32
            want[b * R:(b + 1) * R, at:at + 32] = float("-inf")


@pytest.mark.parametrize("seed", range(6))
def test_reference_logits_on_32_slot_pages_equal_64_slot_ones(seed):
    q, w, ctx, kv64, table64, kv32, table32, ids, counts = random_case(seed)
    R = ctx.shape[1]
    want = ref.masked_indexer_logits(q, kv64, w, ctx, table64, ids, counts)
    got = ref.masked_indexer_logits(q, kv32, w, ctx, table32, ids, counts)
    assert torch.equal(got, want)
    assert bool(torch.isfinite(want).any()) and bool(torch.isinf(want).any())
    # a missing second page, a page outside the cache, a table that ends mid-block: only
    # those 32 slots are lost
    holed = table32.clone()
    assert int(ids[:2, 0].max()) < table64.shape[1]        # the smallest of 5 ids in 0..7
    holed[0, 2 * int(ids[0, 0]) + 1] = -1
    holed[1, 2 * int(ids[1, 0])] = kv32.shape[0] + 3
    expect = want.clone()
    kill(expect, ids, counts, R, 0, int(ids[0, 0]), 1)
    kill(expect, ids, counts, R, 1, int(ids[1, 0]), 0)
    short = holed[:, :-1]                                 # the last block's second page is gone
    kill(expect, ids, counts, R, 0, table64.shape[1] - 1, 1)
    kill(expect, ids, counts, R, 1, table64.shape[1] - 1, 1)
    kill(expect, ids, counts, R, 2, table64.shape[1] - 1, 1)
    got = ref.masked_indexer_logits(q, kv32, w, ctx, short, ids, counts)
    assert torch.equal(got, expect)
    # and slot by slot, from the dequantized keys (fp64 sums: equal to rounding)
    brute = brute_logits(q, kv32, w, ctx, short, ids, counts)
    assert torch.equal(torch.isinf(got), torch.isinf(brute))
    fin = torch.isfinite(brute)
    assert torch.allclose(got[fin], brute[fin], rtol=1e-12, atol=1e-12)


def test_reference_backend_reads_both_page_sizes_native_only_64():
    q, w, ctx, kv64, table64, kv32, table32, ids, counts = random_case(9)
    out = torch.empty(q.shape[0], ids.shape[1] * 64)
    want = ref.masked_indexer_logits(q, kv64, w, ctx, table64, ids, counts).float()
    for slots, kv, table in ((64, kv64, table64), (32, kv32, table32)):
        backend = logits_backends.resolve("reference", "cpu", slots)
        got, lens = backend.run(q, kv, w, ctx, table, ids, counts, out)
        assert lens is None and torch.equal(got, want)
    with pytest.raises(SpinError, match=r"made for 32-slot pages.*\[20, 64, 1, 132\]"):
        logits_backends.resolve("reference", "cpu", 32).run(q, kv64, w, ctx, table32, ids,
                                                             counts, out)
    with pytest.raises(SpinError, match="'native' reads 64-slot K-cache pages, not 32-slot"):
        logits_backends.resolve("native", "cpu", 32)
    with pytest.raises(SpinError, match="'reference' reads 32- or 64-slot K-cache pages, not 16"):
        logits_backends.resolve("reference", "cpu", 16)
    with pytest.raises(SpinError, match="pages of 16 slots"):
        ref.masked_indexer_logits(q, torch.zeros(4, 16, 1, 132, dtype=torch.uint8), w, ctx,
                                  table32, ids, counts)


# ---- the engine -------------------------------------------------------------------------------
WEIGHTS: dict = {}


def weights(cfg):
    key = cfg.to_json()
    if key not in WEIGHTS:
        WEIGHTS[key] = init_weights(cfg)
    return WEIGHTS[key]


def run(cfg, page_slots, spin, lengths, new_tokens, **kw):
    """Requests of these prompt lengths (the last joins two steps later) run to the end:
    (engine, tokens by request, per decode step the SPIN indexer's block ids and counts)."""
    e = Engine(cfg, spin, weights=weights(cfg), page_slots=page_slots, max_batch=4, **kw)
    reqs = [Request(prompt(n, i), max_new_tokens=new_tokens, request_id=i)
            for i, n in enumerate(lengths)]
    for r in reqs[:-1]:
        e.submit(r)
    tokens, picks, t = {}, [], 0
    while not e.idle or t < 3:
        if t == 2:
            e.submit(reqs[-1])
        before = len(e.history)
        tokens.update({o.request_id: o.tokens for o in e.step()})
        if len(e.history) > before and e.spin_indexer is not None:
            ix = e.spin_indexer
            picks.append((ix.block_ids[:ix.batch].clone(), ix.counts[:ix.batch].clone()))
        t += 1
    return e, tokens, picks


class Oracle:
    """Drafts each request's tokens of an earlier run, every second draft spoiled."""

    def __init__(self, tokens, lengths):
        self.tokens, self.lengths = tokens, lengths

    def __call__(self, rid, context, depth):
        done = len(context) - self.lengths[rid]             # tokens generated so far
        true = self.tokens[rid][done:done + depth]
        true += [0] * (depth - len(true))
        return [t if i % 2 == 0 else (t + 1) % 256 for i, t in enumerate(true)]


# (ratios, mtp, prompt lengths): the contexts end mid-block and mid-page (700 DSA slots: 60
# into block 10, 28 into its second page; 175 CSA slots), in a block's first page with the
# second not handed out yet (75 slots), inside the one block there is (40 / 25 slots)
CASES = [(DSA, 0, (700, 75, 40)), (DSA, 2, (700, 75, 40)),
         (CSA, 2, (700, 300, 100))]


@pytest.mark.parametrize("ratios,mtp,lengths", CASES, ids=["dsa", "dsa-mtp2", "csa-mtp2"])
def test_spin_engine_on_32_slot_pages_equals_64_slot_pages(ratios, mtp, lengths):
    cfg = config(ratios, mtp)
    kw = {"measure_miss": True}
    if mtp:    # drafts of a first run's tokens, every other one spoiled: some rows accepted
        first = run(cfg, 64, spin_cfg(), lengths, 10, drafter=copy_drafter)[1]
        kw = {"drafter": Oracle(first, lengths)}
    runs = [run(cfg, slots, spin_cfg(), lengths, 10, **kw) for slots in (64, 32)]
    (e64, tok64, picks64), (e32, tok32, picks32) = runs
    assert e32.caches.index[0].shape[1:] == (32, 1, 132)
    assert e32.caches.max_pages == math.ceil(cfg.index_slots / 32)
    assert e32.logits_backend.name == "reference" and e32.logits_backend.page_slots == 32
    assert e32.spin_indexer.page_slots == 32
    assert tok32 == tok64 and sorted(tok64) == list(range(len(lengths)))
    assert len(picks32) == len(picks64) > 5
    for (ids32, cnt32), (ids64, cnt64) in zip(picks32, picks64):
        assert torch.equal(cnt32, cnt64) and torch.equal(ids32, ids64)
    h32, h64 = e32.history, e64.history
    assert [s.selected_blocks for s in h32] == [s.selected_blocks for s in h64]
    assert any(s.selected_blocks < s.visible_blocks for s in h64), "SPIN never pruned"
    if mtp:
        assert sum(s.accepted for s in h64) > 0               # draft rows were kept
        assert [s.accepted for s in h32] == [s.accepted for s in h64]
    else:                                                     # the shadow reads 32-slot pages
        assert [s.miss for s in h32] == [s.miss for s in h64]
        assert any(m > 0 for s in h64 for m in s.miss)
    for e in (e32, e64):                                      # every page given back
        assert e.caches.free_pages == e.caches.num_pages


@pytest.mark.parametrize("mtp", [0, 2])
def test_all_keep_engine_on_32_slot_pages_equals_64_slot_pages(mtp):
    cfg = config(DSA, mtp)
    kw = {"drafter": copy_drafter} if mtp else {"trace_request": 0}
    (e64, tok64, _), (e32, tok32, _) = [run(cfg, slots, None, (300, 75, 40), 8, **kw)
                                        for slots in (64, 32)]
    assert e32.dense_indexer.block_table.shape[1] == 2 * e32.dense_indexer.m_cap
    assert tok32 == tok64 and len(tok64) == 3
    if not mtp:      # the trace reads the keys back from the pages: the same keys, scores
        t32, t64 = e32.trace(0), e64.trace(0)
        for name in ("keys", "scores", "row_len", "query_pos", "q", "w"):
            assert torch.equal(getattr(t32, name), getattr(t64, name)), name


@pytest.mark.parametrize("spin", [True, False], ids=["spin", "all-keep"])
def test_deepgemm_on_32_slot_pages_equals_native_on_64(spin):
    """The engine's 32-slot pages through the deepgemm backend (the stand-in's CPU kernel on
    SPIN's compacted table, two pages a block), against the native kernel's 64-slot pages."""
    cfg = config(DSA)
    dg = DeepGemmLogits(standin_deep_gemm("standin_deep_gemm_pages"), 32)
    runs = [run(cfg, slots, spin_cfg() if spin else None, (700, 75, 40), 6,
                logits_backend=backend)
            for slots, backend in ((64, "native"), (32, dg))]
    (e64, tok64, picks64), (e32, tok32, picks32) = runs
    assert e32.indexer.backend is dg
    assert tok32 == tok64 and len(tok64) == 3
    assert [s.selected_blocks for s in e32.history] == [s.selected_blocks for s in e64.history]
    for (ids32, cnt32), (ids64, cnt64) in zip(picks32, picks64, strict=True):
        assert torch.equal(cnt32, cnt64) and torch.equal(ids32, ids64)


@pytest.mark.gpu
@pytest.mark.parametrize("mtp", [0, 2])
def test_gpu_deepgemm_on_32_slot_pages_equals_64_slot_pages(mtp):
    """On a GPU (CUDA graphs): DeepGEMM over 32-slot pages gives the tokens and selections it
    gives over 64-slot pages (SM100), or is refused with the reason (SM90: 64-slot pages
    only); the native kernel refuses 32-slot pages with the reason."""
    ok, why = logits_backends.available("deepgemm", "cuda")
    if not ok:
        pytest.skip(f"deepgemm backend: {why}")
    cfg = config(DSA, mtp)
    with pytest.raises(SpinError, match="'native' reads 64-slot K-cache pages, not 32-slot"):
        Engine(cfg, spin_cfg(), weights=weights(cfg), device="cuda", page_slots=32)
    if torch.cuda.get_device_capability()[0] == 9:     # DeepGEMM's SM90 kernel: 64-slot pages
        with pytest.raises(SpinError, match="SM90 paged-logits kernel reads 64-slot pages only"):
            Engine(cfg, spin_cfg(), weights=weights(cfg), device="cuda",
                   logits_backend="deepgemm", page_slots=32)
        return
    runs = []
    for slots in (64, 32):
        e = Engine(cfg, spin_cfg(), weights=weights(cfg), device="cuda", max_batch=3,
                   cuda_graphs=True, logits_backend="deepgemm", switch="spin",
                   page_slots=slots)
        outs = e.run([Request(prompt(n, i), max_new_tokens=12, request_id=i)
                      for i, n in enumerate((700, 75, 40))])
        runs.append(({o.request_id: o.tokens for o in outs},
                     [s.selected_blocks for s in e.history]))
    assert runs[0] == runs[1]


def test_prefill_indexer_and_caches_page_by_page_slots():
    cfg = config(DSA)
    c64, c32 = (Caches(cfg, 2, math.ceil(cfg.index_slots / s) * 2, torch.device("cpu"), s)
                for s in (64, 32))
    assert c32.index[0].shape == (c32.num_pages + 1, 32, 1, 132)
    for c in (c64, c32):
        assert Caches.estimate_bytes(cfg, 2, c.num_pages, c.page_slots) >= c.nbytes()
        c.ensure_pages(1, 75)
    assert (c32.block_table[1] >= 0).sum() == 3 and (c64.block_table[1] >= 0).sum() == 2
    # the same keys through both pagings: the prefill indexer's top-K agree
    g = torch.Generator().manual_seed(4)
    rows, scales = random_fp8_keys(2, g)
    c64.index[0][c64.block_table[1, :2].long()] = pack_pages(rows, scales)
    for h in range(2):
        for j in range(2):
            page = int(c32.block_table[1, 2 * j + h]) if 2 * j + h < 3 else None
            if page is not None:
                c32.index[0][page] = pack_pages(rows[j:j + 1, h * 32:(h + 1) * 32],
                                                scales[j:j + 1, h * 32:(h + 1) * 32])[0]
    q = (torch.randn(5, 64, 128, generator=g) * 2).to(torch.float8_e4m3fn)
    w = torch.randn(5, 64, generator=g) * 0.1
    ctx = torch.arange(71, 76, dtype=torch.int32).view(1, -1)
    tops = []
    for c in (c64, c32):
        ix = PrefillIndexer(20, torch.float32, c.page_slots)
        ix.prepare(ctx, c.block_table[1:2])
        tops.append(ix.layer(0, q, w, c.index[0]))
    assert torch.equal(tops[0], tops[1]) and bool((tops[0] >= 64).any())


# ---- the probe on 32-slot pages ---------------------------------------------------------------
def page_keys(kv, page):
    """float32 keys [S, 128] of one page: fp8 rows times their fp32 scales."""
    S = kv.shape[1]
    flat = kv[page].reshape(-1)
    rows = flat[:S * 128].clone().view(torch.float8_e4m3fn).float().view(S, 128)
    return rows * flat[S * 128:].clone().view(torch.float32).view(S, 1)


def summary(kv, page, fill):
    """A page's summary: the mean of its first `fill` keys (fp64 sum, cast to fp32) in e4m3
    with scale max(amax / 448, 1e-12): (fp8 bytes [128], scale)."""
    mean = (page_keys(kv, page)[:fill].double().sum(0) / fill).float()
    scale = (mean.abs().amax() / 448.0).clamp(min=1e-12)
    return (mean / scale).to(torch.float8_e4m3fn), scale


def check_summaries(table, kv, row, n):
    """Every visible page of a request (block-table row, n visible slots) has its summary."""
    for p in range(math.ceil(n / 32)):
        page = int(row[p])
        fp8, scale = summary(kv, page, min(n - 32 * p, 32))
        assert torch.equal(table[page, :128], fp8.view(torch.uint8)), (page, n)
        assert torch.equal(table[page, 128:132].clone().view(torch.float32), scale.view(1))


def expected_blocks(q, w, kv, row, n, count):
    """The blocks the probe keeps without exploration: the sink and the newest block, then the
    best by block score (the max of its pages' sum_h w_h ReLU(q_h . summary), pages past n or
    not handed out left out; ties to the lower id)."""
    blocks = math.ceil(n / 64)
    if count >= blocks:
        return set(range(blocks))
    score = [float("-inf")] * blocks
    for p in range(math.ceil(n / 32)):
        fp8, scale = summary(kv, int(row[p]), min(n - 32 * p, 32))
        s = fp8.double() * scale.double()
        page_score = float((w.double() * (q.double() @ s).relu()).sum().float())
        score[p // 2] = max(score[p // 2], page_score)
    forced = {0, blocks - 1}
    rest = sorted((j for j in range(blocks) if j not in forced), key=lambda j: (-score[j], j))
    return forced | set(rest[:count - len(forced)])


def test_probe_on_32_slot_pages_ranks_by_its_pages_summaries():
    cfg = config(DSA)
    e = Engine(cfg, spin_cfg(exploration=0.0), weights=weights(cfg), predictor="probe",
               page_slots=32)
    ix = e.spin_indexer
    layer_of_ix = ix.layer
    checked = {"pruned": 0, "rows": 0}

    def layer(l, q, w, kv):
        top = layer_of_ix(l, q, w, kv)
        for b in range(ix.batch):
            n, count = int(ix.context_lens[b, 0]), int(ix.counts[b, l])
            check_summaries(ix.summaries[l], kv, ix.block_table[b], n)
            want = expected_blocks(q[b], w[b], kv, ix.block_table[b], n, count)
            assert set(ix.block_ids[b, l, :count].tolist()) == want
            checked["rows"] += 1
            checked["pruned"] += count < math.ceil(n / 64)
        return top

    ix.layer = layer
    e.submit(Request(prompt(700), max_new_tokens=8, request_id=0))
    e.submit(Request(prompt(301, 3), max_new_tokens=8, request_id=1))
    steps = 0
    while not e.idle:
        e.step()
        steps += 1
        for live in e.running:                # after prefill and after each decode step
            for ci, kv in enumerate(e.caches.index):
                check_summaries(ix.summaries[ci], kv, e.caches.block_table[live.slot],
                                len(live.context))
    assert checked["rows"] > 20 and checked["pruned"] > 10


def test_synthetic_requests_fill_and_summarize_32_slot_pages():
    cfg = config(DSA)
    e = Engine(cfg, spin_cfg(), weights=weights(cfg), predictor="probe", page_slots=32)
    e.add_synthetic(7, 500, 3, seed=1)                   # 500 tokens: slots 0..500
    live = e.running[0]
    row = e.caches.block_table[live.slot]
    assert int((row >= 0).sum()) == math.ceil(501 / 32)
    for ci, kv in enumerate(e.caches.index):
        keys = torch.cat([page_keys(kv, int(p)) for p in row[:16]])
        assert bool((keys.abs().sum(-1) > 0).all())      # every slot's key was written
        check_summaries(e.spin_indexer.summaries[ci], kv, row, 500)
    while not e.idle:
        e.step()
        for live in e.running:
            for ci, kv in enumerate(e.caches.index):
                check_summaries(e.spin_indexer.summaries[ci], kv,
                                e.caches.block_table[live.slot], len(live.context))
    assert len(e.history) == 3 and e.caches.free_pages == e.caches.num_pages


# ---- errors ---------------------------------------------------------------------------------
def test_bad_page_sizes_are_refused_naming_the_value():
    cfg = config(DSA)
    with pytest.raises(SpinError, match="page_slots must be one of 32, 64, got 48"):
        Engine(cfg, spin_cfg(), weights=weights(cfg), page_slots=48)
    with pytest.raises(SpinError, match="page_slots must be one of 32, 64, got 16"):
        EngineOptions(page_slots=16)
    with pytest.raises(SpinError, match="page_slots must be one of 32, 64.*got 128"):
        Caches(cfg, 1, 4, torch.device("cpu"), page_slots=128)
    with pytest.raises(SpinError, match="page_slots must be one of 32, 64.*got 0"):
        PrefillIndexer(8, torch.float32, page_slots=0)
    with pytest.raises(SpinError, match="DenseIndexer: page_slots must be one of 32, 64, got 96"):
        DenseIndexer(8, 1, 1, 1, 64, page_slots=96)
    with pytest.raises(SpinError, match="'reference' was made for 64-slot pages, the K cache has 32-slot"):
        DenseIndexer(8, 1, 1, 1, 64, logits_backend=logits_backends.resolve("reference", "cpu"),
                     page_slots=32)
    # the native kernel cannot read 32-slot pages (on CUDA; its availability needs no GPU)
    with pytest.raises(SpinError, match="'native' reads 64-slot K-cache pages, not 32-slot"):
        resolve_backend("native", torch.device("cuda"), 32)
    assert resolve_backend("native", torch.device("cpu"), 32).name == "reference"
    assert resolve_backend("native", torch.device("cpu"), 64).name == "native"
    with pytest.raises(SpinError, match="was made for 64-slot pages, the engine's K cache has 32-slot pages .*page_slots=32"):
        Engine(cfg, spin_cfg(), weights=weights(cfg), page_slots=32,
               logits_backend=logits_backends.resolve("reference", "cpu"))


# ---- benchmarks/quality.py --------------------------------------------------------------------
@pytest.fixture(scope="module")
def quality():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "quality.py"
    spec = importlib.util.spec_from_file_location("quality_tool", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_quality_tool_runs_on_32_slot_pages(tmp_path, quality):
    reports = {}
    for slots in (64, 32):
        out = tmp_path / str(slots)
        assert quality.main(["--out", str(out), "--device", "cpu", "--prompts", "1",
                             "--mtp-prompts", "0", "--prompt-tokens", "700", "--steps", "3",
                             "--sparsity", "0.5", "--bpb-only", "--page-slots",
                             str(slots)]) == 0
        reports[slots] = json.loads((out / "quality.json").read_text())
    assert reports[32]["page_slots"] == 32 and reports[64]["page_slots"] == 64
    assert reports[32]["logits_backend"] == "reference"         # native's CPU path, 32 slots
    assert reports[32]["bpb"] == reports[64]["bpb"]
    assert reports[64]["bpb"][1]["realized_sparsity"] > 0
    # the summary rows a predictor reads count against its sparsity: one row set per page
    out = tmp_path / "predictors"
    assert quality.main(["--out", str(out), "--device", "cpu", "--prompts", "1",
                         "--mtp-prompts", "0", "--prompt-tokens", "700", "--steps", "3",
                         "--sparsity", "0.5", "--bpb-only", "--page-slots", "32",
                         "--predictor", "spin", "probe", "gauss"]) == 0
    rows = {r["predictor"]: r for r in json.loads((out / "quality.json").read_text())["bpb"]}
    assert rows["spin"]["effective_sparsity"] == rows["spin"]["realized_sparsity"]
    lost = {p: rows[p]["realized_sparsity"] - rows[p]["effective_sparsity"]
            for p in ("probe", "gauss")}
    # a block: 64 keys of 128 + 4 bytes; its two pages' summaries: 144-byte rows, one each
    # (probe) or two each (gauss)
    assert lost["probe"] == pytest.approx(2 * 144 / (64 * 132))
    assert lost["gauss"] == pytest.approx(4 * 144 / (64 * 132))


@pytest.mark.slow
def test_quality_tool_puts_each_runs_replay_beside_its_engine_miss(tmp_path, quality):
    """Every SPIN-masked run beside the replay of the all-keep traces with the same predictor,
    target and pages: on 32-slot pages the probe and gauss replay with 2 summaries (a block's
    best page), and both tools count the summary rows alike (gauss reads twice the probe's)."""
    out = tmp_path / "q"
    assert quality.main(["--out", str(out), "--device", "cpu", "--prompts", "1",
                         "--mtp-prompts", "0", "--prompt-tokens", "700", "--steps", "4",
                         "--sparsity", "0.5", "--page-slots", "32",
                         "--predictor", "spin", "probe", "gauss"]) == 0
    report = json.loads((out / "quality.json").read_text())
    rows = {r["predictor"]: r for r in report["engine_vs_replay"]}
    assert sorted(rows) == ["gauss", "probe", "spin"]
    assert {p: r["summaries"] for p, r in rows.items()} == {"spin": 1, "probe": 2, "gauss": 2}
    engine = {r["predictor"]: r for r in report["bpb"] if r["predictor"]}
    for p, r in rows.items():
        assert r["engine_mean_miss"] == engine[p]["mean_miss"]
        assert 0.0 <= r["replay_mean_miss"] <= 1.0
    for effective in ("engine_effective_sparsity", "replay_effective_sparsity"):
        assert rows["gauss"][effective] < rows["probe"][effective] < rows["spin"][effective]
    # the replay's summary bytes are the engine's: the same drop from spin at the same target
    drop = {p: rows["spin"]["replay_effective_sparsity"] - rows[p]["replay_effective_sparsity"]
            for p in ("probe", "gauss")}
    assert drop["gauss"] == pytest.approx(2 * drop["probe"], rel=0.05)


@pytest.mark.slow
def test_quality_tool_targets_effective_sparsity(tmp_path, quality):
    """--effective: a query-aware predictor's target adds its summary rows' share (at long
    contexts every predictor then lands at about the same effective sparsity); a share that
    pushes the target to 1 is refused by name."""
    out = tmp_path / "q"
    args = ["--out", str(out), "--device", "cpu", "--prompts", "1", "--mtp-prompts", "0",
            "--prompt-tokens", "1500", "--steps", "4", "--page-slots", "32", "--bpb-only",
            "--effective", "--predictor", "spin", "probe", "gauss"]
    assert quality.main(args + ["--sparsity", "0.5"]) == 0
    rows = {r["predictor"]: r for r in json.loads((out / "quality.json").read_text())["bpb"]
            if r["predictor"]}
    share = {"spin": 0.0, "probe": 2 * 144 / (64 * 132), "gauss": 4 * 144 / (64 * 132)}
    for p, r in rows.items():
        assert r["effective_target"] == 0.5
        assert r["target_sparsity"] == pytest.approx(0.5 + share[p])
        assert r["realized_sparsity"] - r["effective_sparsity"] == pytest.approx(share[p])
        # a budget of whole blocks: at this short context (23 blocks) the share moves it by
        # a block or not at all; never below spin's
        assert r["realized_sparsity"] >= rows["spin"]["realized_sparsity"]
    with pytest.raises(SystemExit, match="gauss's summaries needs a target of 1.0"):
        quality.main(args + ["--sparsity", "0.95"])
