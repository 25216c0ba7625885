"""Comparisons of op outputs: bit for bit (float8 included), and a whole step of a Problem on
the CPU (the reference ops) against the same Problem on the GPU (the kernels)."""

import torch

from spin_trtllm import ops


def same(a, b):
    """Bit-for-bit equality of two tensors, float8 ones included (torch.equal lacks them)."""
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def compare_step(p_cpu, p_gpu, m_cap=None, exact_select=True):
    """One run_step of each Problem: the same selections (unless exact_select is False), logits
    within FP8 tensor-core accumulation error, the GPU's top-K equal to the reference top-K of
    the same logits, and state within what each path's own logits allow."""
    ids_c, cnt_c, z_c, top_c = p_cpu.run_step(m_cap=m_cap)
    ids_g, cnt_g, z_g, top_g = p_gpu.run_step(m_cap=m_cap)
    if exact_select:
        assert torch.equal(ids_g.cpu(), ids_c) and torch.equal(cnt_g.cpu(), cnt_c)
    for l in range(p_cpu.L):
        zc, zg = z_c[l], z_g[l].cpu()
        assert torch.equal(torch.isinf(zc), torch.isinf(zg))
        fin = torch.isfinite(zc)
        err = (zg[fin].double() - zc[fin].double()).norm() / zc[fin].double().norm().clamp(min=1e-30)
        # FP8 tensor-core accumulation (as DeepGEMM's): about 1.4e-4 of the row norm measured
        assert err < 5e-4, err
        # top-K of the GPU kernel equals the reference top-K on the same logits
        assert torch.equal(ops.topk(z_g[l].cpu(), ids_c[:, l], cnt_c[:, l], p_cpu.R,
                                    p_cpu.cfg.index_topk), top_g[l].cpu())
    for a, b in zip(p_cpu.state.tensors(), p_gpu.state.tensors()):
        b = b.cpu()
        if a.dtype.is_floating_point:
            # each path feeds its own logits (equal to ~1e-4 of the row norm, FP8 tensor cores);
            # fp8 state may round them to neighbouring values (e4m3: 2^-3 apart relative)
            tol = 2e-3 if a.element_size() > 1 else 0.13
            assert torch.allclose(b.float(), a.float(), rtol=tol, atol=tol)
        else:
            assert torch.equal(a, b)
