"""Give TensorRT-LLM's closed pydantic configs a `spin:` sub-block (framework-free mechanism).

TensorRT-LLM's sparse_attention_config is a discriminated union of StrictBaseModel classes
(extra="forbid"), and its parents bake the union's schema in when they are built. So an add-on
adds the field to each config class and rebuilds them, then rebuilds every parent that holds
the union.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from pydantic.fields import FieldInfo

from ... import predictors
from ...config import SpinConfig
from ..._inputs import shown
from ...errors import SpinConfigError, SpinError

FIELD = "spin"
# the one key of the `spin:` block that is the engine's choice, not a SpinConfig field
PREDICTOR = "predictor"


@dataclass(frozen=True)
class SpinSettings:
    """What a `spin:` block sets: the SpinConfig and the block predictor (spin_trtllm.predictors:
    spin, probe, hybrid or gauss)."""

    config: SpinConfig
    predictor: str = predictors.TRTLLM_DEFAULT_PREDICTOR


def add_spin_field(config_classes: Sequence[type], parent_classes: Sequence[type],
                   field_type: type = SpinConfig) -> list[str]:
    """Add `spin: Optional[field_type] = None` to each config class (idempotent) and rebuild
    them and their parents. Returns the names of the classes that were changed."""
    changed = []
    for cls in config_classes:
        fields = getattr(cls, "model_fields", None)
        if not isinstance(fields, dict):
            raise SpinError(f"{cls.__name__} is not a pydantic v2 model; cannot add `spin`")
        current = fields.get(FIELD)
        if current is not None and current.annotation == Optional[field_type]:
            continue
        if current is not None:
            raise SpinError(f"{cls.__name__} already has a field `{FIELD}` of another type "
                            f"({current.annotation}); refusing to replace it")
        fields[FIELD] = FieldInfo.from_annotated_attribute(
            Optional[field_type], None)
        cls.model_rebuild(force=True)
        changed.append(cls.__name__)
    if changed:
        for parent in parent_classes:
            parent.model_rebuild(force=True)
    return changed


def spin_settings_of(block: Any) -> Optional[SpinSettings]:
    """The effective settings of a sparse_attention_config object (or mapping): its SpinConfig,
    with index_topk taken from the block, and its predictor; None when it has no `spin:`
    sub-block."""
    if block is None:
        return None
    get = block.get if isinstance(block, dict) else (lambda k, d=None: getattr(block, k, d))
    spin = get(FIELD)
    if spin is None:
        return None
    if not isinstance(spin, (SpinConfig, dict)):
        raise SpinConfigError(f"sparse_attention_config.{FIELD} must be a mapping of SPIN "
                              f"settings, got {shown(spin)}")
    fields = spin.model_dump(exclude_unset=True) if isinstance(spin, SpinConfig) else dict(spin)
    predictor = fields.pop(PREDICTOR, predictors.TRTLLM_DEFAULT_PREDICTOR)
    if predictor not in predictors.ENGINE_PREDICTORS:
        raise SpinConfigError(f"sparse_attention_config.{FIELD}.{PREDICTOR}: must be one of "
                              f"{', '.join(predictors.ENGINE_PREDICTORS)}, got "
                              f"{shown(predictor, 60)}")
    outer = {"algorithm": get("algorithm"), "spin": fields}
    if get("index_topk") is not None:
        outer["index_topk"] = get("index_topk")
    return SpinSettings(SpinConfig.from_trtllm(outer), predictor)


def spin_config_of(block: Any) -> Optional[SpinConfig]:
    """The SpinConfig of spin_settings_of(block), or None."""
    settings = spin_settings_of(block)
    return None if settings is None else settings.config
