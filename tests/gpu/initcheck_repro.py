"""What compute-sanitizer initcheck reports in code with no uninitialized read, in a few lines
of torch each (no spin kernel involved): the bf16 GEMM's reports, which
tests/gpu/device_check.sh's initcheck step keeps clear of, and a memcpy-node case that does not
reproduce what it reports in the stand-in's engine loop:

  bf16_gemm        a bf16 GEMM (cuBLAS) then silu on its output: every read of the output is
                   reported as uninitialized (2026-12-06, an H100: 2,048 reports at 16 rows,
                   the same with `--check-bulk-copy yes`); fp32_gemm, the same in float32: no
                   report. Likely cause: the bf16 GEMM stores its tiles with TMA, which
                   initcheck does not track. The tests whose model runs in bf16 are marked
                   no_initcheck; a float32 twin runs the same spin kernels there.
  graph_temp_copy  a captured graph: a kernel fills a temporary from the graph's private pool,
                   then a same-dtype copy of it into a buffer (a memcpy node), replayed twice.
                   Seen in the stand-in's engine loop: "Host API memory access error ...
                   cudaMemcpy source" at cudaGraphLaunch, the source such a temporary, as if
                   initcheck checked a memcpy node's source at the launch, before the kernel
                   that fills it runs. graph_in_place, the kernel writing the buffer itself, is
                   the control. The stand-in's captured metadata writes in place so. This
                   minimal case does not reproduce it: 0 reports (2026-12-06, an H100), while
                   the suite's initcheck run the same day still had 39 such reports in the
                   engine loop's warm-up replays (query-aware predictors, V4 rows, the overlap
                   scheduler): which copies they are is open.

    python3 tests/gpu/initcheck_repro.py            each case in its own process under
                                                    initcheck, with its count of reports
    python3 tests/gpu/initcheck_repro.py CASE       one case, unsanitized
"""
import re
import subprocess
import sys

CASES = ("bf16_gemm", "fp32_gemm", "graph_temp_copy", "graph_in_place")


def run_case(case: str) -> None:
    import torch

    dev = torch.device("cuda")
    if case.endswith("_gemm"):
        dtype = torch.bfloat16 if case == "bf16_gemm" else torch.float32
        x = torch.randn(16, 512, device=dev, dtype=dtype)
        w = torch.randn(512, 1024, device=dev, dtype=dtype)
        out = torch.nn.functional.silu(x @ w)
    else:
        src = torch.arange(96, dtype=torch.int32, device=dev)
        out = torch.zeros(96, dtype=torch.int32, device=dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            if case == "graph_temp_copy":
                out.copy_(src * 2)               # temporary, then a memcpy node
            else:
                torch.mul(src, 2, out=out)       # the kernel writes the buffer
        for _ in range(2):
            graph.replay()
    torch.cuda.synchronize()
    print(case, float(out.float().sum()))


def main() -> int:
    if len(sys.argv) > 1:
        if sys.argv[1] not in CASES:
            sys.exit(f"initcheck_repro: unknown case {sys.argv[1]!r}; one of {', '.join(CASES)}")
        run_case(sys.argv[1])
        return 0
    for case in CASES:
        log = subprocess.run(["compute-sanitizer", "--tool", "initcheck", "--print-limit", "1",
                              sys.executable, __file__, case],
                             capture_output=True, text=True).stdout
        summary = re.search(r"ERROR SUMMARY: (\d+) error", log)
        print(f"{case:16s} {summary.group(1) if summary else '?'} reports under initcheck"
              f"{'' if summary else ' (no summary: ' + log[-200:] + ')'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
