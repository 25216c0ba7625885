"""Build the native library (python -m spin_trtllm._build [--check]); build.sh calls this.

- With a CUDA build of torch and nvcc: compiles cpp/src/*.cu and the torch bindings
  (spin_trtllm/csrc/*.cpp, one file per op) into spin_trtllm/libspin_native.so
  (SPIN_CUDA_ARCHS adds -gencode targets; SPIN_PORTABLE_ONLY=1 builds without sm_90a, to test
  the portable kernels on Hopper).
- Otherwise: says so in one line; the ops run through the reference.
- --check: compiles every cpp/src/*.cu for sm_90a, sm_90 and sm_89 with nvcc alone (no torch
  CUDA needed), and checks the bindings' syntax against the installed torch's headers, so a
  kernel or binding that does not compile fails on CPU-only machines too.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(__file__).resolve().parent
SOURCES = sorted((ROOT / "cpp" / "src").glob("*.cu"))
BINDINGS = sorted((PACKAGE / "csrc").glob("*.cpp"))  # one op's schema and binding per file
SM90A = "-gencode=arch=compute_90a,code=sm_90a"   # wgmma kernels
PORTABLE = ["-gencode=arch=compute_90,code=sm_90"]  # mma.sync kernels
GENCODE = [SM90A, *PORTABLE]
# --check also compiles for sm_89, the oldest architecture with FP8 mma.sync: the portable path
CHECK_GENCODE = GENCODE + ["-gencode=arch=compute_89,code=sm_89"]


def gencode_flags() -> list[str]:
    extra = os.environ.get("SPIN_CUDA_ARCHS", "").split()
    # SPIN_PORTABLE_ONLY=1: leave out sm_90a, so an H100/H200 runs the mma.sync kernels that
    # other architectures get (to test them; slower)
    base = PORTABLE if os.environ.get("SPIN_PORTABLE_ONLY") == "1" else GENCODE
    return base + [f"-gencode=arch=compute_{a},code=sm_{a}" for a in extra]


def nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def cuda_include(compiler: str) -> Path | None:
    """The CUDA toolkit's include folder (cuda_runtime.h), for the bindings' check."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
             Path(compiler).resolve().parent.parent, "/usr/local/cuda"]
    for home in homes:
        if home and (Path(home) / "include" / "cuda_runtime.h").exists():
            return Path(home) / "include"
    return None


def check_bindings(compiler: str) -> int:
    """The bindings' syntax against the installed torch's headers (a CPU wheel's too); the number
    that fail."""
    import sysconfig

    import torch
    from torch.utils.cpp_extension import include_paths

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    cuda = cuda_include(compiler)
    if cxx is None or cuda is None:
        print("spin_trtllm build check: no C++ compiler or CUDA headers; bindings not checked")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        # CPU wheels leave out the header that CUDA builds of torch generate; c10/cuda needs
        # only its name
        stub = Path(tmp) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        stub.parent.mkdir(parents=True)
        stub.write_text("#pragma once\n")
        flags = ["-fsyntax-only", "-std=c++17", f"-I{ROOT / 'cpp' / 'include'}",
                 *[f"-isystem{d}" for d in include_paths()], f"-idirafter{tmp}",
                 f"-isystem{cuda}", f"-isystem{sysconfig.get_paths()['include']}"]
        runs = [(src, subprocess.Popen([cxx, *flags, str(src)], stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True))
                for src in BINDINGS]
        failed = 0
        for src, proc in runs:
            out = proc.communicate()[0]
            status = "ok" if proc.returncode == 0 else "FAILED"
            name = src.relative_to(ROOT) if src.is_relative_to(ROOT) else src
            print(f"c++ {name} (torch {torch.__version__} headers): {status}")
            if proc.returncode:
                print(out, file=sys.stderr)
                failed += 1
    return failed


def check() -> int:
    """Compile each kernel source on its own and check the bindings; 0 when all compile."""
    compiler = nvcc()
    if compiler is None:
        print("spin_trtllm build check: nvcc not found; kernel sources not compiled")
        return 0
    failed = check_bindings(compiler)
    with tempfile.TemporaryDirectory() as tmp:
        for src in SOURCES:
            cmd = [compiler, "-std=c++17", "-c", *CHECK_GENCODE, f"-I{ROOT / 'cpp' / 'include'}",
                   str(src), "-o", str(Path(tmp) / (src.stem + ".o"))]
            res = subprocess.run(cmd, capture_output=True, text=True)
            status = "ok" if res.returncode == 0 else "FAILED"
            print(f"nvcc {src.relative_to(ROOT)} (sm_90a, sm_90, sm_89): {status}")
            if res.returncode:
                print(res.stderr, file=sys.stderr)
                failed += 1
    return 1 if failed else 0


def build(verbose: bool = False) -> int:
    import torch

    if torch.version.cuda is None:
        print("spin_trtllm build: torch has no CUDA; CPU-only package (ops run through the "
              "reference)")
        return 0
    if nvcc() is None:
        print("spin_trtllm build: nvcc not found; CPU-only package (ops run through the "
              "reference)")
        return 0
    from torch.utils.cpp_extension import load

    out_dir = ROOT / "build" / "native"
    out_dir.mkdir(parents=True, exist_ok=True)
    load(name="spin_native",
         sources=[str(s) for s in SOURCES + BINDINGS],
         extra_include_paths=[str(ROOT / "cpp" / "include")],
         extra_cflags=["-O3", "-std=c++17"],
         # -lineinfo: source lines in ncu and compute-sanitizer reports (the code is the same)
         extra_cuda_cflags=["-O3", "-std=c++17", "-lineinfo", *gencode_flags()],
         build_directory=str(out_dir), is_python_module=False, verbose=verbose)
    built = out_dir / "spin_native.so"
    target = PACKAGE / "libspin_native.so"
    shutil.copy2(built, target)
    print(f"spin_trtllm build: wrote {target.relative_to(ROOT)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="only compile the .cu files with nvcc and check the bindings")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    return check() if args.check else build(args.verbose)


if __name__ == "__main__":
    sys.exit(main())
