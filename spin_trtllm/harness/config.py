"""DsaLiteConfig: the shape of a dsa-lite model (DeepSeek-V4 C4A layout, small elsewhere)."""

from __future__ import annotations

import json
import math
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from .._inputs import YAML_MAX_DEPTH, shown
from ..config import MAX_INDEX_TOPK, describe_validation_error
from ..errors import SpinConfigError
from ..limits import MAX_NEXT_N

CSA_RATIO = 4          # DeepSeek-V4 C4A layers: indexer over 4:1 compressed slots
DSA_RATIO = 1          # DeepSeek-V3.2 DSA layers: indexer over every token
INDEX_RATIOS = (DSA_RATIO, CSA_RATIO)
MAX_HCA_RATIO = 128

# Upper bounds of the fields that size weights or buffers (docs/limits.md). A checkpoint's
# config is checked like a user's: these ranges bound each dimension alone; what a run
# allocates from their products is estimated and checked against free memory before it
# starts (harness/engine/memory.py).
# the longest context: trace's longest run (2^20 prompt + 2^16 steps + the MTP rows) fits
MAX_CONTEXT = 1 << 21
# SpinConfig's bound (the engine requires both to agree): the slots of a 1M-token context
MAX_TOPK = MAX_INDEX_TOPK
# raw-token KV per request and layer is window + prefill_chunk (the ring); 65,536 is 16x
# the longest sliding windows in use (4,096) and 512x V4's 128
MAX_WINDOW = 1 << 16
# rows of one prefill pass: its attention and indexer scores grow with rows x context;
# 16,384 is twice TensorRT-LLM's default chunk (8,192)
MAX_PREFILL_CHUNK = 1 << 14
MAX_VOCAB = 1 << 18            # above every current LLM vocabulary (V3's 129,280)
MAX_HIDDEN = 1 << 14           # V3: 7,168
MAX_HEADS = 256                # V3: 128
MAX_HEAD_DIM = 1024            # V3: 192 (+ 512 latent)
MAX_FFN = 1 << 16              # V3's dense FFN: 18,432
MAX_LAYERS = 256               # V3: 61
MAX_SEED = (1 << 64) - 1       # torch.Generator.manual_seed's range
# a checkpoint's config travels as JSON in its metadata: the shipped one is 300 characters
CONFIG_JSON_MAX_CHARS = 64 << 10
_BOUNDS = {"vocab_size": MAX_VOCAB, "hidden": MAX_HIDDEN, "heads": MAX_HEADS, "ffn": MAX_FFN,
           "window": MAX_WINDOW, "index_topk": MAX_TOPK, "max_context": MAX_CONTEXT,
           "prefill_chunk": MAX_PREFILL_CHUNK}


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

    @field_validator(*_BOUNDS)
    @classmethod
    def _bounded(cls, v: int, info) -> int:
        hi = _BOUNDS[info.field_name]
        if not 1 <= v <= hi:
            raise ValueError(f"must be in 1..{hi:,}")
        return v

    @field_validator("head_dim")
    @classmethod
    def _even(cls, v: int) -> int:
        if not 2 <= v <= MAX_HEAD_DIM or v % 2:
            raise ValueError(f"must be an even number in 2..{MAX_HEAD_DIM} (RoPE pairs)")
        return v

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int) -> int:
        if not 0 <= v <= MAX_SEED:
            raise ValueError("must be in 0..2^64 - 1")
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
        if not 1 <= len(v) <= MAX_LAYERS:
            raise ValueError(f"needs 1..{MAX_LAYERS} layers, got {len(v)}")
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
        if not (math.isfinite(v) and v > 0):
            raise ValueError("must be finite and > 0")
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

    def sizes(self) -> str:
        """The fields that size buffers, for messages about memory."""
        return (f"max_context {self.max_context:,}, window {self.window:,}, prefill_chunk "
                f"{self.prefill_chunk:,}, index_topk {self.index_topk:,}, {self.heads} heads x "
                f"{self.head_dim}, {len(self.compress_ratios)} layers")

    @property
    def ring(self) -> int:
        """Raw-token KV kept per request and layer: the window, one compression group and the
        rows of one forward pass (older entries are never read again)."""
        return max(self.window, max(self.compress_ratios), CSA_RATIO) + self.prefill_chunk

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any], what: str = "dsa-lite config") -> "DsaLiteConfig":
        if not isinstance(data, Mapping):
            raise SpinConfigError(f"{what}: expected a mapping, got {type(data).__name__}")
        bad = [k for k in data if not isinstance(k, str)]
        if bad:
            raise SpinConfigError(f"{what}: keys must be strings, got {shown(bad[0], 60)}")
        data = dict(data)
        if isinstance(data.get("compress_ratios"), list):
            data["compress_ratios"] = tuple(data["compress_ratios"])
        try:
            return cls(**data)
        except ValidationError as err:
            raise SpinConfigError(describe_validation_error(err, cls, what)) from None

    @classmethod
    def from_json(cls, text: Any, what: str = "dsa-lite config") -> "DsaLiteConfig":
        """A config from JSON text (a checkpoint's metadata), checked like a user config: at
        most CONFIG_JSON_MAX_CHARS characters, nesting at most YAML_MAX_DEPTH, no repeated
        keys, numbers as JSON writes them (no NaN or infinities), then every field's rule."""
        if not isinstance(text, str):
            raise SpinConfigError(f"{what}: expected JSON text, got {type(text).__name__}")
        if len(text) > CONFIG_JSON_MAX_CHARS:
            raise SpinConfigError(f"{what}: {len(text):,} characters of JSON, over the limit "
                                  f"of {CONFIG_JSON_MAX_CHARS:,}")
        depth = _json_depth(text)
        if depth > YAML_MAX_DEPTH:
            raise SpinConfigError(f"{what}: JSON nested {depth} levels deep, over the limit of "
                                  f"{YAML_MAX_DEPTH}")

        def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
            out: dict[str, Any] = {}
            for k, v in items:
                if k in out:
                    raise SpinConfigError(f"{what}: key {shown(k, 60)} appears twice")
                out[k] = v
            return out

        def constant(name: str) -> Any:
            raise SpinConfigError(f"{what}: {name} is not a number here")

        try:
            data = json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
        except SpinConfigError:
            raise
        except (ValueError, RecursionError) as err:   # JSONDecodeError; ints over 4,300 digits
            raise SpinConfigError(f"{what}: not valid JSON ({err})") from None
        return cls.from_dict(data, what)

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)

    def with_overrides(self, **changes: Any) -> "DsaLiteConfig":
        data = self.model_dump()
        data.update({k: v for k, v in changes.items() if v is not None})
        return DsaLiteConfig.from_dict(data)


def _json_depth(text: str) -> int:
    """How deeply JSON text nests arrays and objects (brackets inside strings do not count),
    found without parsing it (json.loads recurses once per level)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


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
