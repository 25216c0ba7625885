"""SpinIndexer with IndexerOptions(predictor="probe") and dsa-lite's Engine(predictor=...): the
block summaries the indexer keeps beside the K cache, the probe-ranked selection of each layer,
the engine wiring."""

import math

import pytest
import torch

from spin_trtllm import SpinConfig, SpinError
from spin_trtllm import ops
from spin_trtllm import reference as ref
from spin_trtllm.harness import Engine, Request, init_weights, tiny
from spin_trtllm.indexer import SpinIndexer
from spin_trtllm.limits import KEY_BYTES, SLOT_BYTES, SUMMARY_BYTES
from spin_trtllm.options import IndexerOptions
from spin_trtllm.state import StatePool

from spin_trtllm.testing.harness import Scheduled

L, PAGES, NUM_PAGES = 2, 8, 40           # indexer layers, pages per request, pages in the cache
TEXT = ("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 40).encode()


def spin_cfg(**kw):
    return SpinConfig(**{"index_topk": 64, "target_sparsity": 0.5, "exploration": 0.2, **kw})


def random_keys(g, count):
    """`count` random slots: fp8 rows [count, 128] as uint8 and fp32 scales as uint8 [count, 4]."""
    rows = (torch.randn(count, KEY_BYTES, generator=g) * 2).to(torch.float8_e4m3fn)
    scales = torch.rand(count, generator=g) * 0.02 + 0.005
    return rows.view(torch.uint8), scales.view(torch.uint8).view(count, 4)


def write_slots(kv, table_row, slots, g):
    """Write fresh random keys into request slots `slots` (what a forward pass does)."""
    rows, scales = random_keys(g, len(slots))
    flat = kv.view(kv.shape[0], -1)
    for i, s in enumerate(slots):
        page, off = int(table_row[s // 64]), s % 64
        flat[page, off * KEY_BYTES:(off + 1) * KEY_BYTES] = rows[i]
        base = 64 * KEY_BYTES + off * 4
        flat[page, base:base + 4] = scales[i]


def summary_row(x):
    """A summary row of fp32 values x [128]: e4m3 with scale max(amax / 448, 1e-12)."""
    scale = (x.abs().amax() / 448.0).clamp(min=1e-12)
    row = torch.zeros(SUMMARY_BYTES, dtype=torch.uint8)
    row[:KEY_BYTES] = (x / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    row[KEY_BYTES:KEY_BYTES + 4] = scale.view(1).view(torch.uint8)
    return row


def expected_summary(kv, page, fill, gauss=False):
    """The summary row of one page, from the dequantized keys: mean of the first `fill` keys
    (fp64 sum, mean cast to fp32) as a summary row; gauss: then their per-dimension
    population std (fp64) as a second row."""
    keys = ref.dequantize_pages(kv[page:page + 1])[0, :fill].double()  # fp32 products
    row = summary_row((keys.sum(0) / fill).float())
    if not gauss:
        return row
    std = (keys - keys.sum(0) / fill).square().mean(0).sqrt().float()
    return torch.cat([row, summary_row(std)])


def expected_table(kv, tables, lens, gauss=False):
    """From scratch: every visible page of every request (block_table rows, lengths)."""
    out = torch.zeros(kv.shape[0], SUMMARY_BYTES * (2 if gauss else 1), dtype=torch.uint8)
    for row, n in zip(tables, lens):
        for j in range(math.ceil(int(n) / 64)):
            out[int(row[j])] = expected_summary(kv, int(row[j]), min(int(n) - 64 * j, 64), gauss)
    return out


def check_table(table, kv, tables, lens):
    """On CUDA the kernels' std rows may round one e4m3 step from the reference's
    (test_gpu_native_summarize_gauss_equals_reference): there the table must equal the same op
    run from scratch, and its mean rows the reference."""
    gauss = table.shape[1] == 2 * SUMMARY_BYTES
    tables = [row.cpu() for row in tables]
    want = expected_table(kv.cpu(), tables, lens, gauss)
    # the building block agrees with the independent reference (one call over every page)
    scratch = (ops.gauss_summaries_like if gauss else ops.summaries_like)(kv)
    pages = torch.cat([row[:math.ceil(int(n) / 64)] for row, n in zip(tables, lens)])
    fill = torch.cat([(int(n) - 64 * torch.arange(math.ceil(int(n) / 64))).clamp(max=64)
                      for n in lens]).to(torch.int32)
    (ops.summarize_gauss if gauss else ops.summarize)(kv, pages.to(kv.device).contiguous(),
                                                      fill.to(kv.device).contiguous(), scratch)
    used = pages.long()
    scratch, table = scratch.cpu(), table.cpu()
    exact = slice(None) if kv.device.type == "cpu" else slice(0, SUMMARY_BYTES)
    assert torch.equal(scratch[used][:, exact], want[used][:, exact])
    assert torch.equal(table[used], scratch[used]), "a visible page's summary is stale"


class Sim:
    """Drives a probe SpinIndexer the way a model does: each step writes this step's slots of
    every layer just before that layer's indexer call."""

    def __init__(self, R, lengths, cfg=None, seed=0, predictor="probe"):
        self.R, self.cfg = R, cfg or spin_cfg()
        self.g = torch.Generator().manual_seed(seed)
        self.pool = StatePool(L, max_requests=4, cfg=self.cfg, initial_capacity=64)
        self.idx = SpinIndexer(self.cfg, self.pool, max_batch=4, next_n=R,
                               max_context_len=PAGES * 64,
                               options=IndexerOptions(predictor=predictor))
        self.kv = [torch.zeros(NUM_PAGES, 64, 1, SLOT_BYTES, dtype=torch.uint8)
                   for _ in range(L)]
        perm = torch.randperm(NUM_PAGES, generator=self.g)
        self.rids = list(lengths)
        self.table = {r: perm[i * PAGES:(i + 1) * PAGES].to(torch.int32)
                      for i, r in enumerate(self.rids)}
        self.length = dict(lengths)                # committed slots (prompt + accepted)
        self.seen = dict(lengths)                  # the last row's length at its last step
        self.step_no = {r: 0 for r in self.rids}
        for r in self.rids:
            self.pool.admit(r)
            for l in range(L):
                write_slots(self.kv[l], self.table[r], range(self.length[r]), self.g)
                self.idx.summarize_context(l, self.kv[l], self.table[r], [self.length[r]])

    def step(self, batch, accepted=None, on_layer=None, keep_all=False):
        R, idx = self.R, self.idx
        n = torch.tensor([[self.length[r] + 1 + j for j in range(R)] for r in batch],
                         dtype=torch.int32)        # rows see their own slot, drafts after
        table = torch.stack([self.table[r] for r in batch])
        idx.prepare(batch, n, n - 1, [self.step_no[r] for r in batch], table)
        idx.select(keep_all=keep_all)
        for l in range(L):
            for b, r in enumerate(batch):
                write_slots(self.kv[l], self.table[r], range(int(n[b, 0]) - 1, int(n[b, -1])),
                            self.g)
            q = (torch.randn(len(batch) * R, 64, 128, generator=self.g)).to(torch.float8_e4m3fn)
            w = torch.randn(len(batch) * R, 64, generator=self.g) * 0.1
            if on_layer is not None:
                on_layer(l, batch, n, table, q, w)
            idx.layer(l, q, w, self.kv[l])
        acc = torch.tensor([0 if accepted is None else accepted(r) for r in batch],
                           dtype=torch.int32)
        idx.finish(acc if R > 1 else None)
        for b, r in enumerate(batch):
            self.length[r] += 1 + int(acc[b])
            self.step_no[r] += 1
            self.seen[r] = int(n[b, -1])
        return n

    def check(self):
        for l in range(L):
            check_table(self.idx.summaries[l], self.kv[l], [self.table[r] for r in self.rids],
                        [self.seen[r] for r in self.rids])


@pytest.mark.parametrize("R", [1, 3])
def test_summaries_follow_the_cache_through_decode(R):
    # 61 slots: the first page fills up within a few steps; 190: crosses into page 3;
    # 300: a page in the middle
    sim = Sim(R, {5: 61, 6: 190, 7: 300})
    sim.check()
    crossed = set()
    for t in range(8):
        batch = [5, 6, 7] if t % 3 else [7, 5]      # a request sits out some steps
        n = sim.step(batch, accepted=lambda r: (r + t) % R)
        for b, r in enumerate(batch):
            # this step's slots reach a page past the one of the last committed slot
            if (int(n[b, -1]) - 1) // 64 != (int(n[b, 0]) - 2) // 64:
                crossed.add(r)
        # the cache as of each request's last step: its draft rows' slots written too
        sim.check()
    assert 5 in crossed and 6 in crossed           # pages filled up during decode


@pytest.mark.parametrize("R,predictor", [(1, "probe"), (2, "probe"), (1, "hybrid"),
                                         (2, "hybrid"), (1, "gauss"), (2, "gauss")])
def test_probe_layer_selects_by_the_probe_scores(R, predictor):
    cfg = spin_cfg(exploration=0.25)
    sim = Sim(R, {1: 400, 2: 260, 3: 470}, cfg, seed=3, predictor=predictor)
    idx = sim.idx
    seen = {"sparse": 0, "differs": 0, "layers": 0}

    def on_layer(l, batch, n, table, q, w):
        # independently: the summaries after this layer's writes, the reference probe, and
        # select on a copy of the state as it is before the layer runs
        B = len(batch)
        lens = [int(n[b, -1]) for b in range(B)]
        gauss = predictor == "gauss"
        summaries = expected_table(sim.kv[l], list(table), lens, gauss)
        score = ref.gauss_scores if gauss else ref.probe_scores
        scores = score(q, summaries, w, n, table, idx.m_cap).float()
        state = ops.OpState(*(t.clone() for t in sim.pool.state.tensors()))
        slots = sim.pool.slots(batch)
        req = torch.tensor(batch, dtype=torch.int64)
        steps = torch.tensor([sim.step_no[r] for r in batch], dtype=torch.int64)
        max_len = min(idx.max_context_len, sim.pool.capacity)
        if predictor == "hybrid":   # merged with the layer's V/D prediction by rank
            lst = slots.long()
            layer_state = ref.SpinState(state.V[lst, l], state.D[lst, l], state.last_seen[lst, l],
                                        state.decode_steps[lst, l])
            nc = n.long().clamp(max=max_len)
            history, _ = ref.predict_blocks(layer_state, nc, nc - 1, cfg, int(nc.max()))
            wide = torch.full((B, R, idx.m_cap), float("-inf"))
            wide[:, :, :history.shape[2]] = history.float()
            scores = ref.hybrid_scores(scores.view(B, R, -1), wide, ref.block_count(nc, 64))
        ids, cnt = ops.select(state, slots, n, n - 1, req, steps, cfg, idx.m_cap, max_len,
                              block_scores=scores.view(B, R, -1).contiguous(), layer=l)
        spin_ids, spin_cnt = ops.select(state, slots, n, n - 1, req, steps, cfg, idx.m_cap,
                                        max_len)
        seen["want"] = (ids[:, l].clone(), cnt[:, l].clone(), spin_ids[:, l], spin_cnt[:, l])

    orig_layer = idx.layer

    def checked_layer(l, q, w, kv):
        top = orig_layer(l, q, w, kv)
        B = idx.batch
        ids, cnt, spin_ids, spin_cnt = seen.pop("want")
        assert torch.equal(idx.counts[:B, l], cnt)
        assert torch.equal(idx.block_ids[:B, l], ids)
        visible = torch.tensor([math.ceil(int(x) / 64) for x in idx.context_lens[:B, -1]])
        seen["sparse"] += int((cnt.long() < visible).sum())
        seen["differs"] += int(not torch.equal(ids, spin_ids))
        seen["layers"] += 1
        return top

    idx.layer = checked_layer
    for t in range(6):
        sim.step([1, 2, 3] if t != 3 else [3, 1], accepted=lambda r: (r + t) % R,
                 on_layer=on_layer)
    assert seen["layers"] == 6 * L
    assert seen["sparse"] > 0                      # past warm-up the layers really select
    assert seen["differs"] > 0                     # and not as SPIN's history would


@pytest.mark.parametrize("R,predictor", [(1, "probe"), (2, "gauss"), (1, "hybrid"),
                                         (2, "spin")])
def test_only_history_predictors_move_the_emas(R, predictor):
    """The probe and gauss read no V/D history, so their steps leave V and D as admitted
    (zero) and with MTP keep no layer's logits for finish(); every predictor counts the steps
    and marks the scored blocks' last step."""
    sim = Sim(R, {1: 400, 2: 260}, seed=5, predictor=predictor)
    history = predictor in ("spin", "hybrid")
    layers = 0 if sim.idx.logits is None else sim.idx.logits.shape[0]
    assert layers == (L if history and R > 1 else 1 if sim.idx.backend.needs_out else 0)
    for t in range(4):
        sim.step([1, 2], accepted=lambda r: (r + t) % R)
    st = sim.pool.state
    slots = sim.pool.slots([1, 2]).long()
    moved = bool(st.V[slots].abs().sum() > 0) or bool(st.D[slots].abs().sum() > 0)
    assert moved == history
    assert (st.decode_steps[slots] == 4).all()
    last = st.last_seen[slots]
    assert (last == 3).any(dim=-1).all() and (last <= 3).all()


def test_a_history_predictor_needs_a_pool_with_history():
    """The engines give the probe and gauss pools without V/D (StatePool(history=False));
    spin and the hybrid rank by it, and refuse such a pool."""
    pool = StatePool(L, max_requests=2, cfg=spin_cfg(), initial_capacity=64, history=False)
    for predictor in ("probe", "gauss"):
        SpinIndexer(spin_cfg(), pool, max_batch=2, next_n=2, max_context_len=64,
                    options=IndexerOptions(predictor=predictor))
    for predictor in ("spin", "hybrid"):
        with pytest.raises(SpinError, match="ranks by the V/D history"):
            SpinIndexer(spin_cfg(), pool, max_batch=2, next_n=1, max_context_len=64,
                        options=IndexerOptions(predictor=predictor))


def test_keep_all_selects_every_block_and_still_summarizes():
    sim = Sim(1, {4: 130, 9: 250})
    sim.step([4, 9])                               # warm-up
    sim.step([4, 9])
    idx = sim.idx
    assert (idx.counts[:2] < torch.tensor([[3], [4]])).any()    # sparse by now
    sim.step([4, 9], keep_all=True)                # slots 130 and 250
    assert idx.counts[:2].tolist() == [[3, 3], [4, 4]]
    assert idx.block_ids[0, 0, :3].tolist() == [0, 1, 2]
    assert idx.block_ids[1, 1, :4].tolist() == [0, 1, 2, 3]
    sim.check()


def test_bad_predictor_and_page_size():
    cfg = spin_cfg()
    pool = StatePool(L, max_requests=2, cfg=cfg)
    with pytest.raises(SpinError, match="predictor must be one of spin, probe"):
        SpinIndexer(cfg, pool, 1, 1, 256, IndexerOptions(predictor="quest"))
    with pytest.raises(SpinError, match="ranks at most 524288 slots"):
        SpinIndexer(cfg, pool, 1, 1, 524289, IndexerOptions(predictor="hybrid"))
    idx = SpinIndexer(cfg, pool, 1, 1, 256, IndexerOptions(predictor="probe"))
    kv = torch.zeros(4, 64, 1, SLOT_BYTES, dtype=torch.uint8)
    idx.summarize_context(0, kv, torch.arange(4, dtype=torch.int32), [100])
    with pytest.raises(SpinError, match="K cache changed"):
        idx.summarize_context(0, torch.zeros_like(kv), torch.arange(4, dtype=torch.int32), [1])
    with pytest.raises(SpinError, match="outside"):
        idx.summary_table(L, kv)
    with pytest.raises(SpinError, match="predictor must be one of"):
        Engine(tiny(), cfg, predictor="Probe")
    with pytest.raises(SpinError, match="needs a SpinConfig"):
        Engine(tiny(), None, predictor="probe")


# ---- dsa-lite -------------------------------------------------------------------------------
def engine_check(e):
    """The engine's summary tables equal from-scratch summaries of the batch's visible pages
    (the last step's lengths: its draft rows' slots are in the cache too)."""
    idx = e.spin_indexer
    B = idx.batch
    for ci, kv in enumerate(e.caches.index):
        check_table(idx.summaries[ci], kv, list(idx.block_table[:B]),
                    idx.context_lens[:B, -1].tolist())


def selections(cfg, w, predictor, **kw):
    e = Engine(cfg, spin_cfg(exploration=0.0), weights=w, predictor=predictor, **kw)
    e.submit(Request(TEXT[:900], max_new_tokens=10, request_id=1))
    e.submit(Request(TEXT[40:700], max_new_tokens=7, request_id=2))
    picks, tokens = [], {}
    while not e.idle:
        before = len(e.history)
        finished = e.step()
        for o in finished:
            tokens[o.request_id] = o.tokens
        if len(e.history) > before and e.history[-1].spin:
            B = e.spin_indexer.batch
            picks.append(e.spin_indexer.block_ids[:B].clone())
            if predictor != "spin" and not finished:      # finished: pages given back
                engine_check(e)
    return e, picks, tokens


@pytest.mark.slow
@pytest.mark.parametrize("predictor", ["probe", "gauss"])
def test_engine_probe_decodes_and_selects_differently(predictor):
    cfg = tiny().with_overrides(compress_ratios=(0, 1, 128, 1))
    w = init_weights(cfg)
    spin, spin_picks, spin_tokens = selections(cfg, w, "spin")
    probe, probe_picks, probe_tokens = selections(cfg, w, predictor)
    assert probe.spin_indexer.predictor.name == predictor
    assert spin.spin_indexer.predictor.name == "spin"
    assert sorted(probe_tokens) == [1, 2]
    assert len(probe_tokens[1]) == 10 and len(probe_tokens[2]) == 7
    assert any(s.selected_blocks < s.visible_blocks for s in probe.history)
    assert len(probe_picks) == len(spin_picks) > 1
    assert any(not torch.equal(a, b) for a, b in zip(spin_picks, probe_picks))
    assert spin.spin_indexer.summaries == {}      # spin keeps no summaries


@pytest.mark.slow
def test_engine_probe_summaries_with_mtp_and_compressed_slots():
    # C4A (4 tokens per slot: the last row writes a partial group no row sees yet), MTP rows
    cfg = tiny().with_overrides(mtp_depth=2)
    w = init_weights(cfg)
    e = Engine(cfg, spin_cfg(), weights=w, predictor="probe")
    e.submit(Request(TEXT[:1010], max_new_tokens=40, request_id=0,
                     turns=[TEXT[5:60]]))             # a second turn: prefill again
    checked = turns = 0
    while not e.idle:
        before = len(e.history)
        turn = e.running[0].turn if e.running else 0
        finished = e.step()
        if finished or len(e.history) == before:
            continue
        live = e.running[0]
        if live.turn == turn:
            engine_check(e)
            checked += 1
        else:                  # the new turn's prefill rebuilt every page of its context
            n = len(live.context) // cfg.index_ratio
            for ci, kv in enumerate(e.caches.index):
                check_table(e.spin_indexer.summaries[ci], kv,
                            [e.caches.block_table[live.slot]], [n])
            turns += 1
    assert checked > 10 and turns == 1


def test_engine_rebuilds_summaries_after_all_keep_steps():
    # DSA (1 token per slot), prompt of 126: step 0 writes slot 126 (SPIN), the all-keep steps
    # 1-3 write 127 (completing page 1), 128 and 129; step 4 (SPIN) writes 130 only, so page 1
    # is right only if the engine rebuilt the summaries when SPIN took over again
    cfg = tiny().with_overrides(compress_ratios=(0, 1, 128, 1))
    e = Engine(cfg, spin_cfg(), weights=init_weights(cfg), switch="auto", predictor="probe",
               cost_model=Scheduled([True, False, False, False, True, True]))
    e.submit(Request(list(TEXT[:126]), max_new_tokens=8, request_id=0))
    for _ in range(7):                                # prefill, then decode steps 0-5
        e.step()
    assert [s.spin for s in e.history] == [True, False, False, False, True, True]
    engine_check(e)
    assert int(e.spin_indexer.context_lens[0, 0]) == 132


@pytest.mark.slow
def test_engine_hybrid_decodes_and_selects_unlike_either_part():
    cfg = tiny().with_overrides(compress_ratios=(0, 1, 128, 1))
    w = init_weights(cfg)
    _, spin_picks, _ = selections(cfg, w, "spin")
    _, probe_picks, _ = selections(cfg, w, "probe")
    hybrid, hybrid_picks, hybrid_tokens = selections(cfg, w, "hybrid")
    assert hybrid.spin_indexer.predictor.name == "hybrid"
    assert len(hybrid_tokens[1]) == 10 and len(hybrid_tokens[2]) == 7
    assert len(hybrid_picks) == len(spin_picks) == len(probe_picks) > 1
    assert any(not torch.equal(a, b) for a, b in zip(hybrid_picks, spin_picks))
    assert any(not torch.equal(a, b) for a, b in zip(hybrid_picks, probe_picks))


@pytest.mark.gpu
def test_gauss_runs_its_kernels_on_cuda_in_captured_steps():
    """gauss on CUDA: its kernels inside CUDA-graph replays, summaries equal to from-scratch
    ones at every step (engine_check)."""
    cfg = tiny().with_overrides(compress_ratios=(0, 1, 128, 1))
    e, picks, tokens = selections(cfg, init_weights(cfg), "gauss", device="cuda", switch="spin")
    assert e.spin_indexer.predictor.name == "gauss" and e.options.cuda_graphs
    assert sum(s.graph for s in e.history) > 0 and len(picks) > 1
    assert len(tokens[1]) == 10 and len(tokens[2]) == 7
