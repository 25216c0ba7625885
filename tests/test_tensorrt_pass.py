"""The SPIN TensorRT network pass on a fake network (no TensorRT needed): marks, rewiring,
errors, idempotence; load_plugins and the TensorRT backend against a stand-in tensorrt module."""

import sys
import types

import numpy as np
import pytest

from spin_trtllm import SpinConfig, SpinError
from spin_trtllm.integrations import tensorrt as spin_trt
from spin_trtllm.integrations.tensorrt import fields as F
from spin_trtllm.integrations.tensorrt import plugins as P

PLUGIN_OUT = {"SpinSelect": ["int32", "int32"], "SpinIndexerLogits": ["float32"],
              "SpinTopK": ["int32"], "SpinUpdate": ["int32"]}


# ---- a fake of the INetworkDefinition surface the pass uses -------------------------------------
class FakeTensor:
    def __init__(self, name, dtype, shape=()):
        self.name, self.dtype, self.shape = name, dtype, tuple(shape)

    def __repr__(self):
        return f"FakeTensor({self.name})"


class FakeLayer:
    def __init__(self, name, type_, inputs, outputs):
        self.name, self.type = name, type_
        self._inputs, self._outputs = list(inputs), list(outputs)
        self.plugin = None

    @property
    def num_inputs(self):
        return len(self._inputs)

    @property
    def num_outputs(self):
        return len(self._outputs)

    def get_input(self, i):
        return self._inputs[i]

    def get_output(self, i):
        return self._outputs[i]

    def set_input(self, i, tensor):
        assert isinstance(tensor, FakeTensor)
        self._inputs[i] = tensor


class FakeNetwork:
    def __init__(self):
        self._inputs, self._layers, self._outputs = [], [], []

    num_inputs = property(lambda self: len(self._inputs))
    num_layers = property(lambda self: len(self._layers))
    num_outputs = property(lambda self: len(self._outputs))

    def get_input(self, i):
        return self._inputs[i]

    def get_layer(self, i):
        return self._layers[i]

    def get_output(self, i):
        return self._outputs[i]

    def _known(self, t):
        return t in self._inputs or any(t in l._outputs for l in self._layers)

    def add_input(self, name, dtype, shape):
        assert all(t.name != name for t in self._inputs), f"input {name} added twice"
        t = FakeTensor(name, dtype, shape)
        self._inputs.append(t)
        return t

    def add_layer(self, name, type_, inputs, outputs):
        assert all(self._known(t) for t in inputs)
        layer = FakeLayer(name, type_, inputs, [FakeTensor(*o) for o in outputs])
        self._layers.append(layer)
        return layer

    def add_plugin_v3(self, inputs, shape_inputs, plugin):
        assert shape_inputs == [] and all(self._known(t) for t in inputs), inputs
        n = len(self._layers)
        outs = [FakeTensor(f"(Unnamed Layer* {n}) [PluginV3]_output_{k}", d)
                for k, d in enumerate(PLUGIN_OUT[plugin.plugin])]
        layer = FakeLayer(f"(Unnamed Layer* {n}) [PluginV3]", "PLUGIN_V3", inputs, outs)
        layer.plugin = plugin
        self._layers.append(layer)
        return layer

    def mark_output(self, t):
        assert self._known(t)
        self._outputs.append(t)

    def unmark_output(self, t):
        self._outputs.remove(t)

    # for assertions
    def layer(self, name):
        (hit,) = [l for l in self._layers if l.name == name]
        return hit

    def snapshot(self):
        return ([t.name for t in self._inputs], [t.name for t in self._outputs],
                [(l.name, [t.name for t in l._inputs], [t.name for t in l._outputs]) for l in self._layers])


class FakePlugin:
    def __init__(self, plugin, layer_name, fields):
        self.plugin, self.layer_name, self.fields = plugin, layer_name, dict(fields)


class FakeBackend:
    def __init__(self):
        self.made = []

    def dtype(self, name):
        # the real backend's table: a name TensorRT lacks raises there, so here too
        if name not in P.TensorRTBackend._DTYPES:
            raise KeyError(f"TensorRT has no dtype {name!r}")
        return name

    def dtype_name(self, dtype):
        return dtype

    def make_plugin(self, plugin, layer_name, fields):
        self.made.append(FakePlugin(plugin, layer_name, fields))
        return self.made[-1]


def dsa_network(L=2, next_n=1, topk_is_output=False, extra_logits_user=False, indices="int32",
                q_dtype="fp8"):
    """A DSA-like decode network: per layer q/weights projections, a dense indexer logits layer
    (inputs q, k-cache, weights), a top-K (values, indices) and attention reading the indices."""
    net = FakeNetwork()
    h = net.add_input("hidden", "float16", (-1, 7168))
    for l in range(L):
        kv = net.add_input(f"layers.{l}.indexer.k_cache", "int8", (-1, 64, 1, 132))
        q = net.add_layer(f"layers.{l}.indexer.q_proj", "MATRIX_MULTIPLY", [h],
                          [(f"layers.{l}.indexer.q", q_dtype, (-1, 64, 128))]).get_output(0)
        w = net.add_layer(f"layers.{l}.indexer.w_proj", "MATRIX_MULTIPLY", [h],
                          [(f"layers.{l}.indexer.w", "float32", (-1, 64))]).get_output(0)
        z = net.add_layer(f"layers.{l}.indexer.logits", "PLUGIN_V3", [q, kv, w],
                          [(f"layers.{l}.indexer.scores", "float32", (-1, -1))]).get_output(0)
        top = net.add_layer(f"layers.{l}.indexer.topk", "TOPK", [z],
                            [(f"layers.{l}.indexer.top_values", "float32", (-1, 2048)),
                             (f"layers.{l}.indexer.top_indices", indices, (-1, 2048))])
        if topk_is_output:
            net.mark_output(top.get_output(1))
        if extra_logits_user:
            net.add_layer(f"layers.{l}.debug", "REDUCE", [z], [(f"layers.{l}.debug_out", "float32")])
        h = net.add_layer(f"layers.{l}.attn", "PLUGIN_V3", [h, top.get_output(1)],
                          [(f"layers.{l}.attn_out", "float16", (-1, 7168))]).get_output(0)
    net.mark_output(h)
    return net


def mark_all(net, L=2):
    for l in range(L):
        spin_trt.mark_indexer(net, layer=l, logits=f"layers.{l}.indexer.logits",
                              topk=f"layers.{l}.indexer.topk", q=0, weights=2, kv_cache=1)


CFG = SpinConfig(index_topk=2048, target_sparsity=0.5, exploration=0.1, pooling="top4",
                 exploration_policy="age", seed=7)


@pytest.fixture(autouse=True)
def _no_leftover_marks():
    yield
    spin_trt.network_pass._MARKS.clear()


# ---- the pass --------------------------------------------------------------------------------------
def test_pass_rewires_every_marked_indexer():
    net, be = dsa_network(L=3), FakeBackend()
    mark_all(net, 3)
    rep = spin_trt.insert_spin(net, CFG, max_context=131072, backend=be)
    assert rep.layers == [0, 1, 2] and not rep.already_applied and not rep.dense_still_used
    assert set(rep.added_inputs) == {f"spin_{n}" for n in spin_trt.SHARED_INPUTS}
    assert rep.added_inputs["spin_V"] == ("float32", 3)
    assert rep.added_inputs["spin_request_id"] == ("int64", 1)
    assert rep.plugin_layers == ["spin/select"] + [f"spin/L{l}/{k}" for l in range(3)
                                                   for k in ("logits", "topk", "update")]
    sel = net.layer("spin/select")
    assert [t.name for t in sel._inputs] == [f"spin_{n}" for n in (
        "V", "D", "last_seen", "decode_steps", "state_slot", "context_lens", "query_pos",
        "request_id", "step")]
    assert sel.plugin.plugin == "SpinSelect"
    assert sel.plugin.fields == F.select_fields(CFG, max_context=131072)
    assert sel.plugin.fields["m_cap"] == 2048 and sel.plugin.fields["policy"] == 2
    for l in range(3):
        lg, tk, up = (net.layer(f"spin/L{l}/{k}") for k in ("logits", "topk", "update"))
        assert [t.name for t in lg._inputs] == [
            f"layers.{l}.indexer.q", f"layers.{l}.indexer.k_cache", f"layers.{l}.indexer.w",
            "spin_context_lens", "spin_block_table", "spin/block_ids", "spin/counts"]
        assert lg.plugin.fields == {"block_size": 64, "layer": l}
        assert [t.name for t in tk._inputs] == [f"spin/L{l}/logits_out", "spin/block_ids", "spin/counts"]
        assert tk.plugin.fields == {"block_size": 64, "index_topk": 2048, "layer": l}
        # attention now reads the SPIN top-K
        assert net.layer(f"layers.{l}.attn").get_input(1) is tk.get_output(0)
        assert rep.rewired[f"layers.{l}.indexer.top_indices"] == [f"layers.{l}.attn[1]"]
        names = [t.name for t in up._inputs]
        assert names[:12] == ["spin_V", "spin_D", "spin_last_seen", "spin_decode_steps",
                              "spin_state_slot", f"spin/L{l}/logits_out", "spin/block_ids",
                              "spin/counts", "spin_context_lens", "spin_query_pos",
                              "spin_state_slot", "spin_step"]   # accepted: not read (row0_only)
        assert names[12:] == ([] if l == 0 else [f"spin/L{l - 1}/done"])
        assert up.plugin.fields == {"block_size": 64, "layer": l, "ema_decay": 0.5,
                                    "row0_only": 1, "max_context": 131072}
    assert [t.name for t in net._outputs] == ["layers.2.attn_out", "spin/state_updated"]
    assert net.layer("spin/L2/update").get_output(0).name == "spin/state_updated"
    assert spin_trt.marks_of(net) == ([], None)
    assert "indexer layers [0, 1, 2]" in rep.describe()


def test_pass_is_idempotent():
    net, be = dsa_network(), FakeBackend()
    mark_all(net)
    spin_trt.insert_spin(net, CFG, max_context=4096, backend=be)
    before, made = net.snapshot(), len(be.made)
    again = spin_trt.insert_spin(net, CFG, max_context=4096, backend=be)
    assert again.already_applied and again.layers == [0, 1] and net.snapshot() == before
    mark_all(net)      # marking the (still present) dense layers again changes nothing either
    assert spin_trt.insert_spin(net, CFG, max_context=4096, backend=be).already_applied
    assert net.snapshot() == before and len(be.made) == made
    assert "nothing changed" in again.describe()


def test_pass_refuses_new_marks_after_it_ran():
    net, be = dsa_network(L=3), FakeBackend()
    mark_all(net, 2)
    with pytest.raises(SpinError, match="0..L-1"):   # layer 2 is a dense indexer too, but
        spin_trt.insert_spin(net, CFG, max_context=4096, backend=be,   # mark it 0..L-1 only
                             marks=spin_trt.marks_of(net)[0][1:])
    spin_trt.insert_spin(net, CFG, max_context=4096, backend=be)
    mark_all(net, 3)
    with pytest.raises(SpinError, match=r"layers \[2\] were marked since"):
        spin_trt.insert_spin(net, CFG, max_context=4096, backend=be)


def test_dense_topk_network_output_keeps_its_name():
    net = dsa_network(L=1, topk_is_output=True)
    mark_all(net, 1)
    rep = spin_trt.insert_spin(net, CFG, max_context=4096, backend=FakeBackend())
    outs = {t.name: t for t in net._outputs}
    assert outs["layers.0.indexer.top_indices"] is net.layer("spin/L0/topk").get_output(0)
    assert net.layer("layers.0.indexer.topk").get_output(1).name == "layers.0.indexer.top_indices/dense"
    assert "layers.0.indexer.top_indices/dense" not in outs
    assert rep.rewired["layers.0.indexer.top_indices"] == ["layers.0.attn[1]"]


def test_mtp_updates_read_the_verifier_accepted_counts():
    net, be = dsa_network(L=2, next_n=2), FakeBackend()
    mark_all(net)
    with pytest.raises(SpinError, match=r"mark_mtp\(network, next_n=2, accepted=...\)"):
        spin_trt.insert_spin(net, CFG, max_context=4096, next_n=2, backend=be)
    accepted = net.add_layer("mtp.verify", "ELEMENTWISE", [net.get_input(0)],
                             [("mtp.accepted", "int32", (-1,))]).get_output(0)
    spin_trt.mark_mtp(net, next_n=2, accepted="mtp.accepted")
    rep = spin_trt.insert_spin(net, CFG, max_context=4096, backend=be)
    for l in range(2):
        up = net.layer(f"spin/L{l}/update")
        assert up.get_input(10) is accepted and up.plugin.fields["row0_only"] == 0
    assert "spin_accepted" not in rep.added_inputs
    # mtp_update='row0' replays row 0 only: no accepted counts needed
    net2 = dsa_network(L=1)
    mark_all(net2, 1)
    spin_trt.insert_spin(net2, CFG.with_overrides(mtp_update="row0"), max_context=4096, next_n=4,
                         backend=FakeBackend())
    up = net2.layer("spin/L0/update")
    assert up.plugin.fields["row0_only"] == 1 and up.get_input(10).name == "spin_state_slot"
    # or accepted as a network input, added by the pass when named in inputs
    net3 = dsa_network(L=1)
    acc = net3.add_input("accepted_counts", "int32", (-1,))
    mark_all(net3, 1)
    spin_trt.insert_spin(net3, CFG, max_context=4096, next_n=3, inputs={"accepted": "accepted_counts"},
                         backend=FakeBackend())
    assert net3.layer("spin/L0/update").get_input(10) is acc


def test_existing_inputs_are_reused_and_checked():
    net, be = dsa_network(L=1), FakeBackend()
    ctx = net.add_input("ctx_lens", "int32", (-1, 1))
    v = net.add_input("spin_V", "float32", (-1, -1, -1))
    mark_all(net, 1)
    rep = spin_trt.insert_spin(net, CFG, max_context=4096, inputs={"context_lens": ctx}, backend=be)
    assert "spin_V" not in rep.added_inputs and "spin_context_lens" not in rep.added_inputs
    assert net.layer("spin/select").get_input(0) is v and net.layer("spin/select").get_input(5) is ctx
    for bad, needle in [({"context_lens": "ctx16"}, "must be int32, got float16"),
                        ({"query_pos": "qpos3"}, "has 3 rows per request, next_n is 1"),
                        ({"step": "step2d"}, "must have 1 dims"),
                        ({"contxt_lens": "ctx16"}, "unknown names"),
                        ({"state_slot": "nope"}, "no tensor named 'nope'")]:
        n2 = dsa_network(L=1)
        n2.add_input("ctx16", "float16", (-1, 1))
        n2.add_input("qpos3", "int32", (-1, 3))
        n2.add_input("step2d", "int64", (-1, 1))
        mark_all(n2, 1)
        before = n2.snapshot()
        with pytest.raises(SpinError, match=needle):
            spin_trt.insert_spin(n2, CFG, max_context=4096, inputs=bad, backend=FakeBackend())
        assert n2.snapshot() == before, "a failed pass must leave the network as it was"
    # fp16 state: the added V/D inputs follow the config
    n3 = dsa_network(L=1)
    mark_all(n3, 1)
    rep3 = spin_trt.insert_spin(n3, CFG.with_overrides(state_dtype="float16"), max_context=64,
                                backend=FakeBackend())
    assert rep3.added_inputs["spin_V"] == ("float16", 3) and rep3.added_inputs["spin_D"] == ("float16", 3)
    # fp8 state: TensorRT's fp8 (kFP8) inputs, and a caller's fp8 V/D are accepted
    n4 = dsa_network(L=1)
    mark_all(n4, 1)
    fp8 = CFG.with_overrides(state_dtype="float8_e4m3fn")
    rep4 = spin_trt.insert_spin(n4, fp8, max_context=64, backend=FakeBackend())
    assert rep4.added_inputs["spin_V"] == ("fp8", 3) and rep4.added_inputs["spin_D"] == ("fp8", 3)
    n5 = dsa_network(L=1)
    mark_all(n5, 1)
    n5.add_input("myV", "fp8", (-1, -1, -1))
    n5.add_input("myD", "fp8", (-1, -1, -1))
    rep5 = spin_trt.insert_spin(n5, fp8, max_context=64, inputs={"V": "myV", "D": "myD"},
                                backend=FakeBackend())
    assert "spin_V" not in rep5.added_inputs and "spin_D" not in rep5.added_inputs


@pytest.mark.parametrize("kwargs,needle", [
    (dict(logits="layers.0.indexer.logit"), r"no network layer named 'layers.0.indexer.logit' "
                                            r"\(close: layers.0.indexer.logits"),
    (dict(topk="nope"), "no network layer named 'nope'"),
    (dict(q="layers.0.indexer.qq"), "no tensor named 'layers.0.indexer.qq'"),
    (dict(weights=5), "has no input 5"),
    (dict(kv_cache=True), "expected a tensor name"),
    (dict(topk_output=2), "has no output 2"),
    (dict(topk="layers.0.indexer.logits"), "name the same layer"),
    (dict(layer=-1), "layer must be an integer >= 0"),
])
def test_bad_marks_are_refused_at_once(kwargs, needle):
    net = dsa_network(L=1)
    args = dict(layer=0, logits="layers.0.indexer.logits", topk="layers.0.indexer.topk", q=0,
                weights=2, kv_cache=1)
    args.update(kwargs)
    with pytest.raises(SpinError, match=needle):
        spin_trt.mark_indexer(net, **args)
    assert spin_trt.marks_of(net) == ([], None)


def test_pass_errors_leave_the_network_untouched():
    cases = [
        (dict(), lambda n: None, "no DSA indexer is marked"),
        (dict(), lambda n: [spin_trt.mark_indexer(n, layer=l, logits=f"layers.{l}.indexer.logits",
                                                  topk=f"layers.{l}.indexer.topk", q=0, weights=2,
                                                  kv_cache=1) for l in (0, 2)],
         r"must be 0..L-1.*got \[0, 2\]"),
        (dict(indices="int64"), mark_all, "top-K indices 'layers.0.indexer.top_indices'.*must be "
                                          "int32, got int64"),
        (dict(q_dtype="float16"), mark_all, "q 'layers.0.indexer.q' must be fp8/int8/uint8"),
        (dict(extra_logits_user=True), mark_all, "strict: indexer layer 0: the dense indexer is "
                                                 "still computed for layers.0.debug"),
    ]
    for net_kw, marker, needle in cases:
        net = dsa_network(L=3, **net_kw)
        marker(net)
        before = net.snapshot()
        with pytest.raises(SpinError, match=needle):
            spin_trt.insert_spin(net, CFG, max_context=4096, backend=FakeBackend(), strict=True)
        assert net.snapshot() == before
        spin_trt.clear_marks(net)
    net = dsa_network(L=1)
    spin_trt.mark_indexer(net, layer=0, logits="layers.0.indexer.logits",
                          topk="layers.0.indexer.topk", q=0, weights=2, kv_cache=1)
    with pytest.raises(SpinError, match="marked twice"):
        spin_trt.mark_indexer(net, layer=0, logits="layers.0.indexer.logits",
                              topk="layers.0.indexer.topk", q=0, weights=1, kv_cache=2)
    for bad, needle in [(dict(max_context=0), "max_context must be an integer"),
                        (dict(max_context=64, m_cap=0), "m_cap must be an integer"),
                        (dict(max_context=64, next_n=9), "next_n must be 1..8")]:
        with pytest.raises(SpinError, match=needle):
            spin_trt.insert_spin(net, CFG, backend=FakeBackend(), **bad)
    with pytest.raises(SpinError, match="reduction A1 with block_size 64"):
        spin_trt.insert_spin(net, CFG.with_overrides(reduction="A2"), max_context=64, backend=FakeBackend())
    with pytest.raises(SpinError, match="next_n must be 1..8"):
        spin_trt.mark_mtp(net, next_n=0)


def test_dense_consumers_are_reported():
    net = dsa_network(L=1, extra_logits_user=True)
    mark_all(net, 1)
    rep = spin_trt.insert_spin(net, CFG, max_context=4096, backend=FakeBackend())
    assert rep.dense_still_used == ["indexer layer 0: the dense indexer is still computed for "
                                    "layers.0.debug"]
    assert "note: indexer layer 0" in rep.describe()


def test_mark_by_names():
    net = dsa_network(L=3)
    marks = spin_trt.mark_by_names(net, q=0, weights="layers.{layer}.indexer.w", kv_cache=1)
    assert [(m.layer, m.logits, m.topk, m.weights) for m in marks] == [
        (l, f"layers.{l}.indexer.logits", f"layers.{l}.indexer.topk", f"layers.{l}.indexer.w")
        for l in range(3)]
    rep = spin_trt.insert_spin(net, CFG, max_context=4096, backend=FakeBackend())
    assert rep.layers == [0, 1, 2]
    net = dsa_network(L=2)
    with pytest.raises(SpinError, match="exactly one group"):
        spin_trt.mark_by_names(net, q=0, weights=2, kv_cache=1, logits=r"indexer\.logits")
    with pytest.raises(SpinError, match="no layer matches"):
        spin_trt.mark_by_names(net, q=0, weights=2, kv_cache=1, logits=r"blocks\.(\d+)\.logits")
    with pytest.raises(SpinError, match=r"logits \[0, 1\] but top-K \[0\]"):
        spin_trt.mark_by_names(net, q=0, weights=2, kv_cache=1, topk=r"layers\.(0)\..*topk")


# ---- fields --------------------------------------------------------------------------------------
def test_field_builders_follow_the_config():
    f = F.select_fields(CFG, max_context=1000)
    assert f == {"block_size": 64, "target_sparsity": 0.5, "exploration": 0.1, "policy": 2,
                 "pooling": 2, "index_topk": 2048, "warmup_steps": 1, "keep_sink": 1,
                 "keep_newest": 1, "mtp_union": 1, "seed": 7, "max_context": 1000, "m_cap": 16}
    assert F.select_fields(CFG.with_overrides(mtp_mask="row0"), max_context=64, m_cap=3)["mtp_union"] == 0
    assert F.update_fields(CFG, layer=1, max_context=64, next_n=2)["row0_only"] == 0
    for plugin, build in [("SpinSelect", f), ("SpinIndexerLogits", F.logits_fields(layer=0)),
                          ("SpinTopK", F.topk_fields(CFG, layer=0)),
                          ("SpinUpdate", F.update_fields(CFG, layer=0, max_context=64))]:
        assert list(build) == [n for n, _ in F.FIELDS[plugin]]
    with pytest.raises(SpinError, match="layer must be an integer"):
        F.logits_fields(layer=-1)
    with pytest.raises(SpinError, match="has no field 'nope'"):
        F.field_kind("SpinTopK", "nope")
    from spin_trtllm.limits import BLOCK_SLOTS, EXPLORATION_POLICY, POOLING
    for pooling in POOLING:            # the plugins read the enums as the ops pass them
        for policy in EXPLORATION_POLICY:
            got = F.select_fields(CFG.with_overrides(pooling=pooling, exploration_policy=policy),
                                  max_context=64, m_cap=3)
            assert (got["pooling"], got["policy"], got["block_size"]) == \
                (POOLING[pooling], EXPLORATION_POLICY[policy], BLOCK_SLOTS)


# ---- without TensorRT ------------------------------------------------------------------------------
def test_tensorrt_needing_calls_say_so_without_tensorrt(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)     # import tensorrt -> ImportError
    with pytest.raises(SpinError, match="TensorRT Python package"):
        spin_trt.load_plugins()
    net = dsa_network(L=1)
    mark_all(net, 1)
    with pytest.raises(SpinError, match="TensorRT Python package"):
        spin_trt.insert_spin(net, CFG, max_context=64)


def test_missing_library_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("SPIN_TRT_PLUGIN_LIB", str(tmp_path / "nope.so"))
    monkeypatch.setattr(P, "_ROOT", tmp_path)
    monkeypatch.setattr(P, "library_candidates",
                        lambda: [tmp_path / "nope.so", tmp_path / "build" / P.LIBRARY])
    with pytest.raises(SpinError, match="libspin_trtllm_plugins.so not found.*nope.so.*build.sh"):
        P.find_plugin_library()


# ---- load_plugins and the backend against a stand-in tensorrt module --------------------------------
class _Registry:
    def __init__(self, load_ok=True):
        self.creators, self.loaded, self.load_ok = {}, [], load_ok

    def get_creator(self, name, version, namespace):
        assert (version, namespace) == ("1", "")
        return self.creators.get(name)

    def load_library(self, path):
        self.loaded.append(path)
        if not self.load_ok:
            return None
        for n in F.PLUGIN_NAMES:
            self.creators[n] = _Creator(n)
        return object()


class _Creator:
    def __init__(self, name):
        self.name, self.calls = name, []

    def create_plugin(self, name, fc, phase):
        self.calls.append((name, fc, phase))
        return None if name == "refuse" else ("plugin", self.name, name)


def _fake_trt(registry):
    trt = types.ModuleType("tensorrt")
    trt.get_plugin_registry = lambda: registry
    trt.PluginField = lambda name, data, type_: (name, data, type_)
    trt.PluginFieldCollection = lambda fields: list(fields)
    trt.PluginFieldType = types.SimpleNamespace(INT64="INT64", FLOAT64="FLOAT64")
    trt.TensorRTPhase = types.SimpleNamespace(BUILD="BUILD")
    for n in ("float32", "float16", "bfloat16", "int8", "uint8", "fp8", "int32", "int64", "bool"):
        setattr(trt, n, f"DataType.{n}")
    return trt


def test_load_plugins_registers_once(monkeypatch, tmp_path):
    lib = tmp_path / P.LIBRARY
    lib.write_bytes(b"")
    reg = _Registry()
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_trt(reg))
    monkeypatch.setattr(P, "_LOADED", {})
    handle = spin_trt.load_plugins(lib)
    assert handle is not None and reg.loaded == [str(lib.resolve())]
    assert spin_trt.load_plugins(lib) is handle and len(reg.loaded) == 1
    with pytest.raises(SpinError, match="no such plugin library"):
        spin_trt.load_plugins(tmp_path / "other.so")
    bad = _Registry(load_ok=False)
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_trt(bad))
    monkeypatch.setattr(P, "_LOADED", {})
    with pytest.raises(SpinError, match="TensorRT could not load"):
        spin_trt.load_plugins(lib)
    # registered by someone else already (trtexec --dynamicPlugins): loading again is fine
    bad.creators = {n: _Creator(n) for n in F.PLUGIN_NAMES}
    assert spin_trt.load_plugins(lib) is None


def test_backend_builds_float64_and_int64_fields(monkeypatch):
    reg = _Registry()
    reg.load_library("x")
    monkeypatch.setitem(sys.modules, "tensorrt", _fake_trt(reg))
    be = P.TensorRTBackend()
    assert be.dtype("fp8") == "DataType.fp8" and be.dtype_name("DataType.int64") == "int64"
    fields = F.select_fields(CFG, max_context=1000)
    assert be.make_plugin("SpinSelect", "spin/select", fields) == ("plugin", "SpinSelect", "spin/select")
    name, fc, phase = reg.creators["SpinSelect"].calls[-1]
    assert phase == "BUILD" and [f[0] for f in fc] == list(fields)
    kinds = {f[0]: (f[2], f[1].dtype, f[1].tolist()) for f in fc}
    assert kinds["target_sparsity"] == ("FLOAT64", np.float64, [0.5])
    assert kinds["seed"] == ("INT64", np.int64, [7]) and kinds["m_cap"][0] == "INT64"
    with pytest.raises(SpinError, match="the creator refused"):
        be.make_plugin("SpinTopK", "refuse", F.topk_fields(CFG, layer=0))
    reg.creators.clear()
    with pytest.raises(SpinError, match="call spin_trtllm.integrations.tensorrt.load_plugins"):
        be.make_plugin("SpinTopK", "x", {})
