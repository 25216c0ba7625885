"""Train a small dsa-lite model on real text (the Python standard library's sources).

`sequence_forward` is dsa-lite's forward over whole sequences, for training: the same layers,
compressors, window, FP8 rounding of indexer keys and queries, and top-K sparse attention as
the decode engine (tests/test_train.py checks they agree), written as masked attention over
[T, T] so it trains in parallel. The indexer is trained as DeepSeek-V3.2's is: from detached
inputs, by KL from the head-summed attention distribution over the indexer's slots to
softmax(z), on sampled query rows. Training runs a dense stage (attention sees every visible
slot) and then a sparse stage (attention sees the indexer's top-K), plus the MTP draft head
(predicts token t + 2 from the hidden state at t and the embedding of token t + 1).
"""

from __future__ import annotations

import math
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..errors import SpinError
from ..limits import HEAD_DIM, INDEX_HEADS
from .config import INDEX_RATIOS, DsaLiteConfig
from .model import (check_memory, ffn, init_weights, mtp_step, quantize_rows_fp8, rms_norm,
                    rope, weight_count)


# ---- corpus ---------------------------------------------------------------------------------------
@dataclass
class Corpus:
    train: torch.Tensor           # uint8 bytes
    held_out: torch.Tensor
    files: int
    held_out_files: int
    source: str


def stdlib_corpus(held_out_every: int = 20, limit_bytes: Optional[int] = None) -> Corpus:
    """The .py files of this Python's standard library (PSF licence), in path order; every
    file whose crc32(path) % held_out_every == 0 is held out for evaluation."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    if not files:
        raise SpinError(f"no .py files under {root}: no training corpus on this machine")
    train, held = bytearray(), bytearray()
    n_held = 0
    for f in files:
        try:
            data = f.read_bytes()
        except OSError:
            continue
        rel = str(f.relative_to(root))
        full = limit_bytes is not None and len(train) >= limit_bytes
        if zlib.crc32(rel.encode()) % held_out_every == 0:
            held += data + b"\n"
            n_held += 1
        elif not full:
            train += data + b"\n"
        if full and len(held) * held_out_every >= limit_bytes:
            break
    def as_tensor(b: bytearray) -> torch.Tensor:
        return torch.frombuffer(b, dtype=torch.uint8).clone() if b else \
            torch.zeros(0, dtype=torch.uint8)

    return Corpus(as_tensor(train), as_tensor(held), len(files), n_held,
                  f"Python {sysconfig.get_python_version()} standard library ({root})")


def batches(data: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator):
    """Random windows of seq_len + 1 bytes: inputs and next-byte targets."""
    if data.numel() < seq_len + 2:
        raise SpinError(f"corpus of {data.numel()} bytes is shorter than one sequence ({seq_len})")
    while True:
        start = torch.randint(0, data.numel() - seq_len - 1, (batch,), generator=generator)
        idx = start.unsqueeze(1) + torch.arange(seq_len + 1)
        yield data[idx].long()


# ---- the sequence forward -------------------------------------------------------------------------
def fake_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round x to what the engine stores: per-row e4m3 with scale amax/448 (straight-through
    gradient). Returns (dequantized values, scales)."""
    q8, scale = quantize_rows_fp8(x)
    q = q8.float() * scale.unsqueeze(-1)
    return (x + (q.to(x.dtype) - x).detach()), scale


def _pool(x: torch.Tensor, r: int, gate: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """[N, T, d] -> [N, T // r, d]: softmax-gated pooling of each complete group of r tokens."""
    N, T, d = x.shape
    G = T // r
    xg = x[:, :G * r].reshape(N, G, r, d)
    return ((xg @ gate + bias).softmax(-1).unsqueeze(-1) * xg).sum(-2)


def index_scores(w: dict, p: str, xn: torch.Tensor, ratio: int, cfg: DsaLiteConfig,
                 rows: Optional[torch.Tensor] = None, chunk: int = 256) -> torch.Tensor:
    """Indexer scores z [N, rows, G] = sum_h w_h ReLU(q_h . k_g), with the engine's FP8
    rounding, for all query positions or the given ones."""
    N, T, _ = xn.shape
    pos = torch.arange(T, device=xn.device)
    key = _pool(xn @ w[p + "wik"], ratio, w[p + "icomp_gate"], w[p + "icomp_bias"])
    G = key.shape[1]
    key = rope(key, torch.arange(G, device=xn.device).view(1, -1), cfg.rope_theta,
               dims=HEAD_DIM // 2)
    key, _ = fake_fp8_rows(key)
    t = pos if rows is None else rows
    out = []
    for start in range(0, t.numel(), chunk):
        tt = t[start:start + chunk]
        xr = xn[:, tt]
        iq = (xr @ w[p + "wiq"]).view(N, -1, INDEX_HEADS, HEAD_DIM)
        iq = rope(iq, tt.to(torch.float64).view(1, -1) / ratio, cfg.rope_theta,
                  dims=HEAD_DIM // 2)
        iq, _ = fake_fp8_rows(iq.reshape(N, -1, INDEX_HEADS * HEAD_DIM))
        iq = iq.view(N, -1, INDEX_HEADS, HEAD_DIM)
        heads = (xr @ w[p + "wiw"]) * (1.0 / math.sqrt(INDEX_HEADS * HEAD_DIM))
        dots = torch.relu(torch.einsum("nthd,ngd->nthg", iq, key))
        out.append(torch.einsum("nth,nthg->ntg", heads, dots))
    return torch.cat(out, 1)


def sequence_forward(w: dict, cfg: DsaLiteConfig, x: torch.Tensor, sparse: bool = True,
                     kl_rows: int = 0, generator: Optional[torch.Generator] = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: int64 [N, T]. Returns logits [N, T, V] (float32), the last hidden state [N, T, H]
    and the indexer KL loss (0 when kl_rows = 0)."""
    N, T = x.shape
    dev = x.device
    pos = torch.arange(T, device=dev)
    h = w["embed"][x]
    scale = 1.0 / math.sqrt(cfg.head_dim)
    band = (pos.view(1, -1) <= pos.view(-1, 1)) & (pos.view(1, -1) > pos.view(-1, 1) - cfg.window)
    kl = torch.zeros((), device=dev)
    for i, r in enumerate(cfg.compress_ratios):
        p = f"layers.{i}."
        xn = rms_norm(h, w[p + "attn_norm"])
        q = rope((xn @ w[p + "wq"]).view(N, T, cfg.heads, cfg.head_dim), pos.view(1, -1),
                 cfg.rope_theta)
        k = rope(xn @ w[p + "wk"], pos.view(1, -1), cfg.rope_theta)
        v = xn @ w[p + "wv"]
        scores = torch.einsum("nthd,nsd->nhts", q, k) * scale
        scores = scores.masked_fill(~band, float("-inf"))
        values = v
        if r:
            comp = _pool(k, r, w[p + "comp_gate"], w[p + "comp_bias"])          # [N, G, hd]
            G = comp.shape[1]
            visible = torch.arange(G, device=dev).view(1, -1) < ((pos + 1) // r).view(-1, 1)
            cs = torch.einsum("nthd,ngd->nhtg", q, comp) * scale
            keep = visible.expand(N, T, G)
            if r in INDEX_RATIOS:
                xd = xn.detach()                   # the indexer trains on its own
                if sparse:
                    with torch.no_grad():
                        z = index_scores(w, p, xd, r, cfg).float()
                        z = z.masked_fill(~visible, float("-inf"))
                        k_eff = min(cfg.index_topk, G)
                        top = z.topk(k_eff, dim=-1).indices
                        chosen = torch.zeros_like(keep).scatter_(-1, top, True)
                    keep = keep & chosen
                if kl_rows:
                    kl = kl + _indexer_kl(w, p, xd, cs.detach(), visible, r, cfg, kl_rows,
                                          generator)
            cs = cs.masked_fill(~keep.unsqueeze(1), float("-inf"))
            scores = torch.cat([scores, cs], -1)
            values = torch.cat([v, comp], 1)
        att = scores.softmax(-1)
        out = torch.einsum("nhts,nsd->nthd", att, values).reshape(N, T, -1)
        h = h + out @ w[p + "wo"]
        h = h + ffn(w, p, h)
    logits = (rms_norm(h, w["final_norm"]) @ w["lm_head"]).float()
    return logits, h, kl


def _indexer_kl(w, p, xd, comp_scores, visible, r, cfg, rows, generator) -> torch.Tensor:
    """KL(head-summed attention over the indexer's slots || softmax(z)) on sampled rows."""
    N, T, _ = xd.shape
    first = r - 1                                   # rows that see at least one slot
    if T - first < 1:
        return torch.zeros((), device=xd.device)
    t = torch.randint(first, T, (min(rows, T - first),), generator=generator).to(xd.device)
    vis = visible[t]                                                         # [S, G]
    att = comp_scores[:, :, t].float().masked_fill(~vis, float("-inf")).softmax(-1)
    target = att.sum(1)
    target = target / target.sum(-1, keepdim=True)                           # [N, S, G]
    z = index_scores(w, p, xd, r, cfg, rows=t).float().masked_fill(~vis, float("-inf"))
    logq = z.log_softmax(-1)
    terms = torch.where(target > 0, target * (target.clamp(min=1e-30).log() - logq), 0.0)
    return terms.sum(-1).mean()


def mtp_logits(w: dict, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """The MTP head over all positions: hidden at t and the embedding of token t + 1 -> logits
    for token t + 2 (what DsaLiteModel.draft does one step at a time)."""
    return mtp_step(w, hidden, next_tokens)[1]


# ---- training ------------------------------------------------------------------------------------
@dataclass
class TrainConfig:
    seconds: float = 240.0            # wall-clock budget (the schedule follows it)
    max_steps: int = 100_000
    seq_len: int = 4096
    batch: int = 8
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.05
    dense_fraction: float = 0.5       # DSA's dense warm-up share of the budget
    kl_rows: int = 128
    kl_weight: float = 1.0
    mtp_weight: float = 0.3
    eval_every_s: float = 30.0
    eval_batches: int = 4
    seed: int = 0


def held_out_bpb(w, cfg, tc: "TrainConfig", data: torch.Tensor, deadline: float,
                 on_batch: Optional[Callable[[int], object]] = None) -> tuple[float, float, int]:
    """Bits per byte on held-out text with top-K sparse and with dense attention, on the same
    batches (a fixed seed): tc.eval_batches of them, fewer when the next would end past
    `deadline` (at least one). Returns (sparse, dense, batches)."""
    it = batches(data, tc.batch, tc.seq_len, torch.Generator().manual_seed(1234))
    totals, count, done, batch_s = [0.0, 0.0], 0, 0, 0.0
    with torch.no_grad():
        while done < tc.eval_batches and (done == 0 or time.time() + batch_s <= deadline):
            start = time.time()
            xy = next(it).to(w["embed"].device)
            for i, sparse in enumerate((True, False)):
                logits, _, _ = sequence_forward(w, cfg, xy[:, :-1], sparse=sparse)
                totals[i] += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                   xy[:, 1:].reshape(-1), reduction="sum"))
            count += xy[:, 1:].numel()
            done += 1
            batch_s = time.time() - start
            if on_batch is not None:
                on_batch(done)
    return totals[0] / count / math.log(2), totals[1] / count / math.log(2), done


# Peak memory of one training step (sequence_forward, backward, AdamW), measured on the shipped
# model's shapes (ratios 1 and 4) and fitted as
#   SCORE_BYTES x score elements + SLOT_BYTES x batch x indexer slots + 16 x params + fixed,
# score elements being batch x seq_len x (seq_len + compressed entries) x heads summed over the
# layers (every layer scores [T, T] and masks it), indexer slots seq_len / ratio per indexer
# layer. CPU (float32; peak RSS of a fresh process, batch 1..2 x seq_len 1,024..4,096): 10 bytes
# a score, 128 KiB + 64 KiB per indexer layer a slot (the indexer's chunked scores and its KL
# rows); 1.1-1.25x what was measured (1 x 4,096: 6.0 GiB measured, 6.6 estimated). CUDA (H200,
# bfloat16 autocast; max_memory_reserved, batch 1..8 x seq_len 1,024..16,384): 13.5 bytes a
# score, half the CPU's per slot; 1.1-1.3x what was measured (8 x 4,096: 51 GiB measured, 59
# estimated; 2 x 16,384 ran out of the H200's 140 GiB, estimated 222 GiB).
SCORE_BYTES = {"cuda": 13.5, "cpu": 10.0}
SLOT_BYTES = {"cuda": (64 << 10, 32 << 10), "cpu": (128 << 10, 64 << 10)}   # (once, per layer)
TRAIN_FIXED_BYTES = 256 << 20


def train_bytes(cfg: DsaLiteConfig, batch: int, seq_len: int, device: torch.device | str) -> int:
    """Estimated peak memory of a training step on `device` (see SCORE_BYTES)."""
    kind = "cuda" if torch.device(device).type == "cuda" else "cpu"
    T = seq_len
    scores = sum(batch * T * (T + (T // r if r else 0)) * cfg.heads for r in cfg.compress_ratios)
    once, per_layer = SLOT_BYTES[kind]
    slots = batch * (T // cfg.index_ratio) * (once + per_layer * len(cfg.csa_layers))
    return int(SCORE_BYTES[kind] * scores) + slots + 16 * weight_count(cfg) + TRAIN_FIXED_BYTES


def check_train_memory(cfg: DsaLiteConfig, tc: "TrainConfig", device: torch.device | str) -> None:
    """SpinError (one line) when a training step of tc.batch x tc.seq_len would not fit."""
    check_memory(train_bytes(cfg, tc.batch, tc.seq_len, device), device,
                 f"training at --batch {tc.batch} x --seq-len {tc.seq_len:,} (attention scores "
                 f"grow with batch x seq-len^2)")


# tc.seconds covers training and the held-out evaluation: training stops early enough to leave
# the evaluation its tc.eval_batches batches, but at most this share of the budget (the
# evaluation then runs fewer batches, at least one).
EVAL_SHARE = 0.25


def train(cfg: DsaLiteConfig, tc: TrainConfig, corpus: Corpus, device: torch.device | str,
          log: Callable[[str], None] = print, progress: bool = False
          ) -> tuple[dict[str, torch.Tensor], dict]:
    """Returns the trained weights (float32, CPU) and a report for the model card. Training
    and evaluation end within tc.seconds unless one step and one evaluation batch alone take
    longer; `progress`: a progress bar over the budget (step, stage, training loss)."""
    t0 = time.time()                     # the budget counts from here
    deadline = t0 + tc.seconds
    device = torch.device(device)
    if tc.seq_len > cfg.max_context:
        raise SpinError(f"seq_len {tc.seq_len} exceeds the model's max_context {cfg.max_context}")
    check_train_memory(cfg, tc, device)
    torch.manual_seed(tc.seed)
    g = torch.Generator().manual_seed(tc.seed)
    w = {k: v.to(device).requires_grad_(True) for k, v in init_weights(cfg).items()}
    decay = [v for k, v in w.items() if v.dim() == 2 and k != "embed"]
    rest = [v for k, v in w.items() if not (v.dim() == 2 and k != "embed")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": tc.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=tc.lr, betas=(0.9, 0.95))
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" \
        else torch.autocast("cpu", enabled=False)
    it = batches(corpus.train, tc.batch, tc.seq_len, g)
    bar = _Progress(tc.seconds, log) if progress else None
    say = bar.log if bar else log

    def show(text: str) -> None:
        if bar:
            bar.show(time.time() - t0, text)

    last_eval = t0
    history = []
    step = 0
    step_s = 0.0                         # the last step's wall time (it follows the load)
    # An evaluation batch (a sparse and a dense forward) costs at most a sparse-stage step (its
    # forward scores every row with the indexer) plus a dense-stage one: the last of each.
    stage_s = {"dense": 0.0, "sparse": 0.0}
    while step < tc.max_steps:
        now = time.time()
        eval_s = sum(stage_s.values()) if all(stage_s.values()) else 2 * step_s
        reserve = max(eval_s, min(tc.eval_batches * eval_s, EVAL_SHARE * tc.seconds))
        if step and now + step_s + reserve > deadline:
            break
        frac = min(1.0, (now - t0) / max(tc.seconds - reserve, 1e-9))
        lr = tc.lr * min(1.0, (step + 1) / tc.warmup_steps)
        lr = tc.min_lr + (lr - tc.min_lr) * 0.5 * (1 + math.cos(math.pi * frac))
        for group in opt.param_groups:
            group["lr"] = lr
        sparse = frac >= tc.dense_fraction
        xy = next(it).to(device)
        with amp:
            logits, hidden, kl = sequence_forward(w, cfg, xy[:, :-1], sparse=sparse,
                                                  kl_rows=tc.kl_rows, generator=g)
            lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), xy[:, 1:].reshape(-1))
            loss = lm + tc.kl_weight * kl
            if cfg.mtp_depth:
                ml = mtp_logits(w, hidden[:, :-1], xy[:, 1:-1])
                mtp = F.cross_entropy(ml.reshape(-1, ml.shape[-1]), xy[:, 2:].reshape(-1))
                loss = loss + tc.mtp_weight * mtp
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(w.values()), 1.0)
        opt.step()
        step += 1
        bpb = float(lm.detach()) / math.log(2)     # waits for the step: step_s is its real time
        step_s = time.time() - now
        stage = "sparse" if sparse else "dense"
        stage_s[stage] = step_s
        show(f"step {step}, {stage}, loss {bpb:.3f} bpb")
        if time.time() - last_eval >= tc.eval_every_s:
            last_eval = time.time()
            kl_value = float(kl.detach())
            history.append({"step": step, "seconds": last_eval - t0, "train_bpb": bpb,
                            "kl": kl_value})
            say(f"step {step} {last_eval - t0:.0f}s {stage} lm {bpb:.3f} bpb  kl {kl_value:.3f}")
    seconds = time.time() - t0
    weights = {k: v.detach().float().cpu() for k, v in w.items()}
    show(f"step {step}, held-out evaluation")
    with amp:
        held_sparse, held_dense, evaluated = held_out_bpb(
            w, cfg, tc, corpus.held_out, deadline,
            on_batch=lambda i: show(f"step {step}, held-out evaluation {i}/{tc.eval_batches}"))
    total = time.time() - t0
    if bar:
        bar.close()
    report = {"steps": step, "seconds": seconds, "tokens": step * tc.batch * tc.seq_len,
              "eval_seconds": total - seconds,
              "held_out_bpb_sparse": held_sparse, "held_out_bpb_dense": held_dense,
              # the batches evaluated (fewer than asked when the budget ran out)
              "train": {**asdict(tc), "eval_batches": evaluated}, "history": history,
              "corpus": {"source": corpus.source, "files": corpus.files,
                         "held_out_files": corpus.held_out_files,
                         "train_bytes": corpus.train.numel(),
                         "held_out_bytes": corpus.held_out.numel()},
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    log(f"done: {step} steps in {seconds:.0f}s; held-out bpb {held_sparse:.3f} (sparse top-K), "
        f"{held_dense:.3f} (dense) on {evaluated} batches; {total:.0f}s of the "
        f"{tc.seconds:g}s budget")
    return weights, report


class _Progress:
    """train's progress bar: seconds of the budget, with the step, stage and loss."""

    def __init__(self, seconds: float, log: Callable[[str], None]) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self._log = log
        self.bar = tqdm(total=seconds, desc="train", unit="s", leave=False,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s"
                                   "{postfix}")

    def show(self, elapsed: float, text: str) -> None:
        self.bar.n = min(elapsed, self.bar.total)
        self.bar.set_postfix_str(text, refresh=False)
        self.bar.refresh()

    def log(self, line: str) -> None:
        with self._tqdm.external_write_mode():      # the line above the bar, not through it
            self._log(line)

    def close(self) -> None:
        self.bar.close()


def stdlib_model_config(**changes) -> DsaLiteConfig:
    """The shipped model: byte-level, 5 layers (DSA, window, DSA, HCA 64:1, DSA), hidden 128,
    a 64 x 128 indexer with K = 256 over uncompressed tokens (DeepSeek-V3.2 style), MTP d = 1."""
    base = dict(vocab_size=256, hidden=128, heads=4, head_dim=32, ffn=384,
                compress_ratios=(1, 0, 1, 64, 1), window=128, index_topk=256, mtp_depth=1,
                max_context=65536, prefill_chunk=256, rope_theta=10000.0, dtype="float32")
    base.update(changes)
    return DsaLiteConfig.from_dict(base)
