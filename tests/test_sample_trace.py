"""The shipped sample trace and SpinTrace.keep_layers (what `trace --layers` writes)."""

import pytest
import torch

from spin_trtllm import SpinConfig
from spin_trtllm.errors import TraceError
from spin_trtllm.harness.pretrained import SAMPLE_TRACE
from spin_trtllm.replay.evaluate import replay
from spin_trtllm.replay.trace import SpinTrace
from spin_trtllm.testing.traces import make_trace


def test_the_shipped_sample_trace_is_a_real_v2_trace_that_replays():
    trace = SpinTrace.load(SAMPLE_TRACE)
    assert trace.version == 2 and trace.source == "dsa-lite" and trace.num_steps >= 16
    # the scores are the indexer's own: sum_h w relu(q . k) over the stored q, w and keys
    assert trace.check_scores() < 0.02
    res = replay(trace, [0.5], SpinConfig(index_topk=trace.index_topk))[0]
    # SPIN beats random selection at the same sparsity on real patterns
    assert res["mean_miss"] < res["random_mean_miss"]


def test_keep_layers_equals_the_layers_of_the_full_trace():
    full = make_trace(layers=3, steps=7, seed=5)
    part = full.keep_layers([2, 0])
    part.validate()
    assert part.num_layers == 2
    for t in range(full.num_steps):
        a, b = full.step_scores(t), part.step_scores(t)
        assert torch.equal(a[2], b[0]) and torch.equal(a[0], b[1])
    with pytest.raises(TraceError, match="pick from 0..2"):
        full.keep_layers([3])
    with pytest.raises(TraceError, match="twice"):
        full.keep_layers([1, 1])
