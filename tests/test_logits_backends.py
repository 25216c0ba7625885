"""The logits backend seam: native, reference and deepgemm (a dense paged kernel on SPIN's
compacted block table) give SPIN the same selections and the same top-K sets.

On the CPU the deepgemm backend runs the TensorRT-LLM stand-in's CPU DeepGEMM
(tests/trtllm_standin/tensorrt_llm/deep_gemm: DeepGEMM's signatures, NaN past each row's
length, as DeepGEMM leaves those columns unspecified); on a GPU with deep_gemm importable the
same comparison runs against the real kernel.
"""

import pytest
import torch

from spin_trtllm import SpinConfig, SpinError, logits, ops
from spin_trtllm import reference as ref
from spin_trtllm.indexer import DenseIndexer, SpinIndexer
from spin_trtllm.logits import DeepGemmLogits
from spin_trtllm.options import LOGITS_BACKENDS, IndexerOptions
from spin_trtllm.state import StatePool
from spin_trtllm.testing.pages import pack_pages, random_fp8_keys
from standin_modules import standin_deep_gemm

L, PAGES = 2, 12                   # indexer layers; 64-slot pages per request


class Sm90Like:
    """DeepGEMM's SM90 kernel writes finite scores past a row's length (it scores every row
    up to the request's longest); the stand-in writes NaN there. This makes them large finite
    values, so a consumer that reads past the lengths picks them."""

    def __init__(self, dg):
        self.dg = dg
        self.get_num_sms = dg.get_num_sms
        self.get_paged_mqa_logits_metadata = dg.get_paged_mqa_logits_metadata

    def fp8_paged_mqa_logits(self, *args, **kwargs):
        return torch.nan_to_num(self.dg.fp8_paged_mqa_logits(*args, **kwargs), nan=1e4)


def caches(B, device, seed):
    """Per layer: 64-slot FP8 pages of B requests (shuffled table) and the same keys as
    32-slot pages (page p -> pages 2p, 2p + 1)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(L):
        rows, scales = random_fp8_keys(B * PAGES, g)
        halves = [pack_pages(rows[:, h * 32:(h + 1) * 32], scales[:, h * 32:(h + 1) * 32])
                  for h in range(2)]
        pages32 = torch.stack(halves, 1).reshape(B * PAGES * 2, 32, 1, 132)
        out.append((pack_pages(rows, scales).to(device), pages32.to(device)))
    table64 = torch.randperm(B * PAGES, generator=g).view(B, PAGES).to(torch.int32)
    table32 = torch.stack([2 * table64, 2 * table64 + 1], -1).view(B, 2 * PAGES)
    return out, table64.to(device), table32.to(device)


def drive(backend, page_slots, R, steps=4, B=3, device="cpu", seed=0, sparsity=0.5):
    """Decode steps of B requests; returns per step and layer (block ids, counts, top-K)."""
    cfg = SpinConfig(index_topk=40, target_sparsity=sparsity, exploration=0.1, warmup_steps=1)
    pool = StatePool(L, B, cfg, device, initial_capacity=PAGES * 64 + 8)
    named = isinstance(backend, str)
    opts = IndexerOptions(page_slots=page_slots, **({"logits_backend": backend} if named else {}))
    ix = SpinIndexer(cfg, pool, B, R, PAGES * 64, opts, logits_backend=None if named else backend)
    kv, table64, table32 = caches(B, device, seed)
    table = table32 if page_slots == 32 else table64
    for r in range(B):
        pool.admit(r)
    g = torch.Generator().manual_seed(seed + 1)
    length = torch.tensor([500, 611, 703][:B])
    out = []
    for t in range(steps):
        n = (length.view(-1, 1) + t * R + torch.arange(R)).to(torch.int32)
        ix.prepare(list(range(B)), n, n - 1, [t] * B, table)
        ix.select()
        for layer in range(L):
            q = torch.randn(B * R, 64, 128, generator=g).to(torch.float8_e4m3fn).to(device)
            w = (torch.randn(B * R, 64, generator=g) * 0.1).to(device)
            pages = kv[layer][1 if page_slots == 32 else 0]
            top = ix.layer(layer, q, w, pages)
            out.append((ix.block_ids[:B, layer].cpu().clone(), ix.counts[:B, layer].cpu().clone(),
                        top.cpu().sort(-1).values))
        ix.finish(torch.tensor([t % R] * B, dtype=torch.int32, device=device) if R > 1 else None)
    return out


def assert_same(a, b):
    pruned = 0
    for (ids_a, cnt_a, top_a), (ids_b, cnt_b, top_b) in zip(a, b, strict=True):
        assert torch.equal(cnt_a, cnt_b) and torch.equal(ids_a, ids_b), "selections differ"
        assert torch.equal(top_a, top_b), "top-K sets differ"
        pruned += int((cnt_a < PAGES).sum())
    assert pruned > 0, "SPIN never pruned: the comparison would prove nothing"


@pytest.mark.parametrize("R", [1, 2, 3])
def test_deepgemm_on_compacted_tables_equals_native(R):
    """On a CPU "native" runs the reference logits (the kernel is held to them by
    test_ops_logits's GPU tests): this is DeepGEMM's calling convention against them."""
    dg = Sm90Like(standin_deep_gemm())
    native = drive("native", 64, R)
    assert_same(native, drive(DeepGemmLogits(dg, 64), 64, R))        # R 3: one request per row
    assert_same(native, drive(DeepGemmLogits(dg, 32), 32, R))        # a SPIN block = 2 pages


class RealSchedule(Sm90Like):
    """DeepGEMM's own schedule format (reference.paged_logits_schedule, which the GPU tests hold
    to DeepGEMM's function): its logits call requires exactly the schedule DeepGEMM would build
    for the lengths it gets, then scores with the stand-in (given the stand-in's own plan)."""

    def __init__(self, dg):
        super().__init__(dg)
        self.schedules = 0
        self.get_paged_mqa_logits_metadata = self.schedule

    def schedule(self, lens, block_kv, num_sms):
        self.schedules += 1
        return ref.paged_logits_schedule(lens, num_sms)

    def fp8_paged_mqa_logits(self, q, kv, w, lens, table, schedule, *rest):
        assert torch.equal(schedule, ref.paged_logits_schedule(lens, self.get_num_sms()))
        own = self.dg.get_paged_mqa_logits_metadata(lens, kv.shape[1], self.get_num_sms())
        return super().fp8_paged_mqa_logits(q, kv, w, lens, table, own, *rest)


@pytest.mark.parametrize("R", [1, 2, 3])
def test_deepgemm_inputs_of_every_layer_in_one_launch(R, monkeypatch):
    """With DeepGEMM's schedule format every layer's table, lengths and schedule come from one
    ops.compact a step (none from the module's schedule function once it is checked); the
    stand-in's own plan, or next_n 3 (one request per row), keep a compact and a schedule per
    layer. The top-K sets equal the native path's either way."""
    calls = []
    compact = ops.compact
    monkeypatch.setattr(ops, "compact", lambda *a, **k: calls.append(a[0].dim()) or
                        compact(*a, **k))
    native = drive("native", 64, R)
    steps = len(native) // L
    real = RealSchedule(standin_deep_gemm())
    assert_same(native, drive(DeepGemmLogits(real, 64), 64, R))
    per_step = R > 2
    assert calls == ([2] * L * steps if per_step else [3] * steps)
    checked = real.schedules
    calls.clear()
    assert_same(native, drive(DeepGemmLogits(real, 64), 64, R))     # checked already
    assert calls == ([2] * L * steps if per_step else [3] * steps)
    assert real.schedules - checked == (L * steps if per_step else 0)
    calls.clear()
    assert_same(native, drive(DeepGemmLogits(real, 32), 32, R))     # a SPIN block = 2 pages
    assert calls == ([2] * L * steps if per_step else [3] * steps)
    calls.clear()
    assert_same(native, drive(DeepGemmLogits(Sm90Like(standin_deep_gemm()), 64), 64, R))
    assert calls == [2] * L * steps


def test_a_step_without_select_compacts_each_layer_again():
    """The step's compacted tables belong to its select(): a prepare() without one (a caller
    that selects elsewhere) must not hand the previous step's tables to DeepGEMM."""
    real = RealSchedule(standin_deep_gemm())
    cfg = SpinConfig(index_topk=40, target_sparsity=0.5, exploration=0.1, warmup_steps=1)
    pool = StatePool(L, 2, cfg, "cpu", initial_capacity=PAGES * 64 + 8)
    ix = SpinIndexer(cfg, pool, 2, 1, PAGES * 64, IndexerOptions(),
                     logits_backend=DeepGemmLogits(real, 64))
    kv, table, _ = caches(2, "cpu", 5)
    for r in range(2):
        pool.admit(r)
    q = torch.randn(2, 64, 128).to(torch.float8_e4m3fn)
    w = torch.randn(2, 64) * 0.1
    n = torch.tensor([[500], [611]], dtype=torch.int32)
    ix.prepare([0, 1], n, n - 1, [0, 0], table)
    ix.select()
    ix.layer(0, q, w, kv[0][0])
    first_lens = ix.layer_logits(0, q, w, kv[0][0])[1].clone()
    ix.prepare([0, 1], n + 70, n + 69, [1, 1], table)    # no select(): the same blocks
    _, lens = ix.layer_logits(0, q, w, kv[0][0])
    want = ops.compact(ix.block_ids[:2, 0], ix.counts[:2, 0], n + 70, table, 64)[1]
    assert torch.equal(lens, want) and not torch.equal(lens, first_lens)


def test_dense_indexer_through_deepgemm_equals_native():
    dg = Sm90Like(standin_deep_gemm())
    kv, table, _ = caches(2, "cpu", 3)
    n = torch.tensor([[700, 701], [430, 431]], dtype=torch.int32)
    q = torch.randn(4, 64, 128).to(torch.float8_e4m3fn)
    w = torch.randn(4, 64) * 0.1
    tops = []
    for backend in ("native", DeepGemmLogits(dg, 64)):
        ix = DenseIndexer(40, L, 2, 2, PAGES * 64, logits_backend=backend)
        ix.prepare([0, 1], n, n - 1, [0, 0], table)
        tops.append(ix.layer(0, q, w, kv[0][0]).sort(-1).values)
    assert torch.equal(tops[0], tops[1])


def test_registry_resolves_and_refuses_with_reasons():
    assert tuple(logits.BACKENDS) == LOGITS_BACKENDS       # the CLI's torch-free choices
    assert logits.resolve("native", "cpu").name == "native"
    with pytest.raises(SpinError, match="deepgemm.*not usable on cpu.*CUDA"):
        logits.resolve("deepgemm", "cpu")
    with pytest.raises(SpinError, match="unknown logits backend 'bogus'"):
        logits.resolve("bogus", "cpu")
    with pytest.raises(SpinError, match="64-slot"):
        logits.resolve("native", "cpu", page_slots=32)
    cfg = SpinConfig(index_topk=8)
    pool = StatePool(1, 1, cfg, "cpu", initial_capacity=200)
    with pytest.raises(SpinError, match="was made for 64-slot pages, the K cache has 32-slot pages"):
        SpinIndexer(cfg, pool, 1, 1, 128, IndexerOptions(page_slots=32),
                    logits_backend=DeepGemmLogits(standin_deep_gemm(), 64))
    with pytest.raises(SpinError, match="page_slots must be one of"):
        SpinIndexer(cfg, pool, 1, 1, 128, IndexerOptions(page_slots=16))


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 2, 3])
def test_gpu_deepgemm_equals_native(R):
    ok, why = logits.available("deepgemm", "cuda")
    if not ok:
        pytest.skip(f"deepgemm backend: {why}")
    native = drive("native", 64, R, device="cuda", steps=6)
    assert_same(native, drive("deepgemm", 64, R, device="cuda", steps=6))


@pytest.mark.gpu
@pytest.mark.parametrize("mtp", [0, 2])
def test_gpu_dsa_lite_through_deepgemm_equals_native(mtp):
    """dsa-lite end to end (in-flight batching, CUDA graphs, MTP): the same tokens and the same
    selected blocks at every step with DeepGEMM on compacted tables as with the native kernel."""
    ok, why = logits.available("deepgemm", "cuda")
    if not ok:
        pytest.skip(f"deepgemm backend: {why}")
    from spin_trtllm.testing.harness import arrivals, schedule_run

    from spin_trtllm.harness import Engine, init_weights, tiny
    cfg = tiny().with_overrides(mtp_depth=mtp, dtype="float32")
    w = init_weights(cfg)
    sc = SpinConfig(index_topk=cfg.index_topk, target_sparsity=0.5, exploration=0.1)
    runs = []
    for backend in ("native", "deepgemm"):
        engine = Engine(cfg, sc, weights=w, device="cuda", max_batch=3, cuda_graphs=True,
                        logits_backend=backend, switch="spin")
        outs = schedule_run(engine, arrivals())
        runs.append(({k: v.tokens for k, v in outs.items()},
                     [s.selected_blocks for s in engine.history]))
    assert runs[0] == runs[1]
    assert sum(runs[0][1]) < sum(s.visible_blocks for s in engine.history)   # SPIN pruned


@pytest.mark.parametrize("major,page_slots,ok", [(9, 32, False), (9, 64, True), (10, 32, True)])
def test_deepgemm_page_sizes_follow_the_gpu(monkeypatch, major, page_slots, ok):
    """DeepGEMM's SM90 paged-logits kernel takes 64-slot pages only: resolve() says so before
    any engine is built, instead of DeepGEMM's assertion at the first step."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    monkeypatch.setitem(logits.BACKENDS, "deepgemm",
                        (lambda device: (True, ""), logits.DeepGemmLogits))
    monkeypatch.setattr(logits.DeepGemmLogits, "__init__",
                        lambda self, module=None, page_slots=64: None)
    if ok:
        assert isinstance(logits.resolve("deepgemm", "cuda", page_slots), logits.DeepGemmLogits)
    else:
        with pytest.raises(SpinError, match="SM90 paged-logits kernel reads 64-slot pages only"):
            logits.resolve("deepgemm", "cuda", page_slots)
