"""Stand-in for tensorrt_llm/_torch/model_config.py (file version 008e0af8).

Mirrored: ModelConfig (pretrained_config, mapping, sparse_attention_config, spec_config, ...)
and ModelConfig.from_pretrained(checkpoint_dir, trust_remote_code=False, **kwargs) with
upstream's rebuild of the sparse-attention config:
- architectures[0] in ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"): a NEW
  DeepSeekSparseAttentionConfig from the fixed field list (index_n_heads / index_head_dim:
  user value `or` checkpoint; index_topk: user value only if explicitly set, else checkpoint;
  indexer_rope_interleave from the CHECKPOINT; indexer_max_chunk_size,
  skip_indexer_for_short_seqs, use_cute_dsl_topk, use_cute_dsl_paged_mqa_logits,
  q_split_threshold, enable_heuristic_topk, indexer_k_dtype, index_share_for_mtp_iteration
  copied). Every other field - use_self_sampling_topk, use_gvr_emission, and any added one
  such as `spin` - is dropped;
- "DeepseekV4ForCausalLM": a NEW DeepSeekV4SparseAttentionConfig(compress_ratios,
  window_size, indexer_k_dtype, **indexer_config) where indexer_config is the nested
  update_sparse_attention_indexer_config() list (no index_share_for_mtp_iteration); ratios
  from the checkpoint when longer, 0 -> 1, padded with 1 for one-model MTP layers.

Simplified: `checkpoint_dir` is a directory with config.json OR (stand-in only) a dict of the
checkpoint config; the pretrained config is a SimpleNamespace; no quantization, no
transformers, no remote code, no V4 base-checkpoint detection.
"""
import copy
import json
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional

from ..llmapi.llm_args import DeepSeekSparseAttentionConfig, DeepSeekV4SparseAttentionConfig
from ..mapping import Mapping


def _indexer_fields(sac, pretrained_config) -> dict:
    """The fields both rebuilds take from the user's config (index_n_heads / index_head_dim:
    user `or` checkpoint; index_topk: user only if explicitly set) or, without one, from the
    checkpoint and the defaults."""
    if not sac:
        return dict(index_n_heads=pretrained_config.index_n_heads,
                    index_head_dim=pretrained_config.index_head_dim,
                    index_topk=pretrained_config.index_topk, indexer_max_chunk_size=None,
                    skip_indexer_for_short_seqs=True, use_cute_dsl_topk=False,
                    use_cute_dsl_paged_mqa_logits=False, q_split_threshold=8192,
                    enable_heuristic_topk=False)
    return dict(index_n_heads=sac.index_n_heads or pretrained_config.index_n_heads,
                index_head_dim=sac.index_head_dim or pretrained_config.index_head_dim,
                index_topk=(sac.index_topk if "index_topk" in sac.model_fields_set
                            else pretrained_config.index_topk),
                indexer_max_chunk_size=sac.indexer_max_chunk_size,
                skip_indexer_for_short_seqs=sac.skip_indexer_for_short_seqs,
                use_cute_dsl_topk=sac.use_cute_dsl_topk,
                use_cute_dsl_paged_mqa_logits=sac.use_cute_dsl_paged_mqa_logits,
                q_split_threshold=sac.q_split_threshold,
                enable_heuristic_topk=sac.enable_heuristic_topk)


def load_pretrained_config(checkpoint_dir, **kwargs) -> SimpleNamespace:
    if isinstance(checkpoint_dir, dict):
        data = copy.deepcopy(checkpoint_dir)
    else:
        with open(os.path.join(checkpoint_dir, "config.json")) as f:
            data = json.load(f)
    return SimpleNamespace(**data)


@dataclass(kw_only=True)
class ModelConfig:
    pretrained_config: Any = None
    mapping: Mapping = field(default_factory=Mapping)
    sparse_attention_config: Any = None
    spec_config: Any = None
    max_num_tokens: int = 8192
    max_seq_len: Optional[int] = None
    attn_backend: str = "TRTLLM"
    extra_attrs: dict = field(default_factory=dict)

    @classmethod
    def from_pretrained(cls, checkpoint_dir, trust_remote_code=False, **kwargs):

        def update_sparse_attention_indexer_config(pretrained_config, kwargs):
            sac = kwargs.get("sparse_attention_config")
            cfg = _indexer_fields(sac, pretrained_config)
            cfg["indexer_rope_interleave"] = sac.indexer_rope_interleave if sac else False
            cfg["indexer_k_dtype"] = (sac.indexer_k_dtype if sac else
                                      DeepSeekV4SparseAttentionConfig().indexer_k_dtype)
            return cfg

        if checkpoint_dir is None:
            raise ValueError("checkpoint_dir is None. Cannot load model config without a valid "
                             "checkpoint directory.")
        pretrained_config = load_pretrained_config(checkpoint_dir)
        arch = pretrained_config.architectures[0]
        if arch in ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"):
            sac = kwargs.get("sparse_attention_config")
            indexer_rope_interleave = getattr(pretrained_config, "indexer_rope_interleave", False)
            values = _indexer_fields(sac, pretrained_config)
            values["indexer_k_dtype"] = sac.indexer_k_dtype if sac else "fp8"
            values["index_share_for_mtp_iteration"] = (sac.index_share_for_mtp_iteration if sac
                                                       else None)
            kwargs["sparse_attention_config"] = DeepSeekSparseAttentionConfig(
                indexer_rope_interleave=indexer_rope_interleave, **values)
        elif arch == "DeepseekV4ForCausalLM":
            indexer_config = update_sparse_attention_indexer_config(pretrained_config, kwargs)
            ckpt_ratios = getattr(pretrained_config, "compress_ratios", None)
            num_base_layers = pretrained_config.num_hidden_layers
            spec_config = kwargs.get("spec_config", None)
            if (spec_config is not None and "num_nextn_predict_layers" in
                    type(spec_config).model_fields
                    and spec_config.num_nextn_predict_layers is None):
                spec_config.num_nextn_predict_layers = getattr(pretrained_config,
                                                               "num_nextn_predict_layers", 1)
            mtp_enabled = spec_config is not None and spec_config.spec_dec_mode.is_mtp_one_model()
            sac = kwargs.get("sparse_attention_config")
            ckpt_window = getattr(pretrained_config, "window_size", None)
            if ckpt_window is None:
                ckpt_window = getattr(pretrained_config, "sliding_window", None)
            if sac:
                ratios = sac.compress_ratios
                window = sac.window_size if "window_size" in sac.model_fields_set else ckpt_window
            else:
                ratios, window = ckpt_ratios, ckpt_window
            if ckpt_ratios is not None and (ratios is None or len(ckpt_ratios) > len(ratios)):
                ratios = ckpt_ratios
            if window is None:
                window = getattr(pretrained_config, "sliding_window", None)
            if ratios is None:
                raise ValueError("DeepSeek-V4 requires per-layer `compress_ratios`")
            ratios = [r if r > 0 else 1 for r in ratios]
            if mtp_enabled:
                total = num_base_layers + spec_config.num_nextn_predict_layers
                ratios = list(ratios) + [1] * max(0, total - len(ratios))
            indexer_k_dtype = indexer_config.pop("indexer_k_dtype")
            kwargs["sparse_attention_config"] = DeepSeekV4SparseAttentionConfig(
                compress_ratios=ratios, window_size=window, indexer_k_dtype=indexer_k_dtype,
                **indexer_config)
        model_config = cls(pretrained_config=pretrained_config,
                           sparse_attention_config=kwargs.get("sparse_attention_config"),
                           spec_config=kwargs.get("spec_config"),
                           max_num_tokens=kwargs.get("max_num_tokens", 8192),
                           max_seq_len=kwargs.get("max_seq_len"))
        return model_config
