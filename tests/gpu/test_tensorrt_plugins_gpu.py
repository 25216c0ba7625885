"""The TensorRT plugins on the GPU against the torch ops (marked gpu): plugin_harness runs
SpinSelect -> SpinIndexerLogits -> SpinTopK -> SpinUpdate through their creators (serialized,
re-created, attached) on device buffers, the same inputs go through torch.ops.spin.*, and every
output and the state written in place must be identical (same kernels, same arguments: any
argument the plugins map differently from the torch binding shows). Skipped without CUDA, without
a built plugin library (plugins/tensorrt/build.sh, or $SPIN_TRT_PLUGIN_DIR) or without the
native torch library (the torch ops would run the reference; SPIN_REQUIRE_NATIVE=1 fails instead).
$SPIN_TRT_CASE_DIR keeps the cases (tests/gpu/plugin_check.sh reruns one under compute-sanitizer).
"""

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
import torch

from spin_trtllm import SpinConfig
from spin_trtllm import ops
from spin_trtllm.integrations.tensorrt import fields as F
from spin_trtllm.integrations.tensorrt.harness import HarnessCase, find_build
from spin_trtllm.testing.pages import make_cache

BUILD = find_build()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(BUILD is None, reason="no built plugin library and harness (run "
                       "plugins/tensorrt/build.sh, or set SPIN_TRT_PLUGIN_DIR)"),
]


@pytest.fixture(autouse=True)
def _native_ops():
    if os.environ.get("SPIN_REQUIRE_NATIVE") == "1":
        assert ops.NATIVE, "the native torch library did not load"
    elif not ops.NATIVE:
        pytest.skip("the torch ops run the reference here (libspin_native not built): the exact "
                    "comparison needs the native library")


@dataclass
class Scenario:
    B: int = 3
    R: int = 1
    L: int = 2
    lens: tuple = (700, 64, 1500)
    cfg: SpinConfig = field(default_factory=lambda: SpinConfig(index_topk=128, target_sparsity=0.5,
                                                               exploration=0.1))
    warm: tuple = (False,)
    slots: Optional[tuple] = None
    m_cap: Optional[int] = None
    steps: int = 2
    q_view: torch.dtype = torch.float8_e4m3fn     # how q reaches the plugin: fp8, or int8 bytes
    kv_view: torch.dtype = torch.int8             # and the cache: int8 or fp8 bytes
    layered: bool = True                          # False: 2-D [B, m_cap] block lists per layer


SCENARIOS = {
    "base": Scenario(),
    "mtp2_union": Scenario(B=4, R=2, L=3, lens=(700, 64, 1500, 33), warm=(False, True, False, False)),
    "row0_fp16_mean_staleness": Scenario(
        B=2, R=4, L=2, lens=(900, 257),
        cfg=SpinConfig(index_topk=256, target_sparsity=0.6, exploration=0.2, pooling="mean",
                       exploration_policy="staleness", mtp_mask="row0", mtp_update="row0",
                       state_dtype="float16", ema_decay=0.9),
        q_view=torch.int8, kv_view=torch.float8_e4m3fn),
    "one_block_k_over_context": Scenario(B=1, R=1, L=1, lens=(40,), steps=3),
    "rows8_age_top4_no_forced": Scenario(
        B=2, R=8, L=1, lens=(300, 1000),
        cfg=SpinConfig(index_topk=64, target_sparsity=0.7, exploration=0.3, pooling="top4",
                       exploration_policy="age", keep_sink=False, keep_newest=False,
                       warmup_steps=2, seed=12345)),
    "bad_slot_and_overflow": Scenario(B=3, R=1, L=2, lens=(2000, 500, 90), slots=(0, 99, 2),
                                      m_cap=4, warm=(True, False, False)),
    "two_d_block_lists": Scenario(B=3, R=2, L=2, lens=(800, 150, 1300), layered=False),
}


class Problem:
    def __init__(self, sc: Scenario, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.sc, B, R, L = sc, sc.B, sc.R, sc.L
        lens = [sc.lens[i % len(sc.lens)] for i in range(B)]
        self.max_ctx = max(lens) + R * sc.steps
        self.cap = self.max_ctx + 64
        self.m_cap = sc.m_cap or F.default_m_cap(self.max_ctx)
        S = B + 2
        dt = getattr(torch, sc.cfg.state_dtype)
        nb = math.ceil(self.cap / 64)
        self.state = [torch.randn(S, L, self.cap, generator=gen).to(dt),
                      torch.randn(S, L, self.cap, generator=gen).to(dt),
                      torch.randint(0, 50, (S, L, nb), generator=gen),
                      torch.tensor([[0 if sc.warm[i % len(sc.warm)] else 9] * L for i in range(S)])]
        self.slot = (torch.randperm(S, generator=gen)[:B] if sc.slots is None
                     else torch.tensor(sc.slots)).to(torch.int32)
        self.request = torch.randint(0, 1000, (B,), generator=gen)
        pages = math.ceil(self.cap / 64)
        num_pages = B * pages + 3
        self.table = torch.randperm(num_pages, generator=gen)[:B * pages].view(B, pages).to(torch.int32)
        self.cache = [make_cache(num_pages, gen) for _ in range(L)]
        self.steps = []
        for t in range(sc.steps):
            n = torch.tensor([[l + t * R + r for r in range(R)] for l in lens], dtype=torch.int32)
            self.steps.append(dict(
                n=n, q=(n - 1).contiguous(), step=torch.full((B,), 60 + t, dtype=torch.int64),
                qfp8=torch.randn(B * R, 64, 128, generator=gen).to(torch.float8_e4m3fn),
                w=torch.randn(B * R, 64, generator=gen) * 0.1,
                acc=torch.randint(-1, R, (B,), generator=gen, dtype=torch.int32)))

    def reference(self, dev="cuda"):
        """torch.ops.spin: per step select, then per layer logits, top-K, update."""
        sc, cfg = self.sc, self.sc.cfg
        st = ops.OpState(*(t.to(dev).clone() for t in self.state))
        slot, request, table = self.slot.to(dev), self.request.to(dev), self.table.to(dev)
        cache = [c.to(dev) for c in self.cache]
        out = {}
        for t, s in enumerate(self.steps):
            s = {k: v.to(dev) for k, v in s.items()}
            ids, cnt = ops.select(st, slot, s["n"], s["q"], request, s["step"], cfg, self.m_cap,
                                  self.max_ctx)
            out[f"ids{t}"], out[f"cnt{t}"] = ids.clone(), cnt.clone()
            for l in range(sc.L):
                z = ops.indexer_logits(s["qfp8"], cache[l], s["w"], s["n"], table, ids[:, l], cnt[:, l])
                out[f"z{t}_{l}"] = z
                out[f"top{t}_{l}"] = ops.topk(z, ids[:, l], cnt[:, l], sc.R, cfg.index_topk)
                ops.update(st, slot, z, ids[:, l], cnt[:, l], s["n"], s["q"], s["acc"], s["step"], l,
                           cfg, self.max_ctx)
        for name, tensor in zip(("V", "D", "last_seen", "decode_steps"), st.tensors()):
            out[name] = tensor
        return {k: v.cpu() for k, v in out.items()}

    def case(self, directory, ref):
        """The same step as plugin calls; ref supplies the 2-D block lists when not layered."""
        sc, cfg, R, L = self.sc, self.sc.cfg, self.sc.R, self.sc.L
        c = HarnessCase(directory)
        for name, t in zip(("V", "D", "last_seen", "decode_steps"), self.state):
            c.tensor(name, t)
        c.tensor("slot", self.slot)
        c.tensor("request", self.request)
        c.tensor("table", self.table)
        for l in range(L):
            c.tensor(f"kv{l}", self.cache[l], as_dtype=sc.kv_view)
        state_in = ["V", "D", "last_seen", "decode_steps", "slot"]
        for t, s in enumerate(self.steps):
            c.tensor(f"ctx{t}", s["n"])
            c.tensor(f"qpos{t}", s["q"])
            c.tensor(f"step{t}", s["step"])
            c.tensor(f"q{t}", s["qfp8"], as_dtype=sc.q_view)
            c.tensor(f"w{t}", s["w"])
            c.tensor(f"acc{t}", s["acc"])
            accepted = f"acc{t}" if R > 1 and cfg.mtp_update == "prefix_valid" else "slot"  # as the pass
            if sc.layered:
                c.plugin("SpinSelect", f"select{t}",
                         F.select_fields(cfg, max_context=self.max_ctx, m_cap=self.m_cap),
                         state_in + [f"ctx{t}", f"qpos{t}", "request", f"step{t}"], [f"ids{t}", f"cnt{t}"])
                c.save(f"ids{t}", torch.int32, ref[f"ids{t}"].shape)
                c.save(f"cnt{t}", torch.int32, ref[f"cnt{t}"].shape)
            done = []
            for l in range(L):
                if sc.layered:
                    ids, cnt = f"ids{t}", f"cnt{t}"
                else:
                    ids = c.tensor(f"ids{t}_{l}", ref[f"ids{t}"][:, l])
                    cnt = c.tensor(f"cnt{t}_{l}", ref[f"cnt{t}"][:, l])
                c.plugin("SpinIndexerLogits", f"logits{t}_{l}", F.logits_fields(layer=l),
                         [f"q{t}", f"kv{l}", f"w{t}", f"ctx{t}", "table", ids, cnt], [f"z{t}_{l}"])
                c.plugin("SpinTopK", f"topk{t}_{l}", F.topk_fields(cfg, layer=l),
                         [f"z{t}_{l}", ids, cnt], [f"top{t}_{l}"])
                c.plugin("SpinUpdate", f"update{t}_{l}",
                         F.update_fields(cfg, layer=l, max_context=self.max_ctx, next_n=R),
                         state_in + [f"z{t}_{l}", ids, cnt, f"ctx{t}", f"qpos{t}", accepted, f"step{t}"]
                         + done, [f"done{t}_{l}"])
                done = [f"done{t}_{l}"]
                for name in (f"z{t}_{l}", f"top{t}_{l}"):
                    c.save(name, ref[name].dtype, ref[name].shape)
                c.save(f"done{t}_{l}", torch.int32, (1,))
        for name in ("V", "D", "last_seen", "decode_steps"):
            c.save(name, ref[name].dtype, ref[name].shape)
        return c


def _case_dir(tmp_path, name):
    root = os.environ.get("SPIN_TRT_CASE_DIR")
    return Path(root) / name if root else tmp_path / name


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_plugins_match_torch_ops(name, seed, tmp_path):
    lib, harness = BUILD
    p = Problem(SCENARIOS[name], seed)
    ref = p.reference()
    case = p.case(_case_dir(tmp_path, f"{name}_{seed}"), ref)
    res = case.run(harness, lib)
    if res.returncode == 3:
        pytest.skip("plugin_harness sees no CUDA device")
    assert res.returncode == 0, res.stdout + res.stderr
    compared = 0
    for key in case.saved:
        got = case.load(key)
        if key.startswith("done"):
            assert got.tolist() == [0], f"{key}: the update token must be written 0"
            continue
        want = ref[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got, want), f"{name}: {key} differs from torch.ops.spin " \
                                       f"({(got != want).sum().item()} of {want.numel()} entries)"
        compared += 1
    assert compared >= 4 + p.sc.steps * p.sc.L * 2


def test_scenarios_cover_the_edges():
    """The cases above mean what their names say (guards against a generator drifting)."""
    ref = Problem(SCENARIOS["one_block_k_over_context"], 0).reference()
    assert ref["cnt0"].tolist() == [[1]] and (ref["top0_0"] >= 0).sum().item() == 40 < 128
    ref = Problem(SCENARIOS["bad_slot_and_overflow"], 0).reference()
    assert ref["cnt0"][1].tolist() == [0, 0]                     # slot 99 is outside the state
    assert ref["cnt0"][0, 0].item() > 4 and (ref["ids0"][0, 0] >= 0).all()   # union > m_cap
