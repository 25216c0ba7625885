"""What compute-sanitizer initcheck reports in code with no uninitialized read, in a few lines
of torch each: the bf16 GEMM's reports, which tests/gpu/device_check.sh's initcheck step keeps
clear of, and memcpy-node cases around what it reports in the stand-in's engine loop (the
graph_spin_* cases need spin's native library):

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
                   scheduler). A later trace of one (V4 rows, next_n 1) named the copy: the
                   stand-in's kv_lens_cuda_2d refresh, whose source is kv_lens // 4, a
                   temporary a kernel of the same graph wrote just before it.
  graph_buffer_copy  the same with a buffer allocated before the capture and never written
                   outside the graph (the top-K buffer's case in the engine loop).
  graph_after_pdl  graph_temp_copy with a Triton kernel launched as a programmatic dependent
                   launch (launch_pdl) between the kernel and the copy, as spin's top-K and
                   update are in the engine loop (needs Triton 3.6 or later).
                   These two were first run from a scratch copy (2026-12-06, an H100: 0
                   reports each, as was the same with spin's PDL-launched top-K in between), so
                   neither explains the engine loop's reports either.
  graph_spin_topk_copy  spin's top-K writes a buffer in the graph (never written outside it),
                   then a memcpy node copies it. From a scratch copy of these steps
                   (2026-12-06, an H100; this script's version not yet run): 12 reports, one a
                   32-byte sector of the 384-byte copy, at the first replay. The same with
                   topk.cu edited to launch without the programmatic attribute
                   (allow_beside_previous off), and to launch with <<<>>> instead of
                   cudaLaunchKernelEx. A report of the engine loop's form; whether it is the
                   engine loop's cause is open (the one traced there copied a torch temporary).
  graph_spin_remap_copy  the control: spin's remap kernel writes the buffer instead (0 reports
                   from the scratch copy; the top-K run eagerly, then the copy: 0). Of spin's
                   kernels, select, top-K and update let their dependents start early
                   (griddepcontrol.launch_dependents); remap does not.
  graph_early_release_copy  a Triton kernel that lets its dependents start
                   (griddepcontrol.launch_dependents, as spin's top-K, select and update do
                   before they write) and then writes the buffer; the copy follows. The open
                   question: whether initcheck checks a memcpy node when the kernel before it
                   lets its dependents start, before that kernel's writes (not yet run).

    python3 tests/gpu/initcheck_repro.py            each case in its own process under
                                                    initcheck, with its count of reports
    python3 tests/gpu/initcheck_repro.py CASE       one case, unsanitized
"""
import re
import subprocess
import sys

CASES = ("bf16_gemm", "fp32_gemm", "graph_temp_copy", "graph_in_place", "graph_buffer_copy",
         "graph_after_pdl", "graph_spin_topk_copy", "graph_spin_remap_copy",
         "graph_early_release_copy", "graph_waiting_writer_copy", "graph_pdl_writer_copy",
         "graph_spin_topk_kernel_read")


def _triton_fill(case: str):
    """fill(dst): one Triton kernel writing 0, 1, 2, ... into dst. graph_after_pdl: it waits
    for its predecessor (griddepcontrol.wait) and is launched as a programmatic dependent
    launch; graph_early_release_copy: it lets its dependents start at once
    (griddepcontrol.launch_dependents), then writes. Compiled here, outside any capture; exits
    with a message below Triton 3.6 (older ones may drop the grid-dependency calls: pure inline
    asm whose result is unused)."""
    import torch
    try:
        import triton
        import triton.language as tl
        tl.extra.cuda.gdc_wait, tl.extra.cuda.gdc_launch_dependents   # noqa: B018
    except (ImportError, AttributeError):
        sys.exit(f"{case}: needs Triton 3.6 or later")
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 6):
        sys.exit(f"{case}: needs Triton 3.6 or later, found {triton.__version__}")

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
    if case.startswith("graph_spin_topk"):
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
        print(f"{case:24s} {summary.group(1) if summary else '?'} reports under initcheck"
              f"{'' if summary else ' (no summary: ' + log[-200:] + ')'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
