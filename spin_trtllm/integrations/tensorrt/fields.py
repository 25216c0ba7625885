"""Plugin names and fields of libspin_trtllm_plugins.so, and their values from a SpinConfig.

Pure Python (no tensorrt, no torch): the network pass and the harness case writer both use it.
The field lists mirror the creators' getFieldNames() (plugins/tensorrt/src/*_plugin.cpp);
tests/test_tensorrt_plugins_build.py checks the two agree.
"""

from __future__ import annotations

import math

from ...config import SpinConfig
from ...errors import SpinError
from ...limits import BLOCK_SLOTS, EXPLORATION_POLICY, INT32_MAX, MAX_M_CAP, MAX_NEXT_N, POOLING

PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = ""
SELECT, LOGITS, TOPK, UPDATE = "SpinSelect", "SpinIndexerLogits", "SpinTopK", "SpinUpdate"
PLUGIN_NAMES = (SELECT, LOGITS, TOPK, UPDATE)

# plugin -> ((field, kind), ...) in the creator's order; kind "int" (INT64) or "float" (FLOAT64)
FIELDS: dict[str, tuple[tuple[str, str], ...]] = {
    SELECT: (("block_size", "int"), ("target_sparsity", "float"), ("exploration", "float"),
             ("policy", "int"), ("pooling", "int"), ("index_topk", "int"), ("warmup_steps", "int"),
             ("keep_sink", "int"), ("keep_newest", "int"), ("mtp_union", "int"), ("seed", "int"),
             ("max_context", "int"), ("m_cap", "int")),
    LOGITS: (("block_size", "int"), ("layer", "int")),
    TOPK: (("block_size", "int"), ("index_topk", "int"), ("layer", "int")),
    UPDATE: (("block_size", "int"), ("layer", "int"), ("ema_decay", "float"), ("row0_only", "int"),
             ("max_context", "int")),
}


def field_kind(plugin: str, name: str) -> str:
    for field, kind in FIELDS[plugin]:
        if field == name:
            return kind
    raise SpinError(f"{plugin} has no field {name!r} (fields: {', '.join(f for f, _ in FIELDS[plugin])})")


def check_supported(cfg: SpinConfig) -> None:
    """The plugins implement what the kernels do: reduction A1 with 64-slot blocks."""
    if not isinstance(cfg, SpinConfig):
        raise SpinError(f"expected a SpinConfig, got {type(cfg).__name__}")
    if cfg.reduction != "A1" or cfg.block_size != BLOCK_SLOTS:
        raise SpinError(f"the SPIN plugins implement reduction A1 with block_size {BLOCK_SLOTS}; got "
                        f"reduction={cfg.reduction}, block_size={cfg.block_size}")


def _int(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SpinError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def default_m_cap(max_context: int) -> int:
    """Every block of the longest context (warm-up steps select them all), at most MAX_M_CAP
    (past 64 x MAX_M_CAP tokens the lowest block ids are kept)."""
    return min(MAX_M_CAP, math.ceil(_int("max_context", max_context, 1, INT32_MAX) / BLOCK_SLOTS))


def select_fields(cfg: SpinConfig, *, max_context: int, m_cap: int | None = None) -> dict:
    check_supported(cfg)
    max_context = _int("max_context", max_context, 1, INT32_MAX)
    m_cap = default_m_cap(max_context) if m_cap is None else _int("m_cap", m_cap, 1, MAX_M_CAP)
    return {"block_size": BLOCK_SLOTS, "target_sparsity": float(cfg.target_sparsity),
            "exploration": float(cfg.exploration), "policy": EXPLORATION_POLICY[cfg.exploration_policy],
            "pooling": POOLING[cfg.pooling], "index_topk": cfg.index_topk,
            "warmup_steps": cfg.warmup_steps, "keep_sink": int(cfg.keep_sink),
            "keep_newest": int(cfg.keep_newest), "mtp_union": int(cfg.mtp_mask == "union"),
            "seed": cfg.seed, "max_context": max_context, "m_cap": m_cap}


def logits_fields(*, layer: int) -> dict:
    return {"block_size": BLOCK_SLOTS, "layer": _int("layer", layer, 0, INT32_MAX)}


def topk_fields(cfg: SpinConfig, *, layer: int) -> dict:
    check_supported(cfg)
    return {"block_size": BLOCK_SLOTS, "index_topk": cfg.index_topk,
            "layer": _int("layer", layer, 0, INT32_MAX)}


def update_fields(cfg: SpinConfig, *, layer: int, max_context: int, next_n: int = 1) -> dict:
    """row0_only when the config says so, and without MTP (one row: nothing else to replay)."""
    check_supported(cfg)
    next_n = _int("next_n", next_n, 1, MAX_NEXT_N)
    return {"block_size": BLOCK_SLOTS, "layer": _int("layer", layer, 0, INT32_MAX),
            "ema_decay": float(cfg.ema_decay),
            "row0_only": int(cfg.mtp_update == "row0" or next_n == 1),
            "max_context": _int("max_context", max_context, 1, INT32_MAX)}
