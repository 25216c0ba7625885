"""Which of the native library's kernels the sanitized tests launched.

    python3 tests/gpu/kernel_coverage.py KERNEL_LOG.json spin_trtllm/libspin_native.so

KERNEL_LOG.json comes from a pytest run with SPIN_KERNEL_LOG set (tests/conftest.py): the tests
that compute-sanitizer runs (all but those marked large). The
library's kernels (every template instance) are the entry functions of its sm_90a code, read with
cuobjdump. Prints each with the number of tests that launched it; exits 1 if any was never
launched."""

import json
import re
import shutil
import subprocess
import sys


def demangle(names: list[str]) -> list[str]:
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if tool is None:
        return names
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout
    return out.splitlines()


def library_kernels(lib: str) -> list[str]:
    """Entry functions of the sm_90a cubins (the code an H100/H200 runs)."""
    text = subprocess.run(["cuobjdump", "-arch", "sm_90a", "-symbols", lib], capture_output=True,
                          text=True, check=True).stdout
    names = sorted({line.split()[-1] for line in text.splitlines() if "STO_ENTRY" in line})
    if not names:
        sys.exit(f"kernel_coverage: no kernel entry found in {lib} (cuobjdump -symbols)")
    return names


def key(name: str) -> str:
    """One spelling for the profiler's and cu++filt's names of a kernel: `(anonymous
    namespace)` / `<unnamed>`, `<1, true>` / `<(int)1, (bool)1>`, a leading `void` or not."""
    name = re.sub(r"\s+", "", name)
    name = name.replace("(anonymousnamespace)", "<unnamed>").replace("(bool)0", "false")
    name = name.replace("(bool)1", "true").replace("(int)", "")
    return name.removeprefix("void")


def main() -> int:
    log_path, lib = sys.argv[1:3]
    launched = {key(k): v for k, v in json.load(open(log_path)).items()}
    kernels = library_kernels(lib)
    missing = 0
    for mangled, readable in sorted(zip(kernels, demangle(kernels)), key=lambda x: x[1]):
        tests = launched.get(key(readable), [])
        missing += not tests
        print(f"{len(tests):5d} tests  {readable}" + ("" if tests else "   <- NEVER LAUNCHED"))
    print(f"{len(kernels) - missing} of {len(kernels)} kernels launched by the tests")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
