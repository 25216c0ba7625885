"""Which of the native library's kernels the sanitized tests launched.

    python3 tests/gpu/kernel_coverage.py KERNEL_LOG.json [...] spin_trtllm/libspin_native.so \
        [--ran TIMES...] [--merged FILE]

KERNEL_LOG.json comes from a pytest run with SPIN_KERNEL_LOG set
(spin_trtllm/testing/kernel_log.py): the tests that compute-sanitizer runs (all but those marked
large); several (one per process of a plain run) count together, and --merged writes their spin
kernels as one log for a later call's KERNEL_LOG (tests/gpu/sanitizer_order/kernels.json is
one). The library's kernels (every template instance) are the entry functions of its sm_90a
code, read with cuobjdump. Prints each with the number of tests that launched it; exits 1 if
any was never launched, or if the log names spin kernels the library lacks (a stale log). With
--ran, only the tests those SPIN_TEST_TIMES files show as run (not skipped) count: the .times
files of one sanitizer's shards tell which kernels that tool checked, although the kernel log
comes from a plain run (the profiler is not run under compute-sanitizer)."""

import argparse
import json
import re
import shutil
import subprocess
import sys

from spin_trtllm.testing.queue_plugin import known_seconds


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


def coverage(launched: dict[str, list[str]], kernels: list[str],
             ran: set[str] | None = None) -> dict[str, list[str]]:
    """Each kernel (readable name) with the tests that launched it, those in `ran` only if
    given. `launched` maps the kernel log's names to test ids."""
    by_key = {key(name): tests for name, tests in launched.items()}
    return {k: [t for t in by_key.get(key(k), []) if ran is None or t in ran] for k in kernels}


def is_spin(name: str) -> bool:
    """Whether a logged kernel is the library's (namespace spin), not upstream's."""
    return key(name).startswith("spin::")


def not_in_library(launched: dict[str, list[str]], kernels: list[str]) -> list[str]:
    """The kernel log's spin kernels that the library has none of that name for: a log of other
    sources (an earlier plain run), where a renamed kernel would read as never launched."""
    have = {key(k) for k in kernels}
    return sorted(n for n in launched if is_spin(n) and key(n) not in have)


def merge(logs: list[dict[str, list[str]]]) -> dict[str, list[str]]:
    """One kernel log from several processes' (each kernel's tests, sorted, each once)."""
    merged: dict[str, set[str]] = {}
    for log in logs:
        for name, tests in log.items():
            merged.setdefault(name, set()).update(tests)
    return {name: sorted(tests) for name, tests in sorted(merged.items())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("kernel_log", nargs="+")
    ap.add_argument("library")
    ap.add_argument("--ran", nargs="+", metavar="TIMES",
                    help="count only the tests these SPIN_TEST_TIMES files show as run")
    ap.add_argument("--merged", metavar="FILE",
                    help="write the kernel logs' spin kernels as one log (upstream's are not "
                         "checked: torch's alone made it nine times larger)")
    args = ap.parse_args()
    launched = merge([json.load(open(path)) for path in args.kernel_log])
    if args.merged:
        with open(args.merged, "w") as out:
            json.dump({name: tests for name, tests in launched.items() if is_spin(name)}, out,
                      indent=1, sort_keys=True)
    # the tests each file shows as run (passed or not: the kernels ran under the tool), no skips
    ran = set(known_seconds(args.ran)) if args.ran else None
    kernels = library_kernels(args.library)
    names = demangle(kernels)
    tests = coverage(launched, names, ran)
    stale = not_in_library(launched, names)
    if stale:
        print(f"STALE KERNEL LOG: {len(stale)} of its spin kernels are not in {args.library} "
              f"(built from other sources: run `tests/gpu/device_check.sh plain` again for a "
              f"kernel log), e.g. {stale[0]}")
    missing = 0
    for name in sorted(tests):
        missing += not tests[name]
        print(f"{len(tests[name]):5d} tests  {name}"
              + ("" if tests[name] else "   <- NEVER LAUNCHED"))
    which = "the tests" if ran is None else f"the {len(ran)} tests that ran"
    print(f"{len(tests) - missing} of {len(tests)} kernels launched by {which}")
    return 1 if missing or stale else 0


if __name__ == "__main__":
    sys.exit(main())
