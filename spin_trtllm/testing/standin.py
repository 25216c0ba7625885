"""The TensorRT-LLM stand-in (tests/trtllm_standin) in tests: importing it as `tensorrt_llm`,
building a model, cache manager and metadata from a checkpoint config, running forward steps,
and a dense reference for every indexer layer's top-K written from the key-format contract (its
own quantizers, its own logits), independent of the stand-in's code and of SPIN's.
"""

import contextlib
import importlib
import sys

import torch

SPIN_MODULES = ("spin_trtllm.trtllm", "spin_trtllm.integrations.trtllm.patch",
                "spin_trtllm.integrations.trtllm.runtime")


def imp(name):
    return importlib.import_module(name)


def _standin_module(name, also):
    return name == "tensorrt_llm" or name.startswith("tensorrt_llm.") or name in also


@contextlib.contextmanager
def imported_standin(path, purge=()):
    """Import the stand-in at `path` as `tensorrt_llm`, with fresh copies of the modules named
    in `purge`; restores sys.modules and sys.path after."""
    saved = {k: v for k, v in sys.modules.items() if _standin_module(k, purge)}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(path))
    try:
        yield importlib.import_module("tensorrt_llm")
    finally:
        sys.path.remove(str(path))
        for k in [k for k in sys.modules if _standin_module(k, purge)]:
            del sys.modules[k]
        sys.modules.update(saved)


# ---- independent reference: key formats and logits ----------------------------------------
def ref_fp8(x):
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(-1, keepdim=True).clamp(min=1e-4)
                                             / 448.0)))
    return (x / scale).to(torch.float8_e4m3fn).float() * scale


GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def ref_fp4(x):
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True)
                                             .clamp(min=1e-4) / 6.0)))
    y = blocks / scale
    code = (y.abs()[..., None] > (GRID[1:] + GRID[:-1]) / 2).sum(-1)   # round to nearest
    return (torch.sign(y) * GRID[code] * scale).reshape(x.shape)


def ref_quant(x, fp4):
    return ref_fp4(x) if fp4 else ref_fp8(x)


def check_row(sel, logits, cand, k, what):
    """sel: one top-K row; logits: reference scores of the row's visible positions; cand: the
    positions allowed to compete (all visible ones for the dense indexer)."""
    sel = sel[sel >= 0].tolist()
    cand = [int(c) for c in cand]
    if len(cand) <= k:
        assert sorted(sel) == cand, f"{what}: a short row keeps every allowed position"
        return
    assert len(sel) == k and len(set(sel)) == k and set(sel) <= set(cand), \
        f"{what}: bad selection"
    chosen = torch.zeros(logits.shape[0], dtype=torch.bool)
    chosen[sel] = True
    rest = torch.zeros_like(chosen)
    rest[cand] = True
    rest &= ~chosen
    tol = 1e-4 * float(logits.abs().max()) + 1e-5
    assert float(logits[chosen].min()) >= float(logits[rest].max()) - tol, \
        f"{what}: a better position was left out"


class Recorder:
    """Captures each indexer call's inputs (forward pre-hook) to rebuild keys independently."""

    def __init__(self, model):
        self.calls = {}
        for layer in model.model.layers:
            ix = layer.self_attn.indexer
            if ix is not None:
                ix.register_forward_pre_hook(self._hook(ix.layer_idx))

    def _hook(self, layer_idx):
        def hook(module, args):
            qr, hidden, md = args[0], args[1], args[2]
            self.calls.setdefault(layer_idx, []).append(
                (qr.detach().clone(), hidden.detach().clone(), list(md.request_ids),
                 md.seq_lens.tolist(), list(md.kv_cache_params.num_cached_tokens_per_seq)))
        return hook


def reference_check(model, rec, fp4, ratio, dummy_id, allowed=None):
    """Check the last call of every indexer layer against the dense reference; `allowed`
    (layer_idx, request, row, n) -> positions narrows what may compete (SPIN's blocks)."""
    checked = 0
    for layer in model.model.layers[:model.model.num_hidden_layers]:
        ix = layer.self_attn.indexer
        if ix is None:
            continue
        history = {}                      # request -> list of hidden rows (all steps so far)
        for qr, hidden, rids, lens, cached in rec.calls[ix.layer_idx]:
            off = 0
            for rid, n, c in zip(rids, lens, cached):
                if rid != dummy_id:
                    rows = history.setdefault(rid, [])
                    assert sum(len(r) for r in rows) == c, "recorder out of step with the cache"
                    rows.append(hidden[off:off + n])
                    history[rid] = [torch.cat(rows)]
                off += n
        qr, hidden, rids, lens, cached = rec.calls[ix.layer_idx][-1]
        with torch.no_grad():
            if ratio == 1:
                project = ix.wk
            else:
                project = ix.compressor.wkv
            q = ref_quant(ix.wq_b(qr.float()).view(-1, ix.n_heads, ix.head_dim), fp4)
            w = ix.weights_proj(hidden.float()) * ix.weight_scale_factor
            topk = layer.self_attn.last_topk
            off = 0
            for rid, n_new, c in zip(rids, lens, cached):
                if rid == dummy_id:
                    sel = topk[off:off + n_new]
                    assert bool(((sel >= -1) & (sel < max(n_new, 1))).all()), "padding row"
                    off += n_new
                    continue
                tokens = project(history[rid][0].float())                 # [kv, D]
                if ratio > 1:
                    whole = tokens.shape[0] // ratio
                    tokens = tokens[:whole * ratio].view(whole, ratio, -1).mean(1)
                keys = ref_quant(tokens, fp4)
                rows = slice(off, off + n_new)
                scores = torch.relu(torch.einsum("thd,nd->thn", q[rows], keys))
                logits = (scores * w[rows][:, :, None]).sum(1)               # [n_new, kv']
                for j in range(n_new):
                    n = (c + j + 1) // ratio
                    cand = range(n) if allowed is None else allowed(ix.layer_idx, rid, j, n)
                    check_row(topk[off + j], logits[j, :n], cand, ix.index_topk,
                              f"layer {ix.layer_idx} request {rid} row {j}")
                    checked += 1
                off += n_new
    return checked


# ---- building blocks -----------------------------------------------------------------------
V32_CKPT = dict(architectures=["DeepseekV32ForCausalLM"], hidden_size=32, num_hidden_layers=2,
                num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                index_n_heads=64, index_head_dim=128, index_topk=24, vocab_size=97,
                num_nextn_predict_layers=1)
V4_CKPT = dict(V32_CKPT, architectures=["DeepseekV4ForCausalLM"], num_hidden_layers=4,
               compress_ratios=[0, 4, 128, 4], window_size=128, index_topk=16)


def build(trt, ckpt, sparse_cfg, tokens_per_block, next_n, max_seq_len=512, batch=4,
          cuda_graph=False, max_num_tokens=1024):
    llm_args = imp("tensorrt_llm.llmapi.llm_args")
    ModelConfig = imp("tensorrt_llm._torch.model_config").ModelConfig
    spec = (llm_args.MTPDecodingConfig(num_nextn_predict_layers=next_n - 1) if next_n > 1
            else None)
    args = llm_args.TorchLlmArgs(model="ckpt", max_seq_len=max_seq_len, max_batch_size=batch,
                                 kv_cache_config=llm_args.KvCacheConfig(
                                     tokens_per_block=tokens_per_block),
                                 sparse_attention_config=sparse_cfg, speculative_config=spec)
    mc = ModelConfig.from_pretrained(ckpt, sparse_attention_config=args.sparse_attention_config,
                                     spec_config=args.speculative_config)
    torch.manual_seed(0)
    v4 = ckpt["architectures"][0] == "DeepseekV4ForCausalLM"
    if v4:
        model = imp("tensorrt_llm._torch.models.modeling_deepseekv4").DeepseekV4ForCausalLM(mc)
        manager_cls = imp(
            "tensorrt_llm._torch.attention.backends.sparse.deepseek_v4").DeepseekV4CacheManager
        extra = dict(sparse_attn_config=mc.sparse_attention_config)
    else:
        model = imp("tensorrt_llm._torch.models.modeling_deepseekv3").DeepseekV3ForCausalLM(mc)
        manager_cls = imp("tensorrt_llm._torch.attention.backends.sparse.dsa").DSACacheManager
        extra = dict(sparse_attention_config=mc.sparse_attention_config,
                     pretrained_config=mc.pretrained_config)
    pc = mc.pretrained_config
    manager = manager_cls(args.kv_cache_config, None, num_layers=pc.num_hidden_layers,
                          num_kv_heads=1, head_dim=pc.kv_lora_rank + pc.qk_rope_head_dim,
                          tokens_per_block=tokens_per_block, max_seq_len=max_seq_len,
                          max_batch_size=batch, spec_config=spec, **extra)
    backend = imp("tensorrt_llm._torch.attention.backends.utils").get_attention_backend(
        "TRTLLM", mc.sparse_attention_config)
    buffers = imp("tensorrt_llm._torch.memory_buffer_utils").Buffers() if cuda_graph else None
    md = backend.Metadata(max_num_requests=batch, max_num_tokens=max_num_tokens,
                          kv_cache_manager=manager,
                          sparse_attention_config=mc.sparse_attention_config,
                          is_cuda_graph=cuda_graph, cuda_graph_buffers=buffers)
    if next_n > 1:
        md.update_spec_dec_param(batch, True, False, False, next_n - 1, next_n - 1)
    return mc, model, manager, md


def run_step(model, manager, md, requests, cached, new, num_contexts, dummy=0, next_n=1,
             before_forward=None):
    """One forward: requests (ids) with cached / new token counts; `dummy` padding rows."""
    KVCacheParams = imp("tensorrt_llm._torch.metadata").KVCacheParams
    cgr = imp("tensorrt_llm._torch.pyexecutor.cuda_graph_runner")
    ids, cached, new = list(requests), list(cached), list(new)
    for rid, c, n in zip(ids, cached, new):
        manager.add_sequence(rid, c + n)
    if dummy:
        did = cgr.padding_dummy_request(manager, max_draft_tokens=next_n - 1)
        ids += [did] * dummy
        cached += [0] * dummy
        new += [next_n] * dummy
    md.request_ids = ids
    md.prompt_lens = [c + n for c, n in zip(cached, new)]
    md.num_contexts = num_contexts
    md.seq_lens = torch.tensor(new, dtype=torch.int32)
    md.kv_cache_params = KVCacheParams(use_cache=True, num_cached_tokens_per_seq=cached)
    md.prepare()
    if before_forward is not None:
        before_forward(md)
    tokens = torch.randint(0, 97, (sum(new),))
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)])
    with torch.no_grad():
        return model(tokens, positions, md)


def sparse_config(v4, fp4=False, spin=None, **kw):
    llm_args = importlib.import_module("tensorrt_llm.llmapi.llm_args")
    block = {} if spin is None else {"spin": {"target_sparsity": 0.5, "exploration": 0.0, **spin}}
    dtype = "fp4" if fp4 else "fp8"
    if v4:
        return llm_args.DeepSeekV4SparseAttentionConfig(
            indexer_k_dtype=dtype, compress_ratios=V4_CKPT["compress_ratios"], **block, **kw)
    return llm_args.DeepSeekSparseAttentionConfig(indexer_k_dtype=dtype,
                                                  skip_indexer_for_short_seqs=False, **block, **kw)
