import pytest
import torch

from spin_trtllm import SpinConfig, SpinError
from spin_trtllm.state import StatePool


def test_slot_reuse_never_leaks_state():
    pool = StatePool(num_layers=2, max_requests=2, cfg=SpinConfig(), initial_capacity=128)
    a = pool.admit(10, step=3)
    st = pool.state
    st.V[a].normal_()
    st.D[a].normal_()
    st.last_seen[a] = 99
    st.decode_steps[a] = 7
    pool.release(10)
    b = pool.admit(11, step=5)
    assert b == a                                   # the slot is reused ...
    assert (st.V[b] == 0).all() and (st.D[b] == 0).all()   # ... but nothing of request 10
    assert (st.decode_steps[b] == 0).all() and (st.last_seen[b] == 5).all()


def test_reset_touches_only_the_given_requests():
    pool = StatePool(num_layers=1, max_requests=3, cfg=SpinConfig(), initial_capacity=64)
    for rid in (1, 2, 3):
        pool.admit(rid)
    pool.state.V.fill_(1.0)
    pool.state.decode_steps.fill_(4)
    pool.reset([2], step=9)                         # request 2 starts a new turn
    s2 = pool.slot_of(2)
    for rid in (1, 3):
        s = pool.slot_of(rid)
        assert (pool.state.V[s] == 1).all() and int(pool.state.decode_steps[s, 0]) == 4
    assert (pool.state.V[s2] == 0).all() and int(pool.state.decode_steps[s2, 0]) == 0
    assert pool.slots([3, 1]).tolist() == [pool.slot_of(3), pool.slot_of(1)]


def test_pool_errors():
    pool = StatePool(num_layers=1, max_requests=1, cfg=SpinConfig(), initial_capacity=64)
    pool.admit(1)
    with pytest.raises(SpinError, match="already holds"):
        pool.admit(1)
    with pytest.raises(SpinError, match="pool full"):
        pool.admit(2)
    with pytest.raises(SpinError, match="holds no state slot"):
        pool.release(5)
    with pytest.raises(SpinError, match="admit it first"):
        pool.slots([5])
    with pytest.raises(SpinError, match="max_capacity"):
        pool.ensure_capacity(1 << 21)
    with pytest.raises(SpinError, match="initial_capacity"):
        StatePool(num_layers=1, max_requests=1, cfg=SpinConfig(), initial_capacity=0)


def test_capacity_grows_in_pages_and_keeps_state():
    pool = StatePool(num_layers=2, max_requests=2, cfg=SpinConfig(), initial_capacity=100)
    assert pool.capacity == 128                     # whole 64-slot pages
    pool.admit(1, step=4)
    s = pool.slot_of(1)
    pool.state.V[s].normal_()
    pool.state.last_seen[s, :, 1] = 8
    before_V = pool.state.V.clone()
    assert pool.ensure_capacity(100) is False and pool.generation == 0
    assert pool.ensure_capacity(129) is True and pool.generation == 1
    assert pool.capacity == 256                     # doubled
    assert torch.equal(pool.state.V[:, :, :128], before_V)
    assert (pool.state.V[:, :, 128:] == 0).all()
    assert pool.state.last_seen[s, 0, :2].tolist() == [4, 8]
    assert (pool.state.last_seen[s, :, 2:] == 4).all()   # new blocks: aged from the reset
    assert pool.ensure_capacity(1000) and pool.capacity == 1024


@pytest.mark.parametrize("dtype,expected", [("float32", 8.125), ("float16", 4.125),
                                            ("float8_e4m3fn", 2.125)])
def test_bytes_per_slot_per_layer(dtype, expected):
    pool = StatePool(num_layers=3, max_requests=2, cfg=SpinConfig(state_dtype=dtype),
                     initial_capacity=640)
    assert pool.bytes_per_slot_per_layer() == expected
    assert pool.nbytes() == pytest.approx(expected * 2 * 3 * 640 + 2 * 3 * 8)


def test_a_pool_without_history_keeps_the_counters_alone():
    """history=False (probe, gauss): V and D of width 0, the capacity in the blocks' ages,
    which grow and reset as a full pool's do."""
    pool = StatePool(num_layers=2, max_requests=2, cfg=SpinConfig(), initial_capacity=100,
                     history=False)
    assert pool.state.V.shape == pool.state.D.shape == (2, 2, 0) and not pool.state.history
    assert pool.capacity == 128 and pool.state.last_seen.shape == (2, 2, 2)
    assert pool.bytes_per_slot_per_layer() == 8 / 64
    assert pool.nbytes() == 2 * 2 * 2 * 8 + 2 * 2 * 8
    pool.admit(1, step=4)
    s = pool.slot_of(1)
    pool.state.last_seen[s, :, 1] = 8
    pool.state.decode_steps[s] = 3
    assert pool.ensure_capacity(129) and pool.capacity == 256
    assert pool.state.V.shape[2] == 0
    assert pool.state.last_seen[s, 0].tolist() == [4, 8, 4, 4]
    assert (pool.state.decode_steps[s] == 3).all()
    pool.reset([1], step=6)
    assert (pool.state.last_seen[s] == 6).all() and (pool.state.decode_steps[s] == 0).all()
