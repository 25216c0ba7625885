"""SPIN_SHARD=I/N (tests/conftest.py): the shards of a selection are disjoint and together are
the whole selection; a bad value is refused with its name."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def collected(shard=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "SPIN_SHARD"}
    if shard is not None:
        env["SPIN_SHARD"] = shard
    return subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "-o", "addopts=", "tests/test_soak.py", "tests/test_shards.py"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def ids(proc: subprocess.CompletedProcess) -> set[str]:
    assert proc.returncode in (0, 5), proc.stdout + proc.stderr   # 5: an empty shard
    return {line for line in proc.stdout.splitlines() if "::" in line}


@pytest.mark.slow
def test_shards_partition_the_selection():
    whole = ids(collected())
    parts = [ids(collected(f"{i}/3")) for i in range(3)]
    assert len(whole) >= 6 and sum(map(len, parts)) == len(whole)
    assert set().union(*parts) == whole
    assert sum(1 for p in parts if p) >= 2    # a hash that sends everything to one shard fails
    bad = collected("3/3")
    assert bad.returncode != 0 and "SPIN_SHARD='3/3'" in bad.stdout + bad.stderr
