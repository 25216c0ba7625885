"""Stand-in for tensorrt_llm/_torch/models/modeling_deepseekv41.py (version f8ad1603).

Mirrored: DeepseekV41Attention(CSA2Attention), where CSA2Attention is
attention/backends/sparse/csa2/module.py DeepseekV41Attention; it is built from
`model_config.sparse_attention_config.to_sparse_params(pretrained_config=config)`, which must
lower to CSA2Params (algorithm "csa2"), and `params.layout`. No DSA Indexer anywhere on this
path. Simplified: no Engram, mHC, decoder replay or weights; only the attention adapter.
"""
from ..attention.backends.sparse.csa2.module import DeepseekV41Attention as CSA2Attention


class DeepseekV41Attention(CSA2Attention):
    def __init__(self, model_config, layer_idx, aux_stream_dict=None, reduce_output=True):
        config = model_config.pretrained_config
        sparse_config = model_config.sparse_attention_config
        if sparse_config is None:
            raise ValueError("DeepSeek-V4.1 requires CSA2 sparse attention configuration")
        params = sparse_config.to_sparse_params(pretrained_config=config)
        super().__init__(params.layout, layer_idx, None, hidden_size=config.hidden_size,
                         num_heads=config.num_attention_heads, head_dim=config.head_dim,
                         index_heads=config.index_n_heads, index_head_dim=config.index_head_dim,
                         sparse_params=params)
        self.sparse_params = params
        self.reduce_output = reduce_output
