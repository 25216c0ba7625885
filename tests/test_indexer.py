"""SpinIndexer over a changing batch: a request's results do not depend on its neighbours."""

import math

import pytest
import torch

from spin_trtllm import SpinConfig, SpinError
from spin_trtllm.indexer import SpinIndexer
from spin_trtllm.options import IndexerOptions
from spin_trtllm.state import StatePool
from spin_trtllm.testing.pages import make_cache

L, PAGES = 2, 16          # 2 indexer layers, up to 16 pages (1024 slots) per request


def cache_for(rid):
    """Per request: its own FP8 pages for each layer (the pool below places them)."""
    return make_cache(L * PAGES, torch.Generator().manual_seed(100 + rid)).view(L, PAGES, -1)


def q_for(rid, step, layer, R):
    g = torch.Generator().manual_seed(rid * 1000 + step * 10 + layer)
    return (torch.randn(R, 64, 128, generator=g).to(torch.float8_e4m3fn),
            torch.randn(R, 64, generator=g) * 0.1)


def run(schedule, cfg, R=1, accepted_of=lambda rid, t: 0):
    """schedule[t] = request ids in the batch at step t. Returns {(rid, t, layer): topk}."""
    reqs = sorted({r for batch in schedule for r in batch})
    pool = StatePool(L, max_requests=4, cfg=cfg, initial_capacity=64)
    idx = SpinIndexer(cfg, pool, max_batch=4, next_n=R, max_context_len=PAGES * 64)
    # a global page pool: request r owns pages [r * PAGES, (r + 1) * PAGES), shuffled order
    caches = {r: cache_for(r) for r in reqs}
    kv = [torch.cat([caches[r][l] for r in reqs]).view(-1, 64, 1, 132) for l in range(L)]
    perm = {r: torch.randperm(PAGES, generator=torch.Generator().manual_seed(r)) for r in reqs}
    out = {}
    length = {r: 300 + 37 * r for r in reqs}
    for t, batch in enumerate(schedule):
        for r in batch:
            if pool.slot_of(r) is None:
                pool.admit(r, step=t)
        for r in list(pool.request_ids()):
            if r not in batch:
                pool.release(r)
        n = torch.tensor([[length[r] + j for j in range(R)] for r in batch], dtype=torch.int32)
        table = torch.stack([reqs.index(r) * PAGES + perm[r] for r in batch]).to(torch.int32)
        # the cache holds request r's pages in its own order; the table maps block -> page
        idx.prepare(batch, n, n - 1, [t] * len(batch), table)
        idx.select()
        for l in range(L):
            qs = [q_for(r, t, l, R) for r in batch]
            q = torch.cat([x[0] for x in qs])
            w = torch.cat([x[1] for x in qs])
            top = idx.layer(l, q, w, kv[l])
            for i, r in enumerate(batch):
                out[(r, t, l)] = top[i * R:(i + 1) * R].clone()
        acc = torch.tensor([accepted_of(r, t) for r in batch], dtype=torch.int32)
        idx.finish(acc if R > 1 else None)
        for i, r in enumerate(batch):
            length[r] += 1 + int(acc[i])
    return out


@pytest.mark.parametrize("R", [1, 2])
def test_request_results_do_not_depend_on_the_batch(R):
    cfg = SpinConfig(index_topk=64, target_sparsity=0.5, exploration=0.2)
    acc = lambda rid, t: (rid + t) % R
    alone = run([[1]] * 6, cfg, R, acc)
    crowd = run([[1], [1, 2], [3, 1, 2], [1, 3], [1], [2, 1]], cfg, R, acc)
    for t in range(6):
        for l in range(L):
            assert torch.equal(alone[(1, t, l)], crowd[(1, t, l)]), (t, l)


@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("order", ["in order", "out of order", "twice"])
def test_layers_selected_beside_the_previous_topk_pick_the_same_blocks(R, order):
    """The bookkeeping of overlap_select (forced on here: on the CPU the ops ignore
    beside_previous): a step's layers see the blocks select() picks for every layer at once, in
    order, out of order, with keep_all steps, and in a second pass through the layers without
    select() (which selects each layer again from the state as it is then)."""
    layers = 3
    cfg = SpinConfig(index_topk=64, target_sparsity=0.5, exploration=0.2)
    reqs = [0, 1, 2]
    kv = [torch.cat([cache_for(r)[l % L] for r in reqs]).view(-1, 64, 1, 132)
          for l in range(layers)]
    table = torch.stack([r * PAGES + torch.randperm(PAGES, generator=torch.Generator()
                                                    .manual_seed(r)) for r in reqs]).to(torch.int32)
    calls = {"in order": [0, 1, 2], "out of order": [1, 0, 2], "twice": [0, 1, 2, 0, 1, 2]}[order]
    results = {}
    for beside in (False, True):
        pool = StatePool(layers, max_requests=3, cfg=cfg, initial_capacity=64)
        idx = SpinIndexer(cfg, pool, max_batch=3, next_n=R, max_context_len=PAGES * 64)
        idx.select_beside = beside
        for r in reqs:
            pool.admit(r, step=0)
        seen = []
        for t in range(5):
            n = torch.tensor([[300 + 61 * r + t * R + j for j in range(R)] for r in reqs],
                             dtype=torch.int32)
            idx.prepare(reqs, n, n - 1, [t] * 3, table)
            idx.select(keep_all=t == 2)
            for i, l in enumerate(calls):
                if order == "twice" and i == layers and not beside:
                    idx.select(keep_all=t == 2)   # what the overlapped second pass does
                qs = [q_for(r, t, l, R) for r in reqs]
                top = idx.layer(l, torch.cat([x[0] for x in qs]), torch.cat([x[1] for x in qs]),
                                kv[l])
                seen.append((top.clone(), idx.block_ids[:, l].clone(), idx.counts[:, l].clone()))
            idx.finish(torch.tensor([(r + t) % R for r in reqs], dtype=torch.int32)
                       if R > 1 else None)
            # every layer's blocks as the step leaves them (what the engine's statistics read)
            seen.append((idx.block_ids.clone(), idx.counts.clone()))
        results[beside] = (seen, state_of(pool))
    (a, sa), (b, sb) = results[False], results[True]
    assert len(a) == len(b) == 5 * (len(calls) + 1)
    for i, (x, y) in enumerate(zip(a, b)):
        for u, v in zip(x, y):
            assert torch.equal(u, v), i
    for u, v in zip(sa, sb):
        assert torch.equal(u, v)


def test_first_step_after_admission_scores_everything_then_sparsifies():
    cfg = SpinConfig(index_topk=64, target_sparsity=0.5, exploration=0.0)
    pool = StatePool(L, max_requests=2, cfg=cfg, initial_capacity=64)
    idx = SpinIndexer(cfg, pool, max_batch=2, next_n=1, max_context_len=1024)
    pool.admit(7)
    n = torch.tensor([[700]], dtype=torch.int32)
    kv = cache_for(7)[0].view(-1, 64, 1, 132)
    table = torch.arange(PAGES, dtype=torch.int32).view(1, -1)
    counts = []
    for t in range(2):
        idx.prepare([7], n, n - 1, [t], table)
        idx.select()
        counts.append(int(idx.counts[0, 0]))
        q, w = q_for(7, t, 0, 1)
        idx.layer(0, q, w, kv)
        idx.layer(1, q, w, kv)
    assert counts == [math.ceil(700 / 64), 6]        # warm-up: all 11 blocks; then ceil(5.5)


def test_bad_metadata_is_rejected():
    cfg = SpinConfig(index_topk=64)
    pool = StatePool(L, max_requests=2, cfg=cfg)
    idx = SpinIndexer(cfg, pool, max_batch=2, next_n=2, max_context_len=1024)
    pool.admit(1)
    n = torch.tensor([[10, 11]], dtype=torch.int32)
    with pytest.raises(SpinError, match="batch of 3"):
        idx.prepare([1, 2, 3], n, n, [0], torch.zeros(1, 4, dtype=torch.int32))
    with pytest.raises(SpinError, match="must be \\[1, 2\\]"):
        idx.prepare([1], n[:, :1], n[:, :1], [0], torch.zeros(1, 4, dtype=torch.int32))
    with pytest.raises(SpinError, match="block_table must be int32"):
        idx.prepare([1], n, n, [0], torch.zeros(1, 4, dtype=torch.int64))
    with pytest.raises(SpinError, match="admit it first"):
        idx.prepare([9], n, n, [0], torch.zeros(1, 4, dtype=torch.int32))
    idx.prepare([1], n, n - 1, [0], torch.zeros(1, 16, dtype=torch.int32))
    with pytest.raises(SpinError, match="accepted must be int32"):
        idx.finish(None)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_prepare_uploads_every_field_of_the_batch(device):
    """prepare() writes request ids, steps, state slots, lengths and query positions through one
    buffer (one upload on a GPU): each field lands in its own rows, batches of changing size
    overwrite them, sources already on the device (state_slots here) and step tensors work."""
    cfg = SpinConfig(index_topk=64)
    R, max_batch = 2, 5
    pool = StatePool(L, max_requests=max_batch, cfg=cfg, device=device)
    idx = SpinIndexer(cfg, pool, max_batch=max_batch, next_n=R, max_context_len=1024)
    for rid in (7, 3, 11, 2**40, 5):
        pool.admit(rid)
    gen = torch.Generator().manual_seed(0)
    for ids, on_device in (([7, 3, 11, 2**40, 5], False), ([11, 7], True), ([5, 3, 2**40], False)):
        B = len(ids)
        n = torch.randint(10, 1000, (B, R), generator=gen, dtype=torch.int32)
        q = n - torch.randint(1, 5, (B, R), generator=gen, dtype=torch.int32)
        steps = torch.randint(0, 2**40, (B,), generator=gen)
        slots = pool.slots(ids, device="cpu").flip(0)             # any valid slots
        idx.prepare(ids, n, q, steps if B != 2 else steps.tolist(),
                    torch.zeros(B, 16, dtype=torch.int32),
                    state_slots=slots.to(device) if on_device else slots)
        assert idx.request[:B].cpu().tolist() == ids
        assert torch.equal(idx.step[:B].cpu(), steps)
        assert torch.equal(idx.slot[:B].cpu(), slots)
        assert torch.equal(idx.context_lens[:B].cpu(), n)
        assert torch.equal(idx.query_pos[:B].cpu(), q)
        idx.prepare(ids, n, q, steps, torch.zeros(B, 16, dtype=torch.int32))
        assert torch.equal(idx.slot[:B].cpu(), pool.slots(ids, device="cpu"))


def state_of(pool):
    return [t.clone() for t in (pool.state.V, pool.state.D, pool.state.last_seen,
                                pool.state.decode_steps)]


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("beside", ["update", "select", "select, update"])
# 1M-slot rows: a top-K long enough that the launches beside it finish first; under racecheck
# such a case ran 9 minutes, so the sanitizers run the same launches on 64K-slot rows, and
# racecheck (minutes on their clusters of 8 too) on 8K-slot ones: the cluster-8 top-K has its
# racecheck case in test_ops_topk
# (SPIN_TOPK_FILTER=1: 4 rows of 1024 blocks through the filter, whose workspace is freed at
# return while its last kernel still reads it)
@pytest.mark.parametrize("m_cap,topk_filter", [
    pytest.param(16384, "auto", marks=pytest.mark.large),
    pytest.param(1024, "auto", marks=pytest.mark.racecheck_slow),
    pytest.param(1024, "1", marks=pytest.mark.racecheck_slow), (128, "auto")])
def test_gpu_launches_beside_topk_complete_after_it(graph, beside, m_cap, topk_filter,
                                                    monkeypatch):
    """An update or the next layer's select launched beside a long top-K (4 rows of m_cap
    blocks; both: SpinIndexer's order) may finish its own work first, but what follows on the
    stream must still see the whole top-K: a copy right after them would read a half-written
    top-K if their grids completed early. The update has nothing to do (no scored blocks), the
    select a short context; its blocks must be right too."""
    from spin_trtllm import ops
    monkeypatch.setenv("SPIN_TOPK_FILTER", topk_filter)
    cfg = SpinConfig(index_topk=2048, target_sparsity=0.5)
    B = 4
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(B, m_cap * 64, generator=gen).cuda()
    ids = torch.arange(m_cap, dtype=torch.int32).repeat(B, 1).cuda()
    cnt = torch.full((B,), m_cap, dtype=torch.int32).cuda()
    zero = torch.zeros(B, dtype=torch.int32).cuda()
    step = torch.full((B,), 3, dtype=torch.int64).cuda()
    slot = torch.arange(B, dtype=torch.int32).cuda()
    n = torch.full((B, 1), m_cap * 64, dtype=torch.int32).cuda()
    state = ops.OpState.zeros(B, 1, m_cap * 64 + 64, cfg, device="cuda")
    # the select: a short context of 2 layers, warm (decode_steps past warm-up), random V/D
    small = ops.OpState.zeros(B, 2, 1024, cfg, device="cuda")
    small.V.copy_(torch.randn(small.V.shape, generator=gen))
    small.D.copy_(torch.randn(small.D.shape, generator=gen))
    small.decode_steps.fill_(9)
    n_small = torch.full((B, 1), 1000, dtype=torch.int32).cuda()
    req = torch.arange(B, dtype=torch.int64).cuda()
    sel_ids = torch.full((B, 2, 16), -7, dtype=torch.int32).cuda()
    sel_cnt = torch.full((B, 2), -7, dtype=torch.int32).cuda()
    want_ids, want_cnt = ops.select(small, slot, n_small, n_small - 1, req, step, cfg, 16, 1000)
    out = torch.full((B, 2048), -7, dtype=torch.int32).cuda()
    seen = torch.empty_like(out)
    q, q_small = n - 1, n_small - 1            # made up front: no kernel between the launches

    def run():
        out.fill_(-7)
        ops.topk(logits, ids, cnt, 1, 2048, out)
        if "select" in beside:
            ops.select(small, slot, n_small, q_small, req, step, cfg, 16, 1000, sel_ids, sel_cnt,
                       layer=1, beside_previous=True)
        if "update" in beside:
            ops.update(state, slot, logits, ids, zero, n, q, zero, step, 0, cfg, m_cap * 64,
                       beside_previous=True)
        seen.copy_(out)
    expected = ops.topk(logits, ids, cnt, 1, 2048)
    if graph:
        run()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            run()
    for _ in range(3):
        g.replay() if graph else run()
        torch.cuda.synchronize()
        assert torch.equal(seen, expected)
    runs = (4 if graph else 3) * B
    assert int(state.decode_steps.sum()) == (runs if "update" in beside else 0)
    if "select" in beside:
        assert torch.equal(sel_ids[:, 1], want_ids[:, 1])
        assert torch.equal(sel_cnt[:, 1], want_cnt[:, 1])
        assert (sel_ids[:, 0] == -7).all() and (sel_cnt[:, 0] == -7).all()


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2])
def test_gpu_overlapped_update_in_cuda_graphs_matches_serial_eager(R):
    """Steps captured in CUDA graphs with the next layer's select and the update beside the
    top-K give the same top-K and state as eager steps with every layer selected at the start
    and the update after the top-K (with MTP: the select only, the updates are deferred)."""
    cfg = SpinConfig(index_topk=64, target_sparsity=0.5, exploration=0.2, state_dtype="float16")
    reqs, steps = [0, 1, 2], 5
    kv = [torch.cat([cache_for(r)[l] for r in reqs]).view(-1, 64, 1, 132).cuda() for l in range(L)]
    table = torch.stack([r * PAGES + torch.randperm(PAGES, generator=torch.Generator()
                                                    .manual_seed(r)) for r in reqs]).to(torch.int32)
    outs = {}
    for overlap, graphs in ((False, False), (True, True)):
        pool = StatePool(L, max_requests=3, cfg=cfg, device="cuda", initial_capacity=1024)
        idx = SpinIndexer(cfg, pool, max_batch=3, next_n=R, max_context_len=PAGES * 64,
                          options=IndexerOptions(overlap_update=overlap,
                                                 overlap_select=overlap))
        sm90 = torch.cuda.get_device_capability()[0] >= 9
        assert idx.select_beside == (overlap and sm90)
        assert idx.update_beside == (overlap and sm90 and R == 1)
        for r in reqs:
            pool.admit(r, step=0)
        tops = []
        for t in range(steps):
            n = torch.tensor([[400 + 61 * r + t * R + j for j in range(R)] for r in reqs],
                             dtype=torch.int32)
            idx.prepare(reqs, n, n - 1, [t] * 3, table)
            qs = [[q_for(r, t, l, R) for r in reqs] for l in range(L)]
            q = [torch.cat([x[0] for x in qs[l]]).cuda() for l in range(L)]
            w = [torch.cat([x[1] for x in qs[l]]).cuda() for l in range(L)]

            def step():
                idx.select()
                tops = [idx.layer(l, q[l], w[l], kv[l]) for l in range(L)]
                if R > 1:
                    idx.finish(accepted)
                return tops
            accepted = torch.tensor([(r + t) % R for r in reqs], dtype=torch.int32).cuda()
            if graphs and t > 0:                       # the first step eager: warm-up
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = step()
                g.replay()
            else:
                out = step()
            torch.cuda.synchronize()
            tops.append([o.clone() for o in out])
        outs[overlap] = (tops, state_of(pool))
    (t0, s0), (t1, s1) = outs[False], outs[True]
    for t in range(steps):
        for l in range(L):
            assert torch.equal(t0[t][l], t1[t][l]), (t, l)
    for a, b in zip(s0, s1):
        assert torch.equal(a, b)
