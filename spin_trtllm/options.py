"""IndexerOptions: how the decode indexer runs, chosen and validated once, then passed down
whole (CLI -> engine -> SpinIndexer). Torch-free, so the CLI reads its choices from here.

The SPIN algorithm's knobs (target_sparsity, exploration, state_dtype, ...) are SpinConfig's;
these are the engine's choices around it.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import predictors
from .errors import SpinError
from .limits import BLOCK_SLOTS, PAGE_SIZES

LOGITS_BACKENDS = ("native", "deepgemm", "reference")   # spin_trtllm.logits.BACKENDS
SWITCHES = ("auto", "spin", "dense")


@dataclass(frozen=True)
class IndexerOptions:
    """logits_backend: where the compact logits come from (spin_trtllm.logits).
    predictor: what ranks the blocks (spin_trtllm.predictors: spin, probe, hybrid, gauss).
    switch: "spin" runs SPIN every step, "dense" the all-keep indexer, "auto" picks per step
    from the cost model (spin_trtllm.costs); None: "auto" on CUDA, "spin" on the CPU.
    overlap_update: without MTP, each layer's EMA update runs beside its top-K (sm_90+).
    overlap_select: with predictor spin, each layer's select runs beside the previous layer's
    top-K instead of every layer in one launch (sm_90+; see SpinIndexer).
    page_slots: slots per K-cache page (64, or 32: one SPIN block spans two pages)."""

    logits_backend: str = "native"
    predictor: str = "spin"
    switch: str | None = None
    overlap_update: bool = True
    overlap_select: bool = False
    page_slots: int = BLOCK_SLOTS

    def __post_init__(self) -> None:
        for name, choices in (("logits_backend", LOGITS_BACKENDS), ("switch", SWITCHES + (None,)),
                              ("page_slots", PAGE_SIZES)):
            if getattr(self, name) not in choices:
                shown = ", ".join(str(c) for c in choices if c is not None)
                raise SpinError(f"{name} must be one of {shown}, got {getattr(self, name)!r}")
        predictors.get(self.predictor, engine=True)
        for name in ("overlap_update", "overlap_select"):
            if not isinstance(getattr(self, name), bool):
                raise SpinError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @property
    def block_predictor(self) -> predictors.Predictor:
        return predictors.REGISTRY[self.predictor]

    def switch_on(self, device_type: str) -> str:
        """The switch on a device: the given one, or "auto" on CUDA and "spin" elsewhere."""
        return self.switch or ("auto" if device_type == "cuda" else "spin")
