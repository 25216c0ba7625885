"""Stand-in for tensorrt_llm/_torch/attention/backends/sparse/csa2/module.py.

Mirrored: DeepseekV41Attention (the CSA2 attention component) is an nn.Module built from a
CSA2Layout and CSA2Params; it owns its own indexer (csa2/indexer.py upstream) and does NOT
derive from, or build, the DSA `Indexer`. Simplified: no forward (raises), no weights.
"""
import torch.nn as nn

from .params import CSA2Layout, CSA2Params


class CSA2Indexer(nn.Module):
    """Placeholder for csa2/indexer.py: a separate indexer class, not dsa.indexer.Indexer."""

    def __init__(self, layer_idx: int, index_heads: int, index_head_dim: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.index_heads = index_heads
        self.index_head_dim = index_head_dim


class DeepseekV41Attention(nn.Module):
    def __init__(self, layout: CSA2Layout, layer_idx: int, positional=None, *, hidden_size: int,
                 num_heads: int, head_dim: int, index_heads: int, index_head_dim: int,
                 sparse_params: CSA2Params, **kwargs):
        super().__init__()
        if not isinstance(sparse_params, CSA2Params):
            raise TypeError("DeepSeek-V4.1 attention needs CSA2Params")
        self.layout = layout
        self.layer_idx = layer_idx
        self.compress_ratio = layout.compress_ratios[layer_idx]
        self.indexer = CSA2Indexer(layer_idx, index_heads, index_head_dim)

    def forward(self, hidden_states, position_ids, attn_metadata):
        raise NotImplementedError("stand-in: the CSA2 backend is not modelled")
