"""The checkpoint shipped with the package: a dsa-lite model trained on the Python standard
library (spin_trtllm/data/, model card beside it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from .config import DsaLiteConfig

DATA = Path(__file__).resolve().parent.parent / "data"
STDLIB_CHECKPOINT = DATA / "dsa_lite_stdlib.safetensors"          # indexer ratio 1 (V3.2 DSA)
STDLIB_C4A_CHECKPOINT = DATA / "dsa_lite_stdlib_c4a.safetensors"  # indexer ratio 4 (V4 C4A)
# ratio 1 trained on 8,704-byte sequences: covers QUALITY.md's 8K-prompt runs (--checkpoint)
STDLIB_8K_CHECKPOINT = DATA / "dsa_lite_stdlib_8k.safetensors"
# ratio 4 trained on 8,704-byte sequences: QUALITY.md's C4A runs at 8K prompts (--checkpoint)
STDLIB_C4A_8K_CHECKPOINT = DATA / "dsa_lite_stdlib_c4a_8k.safetensors"
# SPIN trace v2 of the ratio-1 model (README Quickstart says how it was made)
SAMPLE_TRACE = DATA / "sample_trace.safetensors"
MODEL_CARD = DATA / "MODEL_CARD.md"


def default_checkpoint(ratio: int = 1) -> Optional[Path]:
    """The shipped checkpoint whose indexer layers use `ratio` tokens per slot, if present."""
    path = {1: STDLIB_CHECKPOINT, 4: STDLIB_C4A_CHECKPOINT}.get(ratio)
    return path if path is not None and path.is_file() else None


def train_outputs(ratio: int, out: Optional[str] = None) -> tuple[Path, Path]:
    """`spin-trtllm train-tiny`'s default outputs: the checkpoint in the working directory,
    named like the shipped one of that indexer ratio (the shipped file is never overwritten
    unless --out names it), and its model card beside the checkpoint."""
    ckpt = Path(out) if out else Path({1: STDLIB_CHECKPOINT, 4: STDLIB_C4A_CHECKPOINT}[ratio].name)
    return ckpt, ckpt.parent / ("MODEL_CARD.md" if ratio == 1 else "MODEL_CARD_c4a.md")


def model_card(cfg: DsaLiteConfig, report: dict[str, Any], command: str) -> str:
    c = report["corpus"]
    t = report["train"]
    lines = [
        "# dsa-lite-stdlib: a small DSA language model trained on the Python standard library",
        "",
        "A byte-level dsa-lite decoder (spin_trtllm.harness) with a DeepSeek-style lightning",
        "indexer, trained so that SPIN can be measured on real learned indexer patterns.",
        "",
        "## Model",
        f"- layers (compress ratio per layer; 1 = DSA indexer layer, 0 = window only, "
        f"r > 4 = HCA): {list(cfg.compress_ratios)}",
        f"- hidden {cfg.hidden}, {cfg.heads} heads x {cfg.head_dim}, FFN {cfg.ffn}, window "
        f"{cfg.window}, vocabulary {cfg.vocab_size} (bytes)",
        f"- indexer 64 heads x 128 dims (FP8 keys and queries), top-K {cfg.index_topk} over "
        f"{'tokens' if cfg.index_ratio == 1 else f'{cfg.index_ratio}-token compressed slots'}",
        f"- MTP draft head depth {cfg.mtp_depth}; RoPE theta {cfg.rope_theta}",
        "",
        "## Data",
        f"- {c['source']}: {c['files']} .py files; every file whose crc32(relative path) % 20 "
        f"== 0 is held out ({c['held_out_files']} files, {c['held_out_bytes']:,} bytes); "
        f"training text {c['train_bytes']:,} bytes.",
        "- Licence of the text: the Python Software Foundation License (PSF-2.0) of CPython's "
        "standard library. The weights are released with this project (Apache-2.0).",
        "",
        "## Training",
        f"- {report['steps']} steps in {report['seconds']:.0f} s on {report['device']}; "
        f"{report['tokens']:,} tokens (sequences of {t['seq_len']} bytes, batch {t['batch']})",
        f"- AdamW lr {t['lr']} -> {t['min_lr']} (cosine over the time budget), weight decay "
        f"{t['weight_decay']}; dense attention for the first {t['dense_fraction']:.0%} of the "
        f"budget, then top-K sparse attention; indexer KL on {t['kl_rows']} sampled rows per "
        f"sequence (weight {t['kl_weight']}), MTP loss weight {t['mtp_weight']}",
        f"- held-out bits per byte: {report['held_out_bpb_sparse']:.3f} with top-K sparse "
        f"attention (how the engine runs it), {report['held_out_bpb_dense']:.3f} with dense "
        f"attention ({t['eval_batches']} batches of {t['batch']} x {t['seq_len']} bytes)",
        "",
        "## Command",
        f"    {command}",
        "",
        "## Training log (train bits per byte)",
        "",
        "| step | seconds | train bpb | indexer KL |",
        "|---|---|---|---|",
    ]
    lines += [f"| {h['step']} | {h['seconds']:.0f} | {h['train_bpb']:.3f} | {h['kl']:.3f} |"
              for h in report["history"]]
    lines += ["", "<!-- report: " + json.dumps({k: v for k, v in report.items()
                                                 if k != "history"}) + " -->", ""]
    return "\n".join(lines)
