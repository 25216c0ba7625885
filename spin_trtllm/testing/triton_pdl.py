"""Triton with its grid-dependency calls (griddepcontrol.wait / .launch_dependents), for the
tests and scripts whose producer or consumer kernels launch as programmatic dependents."""

from __future__ import annotations

MIN_VERSION = (3, 6)   # older Triton may drop the calls: pure inline asm whose result is unused


def triton_with_pdl():
    """(triton, triton.language), or a string saying why not: Triton missing, without
    tl.extra.cuda.gdc_wait/gdc_launch_dependents, or older than MIN_VERSION."""
    try:
        import triton
        import triton.language as tl
        tl.extra.cuda.gdc_wait, tl.extra.cuda.gdc_launch_dependents   # noqa: B018
    except (ImportError, AttributeError):
        return "needs Triton 3.6 or later (tl.extra.cuda.gdc_wait, gdc_launch_dependents)"
    if tuple(int(v) for v in triton.__version__.split(".")[:2]) < MIN_VERSION:
        return f"needs Triton 3.6 or later, found {triton.__version__}"
    return triton, tl
