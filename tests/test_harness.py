"""dsa-lite end to end on the CPU: batching, MTP, multi-turn, slot reuse, bad requests, traces."""

import math

import pytest
import torch

from spin_trtllm import SpinConfig, SpinConfigError, SpinError
from spin_trtllm.harness import (DsaLiteConfig, Engine, Request, RequestError, init_weights,
                                 load_checkpoint, save_checkpoint, tiny)
from spin_trtllm.replay.evaluate import replay
from spin_trtllm.testing.harness import (BRIEF_SCHEDULE, SHORT_SCHEDULE, TEXT, arrivals,
                                        copy_drafter, prompt, schedule_run, spin_cfg)


def run_schedule(engine, schedule):
    """schedule: {engine step: [Request, ...]} submitted before that step. Returns outputs."""
    outs = {}
    t = 0
    while t <= max(schedule) or not engine.idle:
        for r in schedule.get(t, []):
            engine.submit(r)
        for o in engine.step():
            outs[o.request_id] = o
        t += 1
        assert t < 2000
    return outs


@pytest.mark.parametrize("mtp,temperature", [(0, 0.0), (2, 0.9), (2, 0.0)])
@pytest.mark.slow
def test_tokens_do_not_depend_on_the_batch(mtp, temperature):
    cfg = tiny().with_overrides(mtp_depth=mtp)
    w = init_weights(cfg)
    target = lambda: Request(prompt(700), max_new_tokens=30, temperature=temperature, seed=5,
                             request_id=42)
    drafter = None
    if mtp:
        # drafts from a first run's tokens, every other one spoiled: rows > 0 get accepted
        first = run_schedule(Engine(cfg, spin_cfg(), weights=w), {0: [target()]})[42].tokens
        oracle = Oracle(first, 700, every=2)
        drafter = lambda rid, ctx, d: oracle(rid, ctx, d) if rid == 42 else copy_drafter(rid, ctx, d)
    solo = Engine(cfg, spin_cfg(), weights=w, max_batch=4, drafter=drafter)
    alone = run_schedule(solo, {0: [target()]})
    if mtp:
        assert alone[42].accepted > 0                  # rows beyond row 0 were accepted
    others = {0: [Request(prompt(300, 5), max_new_tokens=6, request_id=1), target()],
              3: [Request(prompt(500, 9), max_new_tokens=12, request_id=2)],
              4: [Request(prompt(90, 1), max_new_tokens=3, temperature=1.0, request_id=3)],
              9: [Request(prompt(250, 2), max_new_tokens=25, request_id=4)]}
    engine = Engine(cfg, spin_cfg(), weights=w, max_batch=3, drafter=drafter)
    crowd = run_schedule(engine, others)
    assert max(s.batch for s in engine.history) == 3           # the batch really changed
    assert len({s.batch for s in engine.history}) >= 2
    assert alone[42].tokens == crowd[42].tokens
    assert len(crowd[42].tokens) == 30 and set(crowd) == {1, 2, 3, 4, 42}


@pytest.mark.parametrize("ratios", [(0, 4, 128, 4), (0, 1, 128, 1)])
@pytest.mark.slow
def test_spin_at_zero_sparsity_equals_all_keep(ratios):
    cfg = tiny().with_overrides(compress_ratios=ratios)
    w = init_weights(cfg)
    reqs = lambda: [Request(prompt(900), max_new_tokens=25), Request(prompt(400, 7), max_new_tokens=25)]
    dense = Engine(cfg, None, weights=w, max_batch=2).run(reqs())
    e = Engine(cfg, spin_cfg(target_sparsity=0.0, exploration=0.0), weights=w, max_batch=2,
               measure_miss=True)
    spin = e.run(reqs())
    assert [o.tokens for o in dense] == [o.tokens for o in spin]
    assert not [m for s in e.history for m in s.miss]      # every block kept: nothing eligible
    assert sum(s.selected_blocks for s in e.history) == sum(s.visible_blocks for s in e.history)


@pytest.mark.slow
def test_spin_prunes_and_measures_misses():
    cfg = tiny().with_overrides(max_context=8192)
    e = Engine(cfg, spin_cfg(exploration=0.0), max_batch=2, measure_miss=True)
    e.run([Request(TEXT[:2000] + TEXT[:1000], max_new_tokens=20)])  # 1 prefill + 19 steps
    steps = [s for s in e.history]
    sel = sum(s.selected_blocks for s in steps[1:])
    vis = sum(s.visible_blocks for s in steps[1:])
    assert 0.4 < 1 - sel / vis < 0.6                        # 12 blocks -> 6 kept after warm-up
    assert steps[0].selected_blocks == steps[0].visible_blocks    # warm-up scores everything
    miss = [m for s in steps for m in s.miss]
    # eligible rows: every step after warm-up, every indexer layer
    assert len(miss) == 18 * len(cfg.csa_layers) and all(0 <= m <= 1 for m in miss)
    assert 0 < sum(miss) / len(miss) < 1


def test_step_stats_split_the_wall_time_by_host_phase():
    e = Engine(tiny(), spin_cfg(), max_batch=2)
    e.run([Request(TEXT[:300], max_new_tokens=6), Request(TEXT[:200], max_new_tokens=4)])
    assert e.history
    for s in e.history:
        phases = (s.prepare_seconds, s.launch_seconds, s.wait_seconds)
        assert all(p >= 0 for p in phases) and s.prepare_seconds > 0 and s.launch_seconds > 0
        assert sum(phases) <= s.seconds
        # the advance and the final sync are timed within what follows the wait (the sync a
        # no-op call on the CPU)
        assert 0 < s.advance_seconds and 0 < s.sync_seconds
        assert s.advance_seconds + s.sync_seconds <= s.seconds - sum(phases)
        # on the CPU the forward runs inside the call: it is most of the step
        assert s.launch_seconds > 0.3 * s.seconds


class Oracle:
    """Drafts the true continuation (from an earlier run), or a wrong one."""

    def __init__(self, tokens, prompt_len, wrong=False, every=1):
        self.tokens, self.prompt_len, self.wrong, self.every = tokens, prompt_len, wrong, every
        self.calls = 0

    def __call__(self, rid, context, depth):
        self.calls += 1
        done = len(context) - self.prompt_len            # generated tokens so far
        out = []
        for i in range(depth):
            k = done + i
            t = self.tokens[k] if k < len(self.tokens) else 0
            bad = self.wrong or (i % self.every == self.every - 1 and self.every > 1)
            out.append((t + 1) % 256 if bad else t)
        return out


@pytest.mark.parametrize("wrong,every,expect", [(False, 1, "all"), (True, 1, "none"),
                                               (False, 2, "some")])
def test_mtp_verification_keeps_the_target_tokens(wrong, every, expect):
    cfg0 = tiny()
    cfg3 = tiny().with_overrides(mtp_depth=3)
    w = init_weights(cfg3)
    p = prompt(600)
    ref_out = Engine(cfg0, None, weights=w).run([Request(p, max_new_tokens=40)])[0]
    drafter = Oracle(ref_out.tokens, len(p), wrong, every)
    seen = []
    e = Engine(cfg3, None, weights=w, drafter=drafter)
    finish = e.indexer.finish
    e.indexer.finish = lambda acc=None: (seen.append(acc.tolist()), finish(acc))
    out = e.run([Request(p, max_new_tokens=40)])[0]
    assert out.tokens == ref_out.tokens
    acc = [a[0] for a in seen]
    assert sum(acc) == out.accepted and out.drafted == 3 * len(acc)
    if expect == "all":
        assert all(a == 3 for a in acc[:-1]) and len(acc) == math.ceil(39 / 4)
    elif expect == "none":
        assert out.accepted == 0 and len(acc) == 39
    else:
        assert all(a == 1 for a in acc[:-1])


def test_mtp_with_spin_at_zero_sparsity_equals_single_row_decoding():
    cfg0, cfg3 = tiny(), tiny().with_overrides(mtp_depth=3)
    w = init_weights(cfg3)
    p = prompt(800)
    ref_out = Engine(cfg0, spin_cfg(target_sparsity=0.0), weights=w).run(
        [Request(p, max_new_tokens=30)])[0]
    out = Engine(cfg3, spin_cfg(target_sparsity=0.0), weights=w,
                 drafter=Oracle(ref_out.tokens, len(p), every=3)).run(
        [Request(p, max_new_tokens=30)])[0]
    assert out.tokens == ref_out.tokens and 0 < out.accepted < out.drafted


def test_mtp_head_drafts_run_without_an_oracle():
    cfg = tiny().with_overrides(mtp_depth=2)
    e = Engine(cfg, spin_cfg(), max_batch=2)
    outs = e.run([Request(prompt(300), max_new_tokens=12), Request(prompt(200, 3), max_new_tokens=9)])
    assert sorted(len(o.tokens) for o in outs) == [9, 12]
    assert all(o.drafted == 2 * o.decode_steps and 0 <= o.accepted <= o.drafted for o in outs)


def test_new_turn_resets_spin_state_like_a_fresh_request():
    cfg = tiny()
    w = init_weights(cfg)
    spin = spin_cfg(exploration=0.0)
    first, second = prompt(500), prompt(200, 11)
    e = Engine(cfg, spin, weights=w)
    resets = []
    reset = e.pool.reset
    e.pool.reset = lambda ids, step=0: (resets.append((list(ids), int(step))), reset(ids, step))
    multi = e.run([Request(first, max_new_tokens=15, turns=[second], request_id=7)])[0]
    assert resets == [([7], 0), ([7], 14)]      # admission; turn 2's prefill at its decode step
    assert len(multi.turns) == 2 and all(len(t) == 15 for t in multi.turns)
    # the same context submitted as one prompt, to a fresh engine
    context = list(first) + multi.turns[0] + list(second)
    fresh = Engine(cfg, spin, weights=w).run([Request(context, max_new_tokens=15)])[0]
    assert fresh.tokens == multi.turns[1]


@pytest.mark.slow
def test_a_reused_slot_carries_nothing_over():
    cfg = tiny()
    w = init_weights(cfg)
    b = lambda: Request(prompt(400, 20), max_new_tokens=20, temperature=0.7, seed=9, request_id=3)
    fresh = Engine(cfg, spin_cfg(), weights=w).run([b()])[0]
    e = Engine(cfg, spin_cfg(), weights=w, max_batch=1, max_requests=1)
    outs = e.run([Request(prompt(1200), max_new_tokens=30, request_id=2), b()])
    assert {o.request_id: o for o in outs}[3].tokens == fresh.tokens
    assert e.caches.free_pages == e.caches.num_pages and e.pool.active == 0


def test_accepted_counts_only_kept_drafts_and_auto_ids_are_not_reused():
    cfg = tiny().with_overrides(mtp_depth=3)
    w = init_weights(cfg)
    p = prompt(300)
    base = Engine(cfg, None, weights=w).run([Request(p, max_new_tokens=30)])[0].tokens
    e = Engine(cfg, None, weights=w, drafter=Oracle(base, len(p)))
    out = e.run([Request(p, max_new_tokens=2)])[0]
    # the first token comes from prefill; the one decode step keeps 1 of its 3 correct drafts
    assert out.tokens == base[:2] and out.accepted == 1 and e.history[0].accepted == 1
    again = e.run([Request(p, max_new_tokens=2)])[0]
    assert again.request_id != out.request_id


def test_stop_token_ends_the_turn_and_drops_later_drafts():
    cfg = tiny().with_overrides(mtp_depth=3)
    w = init_weights(cfg)
    p = prompt(300)
    base = Engine(cfg, None, weights=w).run([Request(p, max_new_tokens=30)])[0].tokens
    stop = base[10]
    k = base.index(stop)
    out = Engine(cfg, None, weights=w, drafter=Oracle(base, len(p))).run(
        [Request(p, max_new_tokens=30, stop_token=stop)])[0]
    assert out.tokens == base[:k + 1] and out.finish_reason == "stop"


@pytest.mark.parametrize("req,match", [
    (Request(b""), "empty prompt"),
    (Request([]), "empty prompt"),
    (Request(TEXT * 2, max_new_tokens=200), "max_context is 4096"),
    (Request(b"hi", max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    (Request(b"hi", temperature=-1.0), "temperature must be a finite number"),
    (Request(b"hi", temperature=float("nan")), "temperature must be a finite number"),
    (Request(b"hi", top_k=-2), "top_k must be an int >= 0"),
    (Request(b"hi", seed=-1), "seed must be an int"),
    (Request([1, 2, 999]), "token id 999 outside the vocabulary"),
    (Request(b"hi", turns=[b""]), "turn 1: empty prompt"),
    (Request(b"hi", stop_token=300), "stop_token must be a token id in \\[0, 256\\), got 300"),
    (Request(12345), "must be text, bytes or a list of token ids, got int"),
    (Request(b"hi", turns="abc"), "turns must be a list of prompts"),
    (Request(b"hi", stop_token="x"), "stop_token must be a token id"),
])
def test_bad_requests_are_rejected_without_disturbing_others(req, match):
    cfg = tiny()
    w = init_weights(cfg)
    good = lambda: Request(prompt(300), max_new_tokens=12, request_id=1)
    ref_tokens = Engine(cfg, spin_cfg(), weights=w).run([good()])[0].tokens
    e = Engine(cfg, spin_cfg(), weights=w, max_batch=2)
    e.submit(good())
    e.step()
    e.step()
    with pytest.raises(RequestError, match=match):
        e.submit(req)
    with pytest.raises(RequestError, match="already in use"):
        e.submit(Request(b"x", request_id=1))
    outs = e.run()
    assert [o.request_id for o in outs] == [1] and outs[0].tokens == ref_tokens


def test_engine_config_errors():
    with pytest.raises(SpinConfigError, match="differs from the model's index_topk"):
        Engine(tiny(), SpinConfig(index_topk=512))
    with pytest.raises(SpinConfigError, match="compress_ratios"):
        DsaLiteConfig.from_dict({"compress_ratios": [0, 128]})
    with pytest.raises(SpinConfigError, match="share one ratio"):
        DsaLiteConfig.from_dict({"compress_ratios": [1, 4]})
    with pytest.raises(SpinConfigError, match="unknown key"):
        DsaLiteConfig.from_dict({"layers": 3})
    with pytest.raises(SpinConfigError, match="mtp_depth"):
        DsaLiteConfig.from_dict({"mtp_depth": 8})
    with pytest.raises(SpinError, match="cuda_graphs needs a CUDA device"):
        Engine(tiny(), None, cuda_graphs=True)


@pytest.mark.slow
def test_trace_dump_replays(tmp_path):
    cfg = tiny().with_overrides(mtp_depth=1)
    e = Engine(cfg, spin_cfg(), trace_request=0)
    out = e.run([Request(prompt(2400), max_new_tokens=20, turns=[prompt(100, 4)])])[0]
    trace = e.trace()
    path = trace.save(tmp_path / "t.safetensors")
    from spin_trtllm.replay.trace import SpinTrace
    loaded = SpinTrace.load(path)
    assert loaded.num_layers == len(cfg.csa_layers) and loaded.next_n == 2
    assert loaded.num_steps == out.decode_steps and loaded.compress_ratio == 4
    turn2 = sorted(loaded.turn_starts())[1]
    assert loaded.turn_starts() == {0, turn2} and 0 < turn2 < loaded.num_steps
    # rows see (position + 1) // 4 slots; MTP row 1 is one token later
    assert int(loaded.row_len[0, 0, 0]) == (2400 + 1) // 4
    assert int(loaded.row_len[0, 0, 1]) == (2400 + 2) // 4
    res = replay(loaded, [0.3], spin_cfg())
    assert res[0]["mean_miss"] is not None


def test_checkpoint_round_trip(tmp_path):
    cfg = tiny().with_overrides(seed=3)
    w = init_weights(cfg)
    save_checkpoint(tmp_path / "m.safetensors", cfg, w)
    cfg2, w2 = load_checkpoint(tmp_path / "m.safetensors")
    assert cfg2 == cfg
    a = Engine(cfg, None, weights=w).run([Request(prompt(200), max_new_tokens=8)])[0].tokens
    b = Engine(cfg2, None, weights=w2).run([Request(prompt(200), max_new_tokens=8)])[0].tokens
    assert a == b
    (tmp_path / "bad.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(SpinError, match="not a readable safetensors"):
        load_checkpoint(tmp_path / "bad.safetensors")
    w2.pop("lm_head")
    save_checkpoint(tmp_path / "m2.safetensors", cfg, w2)
    with pytest.raises(SpinError, match="missing \\['lm_head'\\]"):
        load_checkpoint(tmp_path / "m2.safetensors")


def test_tiny_prompts_with_no_indexer_slot_yet():
    e = Engine(tiny(), spin_cfg(), max_batch=2, measure_miss=True)
    outs = e.run([Request(b"a", max_new_tokens=10), Request(b"ab", max_new_tokens=3)])
    assert sorted(len(o.tokens) for o in outs) == [3, 10]


def test_synthetic_requests_decode_and_validate():
    cfg = tiny().with_overrides(mtp_depth=1)
    e = Engine(cfg, spin_cfg(), max_batch=2)
    e.add_synthetic(0, 1000, max_new_tokens=5)
    e.add_synthetic(1, 300, max_new_tokens=3, seed=1)
    with pytest.raises(RequestError, match="batch is full"):
        e.add_synthetic(2, 100, max_new_tokens=3)
    outs = e.run()
    assert sorted(len(o.tokens) for o in outs) == [3, 5]
    with pytest.raises(RequestError, match="do not fit max_context"):
        e.add_synthetic(3, 4090, max_new_tokens=10)
    with pytest.raises(RequestError, match="request_id must be an int"):
        e.add_synthetic(-5, 100, max_new_tokens=3)
    with pytest.raises(RequestError, match="max_new_tokens must be >= 1"):
        e.add_synthetic(4, 100, max_new_tokens=0)


@pytest.mark.slow
def test_state_grows_with_context_without_changing_results():
    cfg = tiny()
    w = init_weights(cfg)
    reqs = lambda: [Request(prompt(2400), max_new_tokens=20), Request(prompt(300, 3), max_new_tokens=20)]
    small = Engine(cfg, spin_cfg(), weights=w, max_batch=2, state_initial_capacity=64)
    assert small.pool.capacity == 64
    a = small.run(reqs())
    assert small.pool.capacity >= (2400 + 20) // 4 and small.pool.generation >= 1
    big = Engine(cfg, spin_cfg(), weights=w, max_batch=2, state_initial_capacity=10 ** 6)
    assert big.pool.capacity >= cfg.index_slots
    assert [o.tokens for o in a] == [o.tokens for o in big.run(reqs())]


@pytest.mark.parametrize("mtp", [0, 2])
@pytest.mark.parametrize("decode_share,prompt_share", [SHORT_SCHEDULE, BRIEF_SCHEDULE])
def test_the_shorter_arrival_schedules_keep_what_the_graph_tests_check(mtp, decode_share,
                                                                      prompt_share):
    """The GPU graph tests' schedules under sanitizers (SHORT_SCHEDULE; BRIEF_SCHEDULE for
    initcheck and racecheck): the same requests, fewer new tokens each (at
    least 3) and prompts no longer, and still the second turn, the pool's growth from a small
    capacity, steps with more than one request and more steps than graphs (what the graph tests
    compare and count)."""
    full, short = arrivals(), arrivals(decode_share, prompt_share)
    assert sorted(full) == sorted(short) == [0, 3, 6]
    pairs = [(f, s) for t in full for f, s in zip(full[t], short[t])]
    assert [f.request_id for f, _ in pairs] == [s.request_id for _, s in pairs]
    assert all(3 <= s.max_new_tokens < f.max_new_tokens for f, s in pairs)
    assert all(0 < len(s.prompt) <= len(f.prompt) for f, s in pairs)
    cfg = tiny().with_overrides(mtp_depth=mtp, dtype="float32")
    sc = SpinConfig(index_topk=cfg.index_topk, target_sparsity=0.5, exploration=0.1)
    e = Engine(cfg, sc, weights=init_weights(cfg), max_batch=3, state_initial_capacity=64,
               switch="spin")
    outs = schedule_run(e, short)
    assert sorted(outs) == [0, 1, 2, 3] and len(outs[2].turns) == 2 and outs[2].turns[1]
    assert e.pool.generation >= 1
    assert sum(s.batch > 1 for s in e.history if s.spin) >= 3
    # a graph per batch size at most: the graph test's replays outnumber its captures
    assert len(e.history) > len({s.batch for s in e.history}) + 2
    # test_switching's plan (SPIN 4 steps, then all-keep 3) reaches both indexers
    assert len(e.history) >= 5
