"""Never slower than all-keep: the cost model (spin_trtllm.costs) and the engine's per-step
switch between SPIN and the all-keep indexer (Engine(switch=...))."""

import pytest
import torch

from spin_trtllm import SpinConfig, SpinError
from spin_trtllm.costs import H200, CostModel, _requests
from spin_trtllm.harness import Engine, Request, init_weights, tiny
from spin_trtllm.testing.harness import Scheduled

TEXT = ("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 40).encode()

@pytest.fixture
def before_the_filter(monkeypatch):
    """Measurements of one CTA a row (SPIN_TOPK_FILTER=0): the model prices that kernel."""
    monkeypatch.setenv("SPIN_TOPK_FILTER", "0")


# Per-layer times measured on an H200 (2026-12-01, commit 7f6bc34, native kernels,
# fp16 state, K 512): (batch, slots, dense logits + top-K us, SPIN at 0.5 us).
MEASURED = [(8, 32768, 17.0 + 26.3, 40.8), (32, 32768, 44.6 + 28.0, 58.8),
            (96, 32768, 112.5 + 34.5, 99.8), (32, 131072, 140.8 + 72.7, 146.9),
            (96, 131072, 461.9 + 152.4, 345.4)]


@pytest.mark.usefixtures("before_the_filter")
@pytest.mark.parametrize("batch,slots,dense,spin", MEASURED)
def test_cost_model_tracks_the_measured_h200_kernels(batch, slots, dense, spin):
    ctx = [slots] * batch
    assert H200.dense_us(ctx) == pytest.approx(dense, rel=0.25)
    assert H200.spin_us(ctx, 0.5) == pytest.approx(spin, rel=0.25)


# The update alone on an H200
# (benchmarks/results/select_update/update_launch_slices_2026-12-02.json, fp16 state, rho 0.5,
# next_n 1): (batch, slots, us).
MEASURED_UPDATE = [(8, 32768, 4.1), (32, 32768, 5.0), (96, 32768, 9.0), (8, 131072, 5.8),
                   (32, 131072, 11.6), (96, 131072, 28.3)]


@pytest.mark.parametrize("batch,slots,update", MEASURED_UPDATE)
def test_cost_model_update_term_tracks_the_measured_update(batch, slots, update):
    scored = batch * slots * 0.5
    assert H200.update_fixed_us + H200.update_us_per_slot * scored == pytest.approx(update,
                                                                                   rel=0.2)


# What the update adds to a step beside the top-K on an H200 (bench_update_overlap.py,
# benchmarks/results/select_update/update_beside_topk_2026-12-02.json, fp16 state, rho 0.5, CUDA
# graphs, mean over the 8 D skews): (batch, slots, us a layer). At 96 x 131072 it added nothing
# measurable, where the model charges half its update term. A coarse fit: one share for every
# shape, 54% low at 8 x 131072 and 33% high at 8 x 32768.
MEASURED_UPDATE_BESIDE = [(8, 32768, 1.33), (32, 32768, 3.55), (96, 32768, 6.68),
                          (8, 131072, 5.55), (32, 131072, 5.35)]


@pytest.mark.parametrize("batch,slots,exposed", MEASURED_UPDATE_BESIDE)
def test_cost_model_prices_the_update_beside_the_topk(batch, slots, exposed):
    ctx = [slots] * batch
    saved = H200.spin_us(ctx, 0.5) - H200.spin_us(ctx, 0.5, update_beside=True)
    after = H200.update_fixed_us + H200.update_us_per_slot * batch * slots * 0.5
    assert saved == pytest.approx(after * (1 - H200.update_beside_share))
    assert after - saved == pytest.approx(exposed, rel=0.6)
    # with MTP the update is deferred to finish(): nothing runs beside a top-K
    assert H200.spin_us(ctx, 0.5, 2) == H200.spin_us(ctx, 0.5, 2, update_beside=True)


def test_cost_model_charges_the_whole_update_after_flashinfers_topk():
    """flashinfer's path (ops.topk's pick at 32 rows of 1M slots, past the filter's 512K) ends
    with the remap kernel, which does not let the update start early; spin's top-K kernel (8
    rows of 32K) does."""
    peer = CostModel(peer_topk=True)
    big, small = [1 << 20] * 32, [32768] * 8
    assert peer.spin_us(big, 0.5, update_beside=True) == peer.spin_us(big, 0.5)
    assert H200.spin_us(big, 0.5, update_beside=True) < H200.spin_us(big, 0.5)
    assert peer.spin_us(small, 0.5, update_beside=True) < peer.spin_us(small, 0.5)


# ops.topk through flashinfer on an H200 (benchmarks/results/topk/flashinfer_path_2026-12-02.json,
# K 512): (rows, slots per row, rho, us of the whole path).
MEASURED_PEER_TOPK = [(8, 32768, 0.0, 20.0), (32, 32768, 0.5, 23.6), (32, 131072, 0.0, 39.4),
                      (96, 131072, 0.0, 73.4), (96, 131072, 0.5, 43.2), (192, 131072, 0.0, 118.6),
                      (192, 32768, 0.0, 54.5), (64, 131072, 0.5, 43.1)]


@pytest.mark.parametrize("rows,slots,rho,us", MEASURED_PEER_TOPK)
def test_cost_model_peer_topk_term_tracks_the_measured_path(rows, slots, rho, us, monkeypatch):
    from spin_trtllm import ops

    monkeypatch.setattr(ops, "spin_topk_is_faster", lambda rows, width, k=None: False)
    peer = CostModel(peer_topk=True)
    scored = rows * slots * (1 - rho)
    assert peer._topk(scored, 1, [slots] * rows) == pytest.approx(us, rel=0.25)
    assert H200._topk(scored, 1, [slots] * rows) != peer._topk(scored, 1, [slots] * rows)


# spin's top-K kernel (one CTA or a cluster a row) on an H100, its 24 cases (benchmarks/results/
# topk/topk_ab_merged_2026-12-06_h100.json, spin_us, K 512; the term's fit):
# (requests, slots per request, next_n, rho, us).
MEASURED_SPIN_TOPK = [(8, 32768, 1, 0.0, 16.0), (8, 32768, 1, 0.5, 15.5),
                      (8, 32768, 2, 0.0, 16.6), (8, 32768, 2, 0.5, 16.2),
                      (8, 131072, 1, 0.0, 20.6), (8, 131072, 1, 0.5, 17.9),
                      (8, 131072, 2, 0.0, 22.9), (8, 131072, 2, 0.5, 20.9),
                      (32, 32768, 1, 0.0, 17.5), (32, 32768, 1, 0.5, 15.7),
                      (32, 32768, 2, 0.0, 18.3), (32, 32768, 2, 0.5, 16.8),
                      (32, 131072, 1, 0.0, 36.7), (32, 131072, 1, 0.5, 24.7),
                      (32, 131072, 2, 0.0, 39.7), (32, 131072, 2, 0.5, 29.7),
                      (96, 32768, 1, 0.0, 17.7), (96, 32768, 1, 0.5, 13.3),
                      (96, 32768, 2, 0.0, 35.8), (96, 32768, 2, 0.5, 24.8),
                      (96, 131072, 1, 0.0, 64.9), (96, 131072, 1, 0.5, 34.1),
                      (96, 131072, 2, 0.0, 119.7), (96, 131072, 2, 0.5, 66.5)]


@pytest.mark.usefixtures("before_the_filter")
@pytest.mark.parametrize("batch,slots,next_n,rho,us", MEASURED_SPIN_TOPK)
def test_cost_model_spin_topk_term_tracks_the_measured_kernel(batch, slots, next_n, rho, us):
    assert H200._topk(batch * slots * (1 - rho), next_n, [slots] * batch) == \
        pytest.approx(us, rel=0.35)


# spin's top-K through its filter on an H200 (benchmarks/results/topk/
# topk_filter_trtllm_2026-12-06_h200.json, filter_us, K 512), taken with SPIN_TOPK_FILTER=1:
# the points the filter term was fitted to (requests, slots per request, next_n, rho, us).
MEASURED_FILTER_TOPK = [(8, 131072, 2, 0.0, 22.6), (8, 131072, 2, 0.5, 21.1),
                        (32, 131072, 1, 0.0, 29.0), (32, 131072, 1, 0.5, 27.8),
                        (32, 131072, 2, 0.0, 47.1), (32, 131072, 2, 0.5, 39.7),
                        (96, 131072, 1, 0.0, 66.1), (96, 131072, 1, 0.5, 42.5),
                        (96, 131072, 2, 0.0, 117.3), (96, 131072, 2, 0.5, 80.3)]


@pytest.mark.parametrize("batch,slots,next_n,rho,us", MEASURED_FILTER_TOPK)
def test_cost_model_filter_topk_term_tracks_the_measured_kernels(batch, slots, next_n, rho, us,
                                                                 monkeypatch):
    from spin_trtllm import ops

    monkeypatch.setenv("SPIN_TOPK_FILTER", "1")
    assert ops.topk_filters(batch * next_n, slots)
    scored = batch * slots * (1 - rho)
    filtered = H200._topk(scored, next_n, [slots] * batch)
    assert filtered == pytest.approx(us, rel=0.15)
    monkeypatch.setenv("SPIN_TOPK_FILTER", "0")          # one CTA a row: the other term
    assert H200._topk(scored, next_n, [slots] * batch) != filtered


def test_with_flashinfer_the_model_prices_spin_topk_where_ops_topk_keeps_it(monkeypatch):
    from spin_trtllm import ops

    monkeypatch.delenv("SPIN_TOPK_FILTER", raising=False)
    peer = CostModel(peer_topk=True)
    # kept by ops.topk: spin's kernel (one CTA a row; the filter at 32 x 256K)
    for batch, slots in ((8, 131072), (96, 32768), (96, 131072), (96, 262144), (32, 262144)):
        assert ops.spin_topk_is_faster(batch, slots)
        assert peer._topk(batch * slots, 1, [slots] * batch) == \
            H200._topk(batch * slots, 1, [slots] * batch)
    for batch, slots in ((96, 1 << 20), (64, 1 << 19)):   # past spin's bounds: flashinfer
        assert not ops.spin_topk_is_faster(batch, slots)
        assert peer._topk(batch * slots, 1, [slots] * batch) != \
            H200._topk(batch * slots, 1, [slots] * batch)
    monkeypatch.setenv("SPIN_TOPK_FILTER", "0")          # no filter: flashinfer at 32 x 512K
    wide = 1 << 19
    assert not ops.spin_topk_is_faster(32, wide)
    assert peer._topk(32 * wide, 1, [wide] * 32) != H200._topk(32 * wide, 1, [wide] * 32)


def test_for_device_prices_the_topk_ops_topk_runs(monkeypatch):
    from spin_trtllm import ops
    from spin_trtllm.ops import _topk

    monkeypatch.setattr(_topk, "_flashinfer_topk", lambda: (object(), object()))
    monkeypatch.setattr(_topk, "_backend", "auto")
    assert H200.for_device("cuda:0").peer_topk and H200.for_device(torch.device("cuda")).peer_topk
    assert not H200.for_device("cpu").peer_topk
    ops.set_topk_backend("spin")
    assert not H200.for_device("cuda").peer_topk
    monkeypatch.setattr(_topk, "_flashinfer_topk", lambda: None)
    ops.set_topk_backend("auto")
    assert not H200.for_device("cuda").peer_topk
    # the peer's term prices the top-K SPIN saves (32 x 1M at rho 0.5, past the filter's 512K
    # slots): its per-slot cost, not spin's kernel's
    ctx = [1 << 20] * 32
    saved = lambda m: m.dense_us(ctx) - m.spin_us(ctx, 0.5)   # noqa: E731
    peer = CostModel(peer_topk=True)
    per_slot = peer.peer_topk_us_per_slot - H200.topk_us_per_slot
    assert per_slot != 0          # else the check below could not tell the two terms apart
    assert saved(peer) - saved(H200) == pytest.approx(per_slot * sum(ctx) * 0.5, rel=0.05)


# Per layer on an H200, same run (benchmarks/results/probe/select_given_1024_ab_2026-12-05.json,
# variant sw: the 1024-thread given-scores select; fp16 state): (batch, slots, next_n, SPIN's
# select share, the probe path, hybrid's select - the probe's select; us).
MEASURED_PROBE = [(96, 131072, 1, 15.1, 36.6, 103.0 - 17.0),
                  (96, 524288, 1, 58.4, 98.7, 430.8 - 37.3),
                  (96, 131072, 2, 27.9, 58.8, 199.7 - 29.5),
                  (96, 524288, 2, 111.0, 153.4, 848.5 - 65.9)]


@pytest.mark.parametrize("batch,slots,next_n,select,probe_path,hybrid_extra", MEASURED_PROBE)
def test_cost_model_tracks_the_measured_select_probe_and_hybrid(batch, slots, next_n, select,
                                                               probe_path, hybrid_extra):
    """Each predictor's choosing term against its measurement (15%); spin_us adds it to the
    terms the predictors share (logits, top-K) and the update (the EMAs' for spin and hybrid)."""
    ctx = [slots] * batch
    choose = {p: H200._choose(ctx, batch * slots, next_n, 1.0, p)
              for p in ("spin", "probe", "hybrid")}
    assert choose["spin"] == pytest.approx(select, rel=0.15)
    assert choose["probe"] == pytest.approx(probe_path, rel=0.15)
    assert choose["hybrid"] - choose["probe"] == pytest.approx(hybrid_extra, rel=0.15)
    for p in ("probe", "hybrid"):
        assert H200.spin_us(ctx, 0.5, next_n, predictor=p) - H200.spin_us(ctx, 0.5, next_n) == \
            pytest.approx(choose[p] - choose["spin"] - (0 if p == "hybrid" else
                                                        H200.update_us_per_slot * slots * batch
                                                        / 2 * next_n))


# Per layer on an H200, one run with the register-A gauss kernel (next_n 1 and 2;
# benchmarks/results/probe/gauss_register_a_ab_2026-12-05.json, variant v5): (batch, slots,
# next_n, gauss path - probe path us).
MEASURED_GAUSS = [(96, 131072, 1, 62.1 - 39.0), (96, 524288, 1, 194.0 - 118.0),
                  (96, 131072, 2, 102.1 - 64.8), (96, 524288, 2, 311.7 - 191.2)]


@pytest.mark.parametrize("batch,slots,next_n,gauss_extra", MEASURED_GAUSS)
def test_cost_model_tracks_the_measured_gauss(batch, slots, next_n, gauss_extra):
    ctx = [slots] * batch
    probe = H200.spin_us(ctx, 0.5, next_n=next_n, predictor="probe")
    gauss = H200.spin_us(ctx, 0.5, next_n=next_n, predictor="gauss")
    assert gauss - probe == pytest.approx(gauss_extra, rel=0.25)


def test_query_aware_predictors_need_more_to_pay():
    with pytest.raises(ValueError, match="unknown predictor"):
        H200.spin_us([4096], 0.5, predictor="quest")
    paid = {p: 0 for p in ("spin", "probe", "gauss", "hybrid")}
    for batch in (4, 16, 32, 96):
        for slots in (8192, 32768, 131072, 524288):
            ctx = [slots] * batch
            use = {p: H200.prefer_spin(ctx, 0.5, predictor=p) for p in paid}
            assert use["spin"] >= use["probe"] >= use["gauss"] and use["probe"] >= use["hybrid"]
            for p in paid:
                paid[p] += use[p]
    assert paid["spin"] > paid["probe"] > paid["hybrid"] > 0 and paid["probe"] >= paid["gauss"] > 0
    # the longest request sets the one-layer select's time, not the batch's total
    assert H200.spin_us([131072] + [1024] * 7, 0.5, predictor="hybrid") > \
        H200.spin_us([16384] * 8, 0.5, predictor="hybrid")


def test_cost_model_decisions():
    assert not H200.prefer_spin([2048] * 4, 0.5)              # the demo's tiny contexts
    assert H200.prefer_spin([131072] * 96, 0.5)               # the paper's serving anchor
    assert not H200.prefer_spin([131072] * 96, 0.0)           # nothing skipped
    assert not H200.prefer_spin([], 0.5)
    # more context or more sparsity never turns SPIN off
    for batch in (1, 4, 16, 64):
        for slots in (1024, 8192, 65536, 262144):
            for rho in (0.1, 0.3, 0.5, 0.7):
                if H200.prefer_spin([slots] * batch, rho):
                    assert H200.prefer_spin([2 * slots] * batch, rho)
                    assert H200.prefer_spin([slots] * (2 * batch), rho)
                    assert H200.prefer_spin([slots] * batch, min(0.95, rho + 0.1))
    # state bytes: float32 costs select and update more than fp16, fp8 less
    ctx = [131072] * 32
    fp32, fp16, fp8 = (H200.spin_us(ctx, 0.5, state_bytes=s) for s in (4, 2, 1))
    assert fp32 > fp16 > fp8


# dsa-lite suites on an H200, captured steps, next_n 1: the first with flashinfer's top-K
# installed on both sides, the second without.
SUITES = [("suite_flashinfer_topk_2026-12-02.jsonl", True),
          ("suite_native_2026-12-02.jsonl", False)]


def _suite_cases():
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "dsa_lite"
    for name, peer in SUITES:
        rows = [r for r in map(json.loads, (root / name).read_text().splitlines())
                if r["backend"] == "native" and r["next_n"] == 1 and r["state_dtype"] == "float16"]
        dense = {(r["indexer_slots"], r["batch"]): r["forward_ms"]
                 for r in rows if r["indexer"] == "dense"}
        for r in rows:
            if r["indexer"] == "spin" and r.get("predictor", "spin") == "spin":
                yield pytest.param(peer, r["indexer_slots"], r["batch"], r["rho"],
                                   dense[r["indexer_slots"], r["batch"]] / r["forward_ms"],
                                   id=f"{name[:-6]}-{r['indexer_slots']}x{r['batch']}-{r['rho']}")


@pytest.mark.usefixtures("before_the_filter")
@pytest.mark.parametrize("peer,slots,batch,rho,speedup", list(_suite_cases()))
def test_switch_agrees_with_the_measured_suites(peer, slots, batch, rho, speedup):
    """Where SPIN's captured forward won clearly (>= 3%) the model takes SPIN; where it did not
    win at all (<= 1%) it keeps all-keep, from either side of the hysteresis."""
    model = CostModel(peer_topk=peer)
    ctx = [slots] * batch
    if speedup >= 1.03:
        assert model.prefer_spin(ctx, rho, running_spin=False)
    elif speedup <= 1.01:
        assert not model.prefer_spin(ctx, rho, running_spin=True)
    else:
        pytest.skip(f"measured speedup {speedup:.3f}: within the noise, either choice")


def _beside_cases():
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks/results/dsa_lite" \
        / "update_beside_topk_2026-12-03.jsonl"
    rows = [r for r in map(json.loads, path.read_text().splitlines())
            if r["overlap_update"] and not r["overlap_select"]]
    dense = {(r["indexer_slots"], r["batch"]): r["forward_ms"]
             for r in rows if r["indexer"] == "dense"}
    for r in rows:
        if r["indexer"] == "spin":
            yield pytest.param(r["indexer_slots"], r["batch"], r["rho"],
                               dense[r["indexer_slots"], r["batch"]] / r["forward_ms"],
                               id=f"beside-{r['indexer_slots']}x{r['batch']}-{r['rho']}")


@pytest.mark.usefixtures("before_the_filter")
@pytest.mark.parametrize("slots,batch,rho,speedup", list(_beside_cases()))
def test_switch_agrees_with_the_update_beside_the_topk(slots, batch, rho, speedup):
    """The dsa-lite runs with the update beside the top-K (2026-12-03, no
    flashinfer): the model with engine_overhead_beside_us takes SPIN where it won by 3% or more
    and, at 32K slots x 32 (won by 1.6%), keeps running it once running."""
    ctx = [slots] * batch
    if speedup >= 1.03:
        assert H200.prefer_spin(ctx, rho, running_spin=False, update_beside=True)
    else:
        assert 1.0 < speedup < 1.03
        assert H200.prefer_spin(ctx, rho, running_spin=True, update_beside=True)
    # without the update beside (overlap_update off, MTP, before sm_90) it pays the old
    # overhead: at 32K x 32 that is all-keep
    if slots * batch == 32768 * 32:
        assert not H200.prefer_spin(ctx, rho, running_spin=True)


def test_hysteresis_keeps_a_boundary_batch_where_it_is():
    model = CostModel(margin=0.05)
    # find a batch where SPIN is ahead by less than the margin
    for slots in range(4096, 1 << 20, 1024):
        ctx = [slots] * 8
        d, s = model.dense_us(ctx), model.spin_us(ctx, 0.3) + model.engine_overhead_us
        if d * 0.95 <= s < d:
            break
    else:
        pytest.fail("no boundary case found")
    assert model.prefer_spin(ctx, 0.3, running_spin=True)
    assert not model.prefer_spin(ctx, 0.3, running_spin=False)


def spin_cfg(**kw):
    return SpinConfig(**{"index_topk": 64, "target_sparsity": 0.5, "exploration": 0.0, **kw})


def run(engine, n_new=12):
    return engine.run([Request(TEXT[:900], max_new_tokens=n_new, request_id=3)])[0].tokens


def test_dense_switch_runs_exactly_all_keep():
    cfg = tiny()
    w = init_weights(cfg)
    dense = run(Engine(cfg, None, weights=w))
    e = Engine(cfg, spin_cfg(), weights=w, switch="dense")
    assert run(e) == dense
    assert e.history and all(not s.spin and s.selected_blocks == s.visible_blocks > 0
                             for s in e.history)


def test_auto_switch_follows_the_model_and_restarts_warm_up():
    cfg = tiny()
    w = init_weights(cfg)
    plan = [True, True, True, False, False, True, True, True]
    e = Engine(cfg, spin_cfg(), weights=w, switch="auto", cost_model=Scheduled(plan))
    run(e, n_new=len(plan) + 1)
    hist = e.history[:len(plan)]
    assert [s.spin for s in hist] == plan
    sparse = [s.selected_blocks < s.visible_blocks for s in hist]
    # step 0 is SPIN's warm-up (every block); steps 1-2 sparse; 3-4 all-keep; step 5 is
    # warm-up again (the state missed two steps), then sparse
    assert sparse == [False, True, True, False, False, False, True, True]
    # a request that never left SPIN stays sparse through the same steps
    e2 = Engine(cfg, spin_cfg(), weights=w, switch="spin")
    run(e2, n_new=len(plan) + 1)
    assert all(s.selected_blocks < s.visible_blocks for s in e2.history[1:len(plan)])


def test_switch_values_and_defaults():
    cfg = tiny()
    with pytest.raises(SpinError, match="switch must be one of auto, spin, dense"):
        Engine(cfg, spin_cfg(), switch="fast")
    assert Engine(cfg, spin_cfg()).switch == "spin"           # CPU: the reference ops
    assert Engine(cfg, spin_cfg(), switch="spin").dense_indexer is None


def test_demo_step_timing_size_and_report():
    from spin_trtllm.harness.report import speed_lines
    from spin_trtllm.harness.speed import CACHE_BYTES_PER_TOKEN, SIZES, fitting_size
    assert fitting_size(10 ** 12) == SIZES[0]
    assert fitting_size(1) is None
    for free in (4e9, 24e9, 80e9, 141e9):
        batch, context = fitting_size(free)
        assert batch * context * CACHE_BYTES_PER_TOKEN <= 0.8 * free
    run = lambda fwd, idx, sp: {"forward_ms": fwd, "indexer_ms": idx, "step_ms": fwd + 2,
                                "realized_sparsity": sp, "spin_steps": 12 if sp else 0,
                                "steps": 12, "accepted_per_step": 0.0}
    lines = speed_lines({"batch": 96, "context_tokens": 524288, "switch": "auto",
                         "null": run(20.0, 0.0, 0.0), "dense": run(32.0, 12.0, 0.0),
                         "spin": run(28.0, 8.0, 0.5)})
    text = "\n".join(lines)
    assert "96 requests x 524,288 tokens" in text and "131,072 indexer slots" in text
    assert "1.14x" in text and "0.67x" in text and "12/12" in text


def test_demo_speed_size_is_checked(capsys):
    from spin_trtllm.cli import main
    assert main(["demo", "--device", "cpu", "--speed-size", "0", "131072"]) == 2
    assert "--speed-size" in capsys.readouterr().err


def test_the_cost_model_counts_the_budget_floor():
    """At high sparsity on short contexts SPIN still scores the floor's blocks (K visible
    slots, one block more when the newest is partly filled): the model must charge them."""
    from spin_trtllm.costs import H200
    ctx = [1000] * 16                               # 16 blocks, the newest holds 40 slots
    assert H200.spin_us(ctx, 0.9, index_topk=512) > H200.spin_us(ctx, 0.9)
    # where the budget is above the floor, K changes nothing
    long = [65536] * 16
    assert H200.spin_us(long, 0.5, index_topk=512) == pytest.approx(H200.spin_us(long, 0.5))
    # the floor's blocks are charged exactly: ceil((512 + 24 empty) / 64) = 9 blocks = 576
    # slots a request, as a sparsity that keeps 576 of the 1024 would be
    assert H200.spin_us(ctx, 0.9, index_topk=512) == pytest.approx(
        H200.spin_us(ctx, 1 - 576 / 1024))


def test_cost_model_routes_the_topk_on_the_engines_table(monkeypatch):
    """ops.topk routes on the block table's width (an engine's m_cap * 64, set by its longest
    possible context), not the batch's longest request: the model asks the same."""
    from spin_trtllm import ops

    widths = []
    monkeypatch.setattr(ops, "topk_filters",
                        lambda rows, width, k=None: widths.append(width) is None and width > 65536)
    ctx = [32768] * 96
    assert H200.prefer_spin(ctx, 0.5, table_slots=131136) is not None
    assert set(widths) == {131136}
    widths.clear()
    H200.prefer_spin(ctx, 0.5)                           # unknown: the longest request's
    assert set(widths) == {32768}
    # the wider table takes the filter's term
    assert H200.dense_us(_requests(ctx, 131136)) != H200.dense_us(ctx)


class _Recording(CostModel):
    """SPIN every step; keeps the visible slots each step's switch was asked with."""

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "asked", [])

    def prefer_spin(self, visible_slots, *args, **kwargs):
        self.asked.append(list(visible_slots))
        return True


@pytest.mark.parametrize("mtp_depth", [0, 2])
def test_switch_and_realized_sparsity_see_each_requests_longest_row(mtp_depth):
    """The switch gets, and visible_blocks counts, each request's longest row as the indexers
    see it (the row-wise max of the context_lens they are given), MTP rows included."""
    cfg = tiny().model_copy(update={"mtp_depth": mtp_depth})
    model = _Recording()
    e = Engine(cfg, spin_cfg(), weights=init_weights(cfg), switch="auto", cost_model=model)
    given = []
    prepare = e.spin_indexer.prepare

    def recording_prepare(ids, ctx, *args, **kwargs):
        given.append(ctx.clone())
        return prepare(ids, ctx, *args, **kwargs)

    e.spin_indexer.prepare = recording_prepare
    e.run([Request(TEXT[:700], max_new_tokens=6, request_id=1),
           Request(TEXT[:130], max_new_tokens=6, request_id=2)])
    steps = e.history
    assert len(given) == len(model.asked) == len(steps) >= 3
    layers = len(cfg.csa_layers)
    for ctx, asked, stats in zip(given, model.asked, steps):
        assert ctx.shape[1] == mtp_depth + 1
        longest = ctx.max(1).values.tolist()
        assert asked == longest and len(set(longest)) == 2
        assert stats.visible_blocks == layers * sum((n + 63) // 64 for n in longest)
