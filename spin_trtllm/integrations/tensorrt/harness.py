"""Cases for plugins/tensorrt/tests/plugin_harness (`run` mode): tensors written as raw files,
plugin calls as lines of case.txt, outputs read back as torch tensors. The tests use this to
run the plugins on the same inputs as the torch ops and compare.

case.txt, one directive a line:
    tensor NAME DTYPE FILE D0 [D1 ...]      DTYPE f32 f16 bf16 i32 i64 fp8 i8 u8 bool; FILE "-": zeros
    plugin TYPE NAME / field NAME KIND VALUE (KIND i32 i64 f32 f64 s) / inputs ... / outputs ... / end
    save NAME FILE
Plugin outputs become tensors under their names; calls run in order, on the same buffers, so
state inputs written in place by SpinUpdate are seen by later calls.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Optional, Sequence

import torch

from ...errors import SpinError
from .fields import FIELDS

ROOT = Path(__file__).resolve().parents[3]
BUILD_SCRIPT = ROOT / "plugins" / "tensorrt" / "build.sh"
_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.int32: "i32",
           torch.int64: "i64", torch.float8_e4m3fn: "fp8", torch.int8: "i8", torch.uint8: "u8",
           torch.bool: "bool"}


def find_build(directory: Optional[os.PathLike] = None) -> Optional[tuple[Path, Path]]:
    """(library, harness) in `directory`, $SPIN_TRT_PLUGIN_DIR or build/tensorrt; None if absent."""
    d = Path(directory or os.environ.get("SPIN_TRT_PLUGIN_DIR") or ROOT / "build" / "tensorrt")
    lib, harness = d / "libspin_trtllm_plugins.so", d / "plugin_harness"
    return (lib, harness) if lib.is_file() and harness.is_file() else None


def build(out_dir: os.PathLike, timeout: float = 900) -> subprocess.CompletedProcess:
    """plugins/tensorrt/build.sh --out out_dir (its one-line skip message when no headers/nvcc)."""
    return subprocess.run(["bash", str(BUILD_SCRIPT), "--out", str(out_dir)], capture_output=True,
                          text=True, timeout=timeout)


class HarnessCase:
    def __init__(self, directory: os.PathLike):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lines: list[str] = []
        self.saved: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}

    def tensor(self, name: str, t: torch.Tensor, as_dtype: Optional[torch.dtype] = None) -> str:
        """Write t (a view as as_dtype, same element size, e.g. fp8 q as int8)."""
        t = t.detach().contiguous().cpu()
        if as_dtype is not None:
            t = t.view(as_dtype)
        if t.dtype not in _DTYPES:
            raise SpinError(f"harness case: dtype {t.dtype} has no harness name")
        path = self.dir / f"{name}.bin"
        path.write_bytes(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        dims = " ".join(str(d) for d in t.shape)
        self.lines.append(f"tensor {name} {_DTYPES[t.dtype]} {path.name} {dims}")
        return name

    def plugin(self, plugin: str, name: str, fields: dict, inputs: Sequence[str],
               outputs: Sequence[str]) -> None:
        kinds = dict(FIELDS[plugin])
        self.lines.append(f"plugin {plugin} {name}")
        for key, value in fields.items():
            kind = "f64" if kinds.get(key) == "float" else "i64"
            self.lines.append(f"field {key} {kind} {value!r}")
        self.lines.append("inputs " + " ".join(inputs))
        self.lines.append("outputs " + " ".join(outputs))
        self.lines.append("end")

    def save(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> None:
        self.saved[name] = (dtype, tuple(shape))
        self.lines.append(f"save {name} {name}.out")

    def write(self) -> Path:
        path = self.dir / "case.txt"
        path.write_text("\n".join(self.lines) + "\n")
        return path

    def run(self, harness: os.PathLike, library: os.PathLike, dry: bool = False,
            timeout: float = 300) -> subprocess.CompletedProcess:
        self.write()
        cmd = [str(harness), "run", str(library), str(self.dir)] + (["--dry"] if dry else [])
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)

    def load(self, name: str) -> torch.Tensor:
        dtype, shape = self.saved[name]
        data = (self.dir / f"{name}.out").read_bytes()
        expected = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
        if len(data) != expected:
            raise SpinError(f"harness output {name}: {len(data)} bytes, expected {expected} for "
                            f"{dtype} {list(shape)}")
        if not data:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return flat.view(dtype).reshape(shape).clone()
