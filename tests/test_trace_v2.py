"""SPIN trace v2: q, w and keys beside the scores; the identity
scores = sum_h w relu(q . keys); dsa-lite writes it (DSA and C4A, next_n 1 and MTP)."""

import pytest
import torch
from safetensors.torch import save_file

from spin_trtllm import TraceError
from spin_trtllm.cli import main
from spin_trtllm.harness import Engine, Request, tiny
from spin_trtllm.replay import trace as trace_mod
from spin_trtllm.replay.trace import SpinTrace

from spin_trtllm.testing.traces import make_trace
from spin_trtllm.testing.harness import copy_drafter, prompt, spin_cfg


def with_qwk(trace: SpinTrace, heads=3, dim=16, extra_slots=2, seed=1) -> SpinTrace:
    """`trace` with random q, w, keys and its scores replaced by the ones they give."""
    gen = torch.Generator().manual_seed(seed)
    T, L, R = trace.row_len.shape
    S = trace.max_slots + extra_slots
    trace.q = torch.randn(T, L, R, heads, dim, generator=gen).half()
    trace.w = torch.randn(T, L, R, heads, generator=gen)
    trace.keys = torch.randn(L, S, dim, generator=gen).half()
    dense = torch.einsum("tlrhd,lsd->tlrsh", trace.q.float(), trace.keys.float())
    dense = (dense.relu() * trace.w.unsqueeze(3)).sum(-1)                  # [T, L, R, S]
    visible = torch.arange(S) < trace.row_len.unsqueeze(-1)
    trace.scores = dense[visible].to(trace.scores.dtype)
    return trace.validate()


def v2_trace(next_n=2, dtype=torch.float32):
    return with_qwk(make_trace(steps=4, layers=2, next_n=next_n, start=30, dtype=dtype))


def tensors_and_meta(trace: SpinTrace):
    names = ("scores", "row_len", "query_pos", "accepted", "q", "w", "keys")
    return {n: getattr(trace, n).clone() for n in names if getattr(trace, n) is not None}, \
        trace.metadata()


def write(tmp_path, tensors, meta, name="bad.safetensors"):
    path = tmp_path / name
    save_file(tensors, str(path), metadata=meta)
    return path


# ---- the format --------------------------------------------------------------------------------
def test_v1_still_loads_and_is_written_without_q(tmp_path):
    trace = make_trace(next_n=2)
    assert trace.version == 1 and trace.metadata()["version"] == "1"
    back = SpinTrace.load(trace.save(tmp_path / "v1.safetensors"))
    assert back.version == 1 and back.q is None and back.keys is None
    assert torch.equal(back.scores, trace.scores)
    with pytest.raises(TraceError, match="no q, w and keys"):
        back.check_scores()
    # a version-2 file without the new tensors is fine too
    tensors, meta = tensors_and_meta(trace)
    meta["version"] = "2"
    assert SpinTrace.load(write(tmp_path, tensors, meta, "v2bare.safetensors")).q is None


@pytest.mark.parametrize("next_n,dtype", [(1, torch.float32), (2, torch.float16)])
def test_v2_round_trip(tmp_path, next_n, dtype):
    trace = v2_trace(next_n, dtype)
    assert trace.version == 2 and (trace.num_heads, trace.head_dim) == (3, 16)
    back = SpinTrace.load(trace.save(tmp_path / "v2.safetensors"))
    assert back.metadata()["version"] == "2"
    for name in ("scores", "row_len", "query_pos", "accepted", "q", "w", "keys"):
        a, b = getattr(back, name), getattr(trace, name)
        assert (a is None and b is None) or (a.dtype == b.dtype and torch.equal(a, b)), name
    assert back.check_scores() < (2e-3 if dtype == torch.float16 else 1e-5)


@pytest.mark.parametrize("mutate,message", [
    (lambda t, m: t.pop("w"), "tensor 'w' is missing: q, w and keys come together"),
    (lambda t, m: [t.pop("q"), t.pop("w")], "tensor 'q' is missing"),
    (lambda t, m: t.update(q=t["q"].float()), "tensor 'q' must be float16 [T, L, R, H, D]"),
    (lambda t, m: t.update(w=t["w"].half()), "tensor 'w' must be float32 [T, L, R, H]"),
    (lambda t, m: t.update(keys=t["keys"][0]), "tensor 'keys' must be float16 [L, S, D]"),
    (lambda t, m: t.update(q=t["q"][:-1].clone()), "tensor 'q' shape [3, 2, 2, 3, 16] must be"),
    (lambda t, m: t.update(w=t["w"][..., :2].clone()), "tensor 'w' shape [4, 2, 2, 2] must be"),
    (lambda t, m: t.update(keys=t["keys"][..., :8].clone()), "tensor 'keys' shape"),
    (lambda t, m: t.update(keys=t["keys"][:, :20].clone()), "need S >= max row_len"),
    (lambda t, m: t["w"].__setitem__((1, 0, 1, 2), float("inf")),
     "tensor 'w'[1, 0, 1, 2] = inf is not finite"),
    (lambda t, m: t["keys"].__setitem__((1, 3, 4), float("nan")), "tensor 'keys'[1, 3, 4]"),
    (lambda t, m: m.update(version="1"), "q, w and keys need version 2"),
    (lambda t, m: m.update(version="3"), "unsupported version '3'"),
])
def test_reader_rejects_bad_v2_files(tmp_path, mutate, message):
    tensors, meta = tensors_and_meta(v2_trace())
    mutate(tensors, meta)
    path = write(tmp_path, tensors, meta)
    with pytest.raises(TraceError) as err:
        SpinTrace.load(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_size_limit_depends_on_the_version(tmp_path, monkeypatch):
    v1 = make_trace().save(tmp_path / "v1.safetensors")
    v2 = v2_trace().save(tmp_path / "v2.safetensors")
    limit = v1.stat().st_size - 1
    monkeypatch.setitem(trace_mod.MAX_BYTES, "1", limit)
    with pytest.raises(TraceError, match=f"over the limit of {limit:,} bytes for version 1"):
        SpinTrace.load(v1)
    SpinTrace.load(v2)                                   # v2 is held to its own limit
    monkeypatch.setitem(trace_mod.MAX_BYTES, "2", v2.stat().st_size - 1)
    with pytest.raises(TraceError, match="over the limit"):
        SpinTrace.load(v2)


def test_check_scores_catches_a_corrupted_key_weight_or_query():
    trace = v2_trace()
    assert trace.check_scores() < 1e-5
    keys = trace.keys.clone()
    trace.keys[1, 7] = -trace.keys[1, 7]                 # slot 7 of layer 1, seen by every row
    with pytest.raises(TraceError, match=r"layer 1, row \d, slot 7: stored"):
        trace.check_scores()
    assert trace.check_scores(tol=None) > 0.02           # tol=None: the figure, no error
    trace.keys = keys
    trace.w[2, 0, 1] *= 1.5
    with pytest.raises(TraceError, match="step 2, layer 0, row 1"):
        trace.check_scores()
    # a sample of rows: the bad row is only found when the sample holds it
    assert trace.check_scores(max_rows=1, tol=None) == pytest.approx(0, abs=1e-5)


def test_check_scores_skips_draft_slots_of_rejected_rows():
    """A rejected draft row saw keys its step's drafts wrote; the next step rewrote them, so
    only the slots the accepted row sees are compared."""
    trace = v2_trace(next_n=2)
    trace.accepted = torch.zeros_like(trace.accepted)     # row 1 rejected at every step
    for t in range(trace.num_steps):
        for layer in range(trace.num_layers):
            n0, n1 = int(trace.row_len[t, layer, 0]), int(trace.row_len[t, layer, 1])
            assert n1 == n0 + 1
            start = int(trace.row_len[:t].sum()) + int(trace.row_len[t, :layer].sum()) + n0
            trace.scores[start + n1 - 1] += 100.0      # row 1's own (draft) slot
    assert trace.check_scores() < 1e-5
    trace.accepted[2] = 1                              # committed: now it is checked
    with pytest.raises(TraceError, match="step 2"):
        trace.check_scores()


# ---- dsa-lite writes it ------------------------------------------------------------------------
@pytest.fixture(scope="module", params=[(1, 0), (1, 1), (4, 0), (4, 1)],
                ids=["dsa-next1", "dsa-mtp", "c4a-next1", "c4a-mtp"])
def engine_trace(request):
    ratio, mtp = request.param
    cfg = tiny().with_overrides(compress_ratios=(0, ratio, 64, ratio), mtp_depth=mtp)
    e = Engine(cfg, spin_cfg(), trace_request=0, drafter=copy_drafter if mtp else None)
    # teacher-forced repetitive text: the copy drafter's drafts are often accepted, not always;
    # a second request shares the batch (and the K cache pages) with the traced one
    e.run([Request(prompt(450), max_new_tokens=20, forced=list(prompt(21, 450))),
           Request(prompt(200, 7), max_new_tokens=24)])
    return ratio, mtp, e.trace(0)


def test_dsa_lite_trace_satisfies_the_identity(engine_trace):
    ratio, mtp, trace = engine_trace
    assert trace.version == 2 and trace.compress_ratio == ratio and trace.next_n == mtp + 1
    T, L, R = trace.row_len.shape
    assert tuple(trace.q.shape) == (T, L, R, 64, 128) and tuple(trace.w.shape) == (T, L, R, 64)
    assert tuple(trace.keys.shape) == (L, trace.max_slots, 128)
    # q holds fp8 e4m3 values (the scale is in w): converting back to fp8 changes nothing
    assert torch.equal(trace.q.to(torch.float8_e4m3fn).half(), trace.q)
    if mtp:
        assert 0 < int((trace.accepted > 0).sum()) < T      # both accepted and rejected drafts
    err = trace.check_scores(max_rows=None)
    assert err < 2e-3
    # every layer's scores are its own (they once all held the last layer's on the CPU)
    assert not torch.equal(trace.step_scores(0)[0], trace.step_scores(0)[1])


def test_info_checks_v2_traces(tmp_path, engine_trace, capsys):
    _, _, trace = engine_trace
    path = trace.save(tmp_path / "t.safetensors")
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert "version=2" in out and "64 heads x 128 dims" in out and "max error" in out
    bad = SpinTrace.load(path)
    bad.keys[0, 3] *= -2                                 # slot 3 of layer 0: every row sees it
    bad.save(tmp_path / "bad.safetensors")
    assert main(["info", str(tmp_path / "bad.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "do not match sum_h w * relu(q . keys)" in err \
        and "slot 3" in err


def test_trace_command_writes_v2(tmp_path, capsys):
    out = tmp_path / "t.safetensors"
    assert main(["trace", str(out), "--prompt-tokens", "200", "--steps", "3", "--quiet",
                 "--device", "cpu"]) == 0
    assert "trace v2" in capsys.readouterr().out
    trace = SpinTrace.load(out)
    assert trace.version == 2 and trace.num_steps == 3 and trace.check_scores() < 2e-3
