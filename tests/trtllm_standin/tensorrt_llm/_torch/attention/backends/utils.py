"""Stand-in for the attention-backend factory (`get_attention_backend`).

UNVERIFIED location: upstream's factory (historically tensorrt_llm/_torch/attention_backend/
utils.py; now under attention/backends/ and sparse/registry.py) was not read. It maps
("TRTLLM", sparse_attention_config) to the backend class whose `.Metadata` the model engine
instantiates: DSATrtllmAttention for algorithm "dsa", DeepseekV4TrtllmAttention for
"deepseek_v4".
"""


def get_attention_backend(backend_name: str = "TRTLLM", sparse_attn_config=None):
    if backend_name != "TRTLLM":
        raise ValueError(f"stand-in: only the TRTLLM backend ({backend_name})")
    algorithm = getattr(sparse_attn_config, "algorithm", None)
    if algorithm == "dsa":
        from .sparse.dsa import DSATrtllmAttention
        return DSATrtllmAttention
    if algorithm == "deepseek_v4":
        from .sparse.deepseek_v4 import DeepseekV4TrtllmAttention
        return DeepseekV4TrtllmAttention
    raise ValueError(f"stand-in: no backend for sparse algorithm {algorithm!r}")
