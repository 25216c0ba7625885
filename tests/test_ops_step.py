"""A whole decode step (select -> per layer indexer_logits, topk, update) of the kernels against
the reference (GPU: marked gpu): MTP rows, state dtypes and vector paths, 256K contexts, and a
CUDA-graph replay equal to eager steps."""

import pytest
import torch

from spin_trtllm import SpinConfig
from spin_trtllm.testing.compare import compare_step
from spin_trtllm.testing.problems import Problem, problem_pair

# GPU tests must run the kernels (SPIN_REQUIRE_NATIVE=1), and spin's own top-K (bit for bit)
pytestmark = pytest.mark.usefixtures("require_native", "spins_own_topk")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", [0, 1, 2])
# the logits kernel takes rows in tensor-core groups of 1, 2 or 4: R 3, 5 and 8 pad or split them
@pytest.mark.parametrize("R", [1, 2, 3, 4, 5, 8])
def test_gpu_step_matches_reference(seed, R):
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5, exploration=0.0)
    p_cpu, p_gpu = problem_pair(B=4, R=R, L=3, lens=(700, 64, 1500, 33), seed=seed, cfg=cfg,
                                warm=(False, True, False, False))
    compare_step(p_cpu, p_gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("state_dtype", ["float32", "float16", "float8_e4m3fn"])
@pytest.mark.parametrize("R", [1, 2])
@pytest.mark.parametrize("cap", [4096, 4100, 4104])
def test_gpu_step_vector_state_path_matches_reference(state_dtype, R, cap):
    """Max pooling reads V/D in vectors: 4 entries (fp32; fp16 when cap % 8 == 4, as with cap
    4100), 8 (fp16 when cap % 8 == 0; fp8 when cap % 16 == 8, as with 4104) or 16 (fp8 when
    cap % 16 == 0); fp8 with cap 4100 reads entry by entry. A block's D window starts at
    q - 64j - 63, so contexts of 3993-4008 put it at every alignment mod 16; 1, 63 and 65 slots
    leave no or one interior block."""
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5, exploration=0.1,
                     state_dtype=state_dtype)
    lens = (4001, 1, 63, 65, 4002, 4003, 2052, 3997, 3998, 3999, 4000, 3993, 3994, 3995, 3996,
            4005, 4006, 4007, 4008)
    p_cpu, p_gpu = problem_pair(B=len(lens), R=R, L=2, lens=lens, cap=cap, seed=7 + R, cfg=cfg)
    compare_step(p_cpu, p_gpu)


@pytest.mark.gpu
def test_gpu_row0_mtp_mask_fp16_state_and_k2048():
    cfg = SpinConfig(index_topk=2048, target_sparsity=0.3, mtp_mask="row0", mtp_update="row0",
                     state_dtype="float16")
    p_cpu, p_gpu = problem_pair(B=2, R=3, L=1, lens=(9000, 2100), seed=3, cfg=cfg)
    compare_step(p_cpu, p_gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("long", [pytest.param(262144, marks=pytest.mark.large), 120000])
def test_gpu_long_context_and_tiny(long):
    cfg = SpinConfig(index_topk=512, target_sparsity=0.5)
    p_cpu, p_gpu = problem_pair(B=2, R=1, L=1, lens=(long, 1), seed=4, cfg=cfg)
    compare_step(p_cpu, p_gpu)


@pytest.mark.gpu
@pytest.mark.parametrize("long", [pytest.param(262143, marks=pytest.mark.large), 119999])
def test_gpu_long_context_mtp(long):
    cfg = SpinConfig(index_topk=2048, target_sparsity=0.4)
    p_cpu, p_gpu = problem_pair(B=1, R=2, L=1, lens=(long,), seed=23, cfg=cfg)
    compare_step(p_cpu, p_gpu)


@pytest.mark.gpu
def test_gpu_cuda_graph_step_matches_eager():
    cfg = SpinConfig(index_topk=128, target_sparsity=0.5, exploration=0.1)
    p = Problem(B=3, R=2, L=2, lens=(900, 400, 1200), seed=7, cfg=cfg, device="cuda")
    q = Problem(B=3, R=2, L=2, lens=(900, 400, 1200), seed=7, cfg=cfg, device="cuda")
    ids = torch.empty(3, 2, p.m_cap, dtype=torch.int32, device="cuda")
    cnt = torch.empty(3, 2, dtype=torch.int32, device="cuda")
    zs = [torch.empty(6, p.m_cap * 64, device="cuda") for _ in range(2)]
    tops = [torch.empty(6, 128, dtype=torch.int32, device="cuda") for _ in range(2)]

    def step():
        torch.ops.spin.select(*p.state.tensors(), p.slot, p.n, p.q, p.request, p.step, ids, cnt,
                              0.5, 0.1, 0, 128, 1, True, True, 0, True, 0, p.max_ctx)
        for l in range(2):
            torch.ops.spin.indexer_logits(p.qfp8, p.cache[l], p.weights, p.n, p.table,
                                          ids[:, l], cnt[:, l], zs[l])
            torch.ops.spin.topk(zs[l], ids[:, l], cnt[:, l], 2, tops[l])
            torch.ops.spin.update(*p.state.tensors(), p.slot, zs[l], ids[:, l], cnt[:, l], p.n,
                                  p.q, p.accepted, p.step, l, 0.5, False, p.max_ctx)

    saved = p.clone_state()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()                                   # warm-up outside the graph
    torch.cuda.current_stream().wait_stream(s)
    for a, b in zip(p.state.tensors(), saved.tensors()):
        a.copy_(b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for t in range(3):                           # replay with new inputs in the same buffers
        new_n = torch.tensor([[900 + 2 * t + r for r in range(2)], [400 + t, 401 + t],
                              [1200 - t, 1201 - t]], dtype=torch.int32, device="cuda")
        for prob in (p, q):
            prob.n.copy_(new_n)
            prob.q.copy_(new_n - 1)
            prob.step.fill_(60 + t)
        graph.replay()
        ids_e, cnt_e, z_e, top_e = q.run_step()
        torch.cuda.synchronize()
        assert torch.equal(ids, ids_e) and torch.equal(cnt, cnt_e)
        for l in range(2):
            assert torch.equal(zs[l], z_e[l]) and torch.equal(tops[l], top_e[l])
        for a, b in zip(p.state.tensors(), q.state.tensors()):
            assert torch.equal(a, b)
