"""DsaLiteConfig: the shape of a dsa-lite model (DeepSeek-V4 C4A layout, small elsewhere)."""

from __future__ import annotations

import json
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from ..config import describe_validation_error
from ..errors import SpinConfigError
from ..limits import MAX_NEXT_N

CSA_RATIO = 4          # DeepSeek-V4 C4A layers: indexer over 4:1 compressed slots
DSA_RATIO = 1          # DeepSeek-V3.2 DSA layers: indexer over every token
INDEX_RATIOS = (DSA_RATIO, CSA_RATIO)
MAX_HCA_RATIO = 128


class DsaLiteConfig(BaseModel):
    """compress_ratios has one entry per layer: 0 = sliding window only, 4 = CSA (compressed
    KV, indexer, top-K sparse attention + window), 1 = DSA (the same over uncompressed tokens,
    as DeepSeek-V3.2), r > 4 = HCA (dense attention over KV compressed r:1 + window). The
    indexer layers of one model share one ratio (1 or 4)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    vocab_size: int = 256
    hidden: int = 64
    heads: int = 4
    head_dim: int = 32
    ffn: int = 128
    compress_ratios: tuple[int, ...] = (0, 4, 128, 4)
    window: int = 128
    index_topk: int = 64
    mtp_depth: int = 0
    max_context: int = 4096
    prefill_chunk: int = 32
    rope_theta: float = 10000.0
    init_std: float = 1.0
    seed: int = 0
    dtype: Literal["float64", "float32", "bfloat16"] = "float64"

    @field_validator("vocab_size", "hidden", "heads", "ffn", "window", "index_topk",
                     "max_context", "prefill_chunk")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v < 1:
            raise ValueError("must be >= 1")
        return v

    @field_validator("head_dim")
    @classmethod
    def _even(cls, v: int) -> int:
        if v < 2 or v % 2:
            raise ValueError("must be an even number >= 2 (RoPE pairs)")
        return v

    @field_validator("mtp_depth")
    @classmethod
    def _mtp(cls, v: int) -> int:
        if not 0 <= v < MAX_NEXT_N:
            raise ValueError(f"must be in 0..{MAX_NEXT_N - 1} (next_n = mtp_depth + 1 <= "
                             f"{MAX_NEXT_N})")
        return v

    @field_validator("compress_ratios")
    @classmethod
    def _ratios(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v:
            raise ValueError("needs at least one layer")
        for r in v:
            if r not in (0,) + INDEX_RATIOS and not CSA_RATIO < r <= MAX_HCA_RATIO:
                raise ValueError(f"each ratio must be 0, 1, {CSA_RATIO} or in ({CSA_RATIO}, "
                                 f"{MAX_HCA_RATIO}], got {r}")
        indexed = {r for r in v if r in INDEX_RATIOS}
        if not indexed:
            raise ValueError("needs at least one indexer layer (ratio 1 or 4): SPIN lives in "
                             "the indexer")
        if len(indexed) > 1:
            raise ValueError("indexer layers must share one ratio (all 1 or all 4)")
        return v

    @field_validator("init_std", "rope_theta")
    @classmethod
    def _positive_float(cls, v: float) -> float:
        if not v > 0:
            raise ValueError("must be > 0")
        return v

    @model_validator(mode="after")
    def _cross(self) -> "DsaLiteConfig":
        if self.mtp_depth + 1 > self.prefill_chunk:
            raise ValueError(f"prefill_chunk ({self.prefill_chunk}) must be >= next_n "
                             f"({self.mtp_depth + 1})")
        if self.max_context < 2:
            raise ValueError("max_context must be >= 2")
        return self

    # ---- derived ------------------------------------------------------------------------------
    @property
    def next_n(self) -> int:
        return self.mtp_depth + 1

    @property
    def index_ratio(self) -> int:
        """Tokens per indexer slot: 4 (C4A) or 1 (V3.2 DSA)."""
        return next(r for r in self.compress_ratios if r in INDEX_RATIOS)

    @property
    def csa_layers(self) -> list[int]:
        """The indexer layers (CSA or DSA)."""
        return [i for i, r in enumerate(self.compress_ratios) if r in INDEX_RATIOS]

    @property
    def index_slots(self) -> int:
        """Indexer slots of the longest context."""
        return self.max_context // self.index_ratio + 1

    @property
    def ring(self) -> int:
        """Raw-token KV kept per request and layer: the window, one compression group and the
        rows of one forward pass (older entries are never read again)."""
        return max(self.window, max(self.compress_ratios), CSA_RATIO) + self.prefill_chunk

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "DsaLiteConfig":
        if not isinstance(data, Mapping):
            raise SpinConfigError(f"dsa-lite config: expected a mapping, got {type(data).__name__}")
        data = dict(data)
        if isinstance(data.get("compress_ratios"), list):
            data["compress_ratios"] = tuple(data["compress_ratios"])
        try:
            return cls(**data)
        except ValidationError as err:
            raise SpinConfigError(describe_validation_error(err, cls, "dsa-lite config")) from None

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)

    def with_overrides(self, **changes: Any) -> "DsaLiteConfig":
        data = self.model_dump()
        data.update({k: v for k, v in changes.items() if v is not None})
        return DsaLiteConfig.from_dict(data)


def tiny() -> DsaLiteConfig:
    """The CPU default: 4 layers (window, CSA, HCA, CSA), float64 so results do not depend on
    how requests are batched."""
    return DsaLiteConfig()


def v4_flash_indexer(**changes: Any) -> DsaLiteConfig:
    """The GPU default: DeepSeek-V4 Flash's layer pattern (2 window layers, 21 CSA layers with
    a 64 x 128 indexer and K = 512, 20 HCA layers at 128:1), a small model around it."""
    ratios = (0, 0) + (CSA_RATIO, MAX_HCA_RATIO) * 20 + (CSA_RATIO,)
    base = dict(hidden=512, heads=8, head_dim=64, ffn=1024, compress_ratios=ratios,
                index_topk=512, max_context=32768, prefill_chunk=256, dtype="bfloat16")
    base.update(changes)
    return DsaLiteConfig.from_dict(base)
