"""Stand-in for tensorrt_llm/_torch/models/modeling_deepseekv4.py (DeepSeek-V4).

UNVERIFIED: modeling_deepseekv4.py itself was not read. Construction follows the V4 backend
(deepseek_v4/backend.py @1a681e4c): every layer gets a DeepseekV4TrtllmAttention; only layers
with compress_ratios[layer_idx] == 4 get a DeepseekV4Indexer (with its own indexer
Compressor); layers with ratio > 1 get a main-KV Compressor; MTP layers are appended with
ratio 1 (from_pretrained pads compress_ratios with 1), hence no indexer.
Names mirrored: DeepseekV4ForCausalLM, DeepseekV4Model, DeepseekV4DecoderLayer,
_deepseek_v4_layer_compress_ratio.

Simplified as modeling_deepseekv3.py (no mHC, MoE, norms, RoPE, LM head).
"""
from .modeling_deepseekv3 import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM, DeepseekV3Model


def _deepseek_v4_layer_compress_ratio(config, model_config, layer_idx) -> int:
    return model_config.sparse_attention_config.compress_ratios[layer_idx]


class DeepseekV4DecoderLayer(DeepseekV3DecoderLayer):
    pass


class DeepseekV4Model(DeepseekV3Model):
    decoder_layer_class = DeepseekV4DecoderLayer


class DeepseekV4ForCausalLM(DeepseekV3ForCausalLM):
    model_class, mtp_layer_class = DeepseekV4Model, DeepseekV4DecoderLayer
