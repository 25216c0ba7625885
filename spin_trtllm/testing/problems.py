"""Random op problems: a batch of requests with state, FP8 pages and queries, run through
torch.ops.spin.* (select -> per layer indexer_logits, topk, update) on any device."""

import math

import torch

from spin_trtllm import SpinConfig
from spin_trtllm import ops
from spin_trtllm.testing.pages import make_cache


def integer_state(*problems):
    """Integer-valued V/D: mean and top4 pooling then sum exactly in any order (the kernels'
    order differs from torch's)."""
    for p in problems:
        g = torch.Generator().manual_seed(9)
        p.state.V.copy_(torch.randint(-20, 20, p.state.V.shape, generator=g).to(p.state.V.dtype))
        p.state.D.copy_(torch.randint(-20, 20, p.state.D.shape, generator=g).to(p.state.D.dtype))


class Problem:
    """A batch of B requests x R rows over L layers with mixed lengths and shuffled pages."""

    def __init__(self, B=3, R=1, L=2, lens=(700, 64, 1500), cap=None, seed=0, cfg=None,
                 warm=(False,), device="cpu", slots=None):
        gen = torch.Generator().manual_seed(seed)
        self.cfg = cfg or SpinConfig(index_topk=128, target_sparsity=0.5, exploration=0.0)
        self.B, self.R, self.L = B, R, L
        lens = [lens[i % len(lens)] for i in range(B)]
        self.cap = cap or max(lens) + R + 64
        self.max_ctx = max(lens) + R - 1
        n = torch.tensor([[l + r for r in range(R)] for l in lens], dtype=torch.int32)
        self.n, self.q = n, (n - 1).clone()
        S = B + 2
        self.state = ops.OpState.zeros(S, L, self.cap, self.cfg)
        self.state.V.copy_(torch.randn(S, L, self.cap, generator=gen))
        self.state.D.copy_(torch.randn(S, L, self.cap, generator=gen))
        self.state.last_seen.copy_(torch.randint(0, 50, self.state.last_seen.shape, generator=gen))
        self.state.decode_steps.copy_(torch.tensor(
            [[0 if warm[i % len(warm)] else 9] * L for i in range(S)]))
        self.slot = (torch.randperm(S, generator=gen)[:B] if slots is None
                     else torch.tensor(slots)).to(torch.int32)
        self.request = torch.randint(0, 1000, (B,), generator=gen)
        self.step = torch.full((B,), 60, dtype=torch.int64)
        pages_per_req = math.ceil(self.cap / 64)
        self.num_pages = B * pages_per_req + 3
        self.cache = [make_cache(self.num_pages, gen) for _ in range(L)]
        self.table = torch.randperm(self.num_pages, generator=gen)[:B * pages_per_req].view(
            B, pages_per_req).to(torch.int32)
        self.qfp8 = (torch.randn(B * R, 64, 128, generator=gen)).to(torch.float8_e4m3fn)
        self.weights = torch.randn(B * R, 64, generator=gen) * 0.1
        self.accepted = torch.randint(0, R, (B,), generator=gen, dtype=torch.int32)
        self.m_cap = math.ceil(self.cap / 64)
        self.to(device)

    def to(self, device):
        for name in ("n", "q", "slot", "request", "step", "table", "qfp8", "weights", "accepted"):
            setattr(self, name, getattr(self, name).to(device))
        self.cache = [c.to(device) for c in self.cache]
        st = self.state
        self.state = ops.OpState(*(t.to(device) for t in st.tensors()))
        return self

    def clone_state(self):
        return ops.OpState(*(t.clone() for t in self.state.tensors()))

    def run_step(self, state=None, m_cap=None):
        """select -> per layer logits, topk, update. Returns (ids, counts, [logits], [topk])."""
        state = state or self.state
        m_cap = m_cap or self.m_cap
        ids, cnt = ops.select(state, self.slot, self.n, self.q, self.request, self.step, self.cfg,
                              m_cap, self.max_ctx)
        logits, tops = [], []
        for l in range(self.L):
            z = ops.indexer_logits(self.qfp8, self.cache[l], self.weights, self.n, self.table,
                                   ids[:, l], cnt[:, l])
            tops.append(ops.topk(z, ids[:, l], cnt[:, l], self.R, self.cfg.index_topk))
            ops.update(state, self.slot, z, ids[:, l], cnt[:, l], self.n, self.q, self.accepted,
                       self.step, l, self.cfg, self.max_ctx)
            logits.append(z)
        return ids, cnt, logits, tops


def problem_pair(**kw):
    """The same Problem on the CPU and on the GPU: (cpu, cuda)."""
    return Problem(**kw), Problem(**kw, device="cuda")
