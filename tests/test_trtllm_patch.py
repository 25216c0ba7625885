"""spin_trtllm.trtllm against a stand-in tensorrt_llm (tests/fake_trtllm), and without one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def run_script(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE / "fake_trtllm"), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, str(HERE / "trtllm_patch_script.py"), *args],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_import_without_tensorrt_llm_is_one_clear_error():
    code = "import spin_trtllm.trtllm"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: spin_trtllm.trtllm needs TensorRT-LLM")


@pytest.mark.parametrize("sparsity", [0.5, 0.0])
def test_patch_replaces_decode_topk_and_keeps_the_rest(sparsity):
    out = run_script(str(sparsity))
    assert out["patched"] == out["again"]                  # idempotent
    assert "DeepSeekSparseAttentionConfig.spin" in out["patched"]
    assert "DeepSeekV4SparseAttentionConfig.spin" in out["patched"]
    assert out["spin_on_params"] == sparsity
    assert any("sparsity" in line for line in out["bad_key_error"])
    assert out["matches_adapter"]
    # target sparsity 0 keeps every block: exactly the dense indexer's top-K
    assert out["equals_dense"] == (sparsity == 0.0)
