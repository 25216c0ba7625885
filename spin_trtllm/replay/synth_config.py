"""SynthConfig, the parameters of a synthetic trace (spin_trtllm/replay/synth.py), without
torch: the CLI's parser reads its fields for synth's flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import SpinError
from ..limits import MAX_NEXT_N

MAX_SCORES = 2_000_000_000  # about 4 GB of fp16; keeps int32 offsets and memory sane
MAX_NOISE = 10.0     # more noise would drown the structure and keep hitting the clamp
SCORE_CLAMP = 99.0   # hard bound for the rare far noise tail
_INT_RULES = {
    "steps": (1, None), "layers": (1, None), "prompt_slots": (1, None),
    "next_n": (1, MAX_NEXT_N), "index_topk": (1, None), "block_size": (1, None),
    "turns": (1, None), "turn_slots": (0, None), "vertical": (0, None),
    "diagonal_bands": (0, None), "sink_slots": (0, None), "local_window": (0, None),
    "seed": (0, (1 << 64) - 1),
}
_FLOAT_RULES = {"shift_prob": (0.0, 1.0), "noise": (0.0, MAX_NOISE), "accept_prob": (0.0, 1.0)}
SCORE_DTYPES = ("float16", "float32")   # synth.py maps them to torch dtypes


def _field(default, help_text: str):
    return field(default=default, metadata={"help": help_text})   # synth's --help


@dataclass(frozen=True)
class SynthConfig:
    steps: int = _field(200, "decode steps T")
    layers: int = _field(4, "indexer layers L")
    prompt_slots: int = _field(4096, "indexer slots visible at step 0 (after prefill), in "
                                     "slot units")
    next_n: int = _field(1, "MTP rows R = draft length + 1 (1..8)")
    compress_ratio: int = _field(1, "1 (V3.2) or 4 (V4 C4A: one slot per 4 tokens)")
    index_topk: int = _field(512, "K of the post-indexer top-K")
    block_size: int = _field(64, "KV slots per block")
    turns: int = _field(1, "turns > 1 inserts new user-message slots and marks turn_start")
    turn_slots: int = _field(256, "slots appended at the start of each later turn (new user "
                                  "message)")
    vertical: int = _field(64, "persistent important slots per layer (vertical lines)")
    diagonal_bands: int = _field(3, "RoPE-like relative-offset bands per layer (diagonals)")
    sink_slots: int = _field(4, "first slots with raised scores (the attention sink)")
    local_window: int = _field(32, "recent slots with elevated scores (in slots)")
    shift_prob: float = _field(0.01, "per (step, layer) probability of re-drawing half the "
                                     "vertical set")
    noise: float = _field(0.3, "std of the Gaussian noise on every score")
    accept_prob: float = _field(0.7, "per-draft acceptance probability for MTP (geometric process)")
    dtype: str = _field("float16", "scores dtype: float16 or float32")
    seed: int = _field(0, "RNG seed")

    def __post_init__(self) -> None:
        for name, (lo, hi) in _INT_RULES.items():
            value = getattr(self, name)
            rule = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
            if (not isinstance(value, int) or isinstance(value, bool) or value < lo
                    or (hi is not None and value > hi)):
                raise SpinError(f"SynthConfig.{name} must be {rule}, got {value!r}")
        if self.compress_ratio not in (1, 4):
            raise SpinError(f"SynthConfig.compress_ratio must be 1 (V3.2) or 4 (V4 C4A), "
                            f"got {self.compress_ratio!r}")
        if self.turns > self.steps:
            raise SpinError(f"SynthConfig.turns must be <= steps = {self.steps} "
                            f"(each turn starts on its own step), got {self.turns}")
        for name, (lo, hi) in _FLOAT_RULES.items():
            value = getattr(self, name)
            # `not lo <= v <= hi` also rejects NaN.
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not lo <= value <= hi):
                raise SpinError(f"SynthConfig.{name} must be a number in [{lo:g}, {hi:g}], "
                                f"got {value!r}")
        if self.dtype not in SCORE_DTYPES:
            raise SpinError(f"SynthConfig.dtype must be one of {sorted(SCORE_DTYPES)}, "
                            f"got {self.dtype!r}")
        # upper bound of the packed scores: every step at the longest possible context
        final_slots = (self.prompt_slots + (self.steps * self.next_n) // self.compress_ratio
                       + self.turns * self.turn_slots + self.next_n)
        scores = self.steps * self.layers * self.next_n * final_slots
        if scores > MAX_SCORES:
            raise SpinError(f"SynthConfig: up to {scores:,} scores "
                            f"(steps x layers x next_n x slots) exceed the limit of "
                            f"{MAX_SCORES:,}; use fewer steps, layers or slots")
