"""Stand-in for tensorrt_llm/llmapi/llm_args.py (file version 00043967).

Mirrored: StrictBaseModel (extra="forbid"); BaseSparseAttentionConfig,
SeqLenAwareSparseAttentionConfig, DeepSeekSparseAttentionConfig and
DeepSeekV4SparseAttentionConfig with upstream's fields, defaults, validators (the SM check
of indexer_k_dtype is skipped without CUDA, as upstream), _is_full_indexer_layer,
to_sparse_params() and to_sparse_metadata_params().

Simplified / UNVERIFIED:
- The union: upstream's declaration was not found in the text read. Here it is
  `SparseAttentionConfig = Annotated[Union[Rocket, DSA, DSv4], Field(discriminator="algorithm")]`,
  the type of `BaseLlmArgs.sparse_attention_config`. Other algorithms are omitted.
- KvCacheConfig, CudaGraphConfig (= DecodeCudaGraphConfig), MTPDecodingConfig, BaseLlmArgs and
  TorchLlmArgs carry only the fields the sparse-attention path reads. Their defaults
  (tokens_per_block 32, max_seq_len, ...) are the stand-in's, not verified.
- Newer main may add V4.1 fields (variant="v41", kv_source_layer_ids, ...) to the V4 config;
  they are not here (see _torch/attention/backends/sparse/csa2/).
- The DSAParams / DeepSeekV4Params keyword lists are built by one helper here (upstream spells
  them out twice); the values are upstream's.
"""
from typing import Annotated, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StrictBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BaseSparseAttentionConfig(StrictBaseModel):
    algorithm: str

    def supports_backend(self, backend: str) -> bool:
        return True

    def to_sparse_params(self, **kwargs):
        raise NotImplementedError(
            f"{type(self).__name__} does not implement SparseParams lowering.")

    def to_sparse_metadata_params(self, **kwargs):
        return None

    def _resolve_checkpoint_defaults(self, pretrained_config: object):
        return self


class SeqLenAwareSparseAttentionConfig(BaseSparseAttentionConfig):
    seq_len_threshold: Optional[int] = None

    def get_indices_block_size(self) -> int:
        return 1

    def needs_separate_short_long_cuda_graphs(self) -> bool:
        return False


class RocketSparseAttentionConfig(SeqLenAwareSparseAttentionConfig):
    """Present only so the union has a non-DeepSeek member, as upstream's does."""
    algorithm: Literal["rocket"] = "rocket"
    window_size: Optional[int] = 32


def _lookup(config, pretrained_config, name: str, default=None):
    """The config's value, else the checkpoint's (upstream's `_value` helper)."""
    value = getattr(config, name)
    if value is not None:
        return value
    if pretrained_config is not None:
        return getattr(pretrained_config, name, default)
    return default


class DeepSeekSparseAttentionConfig(SeqLenAwareSparseAttentionConfig):
    algorithm: Literal["dsa"] = "dsa"
    index_n_heads: Optional[int] = None
    index_head_dim: Optional[int] = None
    index_topk: Optional[int] = None
    indexer_max_chunk_size: Optional[int] = None
    skip_indexer_for_short_seqs: bool = True
    use_cute_dsl_topk: bool = False
    use_cute_dsl_paged_mqa_logits: bool = False
    q_split_threshold: int = 8192
    indexer_rope_interleave: bool = False
    enable_heuristic_topk: bool = False
    use_self_sampling_topk: bool = True
    use_gvr_emission: bool = False
    indexer_k_dtype: Literal["fp8", "fp4"] = "fp8"
    index_share_for_mtp_iteration: Optional[bool] = None

    @model_validator(mode="after")
    def _validate_indexer_k_dtype(self):
        if self.indexer_k_dtype == "fp4" and self.index_head_dim is not None \
                and self.index_head_dim != 128:
            raise ValueError(f"indexer_k_dtype='fp4' requires index_head_dim=128, "
                             f"got {self.index_head_dim}.")
        return self          # the SM>=100 check runs only when CUDA is available (never here)

    def supports_backend(self, backend: str) -> bool:
        return backend == "pytorch"

    def needs_separate_short_long_cuda_graphs(self) -> bool:
        self.seq_len_threshold = self.index_topk
        return self.skip_indexer_for_short_seqs

    @staticmethod
    def _is_full_indexer_layer(pretrained_config, layer_idx) -> bool:
        if pretrained_config is None or layer_idx is None:
            return True
        n = getattr(pretrained_config, "num_hidden_layers", None)
        if n is not None and layer_idx >= n:
            return True                                   # MTP / nextn layer
        pattern = getattr(pretrained_config, "index_topk_pattern", None)
        if pattern is not None:
            full = not (layer_idx < len(pattern) and str(pattern[layer_idx]).upper() == "S")
        else:
            freq = max(getattr(pretrained_config, "index_topk_freq", 1) or 1, 1)
            offset = getattr(pretrained_config, "index_skip_topk_offset", 2)
            full = (max(layer_idx - offset + 1, 0) % freq) == 0
        return True if layer_idx == 0 else full

    def _indexer_params(self, pc) -> dict:
        """The keyword arguments DSAParams and DeepSeekV4Params take alike."""
        return dict(
            index_n_heads=_lookup(self, pc, "index_n_heads"),
            index_head_dim=_lookup(self, pc, "index_head_dim"),
            index_topk=_lookup(self, pc, "index_topk"),
            indexer_max_chunk_size=self.indexer_max_chunk_size,
            skip_indexer_for_short_seqs=self.skip_indexer_for_short_seqs,
            use_cute_dsl_topk=self.use_cute_dsl_topk,
            use_cute_dsl_paged_mqa_logits=self.use_cute_dsl_paged_mqa_logits,
            q_split_threshold=self.q_split_threshold,
            indexer_rope_interleave=self.indexer_rope_interleave,
            enable_heuristic_topk=self.enable_heuristic_topk,
            use_self_sampling_topk=self.use_self_sampling_topk,
            use_gvr_emission=self.use_gvr_emission,
            indexer_k_dtype=self.indexer_k_dtype)

    def _metadata_params(self, pc) -> dict:
        """The keyword arguments DSAMetadataParams and DeepSeekV4MetadataParams take alike."""
        return dict(
            indexer_max_chunk_size=self.indexer_max_chunk_size or 32768,
            max_sparse_topk=_lookup(self, pc, "index_topk"),
            index_head_dim=_lookup(self, pc, "index_head_dim", 128),
            enable_indexer_skip=self.skip_indexer_for_short_seqs,
            enable_heuristic_topk=self.enable_heuristic_topk,
            use_self_sampling_topk=self.use_self_sampling_topk,
            use_gvr_emission=self.use_gvr_emission,
            use_cute_dsl_topk=self.use_cute_dsl_topk,
            use_cute_dsl_paged_mqa_logits=self.use_cute_dsl_paged_mqa_logits,
            q_split_threshold=self.q_split_threshold)

    def to_sparse_params(self, **kwargs):
        from tensorrt_llm._torch.attention.backends.sparse.dsa import DSAParams
        pc = kwargs.get("pretrained_config", None)
        return DSAParams(
            **self._indexer_params(pc),
            is_full_indexer_layer=self._is_full_indexer_layer(pc, kwargs.get("layer_idx")),
            mtp_index_share=bool(_lookup(self, pc, "index_share_for_mtp_iteration", False)))

    def to_sparse_metadata_params(self, **kwargs):
        from tensorrt_llm._torch.attention.backends.sparse.dsa import DSAMetadataParams
        pc = kwargs.get("pretrained_config", None)
        num_layers = getattr(pc, "num_hidden_layers", None)
        shared = num_layers is not None and any(
            not self._is_full_indexer_layer(pc, i) for i in range(num_layers))
        return DSAMetadataParams(
            **self._metadata_params(pc), has_shared_indexer_layers=shared,
            mtp_index_share=bool(_lookup(self, pc, "index_share_for_mtp_iteration", False)))


class DeepSeekV4SparseAttentionConfig(DeepSeekSparseAttentionConfig):
    algorithm: Literal["deepseek_v4"] = "deepseek_v4"
    index_head_dim: Optional[int] = 128
    indexer_k_dtype: Literal["fp8", "fp4"] = "fp4"
    skip_indexer_for_short_seqs: bool = False
    compress_ratios: List[int] = Field(default_factory=lambda: [1, 1, 4, 128, 4, 128, 4])
    window_size: int = 128
    index_topk: Optional[int] = 512

    @field_validator("index_head_dim")
    @classmethod
    def validate_index_head_dim(cls, index_head_dim):
        if index_head_dim is None:
            raise ValueError("index_head_dim is required for DeepSeek-V4 sparse attention.")
        return index_head_dim

    @field_validator("compress_ratios")
    @classmethod
    def normalize_compress_ratios(cls, compress_ratios):
        if not compress_ratios:
            raise ValueError("compress_ratios must not be empty.")
        if any(r < 0 for r in compress_ratios):
            raise ValueError("compress_ratios must be non-negative.")
        return [1 if r == 0 else r for r in compress_ratios]

    def needs_separate_short_long_cuda_graphs(self) -> bool:
        return False

    def to_sparse_params(self, **kwargs):
        from tensorrt_llm._torch.attention.backends.sparse.deepseek_v4 import DeepSeekV4Params
        pc = kwargs.get("pretrained_config", None)
        return DeepSeekV4Params(**self._indexer_params(pc), compress_ratios=self.compress_ratios,
                                window_size=self.window_size)

    def to_sparse_metadata_params(self, **kwargs):
        from tensorrt_llm._torch.attention.backends.sparse.deepseek_v4 import \
            DeepSeekV4MetadataParams
        pc = kwargs.get("pretrained_config", None)
        return DeepSeekV4MetadataParams(**self._metadata_params(pc),
                                        compress_ratios=self.compress_ratios,
                                        window_size=self.window_size)


SparseAttentionConfig = Annotated[
    Union[RocketSparseAttentionConfig, DeepSeekSparseAttentionConfig,
          DeepSeekV4SparseAttentionConfig],
    Field(discriminator="algorithm"),
]


class KvCacheConfig(StrictBaseModel):
    tokens_per_block: int = 32
    max_tokens: Optional[int] = None
    enable_block_reuse: bool = False
    free_gpu_memory_fraction: Optional[float] = None


class DecodeCudaGraphConfig(StrictBaseModel):
    mode: Literal["decode"] = "decode"
    batch_sizes: Optional[List[int]] = None
    max_batch_size: int = 0
    enable_padding: bool = False


CudaGraphConfig = DecodeCudaGraphConfig


class _SpecDecMode:
    def __init__(self, name: str):
        self.name = name

    def is_mtp_one_model(self) -> bool:
        return self.name == "MTP"


class MTPDecodingConfig(StrictBaseModel):
    decoding_type: Literal["MTP"] = "MTP"
    num_nextn_predict_layers: Optional[int] = None
    max_draft_len: Optional[int] = None
    use_relaxed_acceptance_for_thinking: bool = False

    @property
    def spec_dec_mode(self) -> _SpecDecMode:
        return _SpecDecMode("MTP")

    @model_validator(mode="after")
    def _draft_len(self):
        if self.max_draft_len is None and self.num_nextn_predict_layers is not None:
            self.max_draft_len = self.num_nextn_predict_layers
        return self


class BaseLlmArgs(StrictBaseModel):
    model: str
    backend: Optional[str] = None
    max_batch_size: Optional[int] = 8
    max_num_tokens: Optional[int] = 8192
    max_seq_len: Optional[int] = None
    kv_cache_config: KvCacheConfig = Field(default_factory=KvCacheConfig)
    speculative_config: Optional[MTPDecodingConfig] = None
    sparse_attention_config: Optional[SparseAttentionConfig] = None


class TorchLlmArgs(BaseLlmArgs):
    backend: Literal["pytorch"] = "pytorch"
    cuda_graph_config: Optional[CudaGraphConfig] = Field(default_factory=CudaGraphConfig)
    disable_overlap_scheduler: bool = False
    attn_backend: str = "TRTLLM"


LlmArgs = TorchLlmArgs
