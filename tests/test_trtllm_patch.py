"""spin_trtllm.trtllm inside the TensorRT-LLM stand-in (tests/trtllm_standin), which mirrors
upstream's call graph: LLM args -> ModelConfig.from_pretrained -> model build -> Indexer /
DeepseekV4Indexer -> metadata prepare -> decode sparse_attn_indexer -> the top-K consumer.

SPIN's rows are checked against an independent dense reference (spin_trtllm.testing.standin's
own quantizers and logits), restricted to the blocks SPIN selected: every decode row must be the
top-K of exactly those slots, computed by upstream's own (stand-in) DeepGEMM call on the
compacted block table.
"""

import importlib
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from spin_trtllm.testing.standin import (V4_CKPT, V32_CKPT, Recorder, build, imp,
                                         reference_check, run_step, sparse_config)

HERE = Path(__file__).resolve().parent


def selection_of(patch, manager, md):
    """allowed(layer_idx, request, row, n): the visible slots of the blocks SPIN selected."""
    rt = getattr(manager, patch._RUNTIME_ATTR)
    ix = rt.adapter.indexer
    gen = [int(r) for r in md.request_ids[md.num_contexts:]]

    def allowed(layer_idx, rid, j, n):
        b, li = gen.index(rid), rt.layer_index[layer_idx]
        blocks = ix.block_ids[b, li, :min(int(ix.counts[b, li]), ix.m_cap)]
        slots = (blocks.long().view(-1, 1) * 64 + torch.arange(64)).view(-1)
        return [int(s) for s in slots if s < n]
    return allowed, rt


def decode(patch, model, manager, md, fp4, ratio, prompts, steps, next_n, dummy=0, accepted=0):
    """Prefill, then decode steps checked against the reference on SPIN's blocks. Returns how
    many rows SPIN scored on fewer blocks than the dense indexer (pruned)."""
    dummy_id = imp("tensorrt_llm._torch.pyexecutor.cuda_graph_runner").CUDA_GRAPH_DUMMY_REQUEST_ID
    rec = Recorder(model)
    ids = [7, 11]
    run_step(model, manager, md, ids, [0, 0], list(prompts), num_contexts=2)
    reference_check(model, rec, fp4, ratio, dummy_id)
    cached = list(prompts)
    pruned = 0
    for _ in range(steps):
        run_step(model, manager, md, ids, cached, [next_n] * 2, num_contexts=0, dummy=dummy,
                    next_n=next_n)
        allowed, rt = selection_of(patch, manager, md)
        assert rt.active
        assert reference_check(model, rec, fp4, ratio, dummy_id, allowed) > 0
        ix = rt.adapter.indexer
        visible = [((c + next_n) // ratio + 63) // 64 for c in cached]
        pruned += sum(int(ix.counts[b, li]) < visible[b]
                      for b in range(2) for li in range(ix.counts.shape[1]))
        cached = [c + accepted + 1 for c in cached]
    return pruned


@pytest.mark.slow
def test_import_without_tensorrt_llm_is_one_clear_error():
    res = subprocess.run([sys.executable, "-c", "import spin_trtllm.trtllm"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode != 0
    assert res.stderr.strip().splitlines()[-1].startswith(
        "ImportError: spin_trtllm.trtllm needs TensorRT-LLM")


def test_unsupported_layout_is_refused_by_name(tmp_path):
    pkg = tmp_path / "tensorrt_llm"
    (pkg / "llmapi").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '1.3.0'\n")
    (pkg / "llmapi" / "__init__.py").write_text("")
    (pkg / "llmapi" / "llm_args.py").write_text("")
    res = subprocess.run([sys.executable, "-c", "import spin_trtllm.trtllm"], capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": f"{tmp_path}:{HERE.parent}",
                                                      "PATH": "/usr/bin:/bin"})
    assert res.returncode != 0
    assert "cannot find ['Indexer', 'DSAtrtllmAttentionMetadata'" in res.stderr


@pytest.mark.parametrize("v4,tpb", [(False, 64), (True, 128), (True, 256)])
@pytest.mark.parametrize("fp4", [False, True])
@pytest.mark.parametrize("k", [512, 1024, 2048])
def test_spin_block_reaches_every_indexer_layer(env, v4, tpb, fp4, k):
    trt, patch = env
    ckpt = dict(V4_CKPT if v4 else V32_CKPT, index_topk=k)
    mc, model, _, _ = build(trt, ckpt, sparse_config(v4, fp4, spin={}), tpb, next_n=2)
    assert mc.sparse_attention_config.spin is not None     # survived from_pretrained's rebuild
    assert sorted(patch._LAYERS) == ([1, 3] if v4 else [0, 1])
    assert {s.config.index_topk for s in patch._LAYERS.values()} == {k}    # K from the checkpoint
    assert {s.config.target_sparsity for s in patch._LAYERS.values()} == {0.5}
    indexers = [layer.self_attn.indexer for layer in model.model.layers]
    if not v4:        # V3.2's one-model MTP layer builds a full indexer: it stays dense
        assert indexers[2].layer_idx == 2 and indexers[2]._spin is None
    assert all(ix._spin is not None for ix in indexers if ix is not None and ix.layer_idx in
               patch._LAYERS)


@pytest.mark.parametrize("v4", [False, True])
def test_the_predictor_in_the_spin_block_reaches_every_layer(env, v4):
    trt, patch = env
    ckpt = dict(V4_CKPT if v4 else V32_CKPT, index_topk=512)
    build(trt, ckpt, sparse_config(v4, spin={"predictor": "hybrid"}), 256 if v4 else 64,
          next_n=1)
    assert sorted(patch._LAYERS) == ([1, 3] if v4 else [0, 1])
    assert {s.predictor for s in patch._LAYERS.values()} == {"hybrid"}
    assert {s.config.index_topk for s in patch._LAYERS.values()} == {512}


def test_a_bad_predictor_is_refused_by_name(env):
    trt, patch = env
    with pytest.raises(Exception, match="predictor"):
        sparse_config(False, spin={"predictor": "quest"})       # replay only: no kernels
    block = {"algorithm": "dsa", "spin": {"predictor": "quest"}}
    with pytest.raises(patch.SpinError, match=r"sparse_attention_config\.spin\.predictor: "
                                              r"must be one of spin, probe, hybrid"):
        patch.spin_settings_of(block)


def test_the_probe_on_mxfp4_keys_reaches_every_layer(env):
    trt, patch = env
    build(trt, dict(V32_CKPT, index_topk=512),
          sparse_config(False, fp4=True, spin={"predictor": "probe"}), 64, next_n=1)
    assert sorted(patch._LAYERS) == [0, 1]
    assert {s.predictor for s in patch._LAYERS.values()} == {"probe"}


@pytest.mark.parametrize("v4,tpb,next_n", [(False, 64, 1), (True, 128, 2), (True, 256, 1)])
@pytest.mark.slow
def test_probe_decode_rows_on_mxfp4_keys_are_the_topk_of_the_selected_blocks(env, v4, tpb,
                                                                             next_n):
    """The probe on MXFP4 keys (on the CPU: the reference summaries): the summaries of the FP4
    pages and the FP4 query made e4m3 rank the blocks, and every decode row is the top-K of
    exactly the blocks selected, against the dense reference."""
    trt, patch = env
    ckpt = dict(V4_CKPT, index_topk=24) if v4 else V32_CKPT
    _, model, manager, md = build(trt, ckpt, sparse_config(v4, True, spin={"predictor": "probe"}),
                                  tpb, next_n, max_seq_len=2048, max_num_tokens=4096)
    prompts = (1300, 900) if v4 else (700, 450)
    pruned = decode(patch, model, manager, md, True, 4 if v4 else 1, prompts, steps=3,
                    next_n=next_n, accepted=next_n - 1)
    assert pruned > 0, "the probe never dropped a block: the check would prove nothing"
    rt = getattr(manager, patch._RUNTIME_ATTR)
    assert rt.adapter.options.predictor == "probe" and rt.adapter.query_aware


SCENARIOS = [  # (v4, tokens_per_block, fp4, next_n, cuda-graph padding)
    (False, 64, False, 1, False), (False, 64, True, 2, True), (False, 64, False, 2, False),
    (True, 128, False, 2, False), (True, 128, True, 1, True), (True, 256, True, 2, False),
    (True, 256, False, 1, True),
]


@pytest.mark.parametrize("v4,tpb,fp4,next_n,graph", SCENARIOS)
@pytest.mark.slow
def test_spin_decode_rows_are_the_topk_of_the_selected_blocks(env, v4, tpb, fp4, next_n, graph):
    trt, patch = env
    ckpt = dict(V4_CKPT, index_topk=24) if v4 else V32_CKPT
    _, model, manager, md = build(trt, ckpt, sparse_config(v4, fp4, spin={}), tpb, next_n,
                                     cuda_graph=graph, max_seq_len=2048, max_num_tokens=4096)
    prompts = (1300, 900) if v4 else (700, 450)
    pruned = decode(patch, model, manager, md, fp4, 4 if v4 else 1, prompts, steps=3,
                    next_n=next_n, dummy=2 if graph else 0, accepted=next_n - 1)
    assert pruned > 0, "SPIN never dropped a block: the check would prove nothing"


@pytest.mark.slow
def test_zero_sparsity_keeps_every_block_and_gives_the_dense_top_k(env):
    # (the stand-in's small model has many exactly tied scores, so rows are compared with the
    # reference's tie-aware check, not element by element with the dense run)
    trt, patch = env
    _, model, manager, md = build(trt, V32_CKPT,
                                     sparse_config(False, spin={"target_sparsity": 0.0}), 64, 2,
                                     max_seq_len=2048, max_num_tokens=4096)
    assert decode(patch, model, manager, md, False, 1, (700, 450), steps=3, next_n=2,
                  accepted=1) == 0


def test_next_n_changes_replay_the_accepted_rows(env, monkeypatch):
    """Draft cap 3; steps of next_n 1, 3, 2, 2 (runtime_tokens_per_gen_step): each step's
    deferred update replays what the next step's kv lens say was accepted, on that step's own
    buffers."""
    trt, patch = env
    from spin_trtllm.indexer import SpinIndexer
    seen = []
    original = SpinIndexer.finish

    def finish(self, accepted=None):
        seen.append((self.next_n, None if accepted is None else accepted.tolist()))
        return original(self, accepted)

    monkeypatch.setattr(SpinIndexer, "finish", finish)
    _, model, manager, md = build(trt, V32_CKPT, sparse_config(False, spin={}), 64, 4,
                                     max_seq_len=1024, max_num_tokens=2048)
    run_step(model, manager, md, [3, 4], [0, 0], [600, 400], num_contexts=2)
    cached = [600, 400]
    plan = [(1, [0, 0]), (3, [2, 0]), (2, [1, 1]), (2, [0, 1])]     # (next_n, accepted drafts)
    for R, acc in plan:
        md.runtime_tokens_per_gen_step = R
        run_step(model, manager, md, [3, 4], cached, [R, R], num_contexts=0, next_n=R)
        allowed, rt = selection_of(patch, manager, md)
        assert rt.adapter.indexer.next_n == R
        for layer in model.model.layers[:2]:
            top = layer.self_attn.last_topk
            assert top.shape[0] == 2 * R
            for row in range(2 * R):
                rid, j = [3, 4][row // R], row % R
                n = cached[row // R] + j + 1
                assert {int(x) for x in top[row] if x >= 0} <= set(allowed(layer.layer_idx, rid, j, n))
        cached = [c + a + 1 for c, a in zip(cached, acc)]
    md.runtime_tokens_per_gen_step = 1
    run_step(model, manager, md, [3, 4], cached, [1, 1], num_contexts=0, next_n=1)
    assert seen == [(3, [2, 0]), (2, [1, 1]), (2, [0, 1])]


def test_gvr_prior_holds_spin_rows(env, monkeypatch):
    trt, patch = env
    for mod in ("tensorrt_llm._torch.attention.backends.sparse.dsa.indexer",
                "tensorrt_llm._torch.attention.backends.sparse.dsa.metadata"):
        monkeypatch.setattr(imp(mod), "IS_CUTLASS_DSL_AVAILABLE", True)
        monkeypatch.setattr(imp(mod), "get_sm_version", lambda: 100)
    cfg = sparse_config(False, spin={}, enable_heuristic_topk=True, use_self_sampling_topk=False)
    _, model, manager, md = build(trt, V32_CKPT, cfg, 64, next_n=1, max_seq_len=1024, max_num_tokens=2048)
    assert md.needs_gvr_prior
    run_step(model, manager, md, [5, 6], [0, 0], [700, 500], num_contexts=2)
    for t in range(3):
        run_step(model, manager, md, [5, 6], [700 + t, 500 + t], [1, 1], num_contexts=0)
        allowed, _ = selection_of(patch, manager, md)
        for layer in model.model.layers[:2]:
            local = manager.layer_offsets[layer.layer_idx]
            top = layer.self_attn.last_topk
            assert torch.equal(md.gvr_prior_indices[local, :2], top)     # SPIN's rows
            for b, rid in enumerate([5, 6]):
                inside = set(allowed(layer.layer_idx, rid, 0, 10 ** 6))
                assert {int(s) for s in top[b] if s >= 0} <= inside


@pytest.mark.parametrize("predictor", ["spin", "probe"])
def test_short_contexts_leave_the_step_to_upstream(env, predictor):
    trt, patch = env
    cfg = sparse_config(False, spin={"predictor": predictor})
    cfg = cfg.model_copy(update={"skip_indexer_for_short_seqs": True})
    _, model, manager, md = build(trt, V32_CKPT, cfg, 64, next_n=1)
    run_step(model, manager, md, [1], [0], [20], num_contexts=1)
    run_step(model, manager, md, [1], [20], [1], num_contexts=0)     # kv 21 <= K 24
    rt = getattr(manager, patch._RUNTIME_ATTR)
    assert md.skip_indexer_for_gen_reqs
    top = model.model.layers[0].self_attn.last_topk[0]
    assert top[:21].tolist() == list(range(21))
    # SPIN's buffers still hold this step, and its selection inside the step (what a graph
    # captured with SPIN replays here) keeps every block, since no context exceeds K
    assert rt.adapter.indexer.batch == 1 and int(rt.adapter.indexer.request[0]) == 1
    assert int(rt.adapter.indexer.context_lens[0, 0]) == 21
    if predictor == "spin":     # the probe selects inside each layer's call, which upstream skipped
        assert int(rt.adapter.indexer.counts[0, 0]) == 1


def test_mtp_layers_stay_dense_without_the_checkpoint_config(env):
    """upstream's attention may lower the config per layer without pretrained_config; the
    model's layer count recorded at from_pretrained still keeps MTP layers dense."""
    trt, patch = env
    mc, _, _, _ = build(trt, V32_CKPT, sparse_config(False, spin={}), 64, next_n=2)
    cfg = mc.sparse_attention_config
    assert getattr(cfg.to_sparse_params(layer_idx=1), "spin", None) is not None
    assert getattr(cfg.to_sparse_params(layer_idx=2), "spin", None) is None


def test_no_runtime_for_a_manager_without_an_indexer_cache(env):
    from types import SimpleNamespace
    trt, patch = env
    build(trt, V32_CKPT, sparse_config(False, spin={}), 64, next_n=1)
    assert patch._LAYERS
    draft = SimpleNamespace(kv_cache_manager=SimpleNamespace(), indexer_k_cache_block_offsets=None)
    assert patch._runtime(draft, create_ratio=1) is None


def test_deepseek_v41_is_left_alone(env, caplog):
    trt, patch = env
    ModelConfig = imp("tensorrt_llm._torch.model_config").ModelConfig
    ckpt = dict(V4_CKPT, architectures=["DeepseekV41ForCausalLM"])
    with caplog.at_level(logging.WARNING, logger="spin_trtllm"):
        mc = ModelConfig.from_pretrained(ckpt, sparse_attention_config=sparse_config(True, spin={}))
    assert getattr(mc.sparse_attention_config, "spin", None) is None
    assert any("CSA2" in r.getMessage() for r in caplog.records)
    assert not patch._LAYERS


def test_release_1_2_layout():
    """use_custom_topk as the 7th argument: SPIN runs through the custom top-K op; with the
    masked torch.topk path the layer stays dense (one warning)."""
    code = textwrap.dedent("""
        import logging, math, torch
        logging.basicConfig(level=logging.WARNING)
        import spin_trtllm.trtllm
        from spin_trtllm.integrations.trtllm import patch
        from tensorrt_llm.llmapi.llm_args import TorchLlmArgs
        from tensorrt_llm._torch.attention_backend.sparse.dsa import (
            DSACacheManager, DSAtrtllmAttentionMetadata, Indexer)
        cfg = TorchLlmArgs(model="m", sparse_attention_config={
            "algorithm": "dsa", "index_n_heads": 64, "index_head_dim": 128, "index_topk": 2048,
            "skip_indexer_for_short_seqs": False,
            "spin": {"target_sparsity": 0.5, "exploration": 0.0}}).sparse_attention_config
        # the model's layer count, as ModelConfig.from_pretrained records it: the MTP draft
        # layer (layer_idx = num_hidden_layers) gets no SPIN state
        patch._BASE_LAYERS[id(cfg)] = 1
        draft = Indexer(None, None, None, False, cfg, None, layer_idx=1)
        assert draft._spin is None and 1 not in patch._LAYERS
        ix = Indexer(None, None, None, False, cfg, None, layer_idx=0)
        assert patch._LAYERS[0].config.index_topk == 2048 and list(patch._LAYERS) == [0]
        manager = DSACacheManager(num_layers=1, tokens_per_block=64, max_seq_len=8192,
                                  max_batch_size=2, sparse_attention_config=cfg)
        pages = manager.get_indexer_k_cache_buffers(0).view(manager.num_blocks, -1)
        pages[:, :64 * 128] = (torch.randn(manager.num_blocks, 64 * 128) * 2).to(
            torch.float8_e4m3fn).view(torch.uint8)
        pages[:, 64 * 128:] = (torch.rand(manager.num_blocks, 64) * 0.02 + 0.005).view(torch.uint8)
        md = DSAtrtllmAttentionMetadata(kv_cache_manager=manager, max_num_requests=2,
                                        sparse_attention_config=cfg)
        per = manager.max_blocks_per_seq
        md.block_offsets = torch.arange(2 * per, dtype=torch.int32).view(2, per)
        kv = [6000, 5000]
        for t in range(3):
            md.request_ids, md.num_contexts = [5, 6], 0
            md.seq_lens = torch.tensor([2, 2], dtype=torch.int32)
            md.num_cached_tokens = [k - 2 + 2 * t for k in kv]
            md.prepare()
            q = torch.randn(4, 64, 128).to(torch.float8_e4m3fn)
            out = ix.sparse_attn_indexer(md, torch.zeros(4, 8), q, None, None, torch.rand(4, 64))
        rt = getattr(manager, patch._RUNTIME_ATTR)
        sel = rt.adapter.indexer
        assert rt.active and int(sel.counts[0, 0]) < math.ceil((kv[0] + 4) / 64)
        allowed = {int(b) * 64 + s for b in sel.block_ids[0, 0, :int(sel.counts[0, 0])]
                   for s in range(64)}
        assert {int(x) for x in out[0] if x >= 0} <= allowed and int((out[0] >= 0).sum()) == 2048
        ix.sparse_attn_indexer(md, torch.zeros(4, 8), q, None, None, torch.rand(4, 64), False)
        print("legacy ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={"PYTHONPATH": f"{HERE / 'trtllm_standin_legacy'}:"
                                                         f"{HERE.parent}", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "legacy ok" in res.stdout and "use_custom_topk=False" in res.stderr


def _decode_fields(md, ids, cached, new, table):
    """A generation-only metadata as prepare() leaves it (the fields the runtime reads)."""
    from types import SimpleNamespace
    return SimpleNamespace(
        num_contexts=0, num_generations=len(ids), request_ids=list(ids),
        num_tokens=sum(new), num_ctx_tokens=0, kv_cache_manager=md.kv_cache_manager,
        kv_cache_params=SimpleNamespace(num_cached_tokens_per_seq=list(cached)),
        seq_lens_kv=torch.tensor(new), indexer_k_cache_block_offsets=table)


def test_state_is_made_at_the_first_prepare_and_kept_across_kv_cache_rebuilds(env):
    """TensorRT-LLM sizes its KV cache after start-up steps of a temporary engine: SPIN's state
    must exist by then (made at the first prepare, context-only too) and be reused by the
    rebuilt engine, not allocated a second time after the sizing."""
    trt, patch = env
    _, model, manager, md = build(trt, V32_CKPT, sparse_config(False, spin={}), 64, 1)
    run_step(model, manager, md, [1], [0], [90], num_contexts=1)      # prefill only
    rt = getattr(manager, patch._RUNTIME_ATTR, None)
    assert rt is not None and rt.adapter is not None
    adapter = rt.adapter
    assert adapter.pool.nbytes() > 0 and adapter.nbytes() > adapter.pool.nbytes()
    run_step(model, manager, md, [1], [90], [1], num_contexts=0)
    assert adapter.pool.slot_of(1) is not None
    _, model2, manager2, md2 = build(trt, V32_CKPT, sparse_config(False, spin={}), 64, 1)
    run_step(model2, manager2, md2, [5], [0], [120], num_contexts=1)
    rt2 = getattr(manager2, patch._RUNTIME_ATTR)
    assert rt2 is rt and rt2.adapter is adapter             # the same allocation
    assert adapter.pool.slot_of(1) is None                  # nothing carried over
    run_step(model2, manager2, md2, [5], [120], [1], num_contexts=0)
    allowed, _ = selection_of(patch, manager2, md2)
    assert adapter.pool.slot_of(5) is not None


def test_buffers_are_sized_from_the_engine_max_batch(env):
    """A CUDA-graph metadata of batch 1 may run the first decode step: SPIN's buffers still hold
    the engine's max batch, and a larger batch than that is refused by name."""
    trt, patch = env
    mc, model, manager, md = build(trt, V32_CKPT, sparse_config(False, spin={}), 64, 1,
                                      batch=4)
    backend = imp("tensorrt_llm._torch.attention.backends.utils").get_attention_backend(
        "TRTLLM", mc.sparse_attention_config)
    small = backend.Metadata(max_num_requests=1, max_num_tokens=1024, kv_cache_manager=manager,
                             sparse_attention_config=mc.sparse_attention_config)
    rec = Recorder(model)
    run_step(model, manager, md, [1, 2, 3], [0, 0, 0], [80, 90, 100], num_contexts=3)
    run_step(model, manager, small, [1], [80], [1], num_contexts=0)
    run_step(model, manager, md, [1, 2, 3], [81, 90, 100], [1, 1, 1], num_contexts=0)
    rt = getattr(manager, patch._RUNTIME_ATTR)
    assert rt.adapter.max_batch == 4 and rt.adapter.indexer.batch == 3
    allowed, _ = selection_of(patch, manager, md)
    dummy = imp("tensorrt_llm._torch.pyexecutor.cuda_graph_runner").CUDA_GRAPH_DUMMY_REQUEST_ID
    assert reference_check(model, rec, False, 1, dummy, allowed) > 0
    table = torch.zeros(5, 4, dtype=torch.int32)
    with pytest.raises(patch.SpinError, match="5 generation requests in one step, SPIN's "
                                              "buffers hold 4"):
        rt.begin(_decode_fields(md, [1, 2, 3, 4, 6], [90] * 5, [1] * 5, table))


def test_every_step_refills_spin_buffers_even_ragged_ones(env):
    """A step whose rows are not (requests x next_n) on the host runs upstream's dense
    indexer, but SPIN's buffers must hold that step's batch: a graph captured with SPIN that
    replays on it must never see an earlier step's rows."""
    trt, patch = env
    _, model, manager, md = build(trt, V32_CKPT, sparse_config(False, spin={}), 64, 2)
    run_step(model, manager, md, [1, 2], [0, 0], [200, 150], num_contexts=2)
    run_step(model, manager, md, [1, 2], [200, 150], [2, 2], num_contexts=0, next_n=2)
    rt = getattr(manager, patch._RUNTIME_ATTR)
    manager.add_sequence(3, 60)
    table = manager.copy_batch_block_offsets([2, 3])
    rt.begin(_decode_fields(md, [2, 3], [152, 58], [2, 1], table))        # ragged
    ix = rt.adapter.indexer
    assert ix.batch == 2 and ix.request[:2].tolist() == [2, 3]
    assert ix.context_lens[:2].tolist() == [[153, 154], [59, 60]]
    assert torch.equal(ix.block_table[:2, :table.shape[1]], table)


def test_cute_dsl_paged_logits_layers_stay_dense(env, monkeypatch, caplog):
    """SM100 with use_cute_dsl_paged_mqa_logits: upstream scores through its CuTe DSL kernel,
    which SPIN cannot drive: those layers get no SPIN state and run as upstream ships them."""
    trt, patch = env
    for mod in ("tensorrt_llm._torch.attention.backends.sparse.dsa.indexer",
                "tensorrt_llm._torch.attention.backends.sparse.dsa.metadata"):
        monkeypatch.setattr(imp(mod), "IS_CUTLASS_DSL_AVAILABLE", True)
    monkeypatch.setattr(imp("tensorrt_llm._torch.attention.backends.sparse.dsa.indexer"),
                        "is_sm_100f", lambda: True)
    cfg = sparse_config(False, spin={}, use_cute_dsl_paged_mqa_logits=True)
    with caplog.at_level(logging.WARNING, logger="spin_trtllm"):
        _, model, _, _ = build(trt, V32_CKPT, cfg, 64, next_n=1)
    layers = [l.self_attn.indexer for l in model.model.layers[:2]]
    assert all(ix.use_cute_dsl_paged_mqa_logits and ix._spin is None for ix in layers)
    assert not patch._LAYERS and "CuTe DSL paged logits" in caplog.text


@pytest.mark.parametrize("predictor", ["spin", "probe"])
@pytest.mark.parametrize("v4,tpb,fp4,next_n,graph", [SCENARIOS[0], SCENARIOS[1], SCENARIOS[4]])
@pytest.mark.slow
def test_compact_writes_the_schedule_where_it_is_deepgemms(env, monkeypatch, v4, tpb, fp4,
                                                          next_n, graph, predictor):
    """The stand-in's schedule is its own plan, so each layer's call compacts, then schedules.
    With DeepGEMM's format (reference.paged_logits_schedule, which the GPU tests hold to
    DeepGEMM's function) compact writes the schedule too: for every layer in one launch where
    select() chose every layer's blocks (spin), one launch a layer where each layer's call
    chooses its own (probe, TensorRT-LLM's default). The rows are still the top-K of the
    selected blocks."""
    trt, patch = env
    ref = importlib.import_module("spin_trtllm.reference")
    ops = importlib.import_module("spin_trtllm.ops")
    # the module whose schedule function the patch calls (the Indexer's)
    indexer_module = imp("tensorrt_llm._torch.attention.backends.sparse.dsa.indexer")
    monkeypatch.setattr(indexer_module, "get_paged_mqa_logits_metadata",
                        lambda lens, block_kv, num_sms, indices=None:
                        ref.paged_logits_schedule(lens.cpu(), num_sms).to(lens.device))
    calls = []
    compact = ops.compact
    monkeypatch.setattr(ops, "compact", lambda *a, **k: calls.append(
        (a[0].dim(), len(a) > 7 and a[7] is not None)) or compact(*a, **k))
    ckpt = dict(V4_CKPT, index_topk=24) if v4 else V32_CKPT
    _, model, manager, md = build(trt, ckpt, sparse_config(v4, fp4, spin={"predictor": predictor}),
                                  tpb, next_n, cuda_graph=graph, max_seq_len=2048,
                                  max_num_tokens=4096)
    prompts = (1300, 900) if v4 else (700, 450)
    pruned = decode(patch, model, manager, md, fp4, 4 if v4 else 1, prompts, steps=3,
                    next_n=next_n, dummy=2 if graph else 0, accepted=next_n - 1)
    assert pruned > 0, "SPIN never dropped a block: the check would prove nothing"
    layers = len(getattr(manager, patch._RUNTIME_ATTR).layer_index)
    every_layer = predictor == "spin"
    assert calls == [(3 if every_layer else 2, True)] * (3 if every_layer else 3 * layers)
