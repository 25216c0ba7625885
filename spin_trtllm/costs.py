"""When SPIN pays: a cost model of one decode step's indexer, SPIN against all-keep.

SPIN saves the K-cache bytes (and top-K work) of the blocks it skips and pays select (reads
every visible slot's state), the EMA update (reads and writes the scored slots' state) and
fixed launch costs. At small batches and contexts the fixed costs win: there the engine runs
the all-keep indexer instead (switch "auto").

Each kernel's time per indexer layer is `fixed + work / rate`, fitted on an H200 (fp16 state,
K 512) to the per-kernel benchmarks in benchmarks/ (bench_kernel_times.py, bench_topk.py,
bench_update_skew.py, bench_update_overlap.py, bench_probe.py; numbers in
benchmarks/RESULTS.md):
  logits   fixed + K-cache bytes at 3.66 TB/s; an MTP step's rows re-read the pages
           (x 1 + 0.45 (next_n - 1))
  top-K    spin's kernel max(16.75 us, 10.25 us + 4.15 ps per scored slot per row) (fitted on
           an H100: it ran the kernel before within 10% of the H200), through its
           filter (the rows ops.topk filters) 14.5 us + 2.95 ps per scored slot per row + 1.1 ps
           per row and slot of the table's width; FlashInfer's path (where ops.topk hands it the
           rows) 19 us + 4.3 ps per scored slot per row
  select   0.5 us + 1.25 ps per visible slot (a layer's share of the one launch); each MTP
           row after the first adds 0.85 of its per-slot term (every row is scored; fitted
           when each row read the state: on fp16 state the rows now share one read, and an
           extra row cost 0.33-0.56 of a row on an H100, so this overprices MTP select there
           and the switch leans to all-keep; RESULTS.md section 2)
  update   3 us + 4.1 ps per scored slot per row; beside the top-K (next_n 1, sm_90+, spin's
           top-K) a step pays update_beside_share of it; a predictor that reads no V/D history
           (probe, gauss) pays the 3 us alone (its update keeps the counters, not the EMAs)
  probe    summarize + probe 6.2 us + 1.19 ps per visible slot (x 1 + 0.5 (next_n - 1)), then a
           one-layer select: 11.1 us + 0.053 ns per slot of the longest request per row
  hybrid   the probe's, plus 0.67 ns per slot of the longest request per row (the merge)
  gauss    the probe's with its summarize + scores at 13.1 us + 2.56 ps per visible slot
           (x 1 + 0.5 (next_n - 1))
State bytes s scale select's term by s / 2 and the update's by (4 + 4 s) / 12 (its fp32 logit,
V and D read and written). In an engine's captured step SPIN pays engine_overhead_us per layer
beyond its kernels (extra launches and their gaps, its state's traffic), fitted to dsa-lite
suites at target_sparsity 0.5, next_n 1; engine_overhead_beside_us where the update runs beside
the top-K. prefer_spin adds it; spin_us is the kernels alone. The constants are
device-specific (CostModel(...) takes others); only the comparison matters, and the shared
terms cancel (both sides read the same bytes per scored slot).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple, Sequence, Union

import torch

from .limits import BLOCK_SLOTS, SLOT_BYTES
from .predictors import ENGINE_PREDICTORS, REGISTRY
from .reference import floor_blocks

LAST_SEEN_BYTES = torch.iinfo(torch.int64).bits // 8   # state.last_seen: one int64 step a block
SCORE_BYTES = torch.finfo(torch.float32).bits // 8     # one logit, as the top-K ranks it


class _Requests(NamedTuple):
    """A batch's requests as the model reads them, worked out once per call (the engine's switch
    asks every step): visible slots (>= 0), the slots of their whole 64-slot blocks (whole
    blocks are read), those summed, the longest request's, and the top-K table's width (the
    block table ops.topk ranks: the longest request's unless the caller knows it)."""
    visible: tuple[int, ...]
    blocks: tuple[int, ...]
    slots: float
    longest: int
    table: int


Requests = Union[Sequence[int], _Requests]


def _requests(visible_slots: Requests, table_slots: int = 0) -> _Requests:
    if isinstance(visible_slots, _Requests):
        return visible_slots
    visible = tuple(max(0, int(s)) for s in visible_slots)
    blocks = tuple(-(-n // BLOCK_SLOTS) * BLOCK_SLOTS for n in visible)
    longest = max(blocks, default=0)
    return _Requests(visible, blocks, float(sum(blocks)), longest, max(longest, table_slots))


@dataclass(frozen=True)
class CostModel:
    logits_fixed_us: float = 7.5
    logits_bytes_per_us: float = 3.66e6
    mtp_reread: float = 0.45
    topk_floor_us: float = 16.75
    topk_fixed_us: float = 10.25
    topk_us_per_slot: float = 4.15e-6
    topk_filter_fixed_us: float = 14.5
    topk_filter_us_per_slot: float = 2.95e-6
    topk_filter_us_per_table_slot: float = 1.1e-6  # per row and slot of its table's width
    peer_topk: bool = False  # ops.topk runs flashinfer's top-K (for_device sets it)
    peer_topk_fixed_us: float = 19.0
    peer_topk_us_per_slot: float = 4.3e-6
    select_fixed_us: float = 0.5
    select_us_per_slot: float = 1.25e-6
    select_next_n_share: float = 0.85  # of select's per-slot term, each MTP row after the first
    update_fixed_us: float = 3.0
    update_us_per_slot: float = 4.1e-6
    update_beside_share: float = 0.5  # of the update's term, when it runs beside the top-K
    probe_fixed_us: float = 6.2
    probe_us_per_slot: float = 1.19e-6
    query_next_n_share: float = 0.5   # of probe's or gauss's per-slot term, each MTP row after
                                      # the first
    gauss_fixed_us: float = 13.1
    gauss_us_per_slot: float = 2.56e-6
    probe_select_fixed_us: float = 11.1
    probe_select_us_per_request_slot: float = 0.053e-3
    hybrid_us_per_request_slot: float = 0.67e-3
    engine_overhead_us: float = 15.0  # SPIN's per-layer cost in a captured step beyond its kernels
    engine_overhead_beside_us: float = 8.0  # the same where the update runs beside the top-K
    margin: float = 0.03     # SPIN must win by this share (hysteresis at the boundary)

    def _logits(self, slots: float, next_n: int) -> float:
        reread = _rows(self.mtp_reread, next_n)
        return self.logits_fixed_us + slots * SLOT_BYTES * reread / self.logits_bytes_per_us

    def _peer_runs(self, visible_slots: Requests, next_n: int) -> bool:
        """Whether ops.topk hands these rows to flashinfer (the rows and the table's width
        decide)."""
        if not self.peer_topk:
            return False
        from .ops import spin_topk_is_faster

        requests = _requests(visible_slots)
        return not spin_topk_is_faster(len(requests.visible) * next_n, requests.table)

    def _topk(self, slots: float, next_n: int, visible_slots: Requests = ()) -> float:
        """`slots` scored slots per row in all; `visible_slots` (the requests' contexts) give the
        rows and their table's width, which decide whether ops.topk runs flashinfer's path or
        spin's filter."""
        requests = _requests(visible_slots)
        if self._peer_runs(requests, next_n):
            return self.peer_topk_fixed_us + self.peer_topk_us_per_slot * slots * next_n
        from .ops import topk_filters

        rows = len(requests.visible) * next_n
        if rows and topk_filters(rows, requests.table):
            return (self.topk_filter_fixed_us + self.topk_filter_us_per_slot * slots * next_n
                    + self.topk_filter_us_per_table_slot * rows * requests.table)
        return max(self.topk_floor_us, self.topk_fixed_us + self.topk_us_per_slot * slots * next_n)

    def _beside(self, visible_slots: Requests, next_n: int, update_beside: bool) -> bool:
        """Whether the update really runs beside the top-K: asked for, no MTP (the updates
        are deferred then), and spin's top-K kernel (flashinfer's path does not let it start)."""
        return update_beside and next_n == 1 and not self._peer_runs(visible_slots, next_n)

    def for_device(self, device) -> "CostModel":
        """This model with the top-K ops.topk will run on `device`: flashinfer's where it is
        installed on CUDA and SPIN_TOPK allows it, at the shapes ops.topk hands it."""
        from . import ops

        peer = torch.device(device).type == "cuda" and ops.peer_available() \
            and ops.topk_backend() != "spin"
        return replace(self, peer_topk=peer)

    def dense_us(self, visible_slots: Requests, next_n: int = 1) -> float:
        """All-keep indexer, one layer: logits over every visible block + top-K."""
        requests = _requests(visible_slots)
        return self._logits(requests.slots, next_n) + self._topk(requests.slots, next_n, requests)

    def _choose(self, visible_slots: Requests, slots: float, next_n: int, state: float,
                predictor: str) -> float:
        """Choosing the blocks, one layer: select's share of the all-layer launch (spin), or
        summarize + probe + a one-layer select (probe; hybrid adds the merge; gauss scores at
        its own rate)."""
        if predictor not in ENGINE_PREDICTORS:
            raise ValueError(f"CostModel: unknown predictor {predictor!r} (one of "
                             f"{', '.join(ENGINE_PREDICTORS)})")
        chosen = REGISTRY[predictor]
        if not chosen.query:
            return (self.select_fixed_us + self.select_us_per_slot * slots * state
                    * _rows(self.select_next_n_share, next_n))
        longest = _requests(visible_slots).longest
        gauss = predictor == "gauss"
        per_slot = self.gauss_us_per_slot if gauss else self.probe_us_per_slot
        cost = ((self.gauss_fixed_us if gauss else self.probe_fixed_us)
                + per_slot * slots * _rows(self.query_next_n_share, next_n)
                + self.probe_select_fixed_us
                + self.probe_select_us_per_request_slot * longest * next_n)
        if chosen.merges:
            cost += self.hybrid_us_per_request_slot * longest * next_n * state
        return cost

    def spin_us(self, visible_slots: Requests, target_sparsity: float, next_n: int = 1,
                state_bytes: int = 2, predictor: str = "spin",
                update_beside: bool = False, index_topk: int = 0) -> float:
        """SPIN, one layer: choosing the blocks (`predictor`: spin, probe, hybrid or gauss) + masked
        logits + top-K + update, with a target_sparsity share of the blocks skipped, but never
        fewer than the budget floor that holds index_topk visible slots (0: no floor).
        update_beside: the update is launched beside the top-K (next_n 1 only); it overlaps
        only spin's top-K kernel, not flashinfer's path (whose last kernel, the remap, does not
        let it start early)."""
        requests = _requests(visible_slots)
        slots, keep = requests.slots, 1.0 - target_sparsity
        if index_topk > 0:      # never below the budget floor's blocks (a request's all at most)
            scored = sum(max(b * keep, min(b, BLOCK_SLOTS * floor_blocks(
                b // BLOCK_SLOTS, n, index_topk, BLOCK_SLOTS)))
                for n, b in zip(requests.visible, requests.blocks))
        else:
            scored = sum(max(b * keep, 0.0) for b in requests.blocks)
        state = state_bytes / 2
        choose = self._choose(requests, slots, next_n, state, predictor)
        update_bytes = (4 + 4 * state_bytes) / 12      # per scored slot, against fp16's 12
        update = self.update_fixed_us
        if REGISTRY[predictor].history:     # the others keep the counters alone (ema=False)
            update += self.update_us_per_slot * scored * next_n * update_bytes
        if self._beside(requests, next_n, update_beside):
            update *= self.update_beside_share
        return (choose + self._logits(scored, next_n) + self._topk(scored, next_n, requests)
                + update)

    def prefer_spin(self, visible_slots: Requests, target_sparsity: float, next_n: int = 1,
                    state_bytes: int = 2, running_spin: bool = True,
                    predictor: str = "spin", update_beside: bool = False,
                    index_topk: int = 0, table_slots: int = 0) -> bool:
        """True when SPIN, with its in-step overhead, is predicted faster than all-keep for this
        batch (by `margin` when switching to SPIN, so that a batch at the boundary does not flip
        every step). table_slots: the width of the block table the top-K ranks (an engine's
        m_cap * 64, a block past its longest context; 0: the longest request's)."""
        requests = _requests(visible_slots, table_slots)
        if target_sparsity <= 0 or not requests.visible:
            return False
        dense = self.dense_us(requests, next_n)
        overhead = self.engine_overhead_beside_us \
            if self._beside(requests, next_n, update_beside) else self.engine_overhead_us
        spin = self.spin_us(requests, target_sparsity, next_n, state_bytes, predictor,
                            update_beside, index_topk) + overhead
        return spin < dense if running_spin else spin < dense * (1.0 - self.margin)


def _rows(share: float, next_n: int) -> float:
    """A term's factor for next_n rows when each row after the first adds `share` of it."""
    return 1.0 + share * (next_n - 1)


H200 = CostModel()


def indexer_bytes(selected_blocks: int, visible_blocks: int, state_dtype: str | None = None,
                  predictor: str = "spin") -> tuple[int, int]:
    """(K-cache bytes, SPIN state bytes) the decode indexer reads and writes, counted from the
    kernels' access pattern (not measured), for blocks summed over requests and indexer layers.

    K cache: every slot of every scored block, BLOCK_SLOTS x SLOT_BYTES (128 fp8 key bytes + a
    4-byte fp32 scale) per block; all-keep scores every visible block (selected = visible).
    SPIN state (state_dtype "float32", "float16" or "float8_e4m3fn", s = 4, 2 or 1 bytes; None:
    all-keep, no state; reduction A1's slot-level V/D): select reads V (per slot) and D (per
    offset) of every visible slot, 2 s bytes; update reads and writes V and D of every scored
    slot and reads its fp32 logit, 2 x 2 s + 4 bytes. Blocks count whole (a partial newest
    block as 64 slots); one update pass per step (MTP rows up to the accepted draft share it);
    the logits and top-K traffic that SPIN and all-keep both have is not counted.
    A query-aware predictor adds its summary rows (SUMMARY_BYTES each: one for "probe" and
    "hybrid", two for "gauss", the mean and the std) per visible block to the K-cache figure.
    Only a predictor that ranks by history ("spin", "hybrid") reads V/D in select and updates
    them; the others write each scored block's last step (8 bytes) alone."""

    k_cache = selected_blocks * BLOCK_SLOTS * SLOT_BYTES
    if state_dtype is None:
        return k_cache, 0
    s = {"float32": 4, "float16": 2, "float8_e4m3fn": 1}[state_dtype]
    chosen = REGISTRY[predictor]
    if chosen.query:
        k_cache += visible_blocks * chosen.summary_bytes
    if not chosen.history:
        return k_cache, selected_blocks * LAST_SEEN_BYTES
    return k_cache, (selected_blocks * BLOCK_SLOTS * (4 * s + 4)
                     + visible_blocks * BLOCK_SLOTS * 2 * s)


def traffic_bytes(selected_blocks: int, visible_blocks: int, rows: int,
                  state_dtype: str | None = None, predictor: str = "spin") -> int:
    """The fewest bytes a decode indexer of separate kernels (logits, top-K, select, update)
    moves in HBM for these blocks (summed over requests and layers; all-keep: selected =
    visible, no state): indexer_bytes' K cache and state, plus the fp32 logits of `rows` rows
    (a request's MTP rows) over every slot of each scored block, written once by the logits
    kernel and read once by the top-K. At one copy bandwidth this is the time floor that SPIN
    and all-keep are compared by: only fusing kernels (the top-K or the update into the
    logits) moves fewer bytes."""
    if rows < 1:
        raise ValueError(f"traffic_bytes: rows must be >= 1, got {rows}")
    k_cache, state = indexer_bytes(selected_blocks, visible_blocks, state_dtype, predictor)
    return k_cache + state + 2 * SCORE_BYTES * rows * selected_blocks * BLOCK_SLOTS
