"""The TensorRT-LLM adapter's metadata mapping, run against dsa-lite through the same interface:
it must give exactly what dsa-lite's own SpinIndexer wiring gives."""

import pytest
import torch

from spin_trtllm import SpinConfig, SpinError
from spin_trtllm import reference as ref
from spin_trtllm.harness import Engine, Request, init_weights, tiny
from spin_trtllm.integrations.trtllm.adapter import DecodeBatch, SpinDecodeAdapter
from spin_trtllm.testing.pages import make_cache

TEXT = ("for i in range(10):\n    total += values[i] * weights[i]\n" * 60).encode()


class TrtllmStyleIndexer:
    """Drives the adapter the way the TensorRT-LLM patch does: kv lens in tokens, request ids,
    block offsets, and the previous step's acceptance handed over at the next step's start."""

    def __init__(self, adapter, ratio, next_n, derive_accepted):
        self.adapter, self.ratio, self.next_n = adapter, ratio, next_n
        self.derive = derive_accepted
        self.accepted = {}
        self.calls = []

    def prepare(self, request_ids, context_lens, query_pos, steps, block_table):
        # what TensorRT-LLM knows: kv lens in tokens (set by the engine hook below), not the
        # slot lengths and query positions dsa-lite computed
        self.adapter.begin_step(DecodeBatch(list(request_ids), self.kv_lens, block_table,
                                            None if self.derive else self.accepted))
        self.accepted = {}
        self.calls.append(list(request_ids))

    def select(self):
        pass

    def layer(self, layer, q, weights, kv_cache):
        return self.adapter.layer(layer, q, weights, kv_cache)

    def finish(self, accepted=None):
        if accepted is not None:
            self.accepted = dict(zip(self.calls[-1], accepted.tolist()))


def run(cfg, spin, w, requests, via_adapter, derive_accepted=False, drafter=None):
    e = Engine(cfg, None if via_adapter else spin, weights=w, max_batch=3, drafter=drafter)
    if via_adapter:
        adapter = SpinDecodeAdapter(spin, len(cfg.csa_layers), 3, cfg.next_n, cfg.max_context,
                                    compress_ratio=4, device="cpu", initial_capacity=64)
        shim = TrtllmStyleIndexer(adapter, 4, cfg.next_n, derive_accepted)
        e.indexer = shim
        decode = e._decode

        def decode_with_kv_lens(batch, finished):
            # kv lens = tokens in the cache after this step's rows are written
            shim.kv_lens = torch.tensor([len(live.context) + cfg.next_n for live in batch])
            return decode(batch, finished)

        e._decode = decode_with_kv_lens
    outs = {}
    t = 0
    pending = list(requests)
    run.engine = e
    while pending or not e.idle:
        for when, req in list(pending):
            if when == t:
                e.submit(req)
                pending.remove((when, req))
        outs.update({o.request_id: o.tokens for o in e.step()})
        t += 1
    return outs


@pytest.mark.parametrize("mtp,derive", [(0, False), (2, False), (2, True)])
@pytest.mark.slow
def test_adapter_matches_spin_indexer_on_dsa_lite(mtp, derive):
    cfg = tiny().with_overrides(mtp_depth=mtp)
    w = init_weights(cfg)
    spin = SpinConfig(index_topk=cfg.index_topk, target_sparsity=0.5, exploration=0.2)
    reqs = lambda: [(0, Request(TEXT[:1500], max_new_tokens=20, request_id=10)),
                    (0, Request(TEXT[5:700], max_new_tokens=8, temperature=0.9, request_id=11)),
                    (4, Request(TEXT[9:1100], max_new_tokens=14, request_id=12)),
                    (6, Request(TEXT[2:300], max_new_tokens=6, request_id=13))]
    drafter = None
    if mtp:
        # drafts from a first run's tokens, every other one spoiled: some accepted, some not
        first = run(cfg, spin, w, reqs(), via_adapter=False)
        prompt_len = {r.request_id: len(r.prompt) for _, r in reqs()}

        def drafter(rid, context, depth):
            done = len(context) - prompt_len[rid]
            toks = first[rid] + [0] * (done + depth)
            return [toks[done + i] if i % 2 == 0 else (toks[done + i] + 1) % 256
                    for i in range(depth)]
    direct = run(cfg, spin, w, reqs(), via_adapter=False, drafter=drafter)
    accepted = sum(s.accepted for s in run.engine.history)
    adapted = run(cfg, spin, w, reqs(), via_adapter=True, derive_accepted=derive,
                  drafter=drafter)
    assert direct == adapted and len(direct) == 4
    assert (accepted > 0) == (mtp > 0)


def test_adapter_state_follows_the_batch():
    spin = SpinConfig(index_topk=64, target_sparsity=0.5)
    a = SpinDecodeAdapter(spin, num_layers=2, max_batch=2, next_n=2, max_tokens=4096,
                          compress_ratio=4, device="cpu")
    table = torch.arange(8, dtype=torch.int32).view(1, 8).repeat(2, 1)
    a.begin_step(DecodeBatch([5, 6], torch.tensor([800, 900]), table))
    assert sorted(a.pool.request_ids()) == [5, 6]
    # rows see (kv_len - next_n + j + 1) // 4 slots; query at (tokens - 1) // 4
    assert a.indexer.context_lens[:2].tolist() == [[199, 200], [224, 225]]
    assert a.indexer.query_pos[:2].tolist() == [[199, 199], [224, 224]]
    slot6 = a.pool.slot_of(6)
    a.begin_step(DecodeBatch([6, 7], torch.tensor([903, 40]), table, accepted={5: 1, 6: 1}))
    assert sorted(a.pool.request_ids()) == [6, 7] and a.pool.slot_of(6) == slot6
    assert a.indexer.step[:2].tolist() == [1, 0]           # 7 is new: warm-up again
    with pytest.raises(SpinError, match="2 request ids but 3 kv lens"):
        a.begin_step(DecodeBatch([6, 7], torch.tensor([1, 2, 3]), table))
    with pytest.raises(SpinError, match="kv lens must be >= next_n"):
        a.begin_step(DecodeBatch([6, 7], torch.tensor([1, 50]), table))
    out = torch.empty(3, 64, dtype=torch.int32)
    with pytest.raises(SpinError, match="out must be"):
        a.layer(0, torch.zeros(4, 64, 128).to(torch.float8_e4m3fn), torch.zeros(4, 64),
                torch.zeros(8, 64, 1, 132, dtype=torch.uint8), out)


def test_padding_rows_of_a_cuda_graph_batch():
    """TensorRT-LLM pads graph batches with a dummy id (2^64 - 1), repeated: those rows run on
    free state slots with empty contexts, give -1 rows, and leave the real requests alone."""
    spin = SpinConfig(index_topk=64, target_sparsity=0.5, exploration=0.0)
    kw = dict(num_layers=1, max_batch=4, next_n=2, max_tokens=4096, compress_ratio=4,
              device="cpu", initial_capacity=64)
    g = torch.Generator().manual_seed(1)
    rows = (torch.randn(16, 64 * 128, generator=g)).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = (torch.rand(16, 64, generator=g) * 0.01 + 0.001).view(torch.uint8)
    cache = torch.cat([rows, scales], 1).view(-1, 64, 1, 132)
    table = torch.arange(16, dtype=torch.int32).view(2, 8)
    dummy = (1 << 64) - 1
    padded, plain = SpinDecodeAdapter(spin, **kw), SpinDecodeAdapter(spin, **kw)
    for step in range(3):
        kv = torch.tensor([700 + 2 * step, 900 + 2 * step])
        q = torch.randn(8, 64, 128, generator=g).to(torch.float8_e4m3fn)
        w = torch.randn(8, 64, generator=g)
        padded.begin_step(DecodeBatch([3, 8, dummy, dummy], torch.cat([kv, torch.tensor([1, 1])]),
                                      torch.cat([table, table]), accepted={3: 1, 8: 0}))
        plain.begin_step(DecodeBatch([3, 8], kv, table, accepted={3: 1, 8: 0}))
        top = padded.layer(0, q, w, cache)
        assert torch.equal(top[:4], plain.layer(0, q[:4].contiguous(), w[:4].contiguous(), cache))
        assert (top[4:] == -1).all()
        assert sorted(padded.pool.request_ids()) == [3, 8]


def _blocks_seen(a, rid, layer=0):
    """How many blocks the adapter selected for request `rid` in the step just begun."""
    ix = a.indexer
    row = ix.request[:ix.batch].tolist().index(rid)
    return int(ix.counts[row, layer])


def _run_layer(a, gen=torch.Generator().manual_seed(0)):
    """One indexer layer over random keys, so the EMA state learns (and warm-up ends)."""
    B, R = a.indexer.batch, a.indexer.next_n
    kv = torch.randint(0, 120, (64, 64, 1, 132), generator=gen, dtype=torch.uint8)
    kv.view(64, -1)[:, 64 * 128:] = torch.full((64, 64), 0.01).view(torch.uint8)
    q = torch.randn(B * R, 64, 128, generator=gen).to(torch.float8_e4m3fn)
    a.layer(0, q, torch.randn(B * R, 64, generator=gen), kv)


def test_state_survives_steps_a_request_sits_out_and_restarts_with_its_context():
    """Pipeline micro-batches (or partial scheduling) alternate requests: each keeps its state
    and leaves warm-up; a request (re)starting its context, or whose cache shrank (recomputed
    after preemption), starts over; a full pool gives the least recently seen slot away."""
    spin = SpinConfig(index_topk=64, target_sparsity=0.5, exploration=0.0)
    a = SpinDecodeAdapter(spin, num_layers=1, max_batch=2, next_n=1, max_tokens=8192,
                          compress_ratio=1, device="cpu", max_requests=4, initial_capacity=64)
    table = torch.arange(64, dtype=torch.int32).view(1, 64).repeat(2, 1)
    kv = {3: 2000, 4: 2100, 5: 2200, 6: 2300}
    for t in range(4):
        pair = [3, 4] if t % 2 == 0 else [5, 6]
        a.begin_step(DecodeBatch(pair, torch.tensor([kv[r] + t for r in pair]), table))
        _run_layer(a)
    assert sorted(a.pool.request_ids()) == [3, 4, 5, 6]
    assert a._steps[5] == 2 and _blocks_seen(a, 5) < -(-2203 // 64)   # warm-up over: pruned
    a.begin_step(DecodeBatch([3, 4], torch.tensor([2005, 2105]), table, prefill_ids=[5]))
    assert a.pool.slot_of(5) is None and a._steps[3] == 3      # 5 re-prefills: state dropped
    a.begin_step(DecodeBatch([3, 6], torch.tensor([1000, 2306]), table))
    assert a._steps[3] == 1 and _blocks_seen(a, 3) == -(-1000 // 64)   # shrank: warm-up again
    a.begin_step(DecodeBatch([7, 8], torch.tensor([500, 600]), table))  # pool full: evict 4
    assert a.pool.slot_of(4) is None and a.pool.slot_of(3) is not None
    assert sorted(a.pool.request_ids()) == [3, 6, 7, 8]


def test_dense_step_selects_every_block():
    spin = SpinConfig(index_topk=64, target_sparsity=0.5, exploration=0.0)
    a = SpinDecodeAdapter(spin, num_layers=1, max_batch=1, next_n=1, max_tokens=8192,
                          compress_ratio=1, device="cpu", initial_capacity=64)
    table = torch.arange(64, dtype=torch.int32).view(1, 64)
    for t in range(3):
        a.begin_step(DecodeBatch([1], torch.tensor([3000 + t]), table))
        _run_layer(a)
    assert _blocks_seen(a, 1) < 47
    a.begin_step(DecodeBatch([1], torch.tensor([3003]), table), dense=True)
    assert _blocks_seen(a, 1) == 47


@pytest.mark.parametrize("predictor", ["probe", "gauss"])
def test_a_dense_step_selects_every_block_without_history(predictor):
    """The probe's and gauss's state holds no V/D: a dense step selects every block of every
    layer from flat scores, MTP rows included."""
    spin = SpinConfig(index_topk=64, target_sparsity=0.5, exploration=0.0)
    a = SpinDecodeAdapter(spin, num_layers=2, max_batch=1, next_n=2, max_tokens=8192,
                          device="cpu", initial_capacity=64, predictor=predictor)
    assert not a.pool.history
    kv = make_cache(64, torch.Generator().manual_seed(1))
    table = torch.arange(64, dtype=torch.int32).view(1, 64)
    a.begin_step(DecodeBatch([1], torch.tensor([3001]), table, kv_caches=[kv, kv]), dense=True)
    assert _blocks_seen(a, 1, 0) == _blocks_seen(a, 1, 1) == 47      # 3,001 slots


def test_probe_summarizes_the_newest_pages_at_the_lengths_corrected_on_the_device():
    """MTP under TensorRT-LLM's overlap scheduler: the host prepares the step as if every draft
    was accepted, the step corrects its lengths on the device (select_on_device). The layer's
    newest pages are summarized at the corrected lengths: slots past them hold rejected drafts'
    keys."""
    spin = SpinConfig(index_topk=64, target_sparsity=0.5, exploration=0.0)
    a = SpinDecodeAdapter(spin, num_layers=1, max_batch=1, next_n=3, max_tokens=2048,
                          device="cpu", predictor="probe")
    gen = torch.Generator().manual_seed(4)
    cache = make_cache(16, gen)
    table = torch.tensor([[5, 9, 2, 7]], dtype=torch.int32)
    # the host's upper bound: rows see 129..131 tokens; the device: two drafts were rejected
    a.begin_step(DecodeBatch([4], torch.tensor([131]), table, kv_caches=[cache]),
                 select=False)
    a.select_on_device(torch.tensor([129]))
    cache[9] = make_cache(1, gen)[0]         # the step writes slots 126, 127 (and page 2's 128)
    q = torch.randn(3, 64, 128, generator=gen).to(torch.float8_e4m3fn)
    a.layer(0, q, torch.randn(3, 64, generator=gen), cache)
    rows, _ = ref.summarize_pages(cache, torch.tensor([9, 2]), torch.tensor([64, 1]))
    summaries = a.indexer.summaries[0]
    assert torch.equal(summaries[9, :128], rows[0])        # slots 126, 127 of the step's rows
    assert torch.equal(summaries[2, :128], rows[1])        # slot 128 only, not 129 and 130
    stale, _ = ref.summarize_pages(cache, torch.tensor([2]), torch.tensor([3]))
    assert not torch.equal(rows[1], stale[0])


def test_probe_summaries_follow_the_written_pages():
    """predictor probe: the first step summarizes the prompt's pages; a step's layer
    summarizes its newest page; once a SPIN layer ran dense (layers_skipped), prepare()
    summarizes the pages written since the request's last step itself."""
    spin = SpinConfig(index_topk=64, target_sparsity=0.5, exploration=0.0)
    a = SpinDecodeAdapter(spin, num_layers=1, max_batch=1, next_n=1, max_tokens=2048,
                          device="cpu", predictor="probe")
    gen = torch.Generator().manual_seed(3)
    cache = make_cache(16, gen)
    table = torch.tensor([[5, 9, 2, 7, 11]], dtype=torch.int32)

    def want(page, fill):
        rows, scale = ref.summarize_pages(cache, torch.tensor([page]), torch.tensor([fill]))
        return torch.cat([rows[0], scale.view(torch.uint8)])

    def row(page):
        return a.indexer.summaries[0][page, :132]

    def step(kv):
        a.begin_step(DecodeBatch([4], torch.tensor([kv]), table, kv_caches=[cache]))

    def rewrite(page):            # new keys land in the page (the engine writes the cache)
        cache[page] = make_cache(1, gen)[0]

    step(130)                     # 129 prompt slots: pages 5 and 9 full, page 2 holds one
    assert torch.equal(row(5), want(5, 64)) and torch.equal(row(9), want(9, 64))
    assert torch.equal(row(2), want(2, 1)) and int(row(7).count_nonzero()) == 0
    q = torch.randn(1, 64, 128, generator=gen).to(torch.float8_e4m3fn)
    a.layer(0, q, torch.randn(1, 64, generator=gen), cache)
    assert torch.equal(row(2), want(2, 2))        # the layer: its newest slot's page
    rewrite(2)
    step(131)                     # the layer ran last step: nothing left for prepare()
    assert not torch.equal(row(2), want(2, 2))
    a.layers_skipped()            # a SPIN layer ran dense in this step: its page is stale
    rewrite(2)
    step(132)
    assert torch.equal(row(2), want(2, 3)) and not a.trust_layers
    with pytest.raises(SpinError, match="needs DecodeBatch.kv_caches, one K cache per SPIN"):
        a.begin_step(DecodeBatch([4], torch.tensor([133]), table))
