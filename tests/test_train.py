"""Training forward == decode engine, and a short training run that learns."""

import json
import math

import pytest
import torch

from spin_trtllm.harness import Engine, Request, init_weights, tiny
from spin_trtllm.harness.model import DsaLiteModel
from spin_trtllm.harness.train import (Corpus, TrainConfig, index_scores, mtp_logits,
                                       sequence_forward, stdlib_corpus, train)

TEXT = ("import os\nfor name in os.listdir('.'):\n    print(name.upper(), len(name))\n" * 30).encode()


def engine_prefill_logits(cfg, w, tokens):
    """Logits of the last token, through the engine's chunked prefill (caches, FP8 pages)."""
    e = Engine(cfg, None, weights=w, max_batch=1)
    captured = {}
    forward = e.model.forward

    def spy(*args):
        logits, hidden = forward(*args)
        captured["logits"], captured["hidden"] = logits[0, -1].clone(), hidden[0, -1].clone()
        return logits, hidden

    e.model.forward = spy
    e.submit(Request(tokens, max_new_tokens=1))
    e.step()
    return captured["logits"], captured["hidden"]


@pytest.mark.parametrize("ratios,k", [((0, 4, 128, 4), 16), ((1, 0, 64, 1), 48)])
@pytest.mark.slow
def test_sequence_forward_matches_the_engine(ratios, k):
    cfg = tiny().with_overrides(compress_ratios=ratios, index_topk=k, mtp_depth=1,
                                prefill_chunk=37)
    w = init_weights(cfg)
    wd = {n: t.double() for n, t in w.items()}
    x = torch.tensor(list(TEXT[:700]))
    logits, hidden, _ = sequence_forward(wd, cfg, x.view(1, -1), sparse=True)
    for t in (3, 150, 433, 699):
        ref_logits, ref_hidden = engine_prefill_logits(cfg, w, x[:t + 1].tolist())
        torch.testing.assert_close(logits[0, t], ref_logits, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(hidden[0, t], ref_hidden, rtol=1e-6, atol=1e-6)
    # the draft head over all positions equals the engine's one-step draft
    model = DsaLiteModel(cfg, w)
    drafted = model.draft(hidden[0, 200:201], x[201:202], 1)
    assert int(drafted[0, 0]) == int(mtp_logits(wd, hidden[0, 200:201], x[201:202]).argmax())


def test_sparse_attention_differs_from_dense_when_k_is_small():
    cfg = tiny().with_overrides(compress_ratios=(1, 1), index_topk=8)
    w = {n: t.double() for n, t in init_weights(cfg).items()}
    x = torch.tensor(list(TEXT[:300])).view(1, -1)
    sparse, _, _ = sequence_forward(w, cfg, x, sparse=True)
    dense, _, _ = sequence_forward(w, cfg, x, sparse=False)
    assert torch.allclose(sparse[0, :8], dense[0, :8])          # K covers every slot there
    assert not torch.allclose(sparse[0, 200:], dense[0, 200:])


def test_index_scores_for_some_rows_equal_all_rows():
    cfg = tiny().with_overrides(compress_ratios=(1,))
    w = {n: t.double() for n, t in init_weights(cfg).items()}
    xn = torch.randn(2, 90, cfg.hidden, dtype=torch.float64)
    rows = torch.tensor([0, 17, 89])
    torch.testing.assert_close(index_scores(w, "layers.0.", xn, 1, cfg, rows=rows),
                               index_scores(w, "layers.0.", xn, 1, cfg, chunk=32)[:, rows])


@pytest.mark.slow
def test_short_training_run_learns_and_round_trips(tmp_path):
    cfg = tiny().with_overrides(compress_ratios=(1, 64, 1), index_topk=32, mtp_depth=1,
                                dtype="float32", max_context=512)
    data = torch.frombuffer(bytearray(TEXT * 4), dtype=torch.uint8).clone()
    corpus = Corpus(data[:-2000], data[-2000:], 1, 1, "test text")
    tc = TrainConfig(seconds=1e9, max_steps=60, seq_len=128, batch=4, lr=3e-3, warmup_steps=5,
                     dense_fraction=0.0, kl_rows=16, eval_every_s=1e9, eval_batches=2)
    tc.dense_fraction = 0.5
    weights, report = train(cfg, tc, corpus, "cpu", log=lambda m: None)
    assert report["steps"] == 60
    assert report["held_out_bpb_sparse"] < 4.0         # random bytes: 8 bits; this text repeats
    out = Engine(cfg, None, weights=weights).run([Request(TEXT[:200], max_new_tokens=20)])[0]
    assert len(out.tokens) == 20


def test_stdlib_corpus_splits_files():
    c = stdlib_corpus(limit_bytes=3_000_000)
    assert c.train.numel() >= 3_000_000 and c.held_out.numel() > 0 and c.held_out_files > 0
    assert c.train.dtype == torch.uint8


@pytest.mark.parametrize("mtp", [0, 1])
def test_teacher_forced_decoding_matches_the_training_forward(mtp):
    cfg = tiny().with_overrides(compress_ratios=(1, 0, 64, 1), index_topk=48, mtp_depth=mtp)
    w = init_weights(cfg)
    wd = {n: t.double() for n, t in w.items()}
    x = torch.tensor(list(TEXT[:340]))
    logits, _, _ = sequence_forward(wd, cfg, x.view(1, -1), sparse=True)
    expected = logits[0].double().log_softmax(-1)[torch.arange(299, 339), x[300:340]]
    truth = x.tolist()

    def drafter(rid, context, depth):          # right 2 times in 3: rows j > 0 get verified
        n = len(context)
        return [truth[n + i] if (n + i) % 3 else 0 for i in range(depth)]

    e = Engine(cfg, None, weights=w, drafter=drafter if mtp else None)
    out = e.run([Request(x[:300].tolist(), max_new_tokens=40, forced=x[300:340].tolist())])[0]
    assert out.tokens == x[300:340].tolist()
    assert (out.accepted > 0) == (mtp > 0)
    torch.testing.assert_close(torch.tensor(out.logprobs, dtype=torch.float64), expected,
                               rtol=1e-6, atol=1e-6)


def test_shipped_checkpoint_loads_and_decodes():
    from spin_trtllm.harness.model import load_checkpoint
    from spin_trtllm.harness.pretrained import MODEL_CARD, default_checkpoint

    path = default_checkpoint()
    assert path is not None and MODEL_CARD.is_file()
    cfg, w = load_checkpoint(path)
    assert cfg.index_ratio == 1 and cfg.mtp_depth == 1 and cfg.index_topk == 256
    cfg = cfg.with_overrides(max_context=2048)
    prompt = b"def main():\n    args = parse_args()\n    for path in args.paths:\n"
    out = Engine(cfg, None, weights=w).run([Request(prompt * 4, max_new_tokens=24)])[0]
    assert len(out.tokens) == 24
    text = out.text()
    # a model that learned Python emits mostly printable ASCII
    assert sum(c.isprintable() or c in "\n\t" for c in text) >= 20


@pytest.mark.parametrize("name,ratio,card_name", [("STDLIB_8K_CHECKPOINT", 1, "MODEL_CARD_8k.md"),
                                                  ("STDLIB_C4A_8K_CHECKPOINT", 4,
                                                   "MODEL_CARD_c4a_8k.md")])
def test_shipped_8k_checkpoint_covers_the_8k_evaluations(name, ratio, card_name):
    import re

    from spin_trtllm.harness import pretrained
    from spin_trtllm.harness.model import load_checkpoint

    path = getattr(pretrained, name)
    cfg, w = load_checkpoint(path)
    assert cfg.index_ratio == ratio and cfg.index_topk == 256 and cfg.max_context >= 8704
    card = (path.parent / card_name).read_text()
    report = json.loads(re.search(r"<!-- report: (.*) -->", card).group(1))
    # QUALITY.md runs 8,192-byte prompts plus 256 decode steps through it
    assert report["train"]["seq_len"] >= 8192 + 256 + 1
    prompt = b"import os\nimport sys\n\n\ndef main(argv):\n    "
    out = Engine(cfg.with_overrides(max_context=1024), None, weights=w).run(
        [Request(prompt * 3, max_new_tokens=16)])[0]
    assert len(out.tokens) == 16


@pytest.mark.slow
def test_train_tiny_and_trace_commands(tmp_path, capsys):
    from spin_trtllm.cli import main
    from spin_trtllm.replay.trace import SpinTrace

    ckpt = tmp_path / "m.safetensors"
    assert main(["train-tiny", "--out", str(ckpt), "--seconds", "3", "--seq-len", "128",
                 "--batch", "2", "--limit-bytes", "200000", "--device", "cpu"]) == 0
    card = (tmp_path / "MODEL_CARD.md").read_text()
    assert "held-out bits per byte" in card and "PSF" in card
    src = tmp_path / "prompt.txt"
    src.write_bytes(TEXT[:400])
    out = tmp_path / "t.safetensors"
    assert main(["trace", str(out), "--checkpoint", str(ckpt), "--prompt-file", str(src),
                 "--prompt-tokens", "300", "--steps", "20", "--mtp", "--device", "cpu",
                 "--quiet"]) == 0
    tr = SpinTrace.load(out)
    assert tr.next_n == 2 and tr.compress_ratio == 1 and int(tr.row_len[0, 0, 0]) == 301
    assert main(["trace", str(out), "--checkpoint", str(ckpt), "--prompt-file", str(src),
                 "--prompt-tokens", "900", "--device", "cpu"]) == 2
    assert "fewer than --prompt-tokens" in capsys.readouterr().err


def test_trace_from_the_shipped_c4a_model(tmp_path):
    from spin_trtllm.cli import main
    from spin_trtllm.harness.pretrained import default_checkpoint
    from spin_trtllm.replay.trace import SpinTrace

    assert default_checkpoint(4) is not None
    src = tmp_path / "p.txt"
    src.write_bytes(TEXT[:900])
    out = tmp_path / "c4a.safetensors"
    assert main(["trace", str(out), "--ratio", "4", "--prompt-file", str(src),
                 "--prompt-tokens", "800", "--steps", "16", "--device", "cpu", "--quiet"]) == 0
    tr = SpinTrace.load(out)
    assert tr.compress_ratio == 4 and tr.next_n == 1 and int(tr.row_len[0, 0, 0]) == 801 // 4
