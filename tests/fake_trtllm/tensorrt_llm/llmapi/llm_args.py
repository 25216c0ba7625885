from dataclasses import dataclass
from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class StrictBaseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class DSAParams:
    index_topk: int


class DeepSeekSparseAttentionConfig(StrictBaseModel):
    algorithm: Literal["dsa"] = "dsa"
    index_topk: int = 2048

    def to_sparse_params(self):
        return DSAParams(self.index_topk)


class DeepSeekV4SparseAttentionConfig(DeepSeekSparseAttentionConfig):
    algorithm: Literal["deepseek_v4"] = "deepseek_v4"
    index_topk: int = 512


class RocketSparseAttentionConfig(StrictBaseModel):
    algorithm: Literal["rocket"] = "rocket"


SparseAttentionConfig = Annotated[Union[RocketSparseAttentionConfig, DeepSeekSparseAttentionConfig,
                                        DeepSeekV4SparseAttentionConfig],
                                  Field(discriminator="algorithm")]


class BaseLlmArgs(StrictBaseModel):
    model: str = "m"
    sparse_attention_config: Optional[SparseAttentionConfig] = None


class TorchLlmArgs(BaseLlmArgs):
    pass
