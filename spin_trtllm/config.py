"""SpinConfig: the one validated source of truth for every SPIN knob.

Loadable from a dict, from YAML, or from a TensorRT-LLM ``sparse_attention_config`` block
that carries a ``spin:`` sub-block. Invalid values and unknown keys raise SpinConfigError
naming the field and the rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ._inputs import load_yaml_file, one_line, shown
from .errors import SpinConfigError
from .limits import (BLOCK_SLOTS, DEFAULT_EXPLORATION, DEFAULT_EXPLORATION_POLICY, DEFAULT_SEED,
                     DEFAULT_TARGET_SPARSITY, EXPLORATION_POLICY, MAX_BLOCK_SIZE, MAX_INDEX_TOPK,
                     POOLING, STATE_DTYPES, TRTLLM_ALGORITHM_TOPK)

# warmup_steps is compared with int32 step counters in the kernels and plugin fields.
MAX_WARMUP_STEPS = (1 << 31) - 1


class SpinConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, strict=True)

    block_size: int = Field(BLOCK_SLOTS, ge=1, le=MAX_BLOCK_SIZE,
                            description="KV slots per block (one page)")
    target_sparsity: float = Field(DEFAULT_TARGET_SPARSITY, ge=0.0, lt=1.0,
                                   description="rho: fraction of blocks to skip")
    ema_decay: float = Field(0.5, ge=0.0, lt=1.0, description="alpha of the V/D EMAs")
    exploration: float = Field(DEFAULT_EXPLORATION, ge=0.0, lt=1.0,
                               description="gamma: share of m_t explored")
    exploration_policy: Literal[tuple(EXPLORATION_POLICY)] = DEFAULT_EXPLORATION_POLICY
    index_topk: int = Field(512, ge=1, le=MAX_INDEX_TOPK,
                            description="K of the post-indexer top-K")
    warmup_steps: int = Field(1, ge=1, le=MAX_WARMUP_STEPS,
                              description="dense decode steps after each reset")
    keep_sink: bool = True
    keep_newest: bool = True
    reduction: Literal["A0", "A1", "A2"] = "A1"
    pooling: Literal[tuple(POOLING)] = "max"
    mtp_mask: Literal["row0", "union"] = "union"
    mtp_update: Literal["row0", "prefix_valid"] = "prefix_valid"
    # float8_e4m3fn: a quarter of fp32's state bytes; EMAs saturate at +-448
    state_dtype: Literal[STATE_DTYPES] = "float32"
    seed: int = Field(DEFAULT_SEED, ge=0, lt=1 << 32, description="exploration RNG seed (uint32)")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise SpinConfigError(describe_validation_error(err, SpinConfig, "spin config")) from None

    # ---- loaders -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "SpinConfig":
        """Flat dict of SpinConfig fields, or a dict holding `sparse_attention_config`/`spin`."""
        if data is None:
            return cls()
        if not isinstance(data, Mapping):
            raise SpinConfigError(f"spin config: expected a mapping, got {type(data).__name__}")
        _check_keys(data, "spin config")
        if "sparse_attention_config" in data:
            return cls.from_trtllm(data["sparse_attention_config"])
        if set(data) == {"spin"}:
            return cls.from_dict(data["spin"])
        return cls(**dict(data))

    @classmethod
    def from_trtllm(cls, block: Mapping[str, Any]) -> "SpinConfig":
        """From a TensorRT-LLM sparse_attention_config block with a `spin:` sub-block.

        `index_topk` is taken from the block (or the algorithm's default); the other keys of
        the block belong to TensorRT-LLM and are left to it.
        """
        if not isinstance(block, Mapping):
            raise SpinConfigError(
                f"sparse_attention_config: expected a mapping, got {type(block).__name__}")
        algorithm = block.get("algorithm")
        if not isinstance(algorithm, str) or algorithm not in TRTLLM_ALGORITHM_TOPK:
            raise SpinConfigError(
                f"sparse_attention_config.algorithm: must be one of "
                f"{sorted(TRTLLM_ALGORITHM_TOPK)} for SPIN, got {shown(algorithm, 60)}")
        spin = block.get("spin")
        if spin is None:
            spin = {}
        if not isinstance(spin, Mapping):
            raise SpinConfigError(
                f"sparse_attention_config.spin: expected a mapping, got {type(spin).__name__}")
        _check_keys(spin, "sparse_attention_config.spin")
        fields = dict(spin)
        outer_topk = block.get("index_topk", TRTLLM_ALGORITHM_TOPK[algorithm])
        if "index_topk" in fields and fields["index_topk"] != outer_topk:
            raise SpinConfigError(
                f"sparse_attention_config.spin.index_topk: {shown(fields['index_topk'], 60)} "
                f"conflicts with sparse_attention_config.index_topk {shown(outer_topk, 60)}; "
                f"set it once")
        fields["index_topk"] = outer_topk
        return cls(**fields)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "SpinConfig":
        """A YAML file (docs/limits.md: a regular UTF-8 file of at most 256 KiB, no
        anchors or aliases, string keys, nesting <= 32)."""
        name = one_line(path, 300)
        data = load_yaml_file(path, f"spin config {name}", SpinConfigError)
        try:
            return cls.from_dict(data)
        except SpinConfigError as err:
            raise SpinConfigError(f"{name}: {err}") from None

    def with_overrides(self, **changes: Any) -> "SpinConfig":
        """A validated copy with some fields changed (None values are ignored). Fields left at
        their defaults stay unset, so callers can still tell explicit choices apart."""
        data = {name: getattr(self, name) for name in self.model_fields_set}
        data.update({k: v for k, v in changes.items() if v is not None})
        return SpinConfig(**data)

    @property
    def min_blocks(self) -> int:
        """ceil(K / b): the budget floor that leaves room for K slots."""
        return -(-self.index_topk // self.block_size)


def describe_validation_error(err: ValidationError, model: type, label: str) -> str:
    """One line naming every bad field and its rule (unknown keys list the valid ones)."""
    parts = []
    for e in err.errors():
        field = one_line(".".join(str(x) for x in e["loc"]) or "config", 100)
        if e["type"] == "extra_forbidden":
            parts.append(f"{field}: unknown key (valid keys: {', '.join(model.model_fields)})")
        else:
            parts.append(f"{field}: {e['msg']} (got {shown(e.get('input'))})")
    more = f"; and {len(parts) - 8} more" if len(parts) > 8 else ""
    return f"{label}: " + "; ".join(parts[:8]) + more


def _check_keys(data: Mapping[Any, Any], where: str) -> None:
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise SpinConfigError(f"{where}: keys must be strings, got {shown(bad[0], 60)}")
