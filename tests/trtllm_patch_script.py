"""Run by test_trtllm_patch in a subprocess with tests/fake_trtllm on sys.path."""

import json
import sys
from types import SimpleNamespace

import torch

import spin_trtllm.trtllm as spin_trt
from spin_trtllm import SpinConfig
from spin_trtllm.integrations.trtllm.adapter import DecodeBatch, SpinDecodeAdapter
from tensorrt_llm._torch.attention.backends.sparse.dsa.indexer import Indexer
from tensorrt_llm._torch.attention.backends.sparse.dsa.metadata import (
    DSAtrtllmAttentionMetadata, cache_manager)
from tensorrt_llm.llmapi.llm_args import TorchLlmArgs

sparsity = float(sys.argv[1])
report = {"patched": spin_trt.activate(), "again": spin_trt.activate()}
args = TorchLlmArgs(sparse_attention_config={
    "algorithm": "dsa", "index_topk": 64,
    "spin": {"target_sparsity": sparsity, "exploration": 0.1, "seed": 3}})
try:
    TorchLlmArgs(sparse_attention_config={"algorithm": "dsa", "spin": {"sparsity": 0.3}})
except Exception as err:   # pydantic's ValidationError names the bad key
    report["bad_key_error"] = str(err).splitlines()[1:3]
params = args.sparse_attention_config.to_sparse_params()
report["spin_on_params"] = params.spin.target_sparsity
L, PAGES, R = 2, 12, 2
layers = [Indexer(None, None, None, False, params, torch.float32, layer_idx=i) for i in range(L)]
g = torch.Generator().manual_seed(0)
caches = []
for _ in range(L):
    rows = (torch.randn(3 * PAGES, 64 * 128, generator=g)).to(torch.float8_e4m3fn).view(torch.uint8)
    scales = (torch.rand(3 * PAGES, 64, generator=g) * 0.01 + 0.001).view(torch.uint8)
    caches.append(torch.cat([rows, scales], 1).view(-1, 64, 1, 132))
table = torch.stack([torch.randperm(3 * PAGES, generator=g)[:PAGES] for _ in range(3)]).to(torch.int32)


manager = cache_manager(PAGES * 64, caches)      # one per model, shared by its metadata objects


def metadata(step, kv_manager=manager):
    # request 9 in prefill (a 5-token chunk), 4 and 6 decoding with next_n = 2
    kv_gen = [500 + 2 * step, 700 + 3 * step]
    return DSAtrtllmAttentionMetadata(
        num_contexts=1, num_generations=2, request_ids=[9, 4, 6], max_num_sequences=4,
        kv_cache_params=SimpleNamespace(num_cached_tokens_per_seq=[0] + [k - R for k in kv_gen]),
        seq_lens_kv=torch.tensor([5, R, R]), indexer_k_cache_block_offsets=table,
        kv_cache_manager=kv_manager)


direct = SpinDecodeAdapter(SpinConfig(index_topk=64, target_sparsity=sparsity, exploration=0.1,
                                      seed=3), L, 4, R, PAGES * 64, device="cpu",
                           initial_capacity=PAGES * 64 + 1 + R)
same, dense_equal = True, True
for step in range(4):
    md = metadata(step)
    md.prepare()
    q = (torch.randn(5 + 2 * R, 64, 128, generator=g)).to(torch.float8_e4m3fn)
    w = torch.randn(5 + 2 * R, 64, generator=g)
    hidden = torch.zeros(5 + 2 * R, 8)
    direct.begin_step(DecodeBatch([4, 6], md.kv_lens[1:], table[1:]))
    for i, layer in enumerate(layers):
        out = layer.sparse_attn_indexer(md, hidden, q, None, None, w)
        same &= bool((out[:5] == -7).all())          # context rows left to upstream
        ref = direct.layer(i, q[5:].contiguous(), w[5:].contiguous(), caches[i])
        same &= torch.equal(out[5:], ref)
        # the dense top-K: upstream's path, through a layer built without a spin block
        plain = metadata(step, cache_manager(PAGES * 64, caches))
        plain.prepare()
        dense_layer = Indexer(None, None, None, False, type(params)(64), torch.float32,
                              layer_idx=i)
        dense_out = dense_layer.sparse_attn_indexer(plain, hidden, q, None, None, w)
        dense_equal &= torch.equal(out[5:], dense_out[5:])
report["matches_adapter"] = same
report["equals_dense"] = dense_equal
print(json.dumps(report))
