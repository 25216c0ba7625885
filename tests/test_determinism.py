"""Bit-identical results across runs, CUDA streams and processes (as two TP ranks get them):
the same batch through select -> indexer logits -> top-K -> update (one case with many equal
scores, so ties decide the selections and the top-K), and dsa-lite over 64 decode steps with
exploration on. CPU: the reference ops; CUDA (marked gpu): the kernels and CUDA graphs.

The second process runs this file as a script (`python tests/test_determinism.py DEVICE OUT
PART`), which saves one part's outputs (an op case's, or "engine") with torch.save."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spin_trtllm import SpinConfig, ops
from spin_trtllm.harness import Engine, Request, tiny
from spin_trtllm.testing.harness import ARRIVAL_TEXT, TEXT, spin_cfg
from spin_trtllm.testing.pages import pack_pages, random_fp8_keys
from spin_trtllm.testing.problems import Problem, integer_state

# GPU tests must run the kernels (SPIN_REQUIRE_NATIVE=1), and spin's own top-K: flashinfer's
# path (where installed) is called without its deterministic mode
pytestmark = pytest.mark.usefixtures("require_native", "spins_own_topk")

# the engine on CUDA is large: its kernels run under the sanitizers in the op cases above
ENGINE_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.large])]
REPO = Path(__file__).resolve().parent.parent
# Both processes compute on one CPU thread: on a small machine shared with other work, OpenMP's
# waiting threads cost more than a second thread gains on tensors this small
THREADS = 1


@pytest.fixture(autouse=True, scope="module")
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield
    torch.set_num_threads(before)


# ---- one batch through the ops --------------------------------------------------------------
INDEX_TOPK = 128
OP_STEPS = 2             # the second select reads the state the first update wrote
# The update has a one-row and an MTP path, select a 32-bit (fp32 state) and a 16-bit key path
# (fp16/fp8 state); the 17,000-slot request puts the top-K on a thread-block cluster per row on
# sm_90 (candidates gathered from several CTAs).
OP_CASES = {
    "mixed_r1": dict(R=1, lens=(700, 64, 1500, 33), ties=False,
                     cfg=dict(exploration=0.2, exploration_policy="random")),
    "mixed_r2_fp16": dict(R=2, lens=(700, 64, 1500, 33), ties=False,
                          cfg=dict(exploration=0.2, exploration_policy="age",
                                   state_dtype="float16")),
    "tied_r1": dict(R=1, lens=(17000, 700, 64, 1500), ties=True,
                    cfg=dict(exploration=0.2, exploration_policy="staleness")),
    "tied_r2_fp8": dict(R=2, lens=(17000, 700, 64, 1500), ties=True,
                        cfg=dict(exploration=0.1, exploration_policy="random",
                                 state_dtype="float8_e4m3fn")),
}


def tied_cache(num_pages: int, gen: torch.Generator) -> torch.Tensor:
    """K-cache pages whose slots each hold one of three keys (one all zero, so its logits are
    exactly 0) at one scale: a row's logits take at most three values."""
    rows, _ = random_fp8_keys(1, gen)
    pool = rows[0, :3].view(torch.uint8).clone()       # fp8 has no indexing kernels on the CPU
    pool[0] = 0
    pick = torch.randint(0, 3, (num_pages, 64), generator=gen)
    return pack_pages(pool[pick].view(torch.float8_e4m3fn), torch.full((num_pages, 64), 0.01))


def host(x: torch.Tensor) -> torch.Tensor:
    """A CPU copy (on the CPU .cpu() would alias a buffer the next step overwrites)."""
    return x.to("cpu", copy=True)


def op_problem(case: str, device: str) -> Problem:
    spec = OP_CASES[case]
    cfg = SpinConfig(index_topk=INDEX_TOPK, target_sparsity=0.5, **spec["cfg"])
    p = Problem(B=4, R=spec["R"], L=2, lens=spec["lens"], seed=11, cfg=cfg,
                warm=(False, True, False, False))
    if spec["ties"]:
        gen = torch.Generator().manual_seed(12)
        p.cache = [tied_cache(p.num_pages, gen) for _ in range(p.L)]
        integer_state(p)               # few V/D values: block scores and priorities tie too
    return p.to(device)


def op_outputs(case: str, device: str, stream=None) -> dict[str, torch.Tensor]:
    """OP_STEPS decode steps of the case's batch through the public ops (on `stream` when
    given): selections, logits, top-K slot ids and the state after, as CPU tensors."""
    p = op_problem(case, device)
    out = {}
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for t in range(OP_STEPS):
            ids, cnt, logits, tops = p.run_step()
            out[f"{t}/block_ids"], out[f"{t}/counts"] = host(ids), host(cnt)
            for l in range(p.L):
                out[f"{t}/logits{l}"], out[f"{t}/topk{l}"] = host(logits[l]), host(tops[l])
            p.step += 1
        for name, x in zip(("V", "D", "last_seen", "decode_steps"), p.state.tensors()):
            out[name] = host(x)
    if stream is not None:
        stream.synchronize()
    return out


# ---- dsa-lite ---------------------------------------------------------------------------------
ENGINE_STEPS = 64


def engine_outputs(device: str, stream=None) -> dict[str, torch.Tensor]:
    """Two greedy requests decoded together for ENGINE_STEPS steps with exploration on: their
    tokens, each step's selected blocks and top-K slot ids, and the SPIN state after."""
    # DSA layers (ratio 1): 700 and 450 prompt tokens are 11 and 8 blocks, of which SPIN keeps
    # m = 6 and 4, one of them explored (floor(0.25 m))
    cfg = tiny().with_overrides(compress_ratios=(0, 1, 128, 1),
                                **({"dtype": "float32"} if device == "cuda" else {}))
    e = Engine(cfg, spin_cfg(exploration=0.25), device=device, max_batch=2, switch="spin")
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    out, finished = {}, []
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        e.submit(Request(TEXT[:700], max_new_tokens=ENGINE_STEPS + 1, request_id=3))
        e.submit(Request(ARRIVAL_TEXT[:450], max_new_tokens=ENGINE_STEPS + 1, request_id=11))
        ix = e.spin_indexer
        while len(e.history) < ENGINE_STEPS:
            before = len(e.history)
            finished += e.step()
            if len(e.history) == before:
                continue                                   # the step that admitted them
            t, B = before, e.history[-1].batch
            out[f"{t}/block_ids"] = host(ix.block_ids[:B])
            out[f"{t}/counts"] = host(ix.counts[:B])
            out[f"{t}/topk"] = host(ix.topk[:, :B * cfg.next_n])
            stats = e.history[-1]
            out[f"{t}/selected_of_visible"] = torch.tensor([stats.selected_blocks,
                                                            stats.visible_blocks])
        for name, x in zip(("V", "D", "last_seen", "decode_steps"), e.pool.state.tensors()):
            out[name] = host(x)
    if stream is not None:
        stream.synchronize()
    assert sorted(o.request_id for o in finished) == [3, 11], "both finish at the last step"
    for o in finished:
        assert len(o.tokens) == ENGINE_STEPS + 1
        out[f"tokens{o.request_id}"] = torch.tensor(o.tokens)
    return out


def part_outputs(device: str, part: str) -> dict[str, torch.Tensor]:
    """What the second process computes: one op case, or "engine" (the dsa-lite run)."""
    if part == "engine":
        return engine_outputs(device)
    if part not in OP_CASES:
        raise ValueError(f"unknown part {part!r}: expected 'engine' or one of {list(OP_CASES)}")
    return op_outputs(part, device)


# ---- comparison and the second process ------------------------------------------------------
_SAME_SIZE_INT = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def bits(x: torch.Tensor) -> torch.Tensor:
    """Floats as their bit patterns: NaN equals NaN of the same bits, -0.0 differs from 0.0."""
    return x.view(_SAME_SIZE_INT[x.element_size()]) if x.is_floating_point() else x


def assert_bit_identical(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    differ = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
              or not torch.equal(bits(a[k]), bits(b[k]))]
    assert not differ, f"{what}: not bit-identical: {differ}"


@pytest.fixture
def second_process(tmp_path):
    """(device, part) -> part_outputs(device, part) computed in another Python process. One
    part a process: under a sanitizer the tests are shared out over many processes, and each
    would otherwise pay for every case (the large ones too) and the engine run."""
    def get(device: str, part: str) -> dict:
        path = tmp_path / f"{device}-{part}.pt"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
        r = subprocess.run([sys.executable, __file__, device, str(path), part], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"second process failed:\n{r.stderr[-4000:]}"
        return torch.load(path)

    return get


def other_stream(device: str):
    return torch.cuda.Stream() if device == "cuda" else None


# ---- tests ------------------------------------------------------------------------------------
# the tied cases on CUDA are large: under racecheck each ran 7-9 minutes; their cluster top-K
# runs under the sanitizers in tests/test_ops_topk.py
OP_PARAMS = [pytest.param(case, device, marks=[pytest.mark.gpu, pytest.mark.large]
                          if device == "cuda" and OP_CASES[case]["ties"] else
                          [pytest.mark.gpu] if device == "cuda" else [],
                          id=f"{case}-{device}")
             for case in OP_CASES for device in ("cpu", "cuda")]


@pytest.mark.parametrize("case,device", OP_PARAMS)
@pytest.mark.slow
def test_op_step_is_bit_identical_across_runs_streams_and_processes(case, device,
                                                                    second_process):
    first = op_outputs(case, device)
    again = op_outputs(case, device, stream=other_stream(device))
    assert_bit_identical(first, again, f"{case}: second run in this process")
    assert_bit_identical(first, second_process(device, case),
                         f"{case}: run in another process")
    if OP_CASES[case]["ties"]:
        # the inputs do what the case is for: every row with more than K finite logits has the
        # K-th value tied past the K-th place
        for key in (k for k in first if "/logits" in k):
            for row in first[key]:
                fin = row[torch.isfinite(row)]
                if fin.numel() > INDEX_TOPK:
                    assert fin.unique().numel() <= 3
                    kth = fin.sort(descending=True).values[INDEX_TOPK - 1]
                    assert int((fin >= kth).sum()) > INDEX_TOPK, key


@pytest.mark.parametrize("device", ENGINE_DEVICES)
@pytest.mark.slow
def test_dsa_lite_64_steps_with_exploration_are_bit_identical(device, second_process):
    first = engine_outputs(device)
    again = engine_outputs(device, stream=other_stream(device))
    assert_bit_identical(first, again, "dsa-lite: second run in this process")
    assert_bit_identical(first, second_process(device, "engine"), "dsa-lite: another process")
    # SPIN pruned after warm-up: about half the visible blocks selected
    selected, visible = torch.stack([first[f"{t}/selected_of_visible"]
                                     for t in range(1, ENGINE_STEPS)]).sum(0).tolist()
    assert 0.3 < 1 - selected / visible < 0.6


if __name__ == "__main__":
    device, path, part = sys.argv[1:]
    torch.set_num_threads(THREADS)
    ops.set_topk_backend("spin")           # as the spins_own_topk fixture in the test process
    if device == "cuda" and os.environ.get("SPIN_REQUIRE_NATIVE") == "1":
        assert ops.NATIVE, "the native library did not load"
    torch.save(part_outputs(device, part), path)
