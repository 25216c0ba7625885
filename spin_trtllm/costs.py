"""When SPIN pays: a cost model of one decode step's indexer, SPIN against all-keep.

SPIN saves the K-cache bytes (and top-K work) of the blocks it skips and pays select (reads
every visible slot's state), the EMA update (reads and writes the scored slots' state) and
fixed launch costs. At small batches and contexts the fixed costs win: there the engine runs
the all-keep indexer instead (Engine(..., switch="auto")).

Each kernel's time per indexer layer is `fixed + work / rate`, fitted to the per-layer kernel
benchmarks of an H200 (benchmarks/RESULTS.md, fp16 state, K 512; sixth session):
  logits   7.5 us + K-cache bytes at 3.66 TB/s; rows of an MTP step read the pages again,
           so the bytes scale by 1 + 0.45 (next_n - 1) (native kernel)
  top-K    max(16 us, 7.5 us + 7.75 ps per scored slot per row) with spin's kernel (refitted in
           the seventeenth session, benchmarks/results_topk_s17.json: 14.6-224 us at 8-192 rows
           x 32K-128K slots, within a third); with flashinfer's (peer_topk, at the shapes where
           ops.topk hands it the rows: spin_topk_is_faster false) 19 us + 4.3 ps per scored
           slot per row, fitted to the whole path (top-K, lengths, remap) at 8-192 rows x
           32K-128K slots (fourteenth session, benchmarks/results_topk_paths.json: 19.8-118.6 us)
  select   0.5 us + 1.44 ps per visible slot (per layer's share of the one launch); kept after
           the eighteenth session's faster select (0.75-15.3 us a layer at 8-96 x 32K-128K,
           benchmarks/results_select_s18.jsonl, fp16 state), which it prices 1-21% high (fp32
           state, priced at twice that: 9-42% high, results_select_fp32_s18.jsonl)
  update   3 us + 4.1 ps per scored slot per row (refitted in the eleventh session to the
           one-row launch of at most about 1,536 CTAs: 4.1-28.3 us at 8-96 x 32K-128K)
           kept after the sixteenth session's vector update (4.5-24.5 us at those shapes):
           it now prices it 13-18% high at 32-96 x 32K-128K and 21% low at 8 x 32K, and the
           suites the switch is tested against ran the older kernel. Timed where a step runs
           it, after the masked logits and top-K (eighteenth session,
           benchmarks/results_update_in_sequence_s18.jsonl: 2.0-26.1 us), it is within 20% at
           32-96 x 32K-128K and inside the 2.0-4.5 us measured at 8 x 32K. Those timings
           used contexts of whole blocks; a step's context ends mid-block 63 times in 64, which
           cost 7.9-39.9 us in sequence before the nineteenth session's fix of the update's
           edge chunk and 6.0-33.7 after (mean over the 8 D skews, bench_update_skew.py,
           benchmarks/results_update_skew_s19.jsonl): the term prices that 15% low at 96 x
           128K and 34-58% low at the smaller shapes. It is kept: engine_overhead_us below was
           fitted to dsa-lite steps, whose contexts end mid-block
Beside the top-K (next_n 1, sm_90+: SpinIndexer's overlap_update, twenty-first session) the
update runs on the SMs the top-K leaves idle; a step then pays update_beside_share (0.5) of the
term above. Measured (bench_update_overlap.py, CUDA graphs, fp16, mean over the 8 D skews,
benchmarks/results_update_overlap_s21.json): the update adds 1.3-6.7 us a layer beside the top-K
against 5.2-16.8 after it at 8-96 x 32K-128K (0.25-0.53 of it), and nothing measurable at 96 x
128K, where the model still charges half. Where ops.topk runs flashinfer's path, the update
follows its remap kernel, which does not let it start early: the whole term is charged there.
State bytes s scale select's term by s / 2 (float32: twice the fp16 figure) and the update's by
the bytes it moves per scored slot, (4 + 4 s) / 12 (its fp32 logit, V and D read and written):
float8_e4m3fn state 0.5x and 0.67x of fp16's, float32 2x and 1.67x. Measured at 96 x 128K:
fp8 select 0.68x and update 0.81x of fp16's (twentieth session, profiler kernel times,
benchmarks/results_kernel_times_s20.json); fp32 select 1.71x and update 1.28x (fifth and
eighteenth sessions, README): the bytes, not a fixed cost, are what the update's term should
scale, and the fp32 term it replaces (2x) was further from the 1.28x measured.
The query-aware predictors replace select's share (tenth session, `bench_probe.py`, next_n 1):
  probe    summarize + probe 7.5 us + 1.0 ps per visible slot (x 1 + 0.5 (next_n - 1)), then a
           one-layer select, one CTA per request: 10 us + 0.14 ns per slot of the longest
           request per row
  hybrid   the probe's, plus the merge's V/D pooling and rank sort in that select: 0.6 ns per
           slot of the longest request per row (latency-bound: one CTA per request)
In an engine's captured step SPIN pays about 15 us per indexer layer more than its kernels
take alone (engine_overhead_us: its extra launches and their gaps, its state's bytes beside the
layer's other traffic), fitted to the dsa-lite suite on an H200 (fifteenth session,
benchmarks/results_dsa_s15_flashinfer_suite.jsonl; thirteenth, results_dsa_overlap.jsonl): the
measured SPIN / all-keep indexer time ratios, times the model's all-keep time, put SPIN 9-21 us
(fifteenth) and 5-24 us (thirteenth) a layer above the kernels' model at rho 0.5, next_n 1.
prefer_spin adds it for every predictor and next_n (fitted only to SPIN's at next_n 1);
spin_us is the kernels alone. Where the update runs beside the top-K the same fit gives less,
engine_overhead_beside_us = 8 us (twenty-second session, benchmarks/results_dsa_s22.jsonl, rho
0.5, native, no flashinfer: -1.5 to 11.9 us a layer at 32K-128K slots x 32-96, mean 5.7): the
update's tail after the top-K was part of what the 15 us absorbed.
The constants are device-specific; `CostModel(...)` takes others. Only the comparison matters,
and it is insensitive to the shared terms (both sides read the same bytes per scored slot).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from typing import Sequence

import torch

from .reference import PAGE_SLOTS as BLOCK_SLOTS
from .reference import floor_blocks
from .reference import SLOT_BYTES as KEY_BYTES_PER_SLOT   # FP8 key bytes + a 4-byte scale


@dataclass(frozen=True)
class CostModel:
    logits_fixed_us: float = 7.5
    logits_bytes_per_us: float = 3.66e6
    mtp_reread: float = 0.45
    topk_floor_us: float = 16.0
    topk_fixed_us: float = 7.5
    topk_us_per_slot: float = 7.75e-6
    peer_topk: bool = False  # ops.topk runs flashinfer's top-K (for_device sets it)
    peer_topk_fixed_us: float = 19.0
    peer_topk_us_per_slot: float = 4.3e-6
    select_fixed_us: float = 0.5
    select_us_per_slot: float = 1.44e-6
    update_fixed_us: float = 3.0
    update_us_per_slot: float = 4.1e-6
    update_beside_share: float = 0.5  # of the update's term, when it runs beside the top-K
    probe_fixed_us: float = 7.5
    probe_us_per_slot: float = 1.0e-6
    probe_select_fixed_us: float = 10.0
    probe_select_us_per_request_slot: float = 0.14e-3
    hybrid_us_per_request_slot: float = 0.6e-3
    engine_overhead_us: float = 15.0  # SPIN's per-layer cost in a captured step beyond its kernels
    engine_overhead_beside_us: float = 8.0  # the same where the update runs beside the top-K
    margin: float = 0.03     # SPIN must win by this share (hysteresis at the boundary)

    def _logits(self, slots: float, next_n: int) -> float:
        reread = 1.0 + self.mtp_reread * (next_n - 1)
        return self.logits_fixed_us + slots * KEY_BYTES_PER_SLOT * reread / self.logits_bytes_per_us

    def _peer_runs(self, visible_slots: Sequence[int], next_n: int) -> bool:
        """Whether ops.topk hands these rows to flashinfer (the rows and the longest request's
        blocks decide)."""
        from .ops import spin_topk_is_faster

        rows = len(visible_slots) * next_n
        width = _block_slots([max(visible_slots, default=0)])
        return self.peer_topk and not spin_topk_is_faster(rows, int(width))

    def _topk(self, slots: float, next_n: int, visible_slots: Sequence[int] = ()) -> float:
        """`slots` scored slots per row in all; `visible_slots` (the requests' contexts) give the
        rows and their width, which decide whether ops.topk runs flashinfer's path."""
        if self._peer_runs(visible_slots, next_n):
            return self.peer_topk_fixed_us + self.peer_topk_us_per_slot * slots * next_n
        return max(self.topk_floor_us, self.topk_fixed_us + self.topk_us_per_slot * slots * next_n)

    def _beside(self, visible_slots: Sequence[int], next_n: int, update_beside: bool) -> bool:
        """Whether the update really runs beside the top-K: asked for, no MTP (the updates
        are deferred then), and spin's top-K kernel (flashinfer's path does not let it start)."""
        return update_beside and next_n == 1 and not self._peer_runs(visible_slots, next_n)

    def for_device(self, device) -> "CostModel":
        """This model with the top-K ops.topk will run on `device`: flashinfer's where it is
        installed on CUDA and SPIN_TOPK allows it, at the shapes ops.topk hands it."""
        from . import ops

        peer = torch.device(device).type == "cuda" and ops._flashinfer_topk() is not None \
            and os.environ.get("SPIN_TOPK", "auto") != "spin"
        return replace(self, peer_topk=peer)

    def dense_us(self, visible_slots: Sequence[int], next_n: int = 1) -> float:
        """All-keep indexer, one layer: logits over every visible block + top-K."""
        slots = _block_slots(visible_slots)
        return self._logits(slots, next_n) + self._topk(slots, next_n, visible_slots)

    def _choose(self, visible_slots: Sequence[int], slots: float, next_n: int, state: float,
                predictor: str) -> float:
        """Choosing the blocks, one layer: select's share of the all-layer launch (spin), or
        summarize + probe + a one-layer select (probe; hybrid adds the merge)."""
        if predictor == "spin":
            return self.select_fixed_us + self.select_us_per_slot * slots * state
        if predictor not in ("probe", "hybrid"):
            raise ValueError(f"CostModel: unknown predictor {predictor!r}")
        longest = max(_block_slots([s]) for s in visible_slots)
        cost = (self.probe_fixed_us
                + self.probe_us_per_slot * slots * (1.0 + 0.5 * (next_n - 1))
                + self.probe_select_fixed_us
                + self.probe_select_us_per_request_slot * longest * next_n)
        if predictor == "hybrid":
            cost += self.hybrid_us_per_request_slot * longest * next_n * state
        return cost

    def spin_us(self, visible_slots: Sequence[int], sparsity: float, next_n: int = 1,
                state_bytes: int = 2, predictor: str = "spin",
                update_beside: bool = False, index_topk: int = 0) -> float:
        """SPIN, one layer: choosing the blocks (`predictor`: spin, probe or hybrid) + masked
        logits + top-K + update, with a fraction `sparsity` of the blocks skipped, but never
        fewer than the budget floor that holds index_topk visible slots (0: no floor).
        update_beside: the update is launched beside the top-K (next_n 1 only); it overlaps
        only spin's top-K kernel, not flashinfer's path (whose last kernel, the remap, does not
        let it start early)."""
        slots = _block_slots(visible_slots)
        scored = sum(max(_block_slots([n]) * (1.0 - sparsity), _floor_slots(n, index_topk))
                     for n in visible_slots)
        state = state_bytes / 2
        update_bytes = (4 + 4 * state_bytes) / 12      # per scored slot, against fp16's 12
        update = self.update_fixed_us + self.update_us_per_slot * scored * next_n * update_bytes
        if self._beside(visible_slots, next_n, update_beside):
            update *= self.update_beside_share
        return (self._choose(visible_slots, slots, next_n, state, predictor)
                + self._logits(scored, next_n) + self._topk(scored, next_n, visible_slots)
                + update)

    def prefer_spin(self, visible_slots: Sequence[int], sparsity: float, next_n: int = 1,
                    state_bytes: int = 2, running_spin: bool = True,
                    predictor: str = "spin", update_beside: bool = False,
                    index_topk: int = 0) -> bool:
        """True when SPIN, with its in-step overhead, is predicted faster than all-keep for this
        batch (by `margin` when switching to SPIN, so that a batch at the boundary does not flip
        every step)."""
        if sparsity <= 0 or not visible_slots:
            return False
        dense = self.dense_us(visible_slots, next_n)
        overhead = self.engine_overhead_beside_us \
            if self._beside(visible_slots, next_n, update_beside) else self.engine_overhead_us
        spin = self.spin_us(visible_slots, sparsity, next_n, state_bytes, predictor,
                            update_beside, index_topk) + overhead
        return spin < dense if running_spin else spin < dense * (1.0 - self.margin)


def _floor_slots(visible: int, index_topk: int) -> float:
    """Slots of the blocks the budget floor keeps for one request (reference.floor_blocks)."""
    n = max(0, int(visible))
    blocks = math.ceil(n / BLOCK_SLOTS)
    if index_topk <= 0 or blocks == 0:
        return 0.0
    return float(min(blocks, floor_blocks(blocks, n, index_topk, BLOCK_SLOTS)) * BLOCK_SLOTS)


def _block_slots(visible_slots: Sequence[int]) -> float:
    """Slots of the visible blocks of every request (whole 64-slot blocks are read)."""
    return float(sum(math.ceil(max(0, int(s)) / BLOCK_SLOTS) * BLOCK_SLOTS
                     for s in visible_slots))


H200 = CostModel()
