"""The block predictors: what each one ranks blocks by, what it needs, and where it runs.

Torch-free, so the CLI reads its choices from here. The engine (SpinIndexer, the cost model,
dsa-lite, the TensorRT-LLM integration) runs spin, probe, hybrid and gauss, each with CUDA kernels
and a CPU reference; the replay evaluator also runs quest, which needs a trace v2 (queries and
keys) and has no kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .errors import SpinError
from .limits import BLOCK_SLOTS, MAX_HYBRID_BLOCKS, SUMMARY_BYTES


@dataclass(frozen=True)
class Predictor:
    name: str
    history: bool                 # ranks with SPIN's V/D history
    query: bool                   # ranks with query-aware block scores (needs per-block keys)
    engine: bool                  # runs in SpinIndexer (has kernels), not only in replay
    summary_rows_per_block: int   # K-cache rows read per visible block to score it (replay)
    # ranks a block by the best of its sub-blocks' summaries: the replay's `summaries` per
    # block, the engine's pages of a block (two with 32-slot pages)
    sub_blocks: bool = False
    max_context_len: Optional[int] = None   # longest context its select step ranks
    summary: str = ""

    @property
    def summary_bytes(self) -> int:
        """Its summary table's bytes per K-cache page (0: it reads no summaries)."""
        return SUMMARY_BYTES * self.summary_rows_per_block

    @property
    def merges(self) -> bool:
        """Ranks by the max of the rank shares of both (reference.hybrid_scores)."""
        return self.history and self.query


REGISTRY: dict[str, Predictor] = {p.name: p for p in (
    Predictor("spin", history=True, query=False, engine=True, summary_rows_per_block=0,
              summary="EMAs of past indexer scores per slot and per offset (the paper's SPIN)"),
    Predictor("probe", history=False, query=True, engine=True, summary_rows_per_block=1,
              sub_blocks=True, summary="each block's mean key scored with the current query"),
    Predictor("hybrid", history=True, query=True, engine=True, summary_rows_per_block=1,
              sub_blocks=True, max_context_len=MAX_HYBRID_BLOCKS * BLOCK_SLOTS,
              summary="max of the rank shares of spin's and probe's scores"),
    Predictor("quest", history=False, query=True, engine=False, summary_rows_per_block=2,
              summary="upper bound from per-channel key min/max (Quest)"),
    Predictor("gauss", history=False, query=True, engine=True, summary_rows_per_block=2,
              sub_blocks=True,
              summary="expected ReLU score under a per-channel Gaussian of the keys"),
)}
ENGINE_PREDICTORS = tuple(name for name, p in REGISTRY.items() if p.engine)
# what TensorRT-LLM's `spin:` block runs when it names no predictor: the probe misses 7 points
# less than SPIN's history at equal bytes (dsa-lite's C4A model on 32-slot pages, 50% effective
# sparsity; benchmarks/QUALITY.md sections 2 and 8) at about SPIN's GPU cost of a decode step
# (benchmarks/RESULTS.md, "Query-aware predictors in the step")
TRTLLM_DEFAULT_PREDICTOR = "probe"
# replay: how the per-step block budget is spread over layers (replay.probe.AdaptiveBudget)
BUDGETS = ("uniform", "adaptive")
REPLAY_PREDICTORS = tuple(REGISTRY)


def get(name: str, engine: bool = False) -> Predictor:
    """The predictor called `name`; engine=True: one SpinIndexer runs."""
    choices = ENGINE_PREDICTORS if engine else REPLAY_PREDICTORS
    if name not in choices:
        raise SpinError(f"predictor must be one of {', '.join(choices)}, got {name!r}")
    return REGISTRY[name]
