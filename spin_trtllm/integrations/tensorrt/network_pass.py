"""The SPIN pass over a TensorRT network definition: rewire each DSA layer's dense indexer
(logits over every cached slot, then top-K) through the SPIN plugins.

The graph logic only uses the duck-typed surface of tensorrt.INetworkDefinition (num_layers,
get_layer, num_inputs, get_input, add_input, add_plugin_v3, mark_output, unmark_output,
num_outputs, get_output; layers: name, num_inputs, num_outputs, get_input, get_output,
set_input; tensors: name, dtype), plus a backend that turns dtype names and plugin fields into
TensorRT objects (plugins.TensorRTBackend). Tests run it on a fake network without TensorRT.

After the pass, per decode step:
    spin/select          SpinSelect: block_ids [B, L, m_cap], counts [B, L] (all layers)
    spin/L{l}/logits     SpinIndexerLogits: compact scores of the selected blocks
    spin/L{l}/topk       SpinTopK: int32 [B*R, K]; every consumer of the dense top-K now reads it
    spin/L{l}/update     SpinUpdate: V/D/last_seen/decode_steps written in place
The updates are chained by their `done` tokens; the last is the network output
`spin/state_updated`, so TensorRT keeps them. With MTP (next_n > 1) each update also reads the
verifier's accepted-draft counts (int32 [B]), so it runs after the verifier.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

from ...config import SpinConfig
from ...errors import SpinError
from ...limits import MAX_NEXT_N
from .fields import (LOGITS, SELECT, TOPK, UPDATE, check_supported, logits_fields,
                     select_fields, topk_fields, update_fields)

PREFIX = "spin"
DONE_OUTPUT = f"{PREFIX}/state_updated"
# The network inputs SPIN needs, shared by every indexer layer: name -> (dtype, rank);
# "state" is the SpinConfig's state_dtype. Missing ones are added as inputs named spin_<name>.
SHARED_INPUTS: dict[str, tuple[str, int]] = {
    "V": ("state", 3), "D": ("state", 3), "last_seen": ("int64", 3), "decode_steps": ("int64", 2),
    "state_slot": ("int32", 1), "context_lens": ("int32", 2), "query_pos": ("int32", 2),
    "request_id": ("int64", 1), "step": ("int64", 1), "block_table": ("int32", 2),
}
ACCEPTED = ("accepted", ("int32", 1))
Q_DTYPES = ("fp8", "int8", "uint8")
KV_DTYPES = ("int8", "uint8", "fp8")

TensorRef = Union[str, int, Any]   # a tensor name, an input index of the logits layer, or a tensor


@dataclass(frozen=True)
class IndexerMark:
    """One DSA layer's dense indexer: the layer computing its logits and the one computing its
    top-K (by layer name), and the tensors SpinIndexerLogits reads. `q`, `weights`, `kv_cache`
    (and `block_table`, which defaults to the shared one) are tensor names, tensors, or input
    indices of the logits layer. `topk_output`: the top-K layer's output holding the indices
    (None: output 1 when it has two, as ITopKLayer (values, indices), else output 0)."""

    layer: int
    logits: str
    topk: str
    q: TensorRef
    weights: TensorRef
    kv_cache: TensorRef
    topk_output: Optional[int] = None
    block_table: Optional[TensorRef] = None


@dataclass(frozen=True)
class MtpMark:
    """The MTP verifier: next_n rows per request, and the tensor with each request's accepted
    draft count (int32 [B]) that the deferred updates replay (rows 0..accepted)."""

    next_n: int
    accepted: Optional[TensorRef] = None


@dataclass
class SpinPassReport:
    layers: list[int] = field(default_factory=list)
    plugin_layers: list[str] = field(default_factory=list)
    added_inputs: dict[str, tuple[str, int]] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    rewired: dict[str, list[str]] = field(default_factory=dict)   # dense top-K -> consumers
    dense_still_used: list[str] = field(default_factory=list)
    already_applied: bool = False

    def describe(self) -> str:
        if self.already_applied:
            return f"SPIN pass: already applied to indexer layers {self.layers}; nothing changed"
        lines = [f"SPIN pass: indexer layers {self.layers} rewired through "
                 f"{len(self.plugin_layers)} plugin layers"]
        if self.added_inputs:
            lines.append("  added inputs: " + ", ".join(
                f"{n} {d}[{'x'.join('?' * r)}]" for n, (d, r) in self.added_inputs.items()))
        lines.append(f"  outputs: {', '.join(self.outputs)}")
        for dense, users in self.rewired.items():
            lines.append(f"  {dense} -> {', '.join(users) or '(network output only)'}")
        for note in self.dense_still_used:
            lines.append(f"  note: {note}")
        return "\n".join(lines)


# ---- marks ---------------------------------------------------------------------------------------
# network id -> (network, indexer marks, MTP mark); the network is held until the pass runs.
_MARKS: dict[int, tuple[Any, dict[int, IndexerMark], Optional[MtpMark]]] = {}


# SpinConfig.state_dtype -> the TensorRT dtype name (TensorRTBackend.dtype) of the V/D inputs
TRT_STATE_DTYPE = {"float32": "float32", "float16": "float16", "float8_e4m3fn": "fp8"}

def _entry(network):
    if id(network) not in _MARKS or _MARKS[id(network)][0] is not network:
        _MARKS[id(network)] = (network, {}, None)
    return _MARKS[id(network)]


def marks_of(network) -> tuple[list[IndexerMark], Optional[MtpMark]]:
    entry = _MARKS.get(id(network))
    if entry is None or entry[0] is not network:
        return [], None
    return [entry[1][k] for k in sorted(entry[1])], entry[2]


def clear_marks(network) -> None:
    _MARKS.pop(id(network), None)


def mark_indexer(network, *, layer: int, logits: str, topk: str, q: TensorRef,
                 weights: TensorRef, kv_cache: TensorRef, topk_output: Optional[int] = None,
                 block_table: Optional[TensorRef] = None) -> IndexerMark:
    """Mark indexer layer `layer` (0-based, = its index in the SPIN state) of `network`:
    `logits`/`topk` name the layers computing the dense indexer logits and top-K. Checked now:
    the layers exist and the tensors resolve (SpinError naming what is missing)."""
    mark = IndexerMark(layer, logits, topk, q, weights, kv_cache, topk_output, block_table)
    graph = _Graph(network)
    _resolve_mark(graph, mark)
    entry = _entry(network)
    if layer in entry[1] and entry[1][layer] != mark:
        raise SpinError(f"mark_indexer: indexer layer {layer} is marked twice "
                        f"({entry[1][layer].logits!r} and {logits!r})")
    entry[1][layer] = mark
    return mark


def mark_mtp(network, *, next_n: int, accepted: Optional[TensorRef] = None) -> MtpMark:
    """Mark the MTP verifier: next_n query rows per request and its accepted-count tensor."""
    if isinstance(next_n, bool) or not isinstance(next_n, int) or not 1 <= next_n <= MAX_NEXT_N:
        raise SpinError(f"mark_mtp: next_n must be 1..{MAX_NEXT_N}, got {next_n!r}")
    mark = MtpMark(next_n, accepted)
    if accepted is not None:
        _Graph(network).tensor(accepted, "mark_mtp accepted")
    network_, indexers, _ = _entry(network)
    _MARKS[id(network)] = (network_, indexers, mark)
    return mark


DEFAULT_LOGITS_PATTERN = r"layers\.(\d+)\..*indexer.*logits"
DEFAULT_TOPK_PATTERN = r"layers\.(\d+)\..*indexer.*top_?k"


def mark_by_names(network, *, q: TensorRef, weights: TensorRef, kv_cache: TensorRef,
                  logits: str = DEFAULT_LOGITS_PATTERN, topk: str = DEFAULT_TOPK_PATTERN,
                  topk_output: Optional[int] = None) -> list[IndexerMark]:
    """Mark every indexer found by layer names: `logits`/`topk` are regular expressions whose
    one group is the layer index. `q`/`weights`/`kv_cache`: input indices of the logits layer,
    or name templates with `{layer}`."""
    graph = _Graph(network)
    found: dict[str, dict[int, str]] = {"logits": {}, "topk": {}}
    for what, pattern in (("logits", logits), ("topk", topk)):
        rx = re.compile(pattern)
        if rx.groups != 1:
            raise SpinError(f"mark_by_names: the {what} pattern {pattern!r} must have exactly one "
                            f"group (the layer index)")
        for name in graph.layer_names():
            m = rx.search(name)
            if m:
                idx = int(m.group(1))
                if idx in found[what]:
                    raise SpinError(f"mark_by_names: layers {found[what][idx]!r} and {name!r} both "
                                    f"match the {what} pattern for layer {idx}")
                found[what][idx] = name
    if not found["logits"]:
        raise SpinError(f"mark_by_names: no layer matches the logits pattern {logits!r}")
    if set(found["logits"]) != set(found["topk"]):
        raise SpinError(f"mark_by_names: indexer layers with logits {sorted(found['logits'])} but "
                        f"top-K {sorted(found['topk'])}")
    fmt = lambda ref, l: ref.format(layer=l) if isinstance(ref, str) else ref  # noqa: E731
    return [mark_indexer(network, layer=l, logits=found["logits"][l], topk=found["topk"][l],
                         q=fmt(q, l), weights=fmt(weights, l), kv_cache=fmt(kv_cache, l),
                         topk_output=topk_output)
            for l in sorted(found["logits"])]


# ---- graph access --------------------------------------------------------------------------------
class _Graph:
    """Name lookups over the network (TensorRT hands out new wrapper objects per call, so
    tensors and layers are matched by name)."""

    def __init__(self, network):
        self.net = network
        self.layers = [network.get_layer(i) for i in range(network.num_layers)]
        self.inputs = [network.get_input(i) for i in range(network.num_inputs)]
        self.tensors: dict[str, Any] = {t.name: t for t in self.inputs}
        for layer in self.layers:
            for k in range(layer.num_outputs):
                t = layer.get_output(k)
                if t is not None:
                    self.tensors.setdefault(t.name, t)

    def layer_names(self) -> list[str]:
        return [l.name for l in self.layers]

    def layer(self, name: str, what: str):
        hits = [l for l in self.layers if l.name == name]
        if len(hits) == 1:
            return hits[0]
        if hits:
            raise SpinError(f"{what}: {len(hits)} layers are named {name!r}; names must be unique")
        close = difflib.get_close_matches(name, self.layer_names(), n=3, cutoff=0.6)
        raise SpinError(f"{what}: no network layer named {name!r}"
                        + (f" (close: {', '.join(close)})" if close else ""))

    def tensor(self, ref: TensorRef, what: str, owner=None):
        if isinstance(ref, bool):
            raise SpinError(f"{what}: expected a tensor name, tensor or input index, got {ref!r}")
        if isinstance(ref, int):
            if owner is None:
                raise SpinError(f"{what}: an input index needs the logits layer")
            if not 0 <= ref < owner.num_inputs or owner.get_input(ref) is None:
                raise SpinError(f"{what}: layer {owner.name!r} has no input {ref} "
                                f"(it has {owner.num_inputs})")
            return owner.get_input(ref)
        if isinstance(ref, str):
            if ref not in self.tensors:
                close = difflib.get_close_matches(ref, list(self.tensors), n=3, cutoff=0.6)
                raise SpinError(f"{what}: no tensor named {ref!r} in the network"
                                + (f" (close: {', '.join(close)})" if close else ""))
            return self.tensors[ref]
        if not hasattr(ref, "name"):
            raise SpinError(f"{what}: expected a tensor name, tensor or input index, got "
                            f"{type(ref).__name__}")
        return ref

    def consumers(self, tensor_name: str) -> list[tuple[Any, int]]:
        out = []
        for layer in self.layers:
            for i in range(layer.num_inputs):
                t = layer.get_input(i)
                if t is not None and t.name == tensor_name:
                    out.append((layer, i))
        return out

    def is_output(self, tensor_name: str) -> bool:
        return any(self.net.get_output(i).name == tensor_name for i in range(self.net.num_outputs))


@dataclass
class _Resolved:
    mark: IndexerMark
    logits_layer: Any
    topk_layer: Any
    indices: Any
    q: Any
    weights: Any
    kv_cache: Any
    block_table: Optional[Any]


def _resolve_mark(graph: _Graph, mark: IndexerMark, backend=None) -> _Resolved:
    what = f"indexer layer {mark.layer}"
    if isinstance(mark.layer, bool) or not isinstance(mark.layer, int) or mark.layer < 0:
        raise SpinError(f"mark_indexer: layer must be an integer >= 0, got {mark.layer!r}")
    logits_layer = graph.layer(mark.logits, f"{what} logits")
    topk_layer = graph.layer(mark.topk, f"{what} top-K")
    if logits_layer.name == topk_layer.name:
        raise SpinError(f"{what}: logits and top-K name the same layer {mark.logits!r}")
    out = mark.topk_output
    if out is None:
        out = 1 if topk_layer.num_outputs == 2 else 0
    if not 0 <= out < topk_layer.num_outputs:
        raise SpinError(f"{what}: top-K layer {topk_layer.name!r} has no output {out}")
    r = _Resolved(mark, logits_layer, topk_layer, topk_layer.get_output(out),
                  graph.tensor(mark.q, f"{what} q", logits_layer),
                  graph.tensor(mark.weights, f"{what} weights", logits_layer),
                  graph.tensor(mark.kv_cache, f"{what} kv_cache", logits_layer),
                  None if mark.block_table is None
                  else graph.tensor(mark.block_table, f"{what} block_table", logits_layer))
    if backend is not None:
        _expect_dtype(backend, r.indices, ("int32",), f"{what}: the dense top-K indices "
                      f"{r.indices.name!r} (SpinTopK writes int32 slot ids; cast after it if the "
                      f"consumers need another type)")
        _expect_dtype(backend, r.q, Q_DTYPES, f"{what}: q {r.q.name!r}")
        _expect_dtype(backend, r.weights, ("float32",), f"{what}: weights {r.weights.name!r}")
        _expect_dtype(backend, r.kv_cache, KV_DTYPES, f"{what}: kv_cache {r.kv_cache.name!r}")
        if r.block_table is not None:
            _expect_dtype(backend, r.block_table, ("int32",), f"{what}: block_table")
    return r


def _expect_dtype(backend, tensor, allowed: Sequence[str], what: str) -> None:
    got = backend.dtype_name(tensor.dtype)
    if got not in allowed:
        raise SpinError(f"{what} must be {'/'.join(allowed)}, got {got}")


# ---- the pass ------------------------------------------------------------------------------------
def insert_spin(network, cfg: SpinConfig, *, max_context: int, next_n: Optional[int] = None,
                m_cap: Optional[int] = None, inputs: Optional[Mapping[str, TensorRef]] = None,
                marks: Optional[Iterable[IndexerMark]] = None, backend=None,
                strict: bool = False) -> SpinPassReport:
    """Rewire every marked indexer through the SPIN plugins (see the module docstring).

    max_context: the longest context the engine serves (the kernels clamp to it; m_cap defaults
    to ceil(max_context / 64)). next_n: MTP rows (default: mark_mtp's, else 1). inputs: existing
    tensors for the shared SPIN inputs (SHARED_INPUTS names, and "accepted"); the rest are added
    as network inputs spin_<name> with dynamic extents. marks: instead of the mark_* registry.
    strict: refuse when the dense logits or top-K still have other consumers (then the dense
    indexer is still computed). Running the pass again on its own output changes nothing.
    Everything is checked before the network is touched, so a SpinError leaves it as it was."""
    if backend is None:
        from .plugins import TensorRTBackend
        backend = TensorRTBackend()
    check_supported(cfg)
    registered, mtp = marks_of(network)
    marks = sorted(list(marks) if marks is not None else registered, key=lambda m: m.layer)
    graph = _Graph(network)
    layers = [m.layer for m in marks]

    # already applied: the plugin layers are there (marks, if any, must all be covered)
    names = set(graph.layer_names())
    if f"{PREFIX}/select" in names:
        applied = sorted(int(m.group(1)) for n in names
                         if (m := re.fullmatch(rf"{PREFIX}/L(\d+)/topk", n)))
        missing = sorted(set(layers) - set(applied))
        if missing:
            raise SpinError(f"the network already went through the SPIN pass (for indexer layers "
                            f"{applied}), but layers {missing} were marked since: run the pass "
                            f"once, after marking every indexer layer")
        clear_marks(network)
        return SpinPassReport(layers=applied, already_applied=True,
                              plugin_layers=sorted(n for n in names if n.startswith(PREFIX + "/")))
    if not marks:
        raise SpinError("no DSA indexer is marked: call mark_indexer(network, layer=..., "
                        "logits=..., topk=..., q=..., weights=..., kv_cache=...) for each indexer "
                        "layer (or mark_by_names) before insert_spin")
    if layers != list(range(len(marks))):
        raise SpinError(f"indexer layers must be 0..L-1, each marked once (they index the SPIN "
                        f"state); got {layers}")

    if next_n is None:
        next_n = mtp.next_n if mtp is not None else 1
    if isinstance(next_n, bool) or not isinstance(next_n, int) or not 1 <= next_n <= MAX_NEXT_N:
        raise SpinError(f"next_n must be 1..{MAX_NEXT_N}, got {next_n!r}")
    sel_fields = select_fields(cfg, max_context=max_context, m_cap=m_cap)

    # resolve everything before any change
    resolved = [_resolve_mark(graph, m, backend) for m in marks]
    inputs = dict(inputs or {})
    unknown = set(inputs) - set(SHARED_INPUTS) - {ACCEPTED[0]}
    if unknown:
        raise SpinError(f"inputs: unknown names {sorted(unknown)} (known: "
                        f"{', '.join(list(SHARED_INPUTS) + [ACCEPTED[0]])})")
    wanted = dict(SHARED_INPUTS)
    need_accepted = next_n > 1 and cfg.mtp_update == "prefix_valid"
    if need_accepted:
        if ACCEPTED[0] not in inputs and mtp is not None and mtp.accepted is not None:
            inputs[ACCEPTED[0]] = mtp.accepted
        if ACCEPTED[0] not in inputs:
            raise SpinError(f"with MTP (next_n={next_n}) and mtp_update='prefix_valid' the updates "
                            f"replay rows 0..accepted: mark the verifier's accepted-count tensor "
                            f"(mark_mtp(network, next_n={next_n}, accepted=...)) or pass "
                            f"inputs={{'accepted': ...}}")
        wanted[ACCEPTED[0]] = ACCEPTED[1]
    shared: dict[str, Any] = {}
    to_add: dict[str, tuple[str, int]] = {}
    state_dtype = TRT_STATE_DTYPE[cfg.state_dtype]
    for name, (dtype, rank) in wanted.items():
        dtype = state_dtype if dtype == "state" else dtype
        if name in inputs:
            t = graph.tensor(inputs[name], f"inputs[{name!r}]")
        elif f"{PREFIX}_{name}" in graph.tensors:
            t = graph.tensors[f"{PREFIX}_{name}"]
        else:
            to_add[f"{PREFIX}_{name}"] = (dtype, rank)
            continue
        _expect_dtype(backend, t, (dtype,), f"SPIN input {name} ({t.name!r})")
        shape = tuple(getattr(t, "shape", ()) or ())
        if shape and len(shape) != rank:
            raise SpinError(f"SPIN input {name} ({t.name!r}) must have {rank} dims, got {list(shape)}")
        if name in ("context_lens", "query_pos") and len(shape) == 2 and shape[1] >= 0 \
                and shape[1] != next_n:
            raise SpinError(f"SPIN input {name} ({t.name!r}) has {shape[1]} rows per request, "
                            f"next_n is {next_n}")
        shared[name] = t
    still_used = []
    for r in resolved:
        dense = r.logits_layer.get_output(0)
        others = [l.name for l, _ in graph.consumers(dense.name) if l.name != r.topk_layer.name]
        for k in range(r.topk_layer.num_outputs):
            t = r.topk_layer.get_output(k)
            if t is not None and t.name != r.indices.name:
                others += [l.name for l, _ in graph.consumers(t.name)]
                if graph.is_output(t.name):
                    others.append(f"network output {t.name}")
        if graph.is_output(dense.name):
            others.append(f"network output {dense.name}")
        if others:
            still_used.append(f"indexer layer {r.mark.layer}: the dense indexer is still computed "
                              f"for {', '.join(others)}")
    if strict and still_used:
        raise SpinError("strict: " + "; ".join(still_used))
    plugins = {"select": backend.make_plugin(SELECT, f"{PREFIX}/select", sel_fields)}
    for r in resolved:
        l = r.mark.layer
        plugins[f"logits{l}"] = backend.make_plugin(LOGITS, f"{PREFIX}/L{l}/logits",
                                                   logits_fields(layer=l))
        plugins[f"topk{l}"] = backend.make_plugin(TOPK, f"{PREFIX}/L{l}/topk", topk_fields(cfg, layer=l))
        plugins[f"update{l}"] = backend.make_plugin(
            UPDATE, f"{PREFIX}/L{l}/update",
            update_fields(cfg, layer=l, max_context=max_context, next_n=next_n))

    # ---- change the network ----
    report = SpinPassReport(layers=layers, dense_still_used=still_used)
    for name, (dtype, rank) in to_add.items():
        shared[name[len(PREFIX) + 1:]] = network.add_input(name, backend.dtype(dtype), (-1,) * rank)
        report.added_inputs[name] = (dtype, rank)
    s = shared
    if not need_accepted:
        s["accepted"] = s["state_slot"]   # not read: row0_only (one row, or mtp_update='row0')

    def add(name: str, plugin, ins: list, out_names: Sequence[str]):
        layer = network.add_plugin_v3(ins, [], plugin)
        layer.name = name
        for k, out in enumerate(out_names):
            layer.get_output(k).name = out
        report.plugin_layers.append(name)
        return layer

    sel = add(f"{PREFIX}/select", plugins["select"],
              [s["V"], s["D"], s["last_seen"], s["decode_steps"], s["state_slot"], s["context_lens"],
               s["query_pos"], s["request_id"], s["step"]],
              [f"{PREFIX}/block_ids", f"{PREFIX}/counts"])
    ids, counts = sel.get_output(0), sel.get_output(1)
    done = None
    for r in resolved:
        l = r.mark.layer
        table = r.block_table if r.block_table is not None else s["block_table"]
        lg = add(f"{PREFIX}/L{l}/logits", plugins[f"logits{l}"],
                 [r.q, r.kv_cache, r.weights, s["context_lens"], table, ids, counts],
                 [f"{PREFIX}/L{l}/logits_out"])
        logits = lg.get_output(0)
        tk = add(f"{PREFIX}/L{l}/topk", plugins[f"topk{l}"], [logits, ids, counts],
                 [f"{PREFIX}/L{l}/topk_indices"])
        top = tk.get_output(0)
        dense_name = r.indices.name
        users = graph.consumers(dense_name)
        for layer, i in users:
            layer.set_input(i, top)
        report.rewired[dense_name] = [f"{layer.name}[{i}]" for layer, i in users]
        if graph.is_output(dense_name):
            # the engine keeps its output name: the SPIN top-K takes it over
            network.unmark_output(r.indices)
            r.indices.name = f"{dense_name}/dense"
            top.name = dense_name
            network.mark_output(top)
        up_in = [s["V"], s["D"], s["last_seen"], s["decode_steps"], s["state_slot"], logits, ids,
                 counts, s["context_lens"], s["query_pos"], s["accepted"], s["step"]]
        if done is not None:
            up_in.append(done)
        up = add(f"{PREFIX}/L{l}/update", plugins[f"update{l}"], up_in, [f"{PREFIX}/L{l}/done"])
        done = up.get_output(0)
    done.name = DONE_OUTPUT
    network.mark_output(done)
    report.outputs.append(DONE_OUTPUT)
    clear_marks(network)
    return report
