"""Stand-in for tensorrt_llm/_torch/models/modeling_deepseekv3.py (DeepSeek-V3.2 with DSA).

UNVERIFIED: modeling_deepseekv3.py itself was not read. The construction follows what the
backends show: every decoder layer's MLA builds a DSATrtllmAttention, which builds an
`Indexer` on full-indexer layers (every layer of V3.2) with `to_sparse_params(layer_idx=...)`;
the one-model MTP layer(s) get layer_idx = num_hidden_layers + i and are always "full", so they
build an Indexer too. Names mirrored: DeepseekV3ForCausalLM, DeepseekV3Model,
DeepseekV3DecoderLayer, DeepseekV3MTP.

Simplified: no MoE, norms, RoPE or LM head; a decoder layer is residual + MLA; MTP layers are
built (appended to model.layers) but forward() runs only the base layers.
"""
import torch.nn as nn

from ..modules.attention import MLA


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, model_config, layer_idx: int, aux_stream_dict=None):
        super().__init__()
        config = model_config.pretrained_config
        self.layer_idx = layer_idx
        sparse_params = model_config.sparse_attention_config.to_sparse_params(
            pretrained_config=config, layer_idx=layer_idx)
        self.self_attn = MLA(hidden_size=config.hidden_size,
                             num_attention_heads=config.num_attention_heads,
                             qk_nope_head_dim=config.kv_lora_rank,
                             qk_rope_head_dim=config.qk_rope_head_dim,
                             v_head_dim=config.kv_lora_rank, q_lora_rank=config.q_lora_rank,
                             kv_lora_rank=config.kv_lora_rank, layer_idx=layer_idx,
                             model_config=model_config, sparse_params=sparse_params)

    def forward(self, position_ids, hidden_states, attn_metadata):
        return hidden_states + self.self_attn(position_ids, hidden_states, attn_metadata)


class DeepseekV3MTP(DeepseekV3DecoderLayer):
    """One-model MTP layer: layer_idx = num_hidden_layers + i."""


class DeepseekV3Model(nn.Module):
    decoder_layer_class = DeepseekV3DecoderLayer

    def __init__(self, model_config):
        super().__init__()
        config = model_config.pretrained_config
        self.num_hidden_layers = config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer_class(model_config, i)
                                    for i in range(config.num_hidden_layers))

    def forward(self, input_ids, position_ids, attn_metadata):
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers[:self.num_hidden_layers]:
            hidden = layer(position_ids, hidden, attn_metadata)
        return hidden


class DeepseekV3ForCausalLM(nn.Module):
    model_class, mtp_layer_class = DeepseekV3Model, DeepseekV3MTP

    def __init__(self, model_config):
        super().__init__()
        self.model_config = model_config
        self.model = self.model_class(model_config)
        spec = model_config.spec_config
        if spec is not None and spec.spec_dec_mode.is_mtp_one_model():
            n = model_config.pretrained_config.num_hidden_layers
            for i in range(spec.num_nextn_predict_layers):
                self.model.layers.append(self.mtp_layer_class(model_config, n + i))

    def forward(self, input_ids, position_ids, attn_metadata):
        return self.model(input_ids, position_ids, attn_metadata)
