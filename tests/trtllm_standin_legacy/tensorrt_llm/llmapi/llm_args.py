"""Stand-in for tensorrt_llm/llmapi/llm_args.py at release 1.2 (UNVERIFIED field list: the
1.2 file was not read; these are the fields the 1.2 DSA code reads). StrictBaseModel forbids
extra fields; the sparse config union is discriminated by `algorithm`; to_sparse_params()
does not exist yet - the Indexer reads the pydantic config directly."""
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class StrictBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DeepSeekSparseAttentionConfig(StrictBaseModel):
    algorithm: Literal["dsa"] = "dsa"
    index_n_heads: Optional[int] = None
    index_head_dim: Optional[int] = None
    index_topk: Optional[int] = None
    indexer_max_chunk_size: Optional[int] = None
    skip_indexer_for_short_seqs: bool = True


class RocketSparseAttentionConfig(StrictBaseModel):
    algorithm: Literal["rocket"] = "rocket"


SparseAttentionConfig = Annotated[Union[RocketSparseAttentionConfig,
                                        DeepSeekSparseAttentionConfig],
                                  Field(discriminator="algorithm")]


class BaseLlmArgs(StrictBaseModel):
    model: str
    sparse_attention_config: Optional[SparseAttentionConfig] = None


class TorchLlmArgs(BaseLlmArgs):
    pass


LlmArgs = TorchLlmArgs
