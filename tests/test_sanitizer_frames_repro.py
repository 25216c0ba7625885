"""tests/gpu/sanitizer_frames_repro.py counts the frames a loop leaves alive: none in a plain run,
every one that Python keeps (its control case). On the CPU; the sanitizer runs need a GPU."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "gpu" / "sanitizer_frames_repro.py"


def run_case(case: str) -> str:
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path)
    out = subprocess.run([sys.executable, str(SCRIPT), "--run", case, "--device", "cpu"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("case,frames", [("rope", 0), ("rpow", 0), ("pow", 0), ("kept", 200)])
def test_frames_left_alive_are_counted(case, frames):
    assert run_case(case) == f"frames {frames} held 0.00 GiB"


def test_an_unknown_case_is_named():
    out = subprocess.run([sys.executable, str(SCRIPT), "ropes"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2
    assert "no case ropes: the cases are rope, rpow, pow, kept" in out.stderr
