"""libspin_trtllm_plugins.so where nvcc and TensorRT headers exist (CPU only): build it and
plugin_harness with plugins/tensorrt/build.sh, then the harness's checks without a GPU
(creators, fields, output dtypes and shapes, formats, serialization round trips, clone, the
errors), the creators' fields against the Python pass's, and a dry run of plugin calls whose
fields come from the pass's field builders. Skipped with the reason when nvcc or the headers
are missing (CI has nvcc but no headers); build.sh's one-line skip is tested wherever nvcc is."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from spin_trtllm import SpinConfig
from spin_trtllm.integrations.tensorrt import fields as F
from spin_trtllm.integrations.tensorrt import harness as H

ROOT = Path(__file__).resolve().parent.parent
GROUPS = ["creators", "capabilities", "output_dtypes", "output_shapes", "formats",
          "configure_and_shape_change", "serialization_round_trip_and_clone", "bad_fields",
          "enqueue_errors"]


def _nvcc():
    home = os.environ.get("CUDA_HOME")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _headers():
    """Where build.sh will find NvInferRuntime.h, or None."""
    if os.environ.get("TENSORRT_ROOT"):
        inc = Path(os.environ["TENSORRT_ROOT"]) / "include"
        return inc if (inc / "NvInferRuntime.h").is_file() else None
    inc = ROOT / "third_party" / "TensorRT" / "include"
    if (inc / "NvInferRuntime.h").is_file():
        return inc
    for d in ("/usr/include", "/usr/include/x86_64-linux-gnu", "/usr/local/include",
              "/usr/local/tensorrt/include"):
        if (Path(d) / "NvInferRuntime.h").is_file():
            return Path(d)
    return None


NVCC, HEADERS = _nvcc(), _headers()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc not found: the TensorRT plugin library cannot be built here")
    if HEADERS is None:
        pytest.skip("no TensorRT headers (set TENSORRT_ROOT, or put NVIDIA/TensorRT's include/ in "
                    "third_party/TensorRT/include): the plugin library is not built here")
    out = tmp_path_factory.mktemp("trt_plugins")
    res = H.build(out)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "built" in res.stdout, res.stdout
    found = H.find_build(out)
    assert found is not None, res.stdout
    return found


@needs_nvcc
def test_build_script_prints_one_line_and_exits_0_without_headers(tmp_path):
    res = subprocess.run(["bash", str(H.BUILD_SCRIPT), "--out", str(tmp_path)], capture_output=True,
                         text=True, env={**os.environ, "TENSORRT_ROOT": str(tmp_path / "none")})
    assert res.returncode == 0 and res.stderr == ""
    assert res.stdout.splitlines() == [f"plugins/tensorrt: skipped: no TensorRT headers in "
                                       f"{tmp_path / 'none'}/include (set TENSORRT_ROOT)"]
    # a checkout without third_party/ and a compiler that finds no NvInferRuntime.h
    tree = tmp_path / "repo" / "plugins" / "tensorrt"
    tree.mkdir(parents=True)
    shutil.copy(H.BUILD_SCRIPT, tree / "build.sh")
    env = {k: v for k, v in os.environ.items() if k not in ("TENSORRT_ROOT", "CPATH", "CPLUS_INCLUDE_PATH")}
    res = subprocess.run(["bash", str(tree / "build.sh")], capture_output=True, text=True, env=env)
    if HEADERS is not None and HEADERS.parent != ROOT / "third_party" / "TensorRT":
        pytest.skip("the system has TensorRT headers: no skip line to test")
    assert res.returncode == 0
    assert res.stdout.splitlines() == ["plugins/tensorrt: skipped: no TensorRT headers (set TENSORRT_ROOT)"]


def test_build_script_without_nvcc(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME",)}
    env["PATH"] = "/usr/bin:/bin"
    if shutil.which("nvcc", path=env["PATH"]):
        pytest.skip("nvcc is in /usr/bin")
    res = subprocess.run(["bash", str(H.BUILD_SCRIPT), "--out", str(tmp_path)], capture_output=True,
                         text=True, env=env)
    assert res.returncode == 0
    assert res.stdout.splitlines() == ["plugins/tensorrt: skipped: nvcc not found (set CUDA_HOME or "
                                       "put nvcc on PATH)"]


def test_library_exports_only_the_two_entry_points(built):
    lib, _ = built
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found")
    out = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    assert sorted(line.split()[-1] for line in out.splitlines() if line.strip()) == \
        ["getCreators", "setLoggerFinder"]


def test_harness_checks_pass_without_a_gpu(built):
    lib, harness = built
    res = subprocess.run([str(harness), "check", str(lib)], capture_output=True, text=True, timeout=120)
    report = res.stdout + res.stderr
    assert res.returncode == 0, report
    assert [l.split()[1] for l in res.stdout.splitlines() if l.startswith("ok ")] == GROUPS, report
    m = re.search(r"plugin_harness: (\d+) checks, 0 failed", res.stdout)
    assert m and int(m.group(1)) > 200, report


def test_creator_fields_match_the_pass(built):
    lib, harness = built
    res = subprocess.run([str(harness), "fields", str(lib)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    got = {}
    for line in res.stdout.splitlines():
        name, version, *fields = line.split()
        assert version == F.PLUGIN_VERSION
        got[name] = tuple((f.split(":")[0], {"INT64": "int", "FLOAT64": "float"}[f.split(":")[1]])
                          for f in fields)
    assert got == F.FIELDS


def _pass_shaped_case(directory, cfg, B=3, R=2, L=2, max_context=1000, cap=1100, fields=None):
    """Plugin calls as the pass wires them (fields from its builders), zero tensors."""
    c = H.HarnessCase(directory)
    S, nb, pages = B + 1, -(-cap // 64), -(-cap // 64)
    dt = getattr(torch, cfg.state_dtype)
    for name, t in [("V", torch.zeros(S, L, cap, dtype=dt)), ("D", torch.zeros(S, L, cap, dtype=dt)),
                    ("last_seen", torch.zeros(S, L, nb, dtype=torch.int64)),
                    ("decode_steps", torch.zeros(S, L, dtype=torch.int64)),
                    ("slot", torch.arange(B, dtype=torch.int32)),
                    ("ctx", torch.zeros(B, R, dtype=torch.int32)),
                    ("qpos", torch.zeros(B, R, dtype=torch.int32)),
                    ("request", torch.zeros(B, dtype=torch.int64)),
                    ("step", torch.zeros(B, dtype=torch.int64)),
                    ("table", torch.zeros(B, pages, dtype=torch.int32)),
                    ("q", torch.zeros(B * R, 64, 128, dtype=torch.int8)),
                    ("kv", torch.zeros(7, 64, 1, 132, dtype=torch.int8)),
                    ("w", torch.zeros(B * R, 64)), ("acc", torch.zeros(B, dtype=torch.int32))]:
        c.tensor(name, t)
    state = ["V", "D", "last_seen", "decode_steps", "slot"]
    sel = fields or F.select_fields(cfg, max_context=max_context)
    c.plugin("SpinSelect", "spin/select", sel, state + ["ctx", "qpos", "request", "step"], ["ids", "cnt"])
    done = []
    for l in range(L):
        c.plugin("SpinIndexerLogits", f"spin/L{l}/logits", F.logits_fields(layer=l),
                 ["q", "kv", "w", "ctx", "table", "ids", "cnt"], [f"z{l}"])
        c.plugin("SpinTopK", f"spin/L{l}/topk", F.topk_fields(cfg, layer=l), [f"z{l}", "ids", "cnt"],
                 [f"top{l}"])
        c.plugin("SpinUpdate", f"spin/L{l}/update",
                 F.update_fields(cfg, layer=l, max_context=max_context, next_n=R),
                 state + [f"z{l}", "ids", "cnt", "ctx", "qpos", "acc", "step"] + done, [f"done{l}"])
        done = [f"done{l}"]
    c.save("top0", torch.int32, (B * R, cfg.index_topk))
    return c


@pytest.mark.parametrize("state_dtype", ["float32", "float16", "float8_e4m3fn"])
def test_dry_run_of_pass_shaped_calls(built, tmp_path, state_dtype):
    lib, harness = built
    cfg = SpinConfig(index_topk=256, state_dtype=state_dtype, pooling="mean")
    res = _pass_shaped_case(tmp_path, cfg).run(harness, lib, dry=True)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert "SpinSelect spin/select: ids [3, 2, 16] cnt [3, 2]" in lines
    for l in range(2):
        assert f"SpinIndexerLogits spin/L{l}/logits: z{l} [6, 1024]" in lines
        assert f"SpinTopK spin/L{l}/topk: top{l} [6, 256]" in lines
        assert f"SpinUpdate spin/L{l}/update: done{l} [1]" in lines
    assert lines[-1] == "run: 7 plugin calls (dry: nothing enqueued)"


def test_dry_run_reports_bad_fields_and_shapes(built, tmp_path):
    lib, harness = built
    cfg = SpinConfig(index_topk=256)
    bad = {**F.select_fields(cfg, max_context=1000), "target_sparsity": 1.5}
    res = _pass_shaped_case(tmp_path / "a", cfg, fields=bad).run(harness, lib, dry=True)
    assert res.returncode == 1
    assert "SpinSelect 'spin/select': field 'target_sparsity' = 1.5: must satisfy 0 <= " \
           "target_sparsity < 1" in res.stderr
    # a state capacity whose last_seen does not match: cap 1100 needs 18 blocks
    c = _pass_shaped_case(tmp_path / "b", cfg)
    c.lines = [l.replace("tensor last_seen i64 last_seen.bin 4 2 18", "tensor last_seen i64 - 4 2 17")
               for l in c.lines]
    res = c.run(harness, lib, dry=True)
    assert res.returncode == 1
    assert "last_seen must be [S, L, ceil(cap / 64)] = [S, L, 18], got last_seen [4, 2, 17]" in res.stderr
    # next_n 9 rows
    c = _pass_shaped_case(tmp_path / "c", cfg, R=1)
    c.lines = [l.replace("tensor ctx i32 ctx.bin 3 1", "tensor ctx i32 - 3 9") for l in c.lines]
    res = c.run(harness, lib, dry=True)
    assert res.returncode == 1 and "1 <= R (next_n) <= 8" in res.stderr
