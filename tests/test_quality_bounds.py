"""benchmarks/quality_bounds.py: the true-score block statistics against brute force, and the
oracle (most true top-K slots per block) never beaten under the same selection rule."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from spin_trtllm.testing.traces import planted_v2_trace

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "quality_bounds.py"
_spec = importlib.util.spec_from_file_location("quality_bounds", _PATH)
qb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qb)


def test_block_rankings_match_brute_force():
    gen = torch.Generator().manual_seed(5)
    b, n, k = 8, 45, 7                       # 5 complete blocks before the newest (partial)
    dense = torch.randn(48, generator=gen)
    got = qb.block_rankings(dense, n, k, b)
    top = set(dense[:n].topk(k).indices.tolist())
    for j in range(5):
        blk = dense[j * b:(j + 1) * b].double()
        assert got["oracle"][j] == sum(i in top for i in range(j * b, (j + 1) * b))
        assert math.isclose(float(got["true block mean"][j]), float(blk.mean()), rel_tol=1e-5,
                            abs_tol=1e-6)
        assert math.isclose(float(got["true block max"][j]), float(blk.max()), rel_tol=1e-6)
        four = sorted(blk.tolist())[-4:]
        assert math.isclose(float(got["true top-4 mean"][j]), sum(four) / 4, rel_tol=1e-5,
                            abs_tol=1e-6)
        sd = float(blk.std(unbiased=False))
        assert math.isclose(float(got["true mean + 1 sd"][j]), float(blk.mean()) + sd,
                            rel_tol=1e-5, abs_tol=1e-6)
    assert got["oracle"].shape[0] == 5      # the newest block is forced, not ranked
    full = qb.block_rankings(dense, 48, k, b)
    assert full["oracle"].shape[0] == 5     # a complete newest block is forced too


def test_oracle_is_never_beaten(tmp_path):
    trace = planted_v2_trace(steps=14, start=600, block_size=16, index_topk=32)
    path = trace.save(tmp_path / "planted.safetensors")
    out = tmp_path / "bounds.json"
    assert qb.main([str(path), "--sparsity", "0.5", "--json", str(out)]) == 0
    rows = {r["ranking"]: r for r in json.loads(out.read_text())["rows"]}
    assert {"oracle", "probe", "gauss", "true block mean"} <= set(rows)
    assert all(r["rows"] == 2 * (14 - qb.WARMUP_STEPS) for r in rows.values())
    best = rows["oracle"]["mean_miss"]
    assert all(r["mean_miss"] >= best - 1e-12 for r in rows.values())
    assert 0.0 <= best < rows["probe"]["mean_miss"] <= 1.0


@pytest.mark.slow
def test_scripts_refuse_bad_traces_with_one_line(tmp_path):
    import subprocess
    import sys

    v1 = planted_v2_trace(steps=3, start=100, block_size=16, index_topk=32)
    v1.q = v1.w = v1.keys = None                          # a v1 trace: no q, w, keys
    path = v1.save(tmp_path / "v1.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a trace")
    root = _PATH.parents[1]
    for script in ("quality_bounds.py", "quality_predictors.py"):
        for bad, message in ((path, "needs a SPIN trace v2"), (junk, "not a readable safetensors")):
            run = subprocess.run([sys.executable, str(root / "benchmarks" / script), str(bad),
                                  "--json", str(tmp_path / "out.json")],
                                 capture_output=True, text=True, timeout=120)
            assert run.returncode == 2, (script, run.stderr)
            lines = run.stderr.strip().splitlines()
            assert len(lines) == 1 and message in lines[0] and lines[0].startswith(script)
