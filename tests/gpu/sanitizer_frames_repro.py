"""What compute-sanitizer keeps alive in a Python process: after a loop of torch calls, the frames
of the looped function still alive and the GPU memory torch still holds (after gc.collect()),
unsanitized, under memcheck with its default backtraces, and under memcheck with --show-backtrace
device (as tests/gpu/device_check.sh runs every tool but initcheck). Under memcheck the dsa-lite
engine tests left 3.3 GiB after one test (an H100, 2026-12-06, the code of a7eb71c), locals of
finished `rope` frames that a frame of torch's reflected-operator wrapper kept alive, which no
Python object refers to: the host backtrace the tool saves at each launch holds them.

Measured (an H100, compute-sanitizer 2025.3.1, 2026-12-07), 200 calls each: unsanitized,
rope, rpow and pow 0 frames, 0.01 GiB; under memcheck rope 400 frames (1.67 GiB), rpow 200
(1.57 GiB), pow none; under memcheck --show-backtrace no (the same --kernel-name filter), none
of the three; the kept control 200 frames (1.57 GiB) in every mode. `compute-sanitizer --tool
memcheck --show-backtrace device python3 THIS --run rope`: 0 frames, 0.01 GiB (with `host`: 400,
1.67 GiB). rpow, pow and kept have not run with `device`.

  case    what it loops (200 calls, each with an 8 MiB tensor as a local)
  rope    the dsa-lite model's rotary embedding (spin_trtllm/harness/model.py)
  rpow    `10000.0 ** t`: torch's Python wrapper of the reflected operator
  pow     `torch.pow(10000.0, t)`: the same op with no Python frame in torch
  kept    a control: each call appends its own frame to a list (Python holds them)

    python3 tests/gpu/sanitizer_frames_repro.py [CASE...]   each case (default: all) plain,
        under memcheck, and under memcheck --show-backtrace device, each in its own process (from
        the repository root, after `source tests/gpu/device_env.sh`)
    python3 tests/gpu/sanitizer_frames_repro.py --run CASE [--device cpu]   one case, here
"""
import argparse
import gc
import re
import shutil
import subprocess
import sys

CASES = ("rope", "rpow", "pow", "kept")
CALLS = 200
RESULT = re.compile(r"frames (\d+) held ([\d.]+) GiB")
kept_frames = []


def looped(case: str, x, t):
    """One call of the case's loop body; `x` (8 MiB) is a local, as the model's activations are."""
    import torch

    if case == "rope":
        from spin_trtllm.harness.model import rope
        return rope(x, t, 10000.0)
    if case == "rpow":
        return x[..., :1] * 0 + 10000.0 ** t.to(x.dtype)
    if case == "pow":
        return x[..., :1] * 0 + torch.pow(10000.0, t.to(x.dtype))
    kept_frames.append(sys._getframe())
    return x[..., :1] * 0


def run(case: str, device: str) -> str:
    """The case's loop here: its result line."""
    import torch

    x = torch.randn(1, 32, 64, 1024, device=device)            # 8 MiB
    t = torch.arange(64, device=device).view(1, 1, 64)            # positions of x's rows
    for _ in range(CALLS):
        x = x + looped(case, x, t)[..., :1] * 0                  # a fresh x each call
    if device == "cuda":
        torch.cuda.synchronize()
    gc.collect()
    frames = sum(1 for o in gc.get_objects()
                 if type(o).__name__ == "frame" and o.f_code.co_name in ("looped", "rope"))
    held = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else 0.0
    return f"frames {frames} held {held:.2f} GiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cases", nargs="*", metavar="CASE", help=f"of {', '.join(CASES)}")
    ap.add_argument("--run", choices=CASES, help="one case in this process, unsanitized")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        ap.error(f"no case {', '.join(unknown)}: the cases are {', '.join(CASES)}")
    if args.run:
        print(run(args.run, args.device))
        return 0
    if shutil.which("compute-sanitizer") is None:
        ap.error("compute-sanitizer is not on PATH (it comes with the CUDA toolkit)")
    help_text = subprocess.run(["compute-sanitizer", "--help"], capture_output=True,
                               text=True).stdout
    memcheck = ["compute-sanitizer", "--tool", "memcheck", "--kernel-name", "kns=spin"]
    modes = {"plain": [], "memcheck": memcheck}
    if "--show-backtrace" in help_text:
        modes["memcheck, --show-backtrace device"] = memcheck + ["--show-backtrace", "device"]
    print(f"{'case':8}" + "".join(f"{m:>36}" for m in modes))
    for case in args.cases or CASES:
        cells = []
        for prefix in modes.values():
            done = subprocess.run(prefix + [sys.executable, __file__, "--run", case],
                                  capture_output=True, text=True)
            found = RESULT.search(done.stdout)
            cells.append(f"{found.group(1)} frames, {found.group(2)} GiB" if found else
                         f"failed (rc {done.returncode})")
        print(f"{case:8}" + "".join(f"{c:>36}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
