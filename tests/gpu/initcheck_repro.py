"""What compute-sanitizer initcheck reports in code with no uninitialized read, in a few lines
of torch each (no spin kernel involved). tests/gpu/device_check.sh's initcheck step keeps clear
of both:

  bf16_gemm        a bf16 GEMM (cuBLAS) then silu on its output: every read of the output is
                   reported as uninitialized (cuBLAS's sm_90 GEMMs store their tiles with TMA,
                   which initcheck does not see; `--check-bulk-copy yes` changes nothing).
                   fp32_gemm, the same in float32 (a kernel without TMA stores): no report.
                   The tests whose model runs in bf16 are marked no_initcheck; a float32 twin
                   runs the same spin kernels there.
  graph_temp_copy  a captured graph: a kernel fills a temporary from the graph's private pool,
                   then a same-dtype copy of it into a buffer (a memcpy node). initcheck checks
                   a memcpy node's source when the graph is launched, before the kernel runs,
                   so the first replay reports the whole temporary; later replays do not (the
                   kernel wrote it by then). graph_in_place, the kernel writing the buffer
                   itself: no report. The stand-in's captured metadata writes in place so.

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
