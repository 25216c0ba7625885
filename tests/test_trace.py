import pytest
import torch
from safetensors.torch import save_file

from spin_trtllm import TraceError
from spin_trtllm.replay.trace import SpinTrace

from spin_trtllm.testing.traces import make_trace


def test_round_trip(tmp_path):
    trace = make_trace(next_n=3, turn_start=torch.tensor([0, 3], dtype=torch.int32))
    trace.compress_ratio, trace.source = 4, "unit test"
    path = trace.save(tmp_path / "t.safetensors")
    back = SpinTrace.load(path)
    for name in ("scores", "row_len", "query_pos", "turn_start", "accepted"):
        assert torch.equal(getattr(back, name), getattr(trace, name)), name
    assert (back.index_topk, back.block_size, back.compress_ratio, back.source) == (8, 8, 4, "unit test")
    assert back.name == str(path) and back.turn_starts() == {0, 3}


def test_step_scores_unpacks_ragged_rows():
    trace = make_trace(steps=3, layers=2, next_n=2, start=5)
    flat = trace.scores.float()
    # step 1: rows have 6 and 7 slots; the packed order is (layer, row, slot)
    s = trace.step_scores(1)
    start = 2 * (5 + 6)  # step 0 holds 2 layers x (5 + 6) slots
    assert torch.equal(s[0, 0, :6], flat[start:start + 6])
    assert torch.equal(s[0, 1, :7], flat[start + 6:start + 13])
    assert torch.equal(s[1, 0, :6], flat[start + 13:start + 19])
    assert s[0, 0, 6] == float("-inf") and s.shape == (2, 2, 7)


def _write(tmp_path, tensors, meta):
    path = tmp_path / "bad.safetensors"
    save_file(tensors, str(path), metadata=meta)
    return path


def _good(tmp_path):
    trace = make_trace(next_n=2)
    tensors = {"scores": trace.scores, "row_len": trace.row_len, "query_pos": trace.query_pos,
               "accepted": trace.accepted}
    return tensors, trace.metadata()


@pytest.mark.parametrize("mutate,message", [
    (lambda t, m: m.update(format="other"), "format"),
    (lambda t, m: m.update(version="3"), "version"),
    (lambda t, m: m.pop("index_topk"), "missing metadata"),
    (lambda t, m: m.update(block_size="sixty"), "block_size must be an integer"),
    (lambda t, m: m.update(index_topk="0"), "index_topk must be a positive"),
    (lambda t, m: m.update(extra="1"), "unknown metadata"),
    (lambda t, m: m.update(next_n="3"), "next_n"),
    (lambda t, m: t.pop("query_pos"), "missing tensors"),
    (lambda t, m: t.update(logits=torch.zeros(1)), "unknown tensors"),
    (lambda t, m: t.update(scores=t["scores"][:-5].clone()), "truncated or mismatched"),
    (lambda t, m: t.update(scores=t["scores"].double()), "scores' must be float16/float32"),
    (lambda t, m: t.update(row_len=t["row_len"].long()), "row_len' must be int32"),
    (lambda t, m: t.update(row_len=-t["row_len"]), ">= 1 slot"),
    (lambda t, m: t.update(query_pos=t["query_pos"] - 5), "before the last visible slot"),
    (lambda t, m: t.update(query_pos=t["query_pos"][:, :1].clone()), "query_pos shape"),
    (lambda t, m: t.pop("accepted"), "'accepted' is required"),
    (lambda t, m: t.update(accepted=t["accepted"] + 2), "outside [0, next_n - 1"),
    (lambda t, m: t.update(turn_start=torch.tensor([0, 99], dtype=torch.int32)), "turn_start values"),
    (lambda t, m: t["scores"].__setitem__(3, float("nan")), "not finite"),
])
def test_reader_rejects_bad_files(tmp_path, mutate, message):
    tensors, meta = _good(tmp_path)
    tensors = {k: v.clone() for k, v in tensors.items()}
    mutate(tensors, meta)
    path = _write(tmp_path, tensors, meta)
    with pytest.raises(TraceError) as err:
        SpinTrace.load(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_truncated_and_garbage_files(tmp_path):
    path = make_trace().save(tmp_path / "ok.safetensors")
    data = path.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match="not a readable safetensors"):
        SpinTrace.load(cut)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"hello world, not a trace")
    with pytest.raises(TraceError, match="not a readable safetensors"):
        SpinTrace.load(junk)
    with pytest.raises(TraceError, match="no such file"):
        SpinTrace.load(tmp_path / "nope.safetensors")


def test_writer_validates(tmp_path):
    trace = make_trace(next_n=2)
    trace.accepted = None
    with pytest.raises(TraceError, match="accepted"):
        trace.save(tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()


def test_query_far_past_context_rejected(tmp_path):
    tensors, meta = _good(tmp_path)
    tensors["query_pos"] = tensors["query_pos"].clone()
    tensors["query_pos"][0, 0] = 2_000_000_000
    with pytest.raises(TraceError, match="q <= 2 \\* row_len - 1"):
        SpinTrace.load(_write(tmp_path, tensors, meta))


def test_save_to_missing_directory(tmp_path):
    with pytest.raises(TraceError, match="cannot write"):
        make_trace().save(tmp_path / "no" / "such" / "dir.safetensors")
