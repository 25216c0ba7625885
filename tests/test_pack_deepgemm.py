"""tests/gpu/pack_deepgemm.sh on small git repositories: DeepGEMM's tree with the include/ trees
of the cutlass and fmt commits it pins (gitlinks), under deepgemm/, as deepgemm_env.sh unpacks
it; a repository without the pinned commit is refused and writes nothing."""

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "gpu" / "pack_deepgemm.sh"
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                           *args], check=True, capture_output=True, text=True).stdout.strip()


def repo_with(path: Path, files: dict[str, str]) -> str:
    """A repository at path whose one commit holds files; returns the commit."""
    path.mkdir()
    git(path, "init", "-q")
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    git(path, "add", "-A")
    git(path, "commit", "-qm", "c")
    return git(path, "rev-parse", "HEAD")


def deepgemm(tmp_path: Path, cutlass_pin: str, fmt_pin: str) -> Path:
    dg = tmp_path / "dg"
    repo_with(dg, {"setup.py": "# dg\n", "deep_gemm/include/deep_gemm/x.cuh": "x\n"})
    for path, pin in (("third-party/cutlass", cutlass_pin), ("third-party/fmt", fmt_pin)):
        git(dg, "update-index", "--add", "--cacheinfo", f"160000,{pin},{path}")
    git(dg, "commit", "-qm", "submodules")
    return dg


def run(*args, env_out: Path):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "DEEPGEMM_TARBALL": str(env_out)})


def test_packs_deepgemm_with_the_pinned_include_trees(tmp_path):
    cutlass, fmt = tmp_path / "cutlass", tmp_path / "fmt"
    pinned = repo_with(cutlass, {"include/cutlass/gemm.h": "pinned\n", "media/big.png": "png"})
    (cutlass / "include/cutlass/gemm.h").write_text("newer\n")
    git(cutlass, "commit", "-qam", "newer")                 # HEAD moved past the pin
    fmt_pin = repo_with(fmt, {"include/fmt/core.h": "fmt\n", "src/format.cc": "cc\n"})
    dg = deepgemm(tmp_path, pinned, fmt_pin)
    out = tmp_path / "out" / "deepgemm.tar.gz"
    res = run(dg, cutlass, fmt, env_out=out)
    assert res.returncode == 0, res.stdout + res.stderr
    with tarfile.open(out) as tar:
        names = {m.name for m in tar.getmembers() if m.isfile()}
        gemm = tar.extractfile("deepgemm/third-party/cutlass/include/cutlass/gemm.h").read()
    assert names == {"deepgemm/setup.py", "deepgemm/deep_gemm/include/deep_gemm/x.cuh",
                     "deepgemm/third-party/cutlass/include/cutlass/gemm.h",
                     "deepgemm/third-party/fmt/include/fmt/core.h"}
    assert gemm == b"pinned\n"
    assert pinned in res.stdout and fmt_pin in res.stdout


def test_a_repository_without_the_pinned_commit_is_refused(tmp_path):
    fmt = tmp_path / "fmt"
    fmt_pin = repo_with(fmt, {"include/fmt/core.h": "fmt\n"})
    dg = deepgemm(tmp_path, "1" * 40, fmt_pin)
    out = tmp_path / "deepgemm.tar.gz"
    res = run(dg, fmt, fmt, env_out=out)
    assert res.returncode == 1
    assert f"lacks third-party/cutlass's pinned commit {'1' * 40}" in res.stdout
    assert not out.exists()
    assert run(dg, fmt, env_out=out).returncode == 2         # usage
