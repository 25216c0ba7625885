"""What compute-sanitizer initcheck reports in code with no uninitialized read, in a few lines
of torch each: the bf16 GEMM's reports, which tests/gpu/device_check.sh's initcheck step keeps
clear of (no_initcheck), and the memcpy nodes of captured graphs that it reports at a graph's
first replay, whose checks tests/gpu/initcheck_suppressions.xml turns off at graph launches.
Reports per case, 2026-12-06, an H100, compute-sanitizer 2025.3.1, Triton 3.6.0, the code of
a6bd769 (the graph_spin_* cases need spin's native library, the Triton ones Triton 3.6 or
later; "-": not yet run):

  case                          reports  what it runs
  bf16_gemm                     2,048    a bf16 GEMM (cuBLAS), then silu on its output: every
                                         read of the output (the same with --check-bulk-copy
                                         yes); likely its TMA stores, which initcheck does not
                                         track
  fp32_gemm                     0        the same in float32
  graph_spin_topk_copy          12       spin's top-K writes a buffer in a graph, then a memcpy
                                         node copies it: every 32-byte sector of the 384-byte
                                         copy at the first replay, "Host API memory access error
                                         ... cudaMemcpy source" at cudaGraphLaunch, although the
                                         copy equals what the kernel wrote; 0 with the
                                         suppressions. Builds edited by hand gave 12 too: the
                                         top-K launched without the programmatic attribute, or
                                         with <<<>>>, or every kernel without
                                         griddepcontrol.launch_dependents
  eager_spin_topk_copy          -        the same steps run eagerly (0 from a scratch copy)
  graph_pdl_writer_copy         12       a Triton kernel that waits (griddepcontrol.wait),
                                         launched as a programmatic dependent, as the writer
  graph_waiting_writer_copy     0        that kernel launched without the attribute
  graph_early_release_copy      0        a Triton writer that lets its dependents start first
  graph_spin_remap_copy         0        spin's remap as the writer
  graph_spin_topk_kernel_read   0        the top-K's buffer read by a kernel, no memcpy node
  graph_temp_copy               0        a torch kernel writes a temporary, a memcpy copies it
  graph_in_place                0        the torch kernel writes the copied buffer itself
  graph_buffer_copy             0        ... a buffer allocated before the capture
  graph_after_pdl               0        a PDL-launched Triton kernel between writer and copy
  eager_uninit_copy             12       a copy from a never written segment: a true report,
                                         12 with the suppressions too (eager copies stay checked)
  graph_uninit_copy             -        the same copy captured: the suppressions hide it (their
                                         cost)

The copied bytes are the written ones in every case above but the last two: the reports lie
in the tool, and which writers set them off is what the table shows. The stand-in's engine loop
gave such reports at its warm-up (0-39 a run; its kv_lens_cuda_2d refresh copies a temporary a
kernel of the same graph wrote); with the suppressions the suite's initcheck step gives none.

    python3 tests/gpu/initcheck_repro.py [--suppressions] [CASE...]
        each case (default: all) in its own process under initcheck, with its count of reports;
        --suppressions: with tests/gpu/initcheck_suppressions.xml, as device_check.sh runs it
    python3 tests/gpu/initcheck_repro.py --run CASE    one case, unsanitized
"""
import argparse
import re
import subprocess
import sys
from pathlib import Path

CASES = ("bf16_gemm", "fp32_gemm", "graph_temp_copy", "graph_in_place", "graph_buffer_copy",
         "graph_after_pdl", "graph_spin_topk_copy", "graph_spin_remap_copy",
         "graph_early_release_copy", "graph_waiting_writer_copy", "graph_pdl_writer_copy",
         "graph_spin_topk_kernel_read", "eager_spin_topk_copy", "eager_uninit_copy",
         "graph_uninit_copy")


def _triton_fill(case: str):
    """fill(dst): one Triton kernel writing 0, 1, 2, ... into dst. graph_after_pdl: it waits
    for its predecessor (griddepcontrol.wait) and is launched as a programmatic dependent
    launch; graph_early_release_copy: it lets its dependents start at once
    (griddepcontrol.launch_dependents), then writes. Compiled here, outside any capture; exits
    with a message without Triton 3.6 (triton_with_pdl)."""
    import torch
    from spin_trtllm.testing.triton_pdl import triton_with_pdl

    found = triton_with_pdl()
    if isinstance(found, str):
        sys.exit(f"{case}: {found}")
    triton, tl = found

    @triton.jit
    def fill(dst, n, WAIT: tl.constexpr, RELEASE: tl.constexpr, BLOCK: tl.constexpr):
        if WAIT:
            tl.extra.cuda.gdc_wait()
        if RELEASE:
            tl.extra.cuda.gdc_launch_dependents()
        offs = tl.arange(0, BLOCK)
        tl.store(dst + offs, offs, mask=offs < n)

    wait = case in ("graph_after_pdl", "graph_waiting_writer_copy", "graph_pdl_writer_copy")
    pdl = case in ("graph_after_pdl", "graph_pdl_writer_copy")

    def launch(dst):
        fill[(1,)](dst, dst.numel(), WAIT=wait, RELEASE=not wait, BLOCK=128, launch_pdl=pdl)
    launch(torch.empty(128, dtype=torch.int32, device="cuda"))
    return launch


def _spin_writer(case, buf):
    """spin's top-K or remap writing buf (4 rows of 128 int32) from 4 rows of 8 blocks."""
    import torch
    from spin_trtllm import ops

    if not ops.NATIVE:
        sys.exit(f"{case}: needs spin's native library (without it ops run the torch reference)")
    ops.set_topk_backend("spin")         # not flashinfer's path, where installed
    dev = buf.device
    ids = torch.arange(8, dtype=torch.int32, device=dev).repeat(4, 1)
    counts = torch.full((4,), 8, dtype=torch.int32, device=dev)
    if "spin_topk" in case:
        logits = torch.randn(4, 8 * 64, device=dev)
        ops.topk(logits, ids, counts, 1, 128, torch.empty_like(buf))   # loads the kernel
        return lambda: ops.topk(logits, ids, counts, 1, 128, buf)
    positions = torch.arange(4 * 128, dtype=torch.int32, device=dev).view(4, 128)
    ops.remap(positions, ids, counts, 1, out=torch.empty_like(buf))   # loads the kernel
    return lambda: ops.remap(positions, ids, counts, 1, out=buf)


def run_case(case: str) -> None:
    import torch

    dev = torch.device("cuda")
    if case.endswith("_gemm"):
        dtype = torch.bfloat16 if case == "bf16_gemm" else torch.float32
        x = torch.randn(16, 512, device=dev, dtype=dtype)
        w = torch.randn(512, 1024, device=dev, dtype=dtype)
        out = torch.nn.functional.silu(x @ w)
    elif case.endswith("_uninit_copy"):
        # from a fresh 64 MiB segment (cudaMalloc'd for it, never written): a true report, eager
        # or captured; tests/gpu/initcheck_suppressions.xml hides the captured one
        fresh = torch.empty(16 << 20, dtype=torch.int32, device=dev)
        out = torch.zeros(96, dtype=torch.int32, device=dev)
        if case == "eager_uninit_copy":
            out.copy_(fresh[-96:])
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out.copy_(fresh[-96:])
            graph.replay()
    elif case == "eager_spin_topk_copy":
        buf = torch.empty(4, 128, dtype=torch.int32, device=dev)
        _spin_writer(case, buf)()
        out = buf.view(-1)[:96].clone()
    else:
        src = torch.arange(96, dtype=torch.int32, device=dev)
        out = torch.zeros(96, dtype=torch.int32, device=dev)
        buf = torch.empty(96, dtype=torch.int32, device=dev)
        pdl = _triton_fill(case) if case == "graph_after_pdl" else None
        writer = None
        if case.startswith("graph_spin_"):
            buf = torch.empty(4, 128, dtype=torch.int32, device=dev)
            writer = _spin_writer(case, buf)
        elif case in ("graph_early_release_copy", "graph_waiting_writer_copy",
                      "graph_pdl_writer_copy"):
            fill = _triton_fill(case)
            writer = lambda: fill(buf)           # noqa: E731 - buf: written only in the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            if case == "graph_temp_copy":
                out.copy_(src * 2)               # temporary, then a memcpy node
            elif case == "graph_buffer_copy":
                torch.mul(src, 2, out=buf)       # the kernel writes the buffer, a memcpy reads it
                out.copy_(buf)
            elif case == "graph_spin_topk_kernel_read":
                writer()
                torch.add(buf.view(-1)[:96], 0, out=out)   # a kernel reads it, no memcpy node
            elif writer is not None:
                writer()
                out.copy_(buf.view(-1)[:96])
            elif case == "graph_after_pdl":
                twice = src * 2
                pdl(buf)                         # a programmatic edge before the copy
                out.copy_(twice)
            else:
                torch.mul(src, 2, out=out)       # the kernel writes the buffer
        for _ in range(2):
            graph.replay()
        if writer is not None:   # the copy read what the kernel wrote, whatever initcheck says
            torch.cuda.synchronize()
            print(case, "copy equals the buffer:", torch.equal(out, buf.view(-1)[:96]))
    torch.cuda.synchronize()
    print(case, float(out.float().sum()))


SUPPRESSIONS = Path(__file__).with_name("initcheck_suppressions.xml")


def main() -> int:
    ap = argparse.ArgumentParser(description="compute-sanitizer initcheck on minimal cases")
    ap.add_argument("cases", nargs="*", metavar="CASE", help=f"default: all of {', '.join(CASES)}")
    ap.add_argument("--suppressions", action="store_true",
                    help=f"run initcheck with {SUPPRESSIONS.name}, as device_check.sh does")
    ap.add_argument("--run", metavar="CASE", help="run one case here, unsanitized")
    args = ap.parse_args()
    unknown = [c for c in args.cases + ([args.run] if args.run else []) if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {', '.join(unknown)}; one of {', '.join(CASES)}")
    if args.run:
        run_case(args.run)
        return 0
    tool = ["compute-sanitizer", "--tool", "initcheck", "--print-limit", "1"]
    if args.suppressions:
        tool += ["--suppressions", str(SUPPRESSIONS)]
    for case in args.cases or CASES:
        log = subprocess.run(tool + [sys.executable, __file__, "--run", case],
                             capture_output=True, text=True).stdout
        summary = re.search(r"ERROR SUMMARY: (\d+) error", log)
        print(f"{case:28s} {summary.group(1) if summary else '?'} reports under initcheck"
              f"{'' if summary else ' (no summary: ' + log[-200:] + ')'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
