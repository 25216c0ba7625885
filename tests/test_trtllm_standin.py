"""The TensorRT-LLM stand-in (tests/trtllm_standin) on its own, dense (no SPIN).

Builds LLM args -> ModelConfig.from_pretrained -> V3.2 / V4 models -> cache manager ->
attention metadata, runs a prefill and decode steps (MTP next_n 1 and 2, CUDA-graph padding
rows), and checks every indexer layer's top-K against a dense reference written from the
key-format contract (own quantizers, own logits; spin_trtllm.testing.standin), independent of
the stand-in's code.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from spin_trtllm.testing.standin import (V4_CKPT, V32_CKPT, Recorder, build, imp,
                                         imported_standin, reference_check, run_step)

HERE = Path(__file__).resolve().parent
STANDIN = HERE / "trtllm_standin"
LEGACY = HERE / "trtllm_standin_legacy"


@pytest.fixture(scope="module")
def trt():
    """Import the stand-in as `tensorrt_llm` (restoring sys.modules / sys.path after)."""
    with imported_standin(STANDIN) as mod:
        assert Path(mod.__file__).resolve().is_relative_to(STANDIN)
        yield mod


def run_scenario(trt, ckpt, sparse_cfg, tokens_per_block, next_n, cuda_graph, fp4, ratio,
                 prompts=(110, 70), steps=2):
    mc, model, manager, md = build(trt, ckpt, sparse_cfg, tokens_per_block, next_n,
                                   cuda_graph=cuda_graph)
    rec = Recorder(model)
    dummy_id = imp("tensorrt_llm._torch.pyexecutor.cuda_graph_runner").CUDA_GRAPH_DUMMY_REQUEST_ID
    ids = [7, 11]
    run_step(model, manager, md, ids, [0, 0], list(prompts), num_contexts=2)
    checked = reference_check(model, rec, fp4, ratio, dummy_id)
    kv = list(prompts)
    addresses = set()
    for _ in range(steps):
        run_step(model, manager, md, ids, kv, [next_n] * 2, num_contexts=0,
                 dummy=2 if cuda_graph else 0, next_n=next_n)
        checked += reference_check(model, rec, fp4, ratio, dummy_id)
        kv = [k + next_n for k in kv]
        if cuda_graph:
            addresses.add(md.kv_lens_cuda_2d.data_ptr())
    assert checked > 0
    if cuda_graph:
        assert len(addresses) == 1          # graph buffers keep their address across steps
    return mc, model, manager, md


# ---- tests ---------------------------------------------------------------------------------
def test_config_rebuild_drops_unknown_fields_and_takes_topk_from_checkpoint(trt):
    from pydantic import ValidationError
    llm_args = imp("tensorrt_llm.llmapi.llm_args")
    ModelConfig = imp("tensorrt_llm._torch.model_config").ModelConfig
    args = llm_args.TorchLlmArgs(model="m", sparse_attention_config={
        "algorithm": "dsa", "use_self_sampling_topk": False, "indexer_k_dtype": "fp4"})
    cfg = args.sparse_attention_config
    assert isinstance(cfg, llm_args.DeepSeekSparseAttentionConfig)
    with pytest.raises(ValidationError):
        llm_args.TorchLlmArgs(model="m", sparse_attention_config={"algorithm": "dsa", "spin": {}})
    mc = ModelConfig.from_pretrained(V32_CKPT, sparse_attention_config=cfg)
    new = mc.sparse_attention_config
    assert new is not cfg and new.index_topk == 24 and new.indexer_k_dtype == "fp4"
    assert new.use_self_sampling_topk is True          # not in the rebuild's field list
    params = new.to_sparse_params(pretrained_config=mc.pretrained_config, layer_idx=2)
    assert type(params).__name__ == "DSAParams" and params.is_full_indexer_layer  # MTP layer
    explicit = llm_args.DeepSeekSparseAttentionConfig(index_topk=8)
    assert ModelConfig.from_pretrained(V32_CKPT, sparse_attention_config=explicit) \
        .sparse_attention_config.index_topk == 8
    v4cfg = llm_args.DeepSeekV4SparseAttentionConfig()       # index_topk default 512, not set
    spec = llm_args.MTPDecodingConfig(num_nextn_predict_layers=1)
    mc4 = ModelConfig.from_pretrained(V4_CKPT, sparse_attention_config=v4cfg, spec_config=spec)
    s4 = mc4.sparse_attention_config
    assert s4.index_topk == 16 and s4.indexer_k_dtype == "fp4"
    # upstream rule: the user's list wins unless the checkpoint's is longer, so the 7-entry
    # default beats this 4-layer checkpoint (real checkpoints list every layer)
    assert s4.compress_ratios == [1, 1, 4, 128, 4, 128, 4]
    v4cfg = llm_args.DeepSeekV4SparseAttentionConfig(compress_ratios=V4_CKPT["compress_ratios"])
    s4 = ModelConfig.from_pretrained(V4_CKPT, sparse_attention_config=v4cfg,
                                     spec_config=spec).sparse_attention_config
    assert s4.compress_ratios == [1, 4, 128, 4, 1]           # 0 -> 1, MTP layer padded with 1
    assert type(s4.to_sparse_params()).__name__ == "DeepSeekV4Params"


def test_model_construction_v32_v4_v41(trt):
    Indexer = imp("tensorrt_llm._torch.attention.backends.sparse.dsa").Indexer
    V4Indexer = imp("tensorrt_llm._torch.attention.backends.sparse.deepseek_v4").DeepseekV4Indexer
    llm_args = imp("tensorrt_llm.llmapi.llm_args")
    _, model, _, _ = build(trt, V32_CKPT, llm_args.DeepSeekSparseAttentionConfig(), 64, next_n=2)
    layers = model.model.layers
    assert len(layers) == 3 and layers[2].layer_idx == 2                  # MTP: num_hidden_layers
    assert all(isinstance(l.self_attn.indexer, Indexer) for l in layers)  # MTP builds one too
    assert [l.self_attn.indexer.layer_idx for l in layers] == [0, 1, 2]
    assert layers[0].self_attn.indexer.compress_ratio == 1
    v4cfg = llm_args.DeepSeekV4SparseAttentionConfig(compress_ratios=V4_CKPT["compress_ratios"])
    _, model4, _, _ = build(trt, V4_CKPT, v4cfg, 128, next_n=2)
    kinds = [type(l.self_attn.indexer).__name__ if l.self_attn.indexer else None
             for l in model4.model.layers]
    assert kinds == [None, "DeepseekV4Indexer", None, "DeepseekV4Indexer", None]
    ix = model4.model.layers[1].self_attn.indexer
    assert isinstance(ix, V4Indexer) and ix.compress_ratio == 4 and ix.compressor.is_indexer
    assert model4.model.layers[2].self_attn.mqa.compressor is not None    # ratio 128
    csa2 = imp("tensorrt_llm._torch.attention.backends.sparse.csa2")
    v41 = imp("tensorrt_llm._torch.models.modeling_deepseekv41")
    from types import SimpleNamespace
    layout = csa2.CSA2Layout(compress_ratios=[1, 2], kv_source_layer_ids=[0],
                             index_source_layer_ids=[0])
    sac = SimpleNamespace(to_sparse_params=lambda **kw: csa2.CSA2Params(layout=layout))
    pc = SimpleNamespace(hidden_size=32, num_attention_heads=2, head_dim=24, index_n_heads=64,
                         index_head_dim=128)
    attn = v41.DeepseekV41Attention(SimpleNamespace(pretrained_config=pc,
                                                    sparse_attention_config=sac), 1)
    assert attn.sparse_params.algorithm == "csa2" and not isinstance(attn.indexer, Indexer)


# pairwise coverage of key dtype x next_n x CUDA-graph padding (keeps the CPU run short)
@pytest.mark.parametrize("fp4,next_n,cuda_graph", [(False, 1, False), (False, 2, True),
                                                  (True, 1, True), (True, 2, False)])
def test_v32_decode_topk_matches_dense_reference(trt, fp4, next_n, cuda_graph):
    llm_args = imp("tensorrt_llm.llmapi.llm_args")
    cfg = llm_args.DeepSeekSparseAttentionConfig(indexer_k_dtype="fp4" if fp4 else "fp8",
                                                 skip_indexer_for_short_seqs=False)
    _, _, manager, md = run_scenario(trt, V32_CKPT, cfg, 64, next_n, cuda_graph, fp4, ratio=1)
    kv = manager.get_indexer_k_cache_buffers(0)
    assert kv.dtype == torch.uint8 and tuple(kv.shape[1:]) == (64, 1, 68 if fp4 else 132)
    assert not hasattr(md, "topk_indices_buffer")     # only with enable_indexer_skip


@pytest.mark.parametrize("tokens_per_block,fp4,next_n,cuda_graph", [
    (128, False, 1, False), (128, True, 2, True), (256, False, 2, True), (256, True, 1, False),
    (128, False, 2, False), (256, True, 2, True)])
def test_v4_decode_topk_matches_dense_reference(trt, tokens_per_block, fp4, next_n, cuda_graph):
    llm_args = imp("tensorrt_llm.llmapi.llm_args")
    cfg = llm_args.DeepSeekV4SparseAttentionConfig(indexer_k_dtype="fp4" if fp4 else "fp8",
                                                   compress_ratios=V4_CKPT["compress_ratios"])
    _, _, manager, md = run_scenario(trt, V4_CKPT, cfg, tokens_per_block, next_n, cuda_graph,
                                     fp4, ratio=4, prompts=(301, 150))
    kv = manager.get_indexer_k_cache_buffers(1)
    assert kv.dtype == torch.uint8
    assert tuple(kv.shape[1:]) == (tokens_per_block // 4, 1, 68 if fp4 else 132)
    assert md._tokens_per_block == tokens_per_block // 4
    lens = md.sparse_mla_topk_lens[4][:md.num_tokens]
    kv_len = md.kv_lens_cuda[0]
    assert int(lens[next_n - 1]) == 128 + min(int(kv_len) // 4, 16)


def test_skip_indexer_reads_topk_indices_buffer_only_with_enable_indexer_skip(trt):
    llm_args = imp("tensorrt_llm.llmapi.llm_args")
    off = llm_args.DeepSeekSparseAttentionConfig(skip_indexer_for_short_seqs=False)
    _, model, manager, md = build(trt, V32_CKPT, off, 64, next_n=1)
    run_step(model, manager, md, [1], [0], [20], num_contexts=1)

    def force_skip(md):                  # what an integration might try after prepare()
        md.skip_indexer_for_gen_reqs = True

    with pytest.raises(AttributeError, match="topk_indices_buffer"):
        run_step(model, manager, md, [1], [20], [1], num_contexts=0, before_forward=force_skip)
    on = llm_args.DeepSeekSparseAttentionConfig(skip_indexer_for_short_seqs=True)
    _, model, manager, md = build(trt, V32_CKPT, on, 64, next_n=1)
    run_step(model, manager, md, [1], [0], [20], num_contexts=1)
    run_step(model, manager, md, [1], [20], [1], num_contexts=0)     # kv 21 <= topk 24: dense
    assert md.skip_indexer_for_gen_reqs
    top = model.model.layers[0].self_attn.last_topk[0]
    assert top[:21].tolist() == list(range(21)) and bool((top[21:] == -1).all())


def test_mtp_index_sharing_and_gvr_prior(trt, monkeypatch):
    llm_args = imp("tensorrt_llm.llmapi.llm_args")
    cfg = llm_args.DeepSeekSparseAttentionConfig(skip_indexer_for_short_seqs=False,
                                                 index_share_for_mtp_iteration=True)
    _, model, manager, md = build(trt, V32_CKPT, cfg, 64, next_n=2)
    assert md.shared_topk_indices is not None
    run_step(model, manager, md, [3, 4], [0, 0], [60, 50], num_contexts=2)
    run_step(model, manager, md, [3, 4], [60, 50], [2, 2], num_contexts=0, next_n=2)
    md.set_in_mtp_draft_loop(True)                 # a draft forward: next_n 1
    run_step(model, manager, md, [3, 4], [62, 52], [1, 1], num_contexts=0, next_n=1)
    last = model.model.layers[-2].self_attn.last_topk
    assert torch.equal(md.shared_topk_indices[:2], last)     # every request's (last) row
    shared = md.shared_topk_indices[:2].clone()
    md.set_skip_topk(True)
    run_step(model, manager, md, [3, 4], [63, 53], [1, 1], num_contexts=0, next_n=1)
    for layer in model.model.layers[:2]:
        assert torch.equal(layer.self_attn.last_topk, shared)  # reused, not recomputed
    # temporal GVR: the prior buffer exists and holds each request's last decode row
    for mod in ("tensorrt_llm._torch.attention.backends.sparse.dsa.indexer",
                "tensorrt_llm._torch.attention.backends.sparse.dsa.metadata"):
        monkeypatch.setattr(imp(mod), "IS_CUTLASS_DSL_AVAILABLE", True)
        monkeypatch.setattr(imp(mod), "get_sm_version", lambda: 100)
    gvr = llm_args.DeepSeekSparseAttentionConfig(skip_indexer_for_short_seqs=False,
                                                 enable_heuristic_topk=True,
                                                 use_self_sampling_topk=False)
    _, model, manager, md = build(trt, V32_CKPT, gvr, 64, next_n=1)
    assert md.needs_gvr_prior and md.gvr_prior_indices.shape == (2, 4, 24)
    run_step(model, manager, md, [5], [0], [70], num_contexts=1)
    run_step(model, manager, md, [5], [70], [1], num_contexts=0)
    for layer in model.model.layers[:2]:
        local = manager.layer_offsets[layer.layer_idx]
        assert torch.equal(md.gvr_prior_indices[local, 0], layer.self_attn.last_topk[0])


def test_runtime_next_n_below_the_draft_cap_uses_a_schedule_built_for_the_cap(trt):
    """Observation, not an upstream-verified bug: with max_draft_tokens 3 and a runtime tier of
    next_n 2, the full-next_n schedule is built from kv_lens_cuda_2d[:, :4] while the logits call
    passes context_lens [:, :2]."""
    llm_args = imp("tensorrt_llm.llmapi.llm_args")
    deep_gemm = imp("tensorrt_llm.deep_gemm")
    cfg = llm_args.DeepSeekSparseAttentionConfig(skip_indexer_for_short_seqs=False)
    _, model, manager, md = build(trt, V32_CKPT, cfg, 64, next_n=4)
    run_step(model, manager, md, [8], [0], [40], num_contexts=1)
    deep_gemm.SCHEDULE_MISMATCHES.clear()
    md.runtime_tokens_per_gen_step = 2
    run_step(model, manager, md, [8], [40], [2], num_contexts=0, next_n=2)
    assert md.gen_token_stride == 2
    assert (4, 2) in deep_gemm.SCHEDULE_MISMATCHES


@pytest.mark.slow
def test_legacy_release_1_2_layout():
    code = textwrap.dedent("""
        import inspect, torch
        import tensorrt_llm
        from tensorrt_llm._torch.attention_backend.sparse.dsa import Indexer
        params = list(inspect.signature(Indexer.sparse_attn_indexer).parameters)
        assert params[1:8] == ["metadata", "hidden_states", "q_fp8", "k_fp8", "k_scale",
                               "weights", "use_custom_topk"], params
        init = list(inspect.signature(Indexer.__init__).parameters)
        assert "sparse_attention_config" in init and "compress_ratio" not in init, init
        from tensorrt_llm._torch.attention_backend.sparse.dsa import run_selftest
        run_selftest()
        print("legacy ok", tensorrt_llm.__version__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": str(LEGACY), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "legacy ok 1.2." in out.stdout
