"""Small SpinTrace objects: hand-shaped score traces, and trace-v2 stand-ins for the
query-aware predictor tests (SpinTrace objects carrying q, w and keys, the v2 tensors, with
scores computed from them, z = sum_h w_h relu(q_h . k_s))."""

import torch

from spin_trtllm.replay.trace import SpinTrace


def make_trace(steps=6, layers=2, next_n=1, start=40, block_size=8, index_topk=8, seed=0,
               dtype=torch.float32, accepted=None, turn_start=None):
    """Small hand-shaped trace: row r of step t sees start + t + r slots, q = n - 1."""
    gen = torch.Generator().manual_seed(seed)
    n = torch.tensor([[start + t + r for r in range(next_n)] for t in range(steps)])
    row_len = n[:, None, :].expand(steps, layers, next_n).to(torch.int32).contiguous()
    query_pos = (n - 1).to(torch.int32)
    total = int(row_len.sum())
    scores = torch.randn(total, generator=gen).to(dtype)
    if accepted is None and next_n > 1:
        accepted = torch.randint(0, next_n, (steps,), generator=gen, dtype=torch.int32)
    return SpinTrace(scores=scores, row_len=row_len, query_pos=query_pos, index_topk=index_topk,
                     block_size=block_size, accepted=accepted, turn_start=turn_start).validate()


def scores_from_qwk(q, w, keys, row_len):
    """Packed scores (step, layer, row, slot order) of q [T, L, R, H, D], w [T, L, R, H],
    keys [L, S, D] for rows of row_len [T, L, R] visible slots."""
    T, L, R = row_len.shape
    out = []
    for t in range(T):
        for layer in range(L):
            for r in range(R):
                n = int(row_len[t, layer, r])
                dots = torch.einsum("hd,sd->sh", q[t, layer, r].float(), keys[layer, :n].float())
                out.append((dots.relu() * w[t, layer, r].float()).sum(-1))
    return torch.cat(out)


def random_v2_trace(steps=5, layers=2, next_n=1, start=40, heads=3, dim=8, block_size=8,
                    index_topk=8, seed=0, negative_w=True, accepted=None):
    """Unstructured v2 trace: row r of step t sees start + t + r slots, q = n - 1."""
    gen = torch.Generator().manual_seed(seed)
    n = torch.tensor([[start + t + r for r in range(next_n)] for t in range(steps)])
    row_len = n[:, None, :].expand(steps, layers, next_n).to(torch.int32).contiguous()
    S = int(n.max())
    q = torch.randn(steps, layers, next_n, heads, dim, generator=gen).half()
    w = torch.rand(steps, layers, next_n, heads, generator=gen) + 0.1
    if negative_w:
        w = w - 0.5
    keys = torch.randn(layers, S, dim, generator=gen).half()
    if accepted is None and next_n > 1:
        accepted = torch.randint(0, next_n, (steps,), generator=gen, dtype=torch.int32)
    trace = SpinTrace(scores=scores_from_qwk(q, w, keys, row_len), row_len=row_len,
                      query_pos=(n - 1).to(torch.int32), index_topk=index_topk,
                      block_size=block_size, accepted=accepted).validate()
    trace.q, trace.w, trace.keys = q, w, keys
    return trace


def planted_v2_trace(steps=48, layers=2, start=1024, heads=4, dim=32, block_size=16,
                     index_topk=32, topics=12, dwell=6, focus=(1.5, 0.6), seed=0):
    """Planted structure: every block belongs to one of `topics` key directions (its keys are
    that direction plus noise); the query follows one topic for `dwell` steps, then jumps to
    another. The hot blocks (the current topic's) move at each jump to blocks whose history
    is cold, so SPIN's V/D history lags while a probe with the current query sees them.
    focus[l]: how strongly layer l's query follows the topic (lower: more diffuse top-K)."""
    gen = torch.Generator().manual_seed(seed)
    n = torch.tensor([[start + t] for t in range(steps)])
    row_len = n[:, None, :].expand(steps, layers, 1).to(torch.int32).contiguous()
    S = int(n.max())
    nb = -(-S // block_size)
    direction = torch.nn.functional.normalize(torch.randn(layers, topics, dim, generator=gen), dim=-1)
    topic_of = torch.randint(0, topics, (layers, nb), generator=gen)
    blk = torch.arange(S) // block_size
    keys = torch.stack([direction[layer, topic_of[layer, blk]] for layer in range(layers)])
    keys = (keys * 2.0 + 0.6 * torch.randn(layers, S, dim, generator=gen)).half()
    order = torch.randperm(topics, generator=gen)
    current = torch.stack([order[(t // dwell) % topics] for t in range(steps)])
    qdir = direction[:, current].permute(1, 0, 2)                       # [T, L, D]
    strength = torch.tensor(focus, dtype=torch.float32).view(1, layers, 1, 1, 1)
    q = (qdir[:, :, None, None, :] * strength
         + 0.4 * torch.randn(steps, layers, 1, heads, dim, generator=gen)).half()
    w = torch.rand(steps, layers, 1, heads, generator=gen) * 0.5 + 0.5
    trace = SpinTrace(scores=scores_from_qwk(q, w, keys, row_len), row_len=row_len,
                      query_pos=(n - 1).to(torch.int32), index_topk=index_topk,
                      block_size=block_size).validate()
    trace.q, trace.w, trace.keys = q, w, keys
    return trace
