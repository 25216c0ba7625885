"""SPIN through TensorRT-LLM's engine loop, as the stand-in mirrors it: the decoder runner
(prepare() on the host; _forward_step with _preprocess_inputs, which calls
on_update_kv_lens() and applies the overlap scheduler's kv corrections inside the step;
CUDA-graph warm-up, capture and replay per batch key), the one-model MTP worker (acceptance
on the device, kv rewinds, update of the metadata) and requests joining and leaving.

Every decode row is checked against an independent dense reference (keys dequantized here
from the page format, logits in float64) restricted to exactly the blocks SPIN selected, at the
lengths the engine really attends to (after the corrections). On the CPU the stand-in's
DeepGEMM runs and a guard stands in for stream capture (any host read of kv_lens_cuda inside
the captured forward fails the test); on a GPU (tests/gpu/engine_loop.sh) the same loop runs
with real CUDA graphs and DeepGEMM, and graph replays must equal eager steps bit for bit.
"""
import contextlib
import importlib
import logging
import os
import random

import pytest
import torch

from spin_trtllm import predictors
from spin_trtllm.testing.pages import pack_pages
from spin_trtllm.testing import standin
from spin_trtllm.testing.standin import build, check_row, sparse_config

GPU = os.environ.get("TRTLLM_STANDIN_DEVICE", "cpu").startswith("cuda")
if GPU:
    pytestmark = pytest.mark.gpu

K = 128                     # index_topk: several blocks' worth, so SPIN prunes
PAGE = 64
CKPT = dict(standin.V32_CKPT, index_topk=K, num_hidden_layers=2)
V4_CKPT = dict(standin.V4_CKPT, index_topk=K)          # indexer layers 1 and 3 (ratio 4)


# ---- a host-read guard standing in for stream capture on the CPU ---------------------------
_VIEWS = {torch.Tensor.__getitem__, torch.Tensor.view, torch.Tensor.reshape,
          torch.Tensor.narrow, torch.Tensor.select, torch.Tensor.unsqueeze,
          torch.Tensor.expand, torch.Tensor.as_strided}
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
          torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__index__,
          torch.Tensor.__float__}


def _to_host(args, kwargs) -> bool:
    values = list(args[1:]) + list(kwargs.values())
    return any((isinstance(v, str) and v.startswith("cpu")) or
               (isinstance(v, torch.device) and v.type == "cpu") for v in values)


class DeviceOnly(torch.Tensor):
    """A device tensor's views; reading them on the host raises (as inside CUDA-graph
    capture). Results of arithmetic are plain tensors: only direct reads are refused."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS or (func is torch.Tensor.to and _to_host(args, kwargs)):
            raise AssertionError(f"host read of kv_lens_cuda inside CUDA-graph capture "
                                 f"({getattr(func, '__name__', func)})")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in _VIEWS and isinstance(out, torch.Tensor):
            return out.as_subclass(DeviceOnly)
        return out


@contextlib.contextmanager
def capture_guard(md):
    plain = md.kv_lens_cuda
    md.kv_lens_cuda = plain.as_subclass(DeviceOnly)
    saved = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        yield
    finally:
        torch.cuda.is_current_stream_capturing = saved
        md.kv_lens_cuda = plain


# ---- keys and the reference ----------------------------------------------------------------
def random_keys(shape: tuple[int, ...], gen: torch.Generator):
    """Random keys [*shape, 128] quantized as the indexer stores them: (fp8 rows, fp32 scales
    amax / 448)."""
    keys = torch.randn(*shape, 128, generator=gen)
    scale = keys.abs().amax(-1).clamp(min=1e-4) / 448.0
    return (keys / scale[..., None]).to(torch.float8_e4m3fn), scale


def fill_pages(pool: torch.Tensor, gen: torch.Generator) -> None:
    """Random FP8 keys and fp32 scales in every page of one layer's indexer K cache
    (uint8 [pages, slots, 1, 132]; each page holds its fp8 rows of 128 B, then its fp32
    scales)."""
    pages, slots = pool.shape[0], pool.shape[1]
    fp8, scale = random_keys((pages, slots), gen)
    pool.view(pages, -1).copy_(pack_pages(fp8, scale).view(pages, -1).to(pool.device))


def write_slot_keys(pool: torch.Tensor, pages: list[int], slots: list[int],
                    gen: torch.Generator) -> None:
    """New random FP8 keys (and scales) in slot slots[i] of page pages[i], as a step's forward
    writes its tokens' keys: a slot written again (after rejected drafts) changes."""
    if not pages:
        return
    per_page = pool.shape[1]
    fp8, scale = random_keys((len(pages),), gen)
    fp8 = fp8.view(torch.uint8)
    flat = pool.view(pool.shape[0], -1)
    for i, (page, slot) in enumerate(zip(pages, slots)):
        flat[page, slot * 128:(slot + 1) * 128] = fp8[i].to(pool.device)
        at = per_page * 128 + 4 * slot
        flat[page, at:at + 4] = scale[i:i + 1].view(torch.uint8).to(pool.device)


def dequantized_keys(pool: torch.Tensor) -> torch.Tensor:
    """float64 [pages, slots, 128] from the page bytes (the format contract, written here)."""
    pages, slots = pool.shape[0], pool.shape[1]
    raw = pool.reshape(pages, -1).cpu()
    fp8 = raw[:, :slots * 128].contiguous().view(torch.float8_e4m3fn).view(pages, slots, 128)
    scale = raw[:, slots * 128:slots * 132].contiguous().view(torch.float32).view(pages, slots)
    return fp8.double() * scale.double()[..., None]


def reference_logits(keys, pages, n, q, w):
    """Dense indexer scores of slots 0..n-1 of a request whose pages are `pages`."""
    slots = torch.arange(n)
    per_page = keys.shape[1]
    k = keys[torch.as_tensor(pages)[slots // per_page], slots % per_page]   # [n, 128]
    scores = torch.relu(torch.einsum("hd,nd->hn", q.double(), k))
    return (scores * w.double()[:, None]).sum(0)


# ---- the engine loop -----------------------------------------------------------------------
class Loop:
    MAX_TOKENS = 16384
    def __init__(self, trt, patch, next_n: int, graphs: bool, overlap: bool, seed: int,
                 v4: bool = False, tokens_per_block: int = PAGE, predictor: str = "spin"):
        llm_args = importlib.import_module("tensorrt_llm.llmapi.llm_args")
        runner_mod = importlib.import_module(
            "tensorrt_llm._torch.pyexecutor.engine.runners.decoder.runner")
        mtp = importlib.import_module("tensorrt_llm._torch.speculative.mtp")
        self.patch, self.R = patch, next_n
        self.device = torch.device(os.environ.get("TRTLLM_STANDIN_DEVICE", "cpu"))
        self.predictor = predictor
        # the probe's ranking is checked without exploration's random blocks
        spin = {"target_sparsity": 0.5, "exploration": 0.0 if predictor == "probe" else 0.1,
                "predictor": predictor}
        cfg = sparse_config(v4, spin=spin)
        self.batch, self.ratio = 4, 4 if v4 else 1
        ckpt = V4_CKPT if v4 else CKPT
        self.mc, self.model, self.manager, self.md = build(
            trt, ckpt, cfg, tokens_per_block, next_n, max_seq_len=2048 * self.ratio,
            batch=self.batch, max_num_tokens=self.MAX_TOKENS)
        self.layers = [l.self_attn.indexer for l in
                       self.model.model.layers[:ckpt["num_hidden_layers"]]
                       if l.self_attn.indexer is not None]
        gen = torch.Generator().manual_seed(seed)
        self.keys = {}
        for ix in self.layers:
            pool = self.manager.get_indexer_k_cache_buffers(ix.layer_idx)
            fill_pages(pool, gen)
            self.keys[ix.layer_idx] = dequantized_keys(pool)
        self.rng = random.Random(seed)
        self.qgen = torch.Generator().manual_seed(seed + 1)
        self.kgen = torch.Generator().manual_seed(seed + 2)     # the keys each step writes
        rows = self.batch * next_n
        self.q = torch.zeros(rows, 64, 128, dtype=torch.float8_e4m3fn, device=self.device)
        self.w = torch.zeros(rows, 64, device=self.device)
        self.hidden = torch.zeros(rows, CKPT["hidden_size"], device=self.device)
        self.out = torch.zeros(len(self.layers), rows, K, dtype=torch.int32, device=self.device)
        spec = (llm_args.MTPDecodingConfig(num_nextn_predict_layers=next_n - 1)
                if next_n > 1 else None)
        self.spec_md = mtp.MTPSpecMetadata(next_n - 1, torch.zeros(
            self.batch, dtype=torch.int32, device=self.device)) if spec else None
        self.worker = mtp.MTPWorker(spec) if spec else None
        guard = None if GPU else (lambda: capture_guard(self.current_md))
        self.runner = runner_mod.DecoderRunner(
            self.forward, max_batch_size=self.batch, use_cuda_graph=graphs,
            is_spec_decode=next_n > 1, disable_overlap_scheduler=not overlap,
            capture_context=guard, device=self.device)
        self.graph_md = {}
        self.cached: dict[int, int] = {}       # true tokens in each request's cache
        self.pending: dict[int, int] = {}      # rejected drafts the host has not seen yet
        self.checked = 0
        self.rows: list[torch.Tensor] = []

    def metadata(self, key):
        """Upstream keeps one metadata object per CUDA-graph batch key."""
        if key is None:
            return self.md
        if key not in self.graph_md:
            backend = importlib.import_module(
                "tensorrt_llm._torch.attention.backends.utils").get_attention_backend(
                "TRTLLM", self.mc.sparse_attention_config)
            buffers = importlib.import_module("tensorrt_llm._torch.memory_buffer_utils").Buffers()
            md = backend.Metadata(max_num_requests=self.batch, max_num_tokens=self.MAX_TOKENS,
                                  kv_cache_manager=self.manager,
                                  sparse_attention_config=self.mc.sparse_attention_config,
                                  is_cuda_graph=True, cuda_graph_buffers=buffers)
            if self.R > 1:
                md.update_spec_dec_param(self.batch, True, False, False, self.R - 1, self.R - 1)
            self.graph_md[key] = md
        return self.graph_md[key]

    def forward(self, inputs, md, spec_md):
        ng = md.num_generations
        n = ng * self.R
        for i, ix in enumerate(self.layers):
            top = ix.sparse_attn_indexer(md, self.hidden[:n], self.q[:n], None, None,
                                         self.w[:n], is_generation=True)
            self.out[i, :n].copy_(top)
        if self.worker is not None:
            self.worker.forward(None, None, None, None, md, spec_md)
        return self.out

    def warmup(self) -> None:
        """Capture every generation batch size before serving, on padding requests (one dummy
        id repeated, as upstream's warm-up does), so serving steps only replay."""
        cgr = importlib.import_module("tensorrt_llm._torch.pyexecutor.cuda_graph_runner")
        KVCacheParams = importlib.import_module("tensorrt_llm._torch.metadata").KVCacheParams
        # the padding request holds its pages with graphs on or off: requests get the same
        # pages (the same keys) either way
        dummy = cgr.padding_dummy_request(self.manager, self.R - 1)
        if not self.runner.cuda_graph_runner.enabled:
            return
        for ng in range(1, self.batch):
            md = self.current_md = self.metadata((ng, self.R))
            md.request_ids = [dummy] * ng
            md.prompt_lens = [self.R] * ng
            md.num_contexts = 0
            md.seq_lens = torch.tensor([self.R] * ng, dtype=torch.int32)
            md.kv_cache_params = KVCacheParams(use_cache=True, num_cached_tokens_per_seq=[0] * ng)
            md.prepare()
            self.runner.previous_kv_lens_offsets_cuda.zero_()
            if self.spec_md is not None:
                self.spec_md.num_accepted_draft_tokens_cuda.zero_()
            self.runner.forward(None, md, self.spec_md)
        rt = getattr(self.manager, self.patch._RUNTIME_ATTR, None)
        self.tables_at_warmup = sorted(rt.adapter.indexer.summaries) if rt else []

    def step(self, contexts: dict[int, int], gens: list[int], accept: dict[int, int]):
        """contexts: new request -> prompt length; gens: requests decoding this step;
        accept: drafts accepted per generation request (decided on the device)."""
        R, overlap = self.R, not self.runner.disable_overlap_scheduler
        ids = list(contexts) + gens
        host_cached, offsets, new = [], [], []
        for rid, prompt in contexts.items():
            self.cached[rid] = 0
            host_cached.append(0)
            new.append(prompt)
        for rid in gens:
            rejected = self.pending.pop(rid, 0)
            if overlap:            # the host assumes every draft of the last step accepted
                host_cached.append(self.cached[rid] + rejected)
                offsets.append(-rejected)
            else:
                host_cached.append(self.cached[rid])
                offsets.append(0)
            new.append(R)
        for rid, c, n in zip(ids, host_cached, new):
            self.manager.add_sequence(rid, c + n)
        key = (len(gens), R) if not contexts and self.runner.cuda_graph_runner.enabled else None
        md = self.current_md = self.metadata(key)
        KVCacheParams = importlib.import_module("tensorrt_llm._torch.metadata").KVCacheParams
        md.request_ids = ids
        md.prompt_lens = [c + n for c, n in zip(host_cached, new)]
        md.num_contexts = len(contexts)
        md.seq_lens = torch.tensor(new, dtype=torch.int32)
        md.kv_cache_params = KVCacheParams(use_cache=True, num_cached_tokens_per_seq=host_cached)
        md.prepare()
        ng = len(gens)
        self.write_step_keys(md, gens)
        self.q[:ng * R].copy_(torch.randn(ng * R, 64, 128, generator=self.qgen)
                              .to(torch.float8_e4m3fn))
        self.w[:ng * R].copy_(torch.rand(ng * R, 64, generator=self.qgen) - 0.3)
        self.runner.previous_kv_lens_offsets_cuda[:ng].copy_(torch.tensor(offsets or [0],
                                                                           dtype=torch.int32)[:ng])
        if self.spec_md is not None:
            self.spec_md.num_accepted_draft_tokens_cuda[:ng].copy_(
                torch.tensor([accept.get(r, 0) for r in gens] or [0], dtype=torch.int32)[:ng])
        if ng:
            self.runner.forward(None, md, self.spec_md)
        else:
            md.on_update_kv_lens()
        rows = self.out[:, :ng * R].cpu()
        self.rows.append(rows)
        if ng:
            self.check(md, gens, rows)
        for rid, prompt in contexts.items():
            self.cached[rid] = prompt
        for rid in gens:
            a = min(max(accept.get(rid, 0), 0), R - 1)
            self.cached[rid] += a + 1
            self.pending[rid] = R - 1 - a

    def write_step_keys(self, md, gens):
        """What upstream's indexer does before scoring: write the keys of this step's rows,
        at the slots the device's lengths give (with the overlap scheduler the host's are an
        upper bound): tokens cached .. cached + R - 1, slot = token // ratio."""
        table = md.indexer_k_cache_block_offsets[md.num_contexts:md.num_seqs].cpu()
        for ix in self.layers:
            pool = self.manager.get_indexer_k_cache_buffers(ix.layer_idx)
            per_page = pool.shape[1]
            pages, slots = [], []
            for b, rid in enumerate(gens):
                first = self.cached[rid] // self.ratio
                for slot in range(first, (self.cached[rid] + self.R) // self.ratio):
                    pages.append(int(table[b, slot // per_page]))
                    slots.append(slot % per_page)
            write_slot_keys(pool, pages, slots, self.kgen)
            self.keys[ix.layer_idx] = dequantized_keys(pool)

    def check(self, md, gens, rows):
        rt = getattr(self.manager, self.patch._RUNTIME_ATTR)
        ix = rt.adapter.indexer
        assert ix.batch == len(gens) and ix.next_n == self.R
        table = md.indexer_k_cache_block_offsets[md.num_contexts:md.num_seqs].cpu()
        q, w = self.q.cpu().float(), self.w.cpu()
        block_ids, counts = ix.block_ids.cpu(), ix.counts.cpu()
        pruned = 0
        for li, layer in enumerate(self.layers):
            spin_layer = rt.layer_index[layer.layer_idx]
            for b, rid in enumerate(gens):
                chosen = block_ids[b, spin_layer, :int(counts[b, spin_layer])].long()
                for j in range(self.R):
                    # what the engine attends to: indexer slots of the tokens so far
                    n = (self.cached[rid] + j + 1) // self.ratio
                    assert int(ix.context_lens[b, j]) == n, "SPIN's row length"
                    per_page = self.keys[layer.layer_idx].shape[1]
                    pages = table[b, :(n + per_page - 1) // per_page].tolist()
                    logits = reference_logits(self.keys[layer.layer_idx], pages, n,
                                              q[b * self.R + j], w[b * self.R + j])
                    slots = (chosen.view(-1, 1) * PAGE + torch.arange(PAGE)).view(-1)
                    allowed = [int(s) for s in slots if s < n]
                    check_row(rows[li, b * self.R + j], logits, allowed, K,
                                 f"layer {layer.layer_idx} request {rid} row {j}")
                    self.checked += 1
                    pruned += len(allowed) < n
                    if self.predictor == "probe" and self.R == 1:
                        self.check_probe_ranking(layer.layer_idx, pages, n, chosen,
                                                 q[b], w[b], f"layer {layer.layer_idx} "
                                                 f"request {rid}")
        self.pruned = getattr(self, "pruned", 0) + pruned

    def check_probe_ranking(self, layer_idx, pages, n, chosen, q, w, where):
        """predictor probe: every chosen block but the forced sink and newest scores at least
        as high as every block left out, by page summaries made here from the page bytes (the
        mean of a page's visible keys, re-quantized e4m3 with scale amax / 448, as the summary
        row format specifies; a block of two 32-slot pages scores as its best page), to a
        tolerance for fp8 rounding of the summaries."""
        keys = self.keys[layer_idx]
        S = keys.shape[1]                     # slots per page: 64, or 32 (two pages a block)
        blocks = (n + PAGE - 1) // PAGE
        score = []
        for j in range(blocks):
            best = float("-inf")
            for c in range(j * PAGE // S, min((j + 1) * PAGE // S, (n + S - 1) // S)):
                mean = keys[pages[c], :min(n - c * S, S)].mean(0)
                scale = max(float(mean.abs().max()) / 448.0, 1e-12)
                summary = (mean / scale).float().to(torch.float8_e4m3fn).double() * scale
                best = max(best, float((torch.relu(q.double() @ summary) * w.double()).sum()))
            score.append(best)
        score = torch.tensor(score)
        picked = set(chosen.tolist())
        ranked = [j for j in picked if j not in (0, blocks - 1)]
        left = [j for j in range(blocks) if j not in picked]
        if not ranked or not left:
            return
        tol = 0.02 * float(score.abs().max())
        worst, best = min(score[ranked]), max(score[left])
        assert worst >= best - tol, (f"{where}: the probe chose a block scoring {worst:.4g} "
                                     f"and left one scoring {best:.4g}")
        self.ranked = getattr(self, "ranked", 0) + 1


def acceptance(rng, gens, R, step):
    """All rejected, all accepted, then random (the patterns the issue names)."""
    if step % 5 == 0:
        return {r: 0 for r in gens}
    if step % 5 == 1:
        return {r: R - 1 for r in gens}
    return {r: rng.randrange(R) for r in gens}


def run_loop(trt, patch, next_n, graphs, overlap, seed=0, steps=14, v4=False,
             tokens_per_block=PAGE, predictor="spin"):
    loop = Loop(trt, patch, next_n, graphs, overlap, seed, v4, tokens_per_block, predictor)
    loop.warmup()
    rng = random.Random(seed)
    scale = loop.ratio                # V4: 4 tokens per indexer slot
    loop.step({1: 700 * scale, 2: 950 * scale}, [], {})
    live = [1, 2]
    for t in range(steps):
        contexts = {}
        if t == 3:
            contexts = {3: 1300 * scale}         # joins beside decoding requests
        if t == 8:
            live.remove(1)                       # leaves
            loop.manager.free_resources(1)
        if t == 10:
            contexts = {4: 400 * scale}
        gens = list(live)
        loop.step(contexts, gens, acceptance(rng, gens, next_n, t))
        live += list(contexts)
    return loop


# Under racecheck the engine loops take 60-150 s each: the slowest leave their kernel instances
# to their siblings there (racecheck_slow), the same kernels with the same next_n
@pytest.mark.parametrize("next_n,overlap", [
    (1, False), (2, True), (3, True), pytest.param(4, False, marks=pytest.mark.racecheck_slow),
    (4, True)])
def test_engine_loop_rows_are_the_topk_of_the_selected_blocks(env, next_n, overlap):
    trt, patch = env
    loop = run_loop(trt, patch, next_n, graphs=True, overlap=overlap)
    assert loop.checked >= 60 * next_n and loop.pruned > 0


# DeepSeek-V4: 4 tokens per indexer slot; tokens_per_block 256 gives 64-slot pages, 128 gives
# 32-slot pages (two a SPIN block), which DeepGEMM's SM90 kernel does not take (upstream fails
# there with or without SPIN): on a GPU only 256 runs
V4_CASES = [(256, 1, False), (256, 3, True), (256, 2, True)] + \
    ([] if GPU else [(128, 2, True), (128, 4, False)])


@pytest.mark.parametrize("tokens_per_block,next_n,overlap", V4_CASES)
def test_engine_loop_v4_rows_are_the_topk_of_the_selected_blocks(env, tokens_per_block, next_n,
                                                                 overlap):
    trt, patch = env
    loop = run_loop(trt, patch, next_n, graphs=True, overlap=overlap, v4=True,
                    tokens_per_block=tokens_per_block)
    assert loop.checked >= 60 * next_n and loop.pruned > 0
    assert loop.keys[loop.layers[0].layer_idx].shape[1] == tokens_per_block // 4


# (predictor, v4, next_n, tokens_per_block): V4 with 128 has 32-slot pages (two a block),
# which DeepGEMM's SM90 kernel does not take: CPU only
PROBE_CASES = [("probe", False, 1, PAGE), ("probe", True, 1, 256), ("probe", False, 3, PAGE),
               ("hybrid", False, 1, PAGE), ("hybrid", True, 2, 256),
               ("gauss", False, 1, PAGE), ("gauss", True, 2, 256)] + \
    ([] if GPU else [("probe", True, 1, 128), ("hybrid", True, 3, 128), ("gauss", True, 1, 128)])


@pytest.mark.parametrize("predictor,v4,next_n,tokens_per_block", PROBE_CASES)
def test_engine_loop_query_aware_predictors(env, predictor, v4, next_n, tokens_per_block, caplog):
    """spin.predictor probe / hybrid / gauss in the YAML: every decode row is the top-K of exactly
    the blocks selected, and (probe, next_n 1) the selected blocks are the best by summaries made
    here from the page bytes, so the prompt pages were summarized before the first decode
    step and every newer page since."""
    trt, patch = env
    caplog.set_level(logging.INFO, logger="spin_trtllm")
    loop = run_loop(trt, patch, next_n, graphs=True, overlap=next_n > 1, v4=v4,
                    tokens_per_block=tokens_per_block, predictor=predictor)
    adapter = loop.manager._spin_trtllm_runtime.adapter
    assert adapter.options.predictor == predictor and adapter.query_aware
    # made before the first capture (one made inside it would be zeroed at every replay)
    assert loop.tables_at_warmup == list(range(len(loop.layers)))
    tables = sum(t.nbytes for t in adapter.indexer.summaries.values())
    row = 144 * predictors.REGISTRY[predictor].summary_rows_per_block   # gauss: mean and std
    assert f"of {predictor} summary tables ({row} B per indexer page per layer)" in caplog.text
    assert tables == len(loop.layers) * loop.manager.get_indexer_k_cache_buffers(
        loop.layers[0].layer_idx).shape[0] * row and adapter.nbytes() > tables
    assert loop.checked >= 60 * next_n and loop.pruned > 0
    if predictor == "probe" and next_n == 1:
        assert loop.ranked >= 20


@pytest.mark.skipif(not GPU, reason="on the CPU a replay re-runs the forward in Python")
@pytest.mark.parametrize("next_n", [1, 3])
def test_replayed_graphs_equal_eager_steps(env, next_n):
    trt, patch = env
    graphed = run_loop(trt, patch, next_n, graphs=True, overlap=True, seed=5)
    eager = run_loop(trt, patch, next_n, graphs=False, overlap=True, seed=5)
    assert graphed.checked == eager.checked > 0
    assert len(graphed.rows) == len(eager.rows)
    for a, b in zip(graphed.rows, eager.rows):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.racecheck_slow
def test_mtp_updates_in_the_forward_equal_the_host_replay(env, monkeypatch):
    """Without the overlap scheduler the host knows every acceptance one step later, so the
    deferred updates replayed from the host (the fallback for engines without a one-model
    worker) are exact: running them in the forward instead, right after the MTP worker's
    acceptance, must leave the same state and the same rows (once each, with that
    acceptance)."""
    trt, patch = env
    inside = run_loop(trt, patch, 3, graphs=False, overlap=False, seed=9)
    def state(loop):            # per request: slots may be handed out in another order
        adapter = loop.manager._spin_trtllm_runtime.adapter
        # the host replays a step's updates when the next step begins: let it, for the last
        live = [rid for rid in adapter.pool.request_ids() if rid in loop.pending]
        adapter.follow(live, {rid: loop.cached[rid] for rid in live})
        pool = adapter.pool
        return {rid: [t[pool.slot_of(rid)].clone() for t in pool.state.tensors()]
                for rid in pool.request_ids()}

    state_inside = state(inside)
    assert any(bool(t.abs().sum() > 0) for ts in state_inside.values() for t in ts[:2]), \
        "the updates ran"
    monkeypatch.setattr(patch._Runtime, "on_accepted", lambda self, md, num: None)
    host = run_loop(trt, patch, 3, graphs=False, overlap=False, seed=9)
    for a, b in zip(inside.rows, host.rows):
        assert torch.equal(a, b)
    state_host = state(host)
    assert sorted(state_inside) == sorted(state_host) and len(state_host) >= 3
    for rid, tensors in state_inside.items():
        for a, b in zip(tensors, state_host[rid]):
            assert torch.equal(a, b), f"request {rid}"


@pytest.mark.parametrize("v4,predictor", [(False, "spin"), (True, "spin"), (False, "probe"),
                                          (True, "gauss")])
@pytest.mark.slow
@pytest.mark.racecheck_slow
def test_the_overlap_scheduler_changes_nothing(env, v4, predictor):
    """With the overlap scheduler the host prepares each MTP step as if every draft was
    accepted and the runner corrects kv_lens_cuda inside the step: SPIN must select, score and
    update exactly as when the host knew the lengths (the query-aware predictors: summarize the
    newest pages at the corrected lengths, without the rejected drafts' slots)."""
    trt, patch = env
    on = run_loop(trt, patch, 3, graphs=True, overlap=True, seed=3, v4=v4,
                  tokens_per_block=256 if v4 else PAGE, predictor=predictor)
    off = run_loop(trt, patch, 3, graphs=True, overlap=False, seed=3, v4=v4,
                   tokens_per_block=256 if v4 else PAGE, predictor=predictor)
    assert on.checked == off.checked > 0
    for a, b in zip(on.rows, off.rows):
        assert torch.equal(a, b)
