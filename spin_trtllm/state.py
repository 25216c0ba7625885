"""Per-request SPIN state for in-flight batching: a pool of state slots x indexer layers (V/D
EMAs and the blocks' ages; the ages alone with history=False, for the probe and gauss).

A request takes a slot when it is admitted and gives it back when it finishes. Its slot is
zeroed (V = D = 0, warm-up restarted) when it is admitted, after its prefill, at the start of a
new turn and when it resumes after preemption, so nothing of an earlier request or turn can
leak into it. The pool's per-slot capacity (slots of context) grows in whole 64-slot pages,
doubling when a request's context outgrows it, instead of being sized for the longest possible
context up front.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from .config import SpinConfig
from .errors import SpinError
from .limits import BLOCK_SLOTS
from .ops import OpState


class StatePool:
    def __init__(self, num_layers: int, max_requests: int, cfg: SpinConfig,
                 device: torch.device | str = "cpu", initial_capacity: int = 4096,
                 max_capacity: int = 1 << 20, history: bool = True):
        """history False: no V/D EMAs, only the counters (a predictor that reads no V/D
        history: probe, gauss); the state is then 8 bytes per 64-slot block."""
        if num_layers < 1 or max_requests < 1:
            raise SpinError(f"StatePool: num_layers ({num_layers}) and max_requests "
                            f"({max_requests}) must be >= 1")
        if not 1 <= initial_capacity <= max_capacity:
            raise SpinError(f"StatePool: need 1 <= initial_capacity ({initial_capacity}) <= "
                            f"max_capacity ({max_capacity})")
        self.cfg = cfg
        self.device = torch.device(device)
        self.max_capacity = max_capacity
        self.state = OpState.zeros(max_requests, num_layers, self._pages(initial_capacity), cfg,
                                   self.device, history)
        self._slot_of: dict[int, int] = {}
        self._reset_step = [0] * max_requests     # step of each slot's last reset (block ages)
        self._free = list(range(max_requests - 1, -1, -1))  # pop() hands out slot 0 first
        self.generation = 0       # bumped when the state tensors are reallocated

    @staticmethod
    def _pages(capacity: int) -> int:
        return math.ceil(capacity / BLOCK_SLOTS) * BLOCK_SLOTS

    # ---- sizes ------------------------------------------------------------------------------
    @property
    def history(self) -> bool:
        """The state holds the V/D EMAs (False: the counters alone)."""
        return self.state.history

    @property
    def capacity(self) -> int:
        """Context slots (and query positions) each state slot can hold."""
        return self.state.capacity

    @property
    def num_layers(self) -> int:
        return self.state.V.shape[1]

    @property
    def max_requests(self) -> int:
        return self.state.V.shape[0]

    @property
    def active(self) -> int:
        return len(self._slot_of)

    def bytes_per_slot_per_layer(self) -> float:
        """State bytes per context slot per layer: V + D entries (with history) plus the block
        ages."""
        elem = self.state.V.element_size() if self.history else 0
        return 2 * elem + self.state.last_seen.element_size() / BLOCK_SLOTS

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.tensors())

    # ---- lifecycle --------------------------------------------------------------------------
    def admit(self, request_id: int, step: int = 0) -> int:
        """Give a new request a zeroed slot; raises when the pool is full or the id is taken."""
        if request_id in self._slot_of:
            raise SpinError(f"request {request_id} already holds state slot "
                            f"{self._slot_of[request_id]}")
        if not self._free:
            raise SpinError(f"state pool full: {self.max_requests} requests active; finish or "
                            f"preempt one first")
        slot = self._free.pop()
        self._slot_of[request_id] = slot
        self.reset([request_id], step)
        return slot

    def reset(self, request_ids: Iterable[int], step: int | torch.Tensor = 0) -> None:
        """Zero the requests' state and restart warm-up: after prefill, at a new turn, on resume."""
        slots = self.slots(request_ids)
        if slots.numel() == 0:
            return
        steps = torch.as_tensor(step, dtype=torch.int64, device=self.device).expand(slots.shape)
        torch.ops.spin.reset(*self.state.tensors(), slots, steps.contiguous())
        for slot, st in zip(slots.tolist(), steps.tolist()):
            self._reset_step[slot] = st

    def release(self, request_id: int) -> None:
        """A finished (or preempted) request gives its slot back; the next owner gets it zeroed."""
        slot = self._slot_of.pop(request_id, None)
        if slot is None:
            raise SpinError(f"request {request_id} holds no state slot")
        self._free.append(slot)

    def slots(self, request_ids: Iterable[int],
              device: Optional[torch.device | str] = None) -> torch.Tensor:
        """int32 state slots of the requests, in order (the state_slot input of the ops), on
        the pool's device unless `device` is given."""
        out = []
        for rid in request_ids:
            slot = self._slot_of.get(int(rid))
            if slot is None:
                raise SpinError(f"request {rid} holds no state slot (admit it first)")
            out.append(slot)
        return torch.tensor(out, dtype=torch.int32,
                            device=self.device if device is None else device)

    def ensure_capacity(self, needed: int) -> bool:
        """Grow every slot to hold `needed` context slots / query positions (doubling, in whole
        pages). Returns True when the state was reallocated: buffers captured in a CUDA graph
        must then be captured again."""
        if needed <= self.capacity:
            return False
        if needed > self.max_capacity:
            raise SpinError(f"context of {needed} slots exceeds the pool's max_capacity "
                            f"{self.max_capacity}")
        new_cap = min(self._pages(max(needed, 2 * self.capacity)), self._pages(self.max_capacity))
        old = self.state
        self.state = OpState.zeros(self.max_requests, self.num_layers, new_cap, self.cfg,
                                   self.device, self.history)
        cap, blocks = old.V.shape[2], old.last_seen.shape[2]
        self.state.V[:, :, :cap] = old.V
        self.state.D[:, :, :cap] = old.D
        self.state.last_seen[:, :, :blocks] = old.last_seen
        # blocks that did not exist yet count as seen at the slot's last reset, as in the
        # reference, where every block's age starts at the reset
        self.state.last_seen[:, :, blocks:] = torch.tensor(
            self._reset_step, dtype=torch.int64, device=self.device).view(-1, 1, 1)
        self.state.decode_steps.copy_(old.decode_steps)
        self.generation += 1
        return True

    def free_slots(self, count: int) -> list[int]:
        """`count` slots no request holds (zeroed again when a request is admitted to one):
        scratch for padding rows."""
        if count > len(self._free):
            raise SpinError(f"state pool: {count} free slots needed, {len(self._free)} free")
        return self._free[-count:] if count else []

    def request_ids(self) -> list[int]:
        return list(self._slot_of)

    def slot_of(self, request_id: int) -> Optional[int]:
        return self._slot_of.get(request_id)
