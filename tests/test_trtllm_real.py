"""With TensorRT-LLM installed (`pytest -m trtllm`, skipped elsewhere): SPIN inside a real LLM.

A tiny DeepSeek-V3.2-shaped checkpoint config with dummy (random) weights; greedy decoding.
"""

import json

import pytest

trtllm = pytest.importorskip("tensorrt_llm", reason="needs tensorrt_llm")
torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.trtllm, pytest.mark.gpu]

TINY_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": True,
    "q_lora_rank": 128, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 32,
    "v_head_dim": 32, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 64,
    "max_position_embeddings": 8192, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "tie_word_embeddings": False,
}


def generate(model_dir, spin):
    import spin_trtllm.trtllm  # noqa: F401
    from tensorrt_llm import LLM, SamplingParams

    block = {"algorithm": "dsa", "index_topk": 64}
    if spin is not None:
        block["spin"] = spin
    llm = LLM(model=str(model_dir), load_format="dummy", max_batch_size=4, max_seq_len=4096,
              sparse_attention_config=block)
    prompts = [[(7 * i + j) % 1000 + 1 for j in range(1500 + 300 * i)] for i in range(3)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0))
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_v32")
    (d / "config.json").write_text(json.dumps(TINY_V32))
    return d


def test_spin_at_zero_sparsity_reproduces_the_dense_indexer(model_dir):
    assert generate(model_dir, {"target_sparsity": 0.0}) == generate(model_dir, None)


def test_spin_runs_and_prunes(model_dir):
    from spin_trtllm.integrations.trtllm import patch

    out = generate(model_dir, {"target_sparsity": 0.5, "exploration": 0.0})
    assert all(len(t) == 24 for t in out)
    assert patch._LAYERS, "no indexer layer picked up the spin block"
