"""Choosing tokens: sampling, teacher forcing, and verifying MTP drafts against the target rows."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ... import reference as ref
from .requests import Live, needs_logits


def sample(logits: torch.Tensor, temperature: float, top_k: int, seed: int,
           position: int) -> int:
    """Greedy at temperature 0; else Gumbel-max with counter-hash noise keyed by (seed,
    position): the same token whatever the batch, device or run."""
    if temperature == 0:
        return int(logits.argmax())
    x = logits.double() / temperature
    if 0 < top_k < x.numel():
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    vocab = torch.arange(x.numel(), dtype=torch.int64)
    h = ref.counter_hash(seed, torch.tensor(position), torch.tensor(0), torch.tensor(0), vocab)
    u = (h.double() + 0.5) / 2.0 ** 32
    return int((x - torch.log(-torch.log(u))).argmax())


def target(live: Live, logits: torch.Tensor, ahead: int, position: int) -> int:
    """The target row's token: the forced one (teacher forcing, its log-prob recorded) or
    a sample. `ahead` counts the rows before it in this step."""
    r = live.req
    if r.forced is None:
        return sample(logits, r.temperature, r.top_k, r.seed, position)
    index = len(live.out[-1]) + ahead
    token = int(r.forced[min(index, len(r.forced) - 1)])
    live.logprobs.append(float(logits.double().log_softmax(-1)[token]))
    return token


def verify(batch: Sequence[Live], start: Sequence[int], greedy: list[list[int]],
           row_logits: Optional[torch.Tensor], sampled: list[int],
           next_n: int) -> tuple[list[int], list[list[int]]]:
    """Per request: how many drafts its target rows accept, and the tokens it emits (the
    accepted drafts and the target after them). Greedy requests take `greedy` (argmax per row);
    the `sampled` ones (needs_logits) their rows of `row_logits`, in that order. `start`: each
    request's position of its first row."""
    where = {b: i for i, b in enumerate(sampled)}
    accepted, emitted = [], []
    for b, live in enumerate(batch):
        p = int(start[b])
        targets = []
        a = 0
        for j in range(next_n):
            if needs_logits(live.req):
                targets.append(target(live, row_logits[where[b], j], j, p + j + 1))
            else:
                targets.append(greedy[b][j])
            if j < next_n - 1 and live.drafts[j] == targets[j]:
                a += 1
            else:
                break
        accepted.append(a)
        emitted.append(live.drafts[:a] + [targets[a]])
    return accepted, emitted
