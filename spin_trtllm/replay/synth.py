"""Synthetic SPIN traces: indexer scores with the structure SPIN predicts from.

The score of slot i for a query at slot position q in layer l is a sum of
  vertical   persistent important slots (weights 2-5), occasionally extended by new context
             and partly re-drawn on a sudden attention shift,
  diagonal   RoPE-like periodic bands in the relative offset o = q - i (weights 1.5-3),
  sink       the first `sink_slots` slots,
  local      recent offsets, decaying with distance,
  content    a small static per-(layer, slot) term, plus fresh Gaussian noise every row.

Positions (tokens counted from 0, c = compress_ratio, p = tokens visible to row 0 of a step,
starting at prompt_slots * c):
  row r of a step queries token p - 1 + r and sees tokens [0, p + r)
  row_len[t, l, r]  n_r = (p + r) // c        complete compressed slots visible
  query_pos[t, r]   q_r = (p + r - 1) // c    slot holding the query token
so n_r >= 1, n_r is non-decreasing in r, q_r >= n_r - 1, and with c = 1 n_r = q_r + 1 and
row 0 of step 0 sees exactly prompt_slots slots. A step commits accepted + 1 tokens
(p += accepted + 1); a later turn first appends turn_slots * c tokens (turn_slots slots).
"""

from __future__ import annotations

from dataclasses import fields

import torch

from .._threads import one_thread
from .synth_config import SCORE_CLAMP, SynthConfig
from .trace import SpinTrace

_DTYPES = {"float16": torch.float16, "float32": torch.float32}


def _plan(cfg: SynthConfig, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                            list[int]]:
    """Row lengths n [T, R] and query positions q [T, R] (int64), and the turn-start steps."""
    c, T, R = cfg.compress_ratio, cfg.steps, cfg.next_n
    turn_steps = [k * T // cfg.turns for k in range(cfg.turns)]  # evenly spaced, distinct
    committed = accepted.to(torch.int64) + 1
    before = torch.cat([torch.zeros(1, dtype=torch.int64), committed.cumsum(0)[:-1]])
    appended = torch.zeros(T, dtype=torch.int64)
    appended[turn_steps[1:]] = cfg.turn_slots * c
    p = cfg.prompt_slots * c + before + appended.cumsum(0)  # tokens visible to row 0
    seen = p.unsqueeze(1) + torch.arange(R, dtype=torch.int64)  # tokens visible to row r
    return seen // c, (seen - 1) // c, turn_steps


def _diagonal_table(cfg: SynthConfig, g: torch.Generator, width: int) -> torch.Tensor:
    """float32 [L, width]: diagonal + local term as a function of the offset o = q - i."""
    L, B = cfg.layers, cfg.diagonal_bands
    o = torch.arange(width, dtype=torch.float32)
    table = torch.zeros(L, width)
    if B:
        # RoPE-like: periods spread log-uniformly over 64..4096 slots, so a few bands are visible.
        period = torch.exp2(6.0 + 6.0 * torch.rand(L, B, 1, generator=g))
        phase = torch.rand(L, B, 1, generator=g) * period
        sigma = 0.75 + 1.75 * torch.rand(L, B, 1, generator=g)
        weight = 1.5 + 1.5 * torch.rand(L, B, 1, generator=g)
        for b in range(B):  # one band at a time keeps memory at [L, width]
            m = torch.remainder(o - phase[:, b], period[:, b])
            dist = torch.minimum(m, period[:, b] - m)
            table += weight[:, b] * torch.exp(-0.5 * (dist / sigma[:, b]) ** 2)
    if cfg.local_window:
        near = o < cfg.local_window
        tau = max(cfg.local_window / 4.0, 1.0)
        table += torch.where(near, 3.0 * torch.exp(-o / tau), torch.zeros(())).unsqueeze(0)
    return table


def _draw_weights(shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    return 2.0 + 3.0 * torch.rand(shape, generator=g)




def synthesize(cfg: SynthConfig, progress: bool = False) -> SpinTrace:
    """Generate a validated synthetic SpinTrace; its tensors are bit-identical for the same
    config (a saved file's header may order the metadata differently)."""
    from tqdm import tqdm

    g = torch.Generator().manual_seed(cfg.seed)
    T, L, R = cfg.steps, cfg.layers, cfg.next_n
    dtype = _DTYPES[cfg.dtype]

    if R > 1:
        # Geometric acceptance: drafts accepted in order until the first rejection.
        ok = (torch.rand(T, R - 1, generator=g) < cfg.accept_prob).to(torch.int32)
        accepted = ok.cumprod(1).sum(1).to(torch.int32)
    else:
        accepted = torch.zeros(T, dtype=torch.int32)
    n, q, turn_steps = _plan(cfg, accepted)
    n_max, q_max = int(n.max()), int(q.max())

    per_step = L * n.sum(1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), per_step.cumsum(0)]).tolist()
    out = torch.empty(offsets[-1], dtype=dtype)

    # Static per-(layer, slot) terms, drawn once for every slot the run will ever see.
    static = 0.5 * torch.randn(L, n_max, generator=g)
    sinks = min(cfg.sink_slots, n_max)
    static[:, :sinks] += 3.0 + 2.0 * torch.rand(L, sinks, generator=g)
    # Reversed offset table: slice [q_max-q, q_max-q+n) maps slot i to offset q - i, no copy.
    diag_rev = _diagonal_table(cfg, g, q_max + 1).flip(-1).contiguous()

    vert = torch.zeros(L, n_max)
    k0 = min(cfg.vertical, cfg.prompt_slots)
    if k0:
        pos = torch.rand(L, cfg.prompt_slots, generator=g).argsort(1)[:, :k0]
        vert.scatter_(1, pos, _draw_weights((L, k0), g))
    base = static + vert
    # Density of important slots, reused for context that appears later.
    density = min(cfg.vertical / cfg.prompt_slots, 0.5)
    turn_set = set(turn_steps[1:])
    seen_hi = cfg.prompt_slots
    n_list, q_list = n.tolist(), q.tolist()
    # One reused work buffer: fresh per-row allocations hit page faults on every row.
    work = torch.empty(L * n_max)

    with one_thread():
        for t in tqdm(range(T), desc="synth", unit="step", disable=not progress):
            hi = n_list[t][-1]
            if hi > seen_hi and density > 0:
                # New context may add vertical lines; a new user message draws more attention.
                d = min(2 * density, 1.0) if t in turn_set else density
                fresh = torch.rand(L, hi - seen_hi, generator=g) < d
                w = torch.where(fresh, _draw_weights((L, hi - seen_hi), g), torch.zeros(()))
                vert[:, seen_hi:hi] = w
                base[:, seen_hi:hi] = static[:, seen_hi:hi] + w
            seen_hi = max(seen_hi, hi)

            ctx = n_list[t][0]
            shifted = (torch.rand(L, generator=g) < cfg.shift_prob).nonzero().flatten().tolist()
            for l in shifted:  # rare: re-draw a random half of this layer's vertical set
                idx = (vert[l, :seen_hi] > 0).nonzero().flatten()
                k = (idx.numel() + 1) // 2
                if k == 0:
                    continue
                gone = idx[torch.randperm(idx.numel(), generator=g)[:k]]
                vert[l, gone] = 0.0
                base[l, gone] = static[l, gone]
                new = torch.randint(0, ctx, (k,), generator=g)
                vert[l, new] = _draw_weights((k,), g)
                base[l, new] = static[l, new] + vert[l, new]

            row_n, row_q = n_list[t], q_list[t]
            stride = sum(row_n)  # one layer's rows of this step, packed (layer, row, slot)
            pre = 0
            for r in range(R):
                nr, s = row_n[r], q_max - row_q[r]
                x = work[:L * nr].view(L, nr).normal_(0.0, cfg.noise, generator=g)
                x += base[:, :nr]
                x += diag_rev[:, s:s + nr]
                x.clamp_(-SCORE_CLAMP, SCORE_CLAMP)
                out.as_strided((L, nr), (stride, 1), offsets[t] + pre).copy_(x)
                pre += nr

    row_len = n.to(torch.int32).unsqueeze(1).expand(T, L, R).contiguous()
    settings = " ".join(f"{f.name}={getattr(cfg, f.name)}" for f in fields(cfg)
                        if f.name != "seed")
    trace = SpinTrace(
        scores=out, row_len=row_len, query_pos=q.to(torch.int32),
        index_topk=cfg.index_topk, block_size=cfg.block_size,
        turn_start=torch.tensor(turn_steps, dtype=torch.int32) if cfg.turns > 1 else None,
        accepted=accepted if R > 1 else None, compress_ratio=cfg.compress_ratio,
        source=f"synth seed={cfg.seed} {settings}", name=f"<synth seed={cfg.seed}>")
    return trace.validate()
