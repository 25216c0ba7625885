import pytest
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


@pytest.fixture
def small_trace():
    return make_trace()
