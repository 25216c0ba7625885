"""Upstream: tensorrt_llm/mapping.py (not read; only what model_config / metadata touch).
Stand-in for tensorrt_llm/mapping.py: a single-rank Mapping (no TP/PP/attention DP)."""
from dataclasses import dataclass


@dataclass
class Mapping:
    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    enable_attention_dp: bool = False

    def pp_layers(self, num_layers: int):
        return list(range(num_layers))
