"""Replay SPIN over a synthetic trace from Python: python examples/replay_api.py"""

from pathlib import Path
import tempfile

from spin_trtllm import SpinConfig
from spin_trtllm.replay.evaluate import replay
from spin_trtllm.replay.synth import SynthConfig, synthesize
from spin_trtllm.replay.trace import SpinTrace

cfg = SpinConfig.from_yaml(Path(__file__).with_name("spin.yaml"))
with tempfile.TemporaryDirectory() as tmp:
    path = synthesize(SynthConfig(steps=100, layers=2, prompt_slots=4096, seed=1)).save(
        Path(tmp) / "trace.safetensors")
    for r in replay(SpinTrace.load(path), [0.3, 0.5], cfg):
        print(f"target {r['target_sparsity']:.2f}  realized {r['realized_sparsity']:.3f}  "
              f"mean miss {r['mean_miss']:.3f}  p99 miss {r['p99_miss']:.3f}  "
              f"eligible rows {r['eligible_rows']}")
