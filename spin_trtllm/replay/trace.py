"""SPIN trace v1/v2: dense indexer scores of a decode run, the interchange format of replay.

A safetensors file. Metadata (strings): format=spin-trace, version=1 or 2, index_topk,
block_size, next_n, optional compress_ratio and source. Tensors:
  scores     float16/float32 [sum(row_len)]  packed in (step, layer, row, slot) order
  row_len    int32 [T, L, R]                 visible slots of each row
  query_pos  int32 [T, R]                    query position in slot coordinates
  turn_start int32 [n]   optional            steps that begin a turn (step 0 always does)
  accepted   int32 [T]   optional, required when R > 1: accepted draft rows per step
Version 2 adds, all three or none (version=2 is written when they are present):
  q          float16 [T, L, R, H, D]         the indexer queries (their fp8 values; the
                                             quantization scale is folded into w)
  w          float32 [T, L, R, H]            the head weights, every scale folded in
  keys       float16 [L, S, D]               the dequantized indexer key of slot s (fp8 value x
                                             its fp32 scale), S >= every row's length
so that scores[t, l, r, s] = sum_h w[t, l, r, h] * relu(q[t, l, r, h] . keys[l, s]) on the
checked slots (check_scores: every visible slot of committed rows; a rejected MTP draft row
only on the slots its step's accepted row sees, the later ones held draft keys that the next
step overwrote).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch

from .._inputs import (TRACE_MAX_BYTES, TRACE_V2_MAX_BYTES, check_input_file, library_path,
                       one_line, printable, shown, size_text)
from .._outputs import write_output
from ..config import MAX_BLOCK_SIZE, MAX_INDEX_TOPK
from ..errors import TraceError
from ..limits import MAX_NEXT_N

FORMAT = "spin-trace"
VERSION = 2                      # written when q, w and keys are present, else 1
VERSIONS = ("1", "2")
REQUIRED_TENSORS = ("scores", "row_len", "query_pos")
OPTIONAL_TENSORS = ("turn_start", "accepted")
V2_TENSORS = ("q", "w", "keys")  # version 2: all three or none
MAX_BYTES = {"1": TRACE_MAX_BYTES, "2": TRACE_V2_MAX_BYTES}
# check_scores: |stored - recomputed| over the row's max |score| (fp16 q and keys)
SCORE_TOLERANCE = 2e-2
REQUIRED_META = ("format", "version", "index_topk", "block_size", "next_n")
OPTIONAL_META = ("compress_ratio", "source")
# Integer metadata: decimal digits only (no sign, '_' or spaces; at most 19), and these bounds.
META_BOUNDS = {"index_topk": MAX_INDEX_TOPK, "block_size": MAX_BLOCK_SIZE,
               "compress_ratio": 1 << 16}


@dataclass
class SpinTrace:
    scores: torch.Tensor
    row_len: torch.Tensor
    query_pos: torch.Tensor
    index_topk: int
    block_size: int
    turn_start: Optional[torch.Tensor] = None
    accepted: Optional[torch.Tensor] = None
    compress_ratio: Optional[int] = None
    source: Optional[str] = None
    q: Optional[torch.Tensor] = None
    w: Optional[torch.Tensor] = None
    keys: Optional[torch.Tensor] = None
    name: str = "<memory>"
    _offsets: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    _layer_offsets: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)

    # ---- shape helpers ----------------------------------------------------------------------
    @property
    def num_steps(self) -> int:
        return int(self.row_len.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.row_len.shape[1])

    @property
    def next_n(self) -> int:
        return int(self.row_len.shape[2])

    @property
    def max_slots(self) -> int:
        return int(self.row_len.max()) if self.row_len.numel() else 0

    @property
    def version(self) -> int:
        """2 when the trace carries q, w and keys, else 1."""
        return 2 if self.q is not None else 1

    @property
    def num_heads(self) -> Optional[int]:
        return int(self.q.shape[3]) if self.q is not None else None

    @property
    def head_dim(self) -> Optional[int]:
        return int(self.q.shape[4]) if self.q is not None else None

    def turn_starts(self) -> set[int]:
        starts = {0}
        if self.turn_start is not None:
            starts.update(int(x) for x in self.turn_start.tolist())
        return starts

    def accepted_or_zero(self) -> torch.Tensor:
        if self.accepted is None:
            return torch.zeros(self.num_steps, dtype=torch.int32)
        return self.accepted

    def step_offsets(self) -> torch.Tensor:
        """int64 [T + 1]: where each step's scores start in `scores`."""
        if self._offsets is None:
            lo = self.layer_offsets()
            self._offsets = torch.cat([lo[:, 0], lo[-1:, -1]])
        return self._offsets

    def layer_offsets(self) -> torch.Tensor:
        """int64 [T, L + 1]: where layer l of step t starts in `scores` (column L: step t's
        end)."""
        if self._layer_offsets is None:
            per_layer = self.row_len.to(torch.int64).sum(2).flatten()
            ends = per_layer.cumsum(0).view(self.num_steps, self.num_layers)
            self._layer_offsets = torch.cat([ends[:, :1] - per_layer.view_as(ends)[:, :1], ends],
                                            dim=1)
        return self._layer_offsets

    def step_scores(self, t: int, width: Optional[int] = None,
                    layers: Optional[tuple[int, int]] = None,
                    rows: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """float32 [L', R', width] dense scores of step t, -inf past each row's length; layers
        and rows: [lo, hi) ranges (default all); width: default the widest of those rows."""
        l0, l1 = layers or (0, self.num_layers)
        r0, r1 = rows or (0, self.next_n)
        lens = self.row_len[t, l0:l1].to(torch.int64)                    # [L', R]
        offsets = self.layer_offsets()[t]
        start, end = int(offsets[l0]), int(offsets[l1])
        flat = self.scores[start:end].float()
        if (r0, r1) == (0, self.next_n):
            width = int(lens.max()) if width is None else width
            if bool((lens == width).all()):
                return flat.view(lens.shape[0], lens.shape[1], width)
        row_start = (lens.flatten().cumsum(0) - lens.flatten()).view_as(lens)[:, r0:r1]
        lens = lens[:, r0:r1]
        width = int(lens.max()) if width is None else width
        pos = torch.arange(width)
        valid = pos < lens.unsqueeze(-1)
        idx = (row_start.unsqueeze(-1) + pos).clamp(max=max(flat.numel() - 1, 0))
        out = flat[idx] if flat.numel() else torch.zeros(idx.shape)
        return out.masked_fill(~valid, float("-inf"))

    def keep_layers(self, layers: list[int]) -> "SpinTrace":
        """The trace of these indexer layers only, in this order (a smaller file: `trace
        --layers`)."""
        if not layers or any(not 0 <= l < self.num_layers for l in layers):
            raise TraceError(f"layers {layers}: pick from 0..{self.num_layers - 1}")
        if len(set(layers)) != len(layers):
            raise TraceError(f"layers {layers}: a layer is named twice")
        offsets = self.layer_offsets()
        scores = torch.cat([self.scores[int(offsets[t, l]):int(offsets[t, l + 1])]
                            for t in range(self.num_steps) for l in layers]) \
            if self.num_steps else self.scores
        pick = lambda x, dim: None if x is None else x.index_select(dim, torch.tensor(layers))
        return replace(self, scores=scores, row_len=pick(self.row_len, 1).contiguous(),
                       q=pick(self.q, 1), w=pick(self.w, 1), keys=pick(self.keys, 0),
                       _offsets=None, _layer_offsets=None)

    # ---- validation -------------------------------------------------------------------------
    def validate(self) -> "SpinTrace":
        where = f"trace {one_line(self.name, 300)}"

        def fail(msg: str) -> None:
            raise TraceError(f"{where}: {msg}")

        for key, value in (("index_topk", self.index_topk), ("block_size", self.block_size),
                           ("compress_ratio", self.compress_ratio)):
            if value is None and key == "compress_ratio":
                continue
            if (not isinstance(value, int) or isinstance(value, bool)
                    or not 1 <= value <= META_BOUNDS[key]):
                fail(f"metadata {key} must be a positive integer <= {META_BOUNDS[key]}, "
                     f"got {shown(value)}")
        for name, tensor, dtypes, ndim in (
                ("scores", self.scores, (torch.float16, torch.float32), 1),
                ("row_len", self.row_len, (torch.int32,), 3),
                ("query_pos", self.query_pos, (torch.int32,), 2)):
            if not isinstance(tensor, torch.Tensor):
                fail(f"tensor '{name}' is missing")
            if tensor.dtype not in dtypes:
                fail(f"tensor '{name}' must be {'/'.join(str(d).split('.')[-1] for d in dtypes)}, "
                     f"got {str(tensor.dtype).split('.')[-1]}")
            if tensor.dim() != ndim:
                fail(f"tensor '{name}' must have {ndim} dims, got shape {list(tensor.shape)}")
        T, L, R = self.row_len.shape
        if T < 1 or L < 1 or R < 1:
            fail(f"row_len shape {list(self.row_len.shape)} must be [T>=1, L>=1, R>=1]")
        if R > MAX_NEXT_N:      # replay pads a step's rows to the longest: bounded by R
            fail(f"row_len has {R} rows per step (next_n); at most {MAX_NEXT_N} (the query row "
                 f"and up to {MAX_NEXT_N - 1} MTP drafts)")
        if tuple(self.query_pos.shape) != (T, R):
            fail(f"query_pos shape {list(self.query_pos.shape)} must be [T, R] = [{T}, {R}]")
        if bool((self.row_len < 1).any()):
            t, l, r = (self.row_len < 1).nonzero()[0].tolist()
            fail(f"row_len[{t},{l},{r}] = {int(self.row_len[t, l, r])}: every row needs >= 1 slot")
        total = int(self.row_len.to(torch.int64).sum())
        if total != self.scores.numel():
            fail(f"scores has {self.scores.numel()} values but row_len sums to {total} "
                 f"(truncated or mismatched packing)")
        q = self.query_pos.unsqueeze(1)
        too_small = q < self.row_len - 1
        if bool(too_small.any()):
            t, l, r = too_small.nonzero()[0].tolist()
            fail(f"query_pos[{t},{r}] = {int(self.query_pos[t, r])} is before the last visible "
                 f"slot {int(self.row_len[t, l, r]) - 1} of layer {l} (offsets q - i must be >= 0)")
        # D is indexed by q - i, so q far past the context would need a huge D state
        too_far = q.to(torch.int64) > 2 * self.row_len.to(torch.int64) - 1
        if bool(too_far.any()):
            t, l, r = too_far.nonzero()[0].tolist()
            fail(f"query_pos[{t},{r}] = {int(self.query_pos[t, r])} is more than row_len "
                 f"{int(self.row_len[t, l, r])} slots past the last visible slot of layer {l} "
                 f"(need q <= 2 * row_len - 1)")
        if not bool(torch.isfinite(self.scores).all()):
            bad = int((~torch.isfinite(self.scores)).nonzero()[0])
            fail(f"scores[{bad}] = {float(self.scores[bad])} is not finite")
        if self.turn_start is not None:
            ts = self.turn_start
            if ts.dtype != torch.int32 or ts.dim() != 1:
                fail(f"tensor 'turn_start' must be int32 [n], got {str(ts.dtype).split('.')[-1]} "
                     f"{list(ts.shape)}")
            if bool(((ts < 0) | (ts >= T)).any()):
                fail(f"turn_start values must be step indices in [0, {T}), got {ts.tolist()[:8]}")
        if self.accepted is None:
            if R > 1:
                fail(f"tensor 'accepted' is required when next_n = {R} > 1")
        else:
            acc = self.accepted
            if acc.dtype != torch.int32 or tuple(acc.shape) != (T,):
                fail(f"tensor 'accepted' must be int32 [T] = [{T}], got "
                     f"{str(acc.dtype).split('.')[-1]} {list(acc.shape)}")
            if bool(((acc < 0) | (acc > R - 1)).any()):
                t = int(((acc < 0) | (acc > R - 1)).nonzero()[0])
                fail(f"accepted[{t}] = {int(acc[t])} is outside [0, next_n - 1 = {R - 1}]")
        self._validate_v2(fail)
        return self

    def _validate_v2(self, fail) -> None:
        """q, w and keys (version 2): all or none, dtypes, shapes against T, L, R, finite."""
        given = {n: getattr(self, n) for n in V2_TENSORS}
        present = [n for n, v in given.items() if v is not None]
        if not present:
            return
        if len(present) < len(V2_TENSORS):
            missing = [n for n in V2_TENSORS if n not in present]
            fail(f"tensor '{missing[0]}' is missing: q, w and keys come together "
                 f"(found {present})")
        T, L, R = self.row_len.shape
        for name, dtype, ndim, dims in (("q", torch.float16, 5, "[T, L, R, H, D]"),
                                        ("w", torch.float32, 4, "[T, L, R, H]"),
                                        ("keys", torch.float16, 3, "[L, S, D]")):
            tensor = given[name]
            if not isinstance(tensor, torch.Tensor):
                fail(f"tensor '{name}' must be a tensor, got {type(tensor).__name__}")
            if tensor.dtype != dtype or tensor.dim() != ndim:
                fail(f"tensor '{name}' must be {str(dtype).split('.')[-1]} {dims}, got "
                     f"{str(tensor.dtype).split('.')[-1]} {list(tensor.shape)}")
        q, w, keys = self.q, self.w, self.keys
        H, D = int(q.shape[3]), int(q.shape[4])
        if tuple(q.shape[:3]) != (T, L, R) or H < 1 or D < 1:
            fail(f"tensor 'q' shape {list(q.shape)} must be [T, L, R, H>=1, D>=1] with "
                 f"[T, L, R] = {[T, L, R]} (row_len)")
        if tuple(w.shape) != (T, L, R, H):
            fail(f"tensor 'w' shape {list(w.shape)} must be [T, L, R, H] = {[T, L, R, H]}")
        if keys.shape[0] != L or keys.shape[2] != D:
            fail(f"tensor 'keys' shape {list(keys.shape)} must be [L, S, D] with L = {L}, "
                 f"D = {D} (q)")
        if keys.shape[1] < self.max_slots:
            fail(f"tensor 'keys' has {keys.shape[1]} slots but rows see up to "
                 f"{self.max_slots} (need S >= max row_len)")
        for name in V2_TENSORS:
            tensor = given[name]
            finite = torch.isfinite(tensor)
            if not bool(finite.all()):
                at = (~finite).nonzero()[0].tolist()
                fail(f"tensor '{name}'{at} = {float(tensor[tuple(at)])} is not finite")

    # ---- the v2 identity ----------------------------------------------------------------------
    def check_scores(self, max_rows: Optional[int] = 256,
                     tol: Optional[float] = SCORE_TOLERANCE) -> float:
        """Recompute scores from q, w and keys and compare:
        scores[t, l, r, s] = sum_h w[t, l, r, h] * relu(q[t, l, r, h, :] . keys[l, s, :]).

        Rows checked: all of them, or `max_rows` spread evenly over (step, layer, row) order.
        Slots checked: every visible slot of a committed row (r <= accepted[t]); a rejected
        MTP draft row only on the slots its step's accepted row sees (its later slots held
        draft keys that the next step overwrote, so `keys` has other values there). The error
        of a row is max |stored - recomputed| over max(|stored|, |recomputed|) of the row's
        checked slots (0 for an all-zero row). Returns the largest error; raises TraceError
        naming the worst row and slot when it is over `tol` (None: never)."""
        where = f"trace {one_line(self.name, 300)}"
        if self.q is None:
            raise TraceError(f"{where}: no q, w and keys to check the scores against "
                             f"(version 1)")
        T, L, R = self.row_len.shape
        lens = self.row_len.to(torch.int64)
        if R > 1:                                # rejected rows: only the committed slots
            acc = self.accepted_or_zero().to(torch.int64).view(T, 1, 1).expand(T, L, 1)
            committed = lens.gather(2, acc)
            rejected = torch.arange(R).view(1, 1, R) > acc
            lens = torch.where(rejected, torch.minimum(lens, committed), lens)
        flat_len = self.row_len.to(torch.int64).flatten()
        row_start = flat_len.cumsum(0) - flat_len
        rows = T * L * R
        if max_rows is not None and rows > max_rows:
            picks = torch.linspace(0, rows - 1, max(max_rows, 1)).round().to(torch.int64)
            picks = picks.unique().tolist()
        else:
            picks = range(rows)
        worst = (0.0, 0, 0, 0.0, 0.0)           # error, row, slot, stored, recomputed
        chunk = 1 << 15
        for i in picks:
            t, rest = divmod(i, L * R)
            l, r = divmod(rest, R)
            n = int(lens[t, l, r])
            start = int(row_start[i])
            q = self.q[t, l, r].float()                      # [H, D]
            w = self.w[t, l, r].float()                      # [H]
            got = torch.cat([torch.relu(self.keys[l, s:min(s + chunk, n)].float() @ q.T) @ w
                             for s in range(0, n, chunk)])
            stored = self.scores[start:start + n].float()
            scale = float(torch.maximum(stored.abs().max(), got.abs().max()))
            if scale == 0.0:
                continue
            diff = (stored - got).abs()
            s = int(diff.argmax())
            err = float(diff[s]) / scale
            if err > worst[0]:
                worst = (err, i, s, float(stored[s]), float(got[s]))
        err, i, s, stored, got = worst
        if tol is not None and err > tol:
            t, rest = divmod(i, L * R)
            l, r = divmod(rest, R)
            raise TraceError(f"{where}: scores do not match sum_h w * relu(q . keys): step {t}, "
                             f"layer {l}, row {r}, slot {s}: stored {stored:.6g}, from q/w/keys "
                             f"{got:.6g} (error {err:.3g} of the row's max |score|, tolerance "
                             f"{tol:g})")
        return err

    # ---- file I/O ---------------------------------------------------------------------------
    def metadata(self) -> dict[str, str]:
        meta = {"format": FORMAT, "version": str(self.version), "index_topk": str(self.index_topk),
                "block_size": str(self.block_size), "next_n": str(self.next_n)}
        if self.compress_ratio is not None:
            meta["compress_ratio"] = str(self.compress_ratio)
        if self.source is not None:
            meta["source"] = self.source
        return meta

    def save(self, path: str | Path) -> Path:
        from safetensors.torch import save_file

        self.validate()
        tensors = {"scores": self.scores.contiguous(), "row_len": self.row_len.contiguous(),
                   "query_pos": self.query_pos.contiguous()}
        if self.turn_start is not None:
            tensors["turn_start"] = self.turn_start.contiguous()
        if self.accepted is not None:
            tensors["accepted"] = self.accepted.contiguous()
        if self.q is not None:
            tensors.update(q=self.q.contiguous(), w=self.w.contiguous(),
                           keys=self.keys.contiguous())
        path = Path(path)
        try:
            write_output(path, "trace", writer=lambda tmp: save_file(
                tensors, tmp, metadata=self.metadata()), error=TraceError)
        except TraceError:
            raise
        except Exception as err:  # safetensors' own error type
            raise TraceError(f"trace {one_line(path, 300)}: cannot write "
                             f"({one_line(err, 200)})") from None
        return path

    @classmethod
    def load(cls, path: str | Path) -> "SpinTrace":
        from safetensors import safe_open

        where = f"trace {one_line(path, 300)}".rstrip()
        # the larger (v2) limit first; a v1 file is held to its own once its version is read
        path = check_input_file(path, where, max(MAX_BYTES.values()), TraceError)  # '' is not '.'

        def read(load_tensors: bool):
            try:
                with library_path(path) as name, safe_open(name, framework="pt") as f:
                    if load_tensors:
                        return {k: f.get_tensor(k) for k in f.keys()}
                    return f.metadata() or {}, set(f.keys())
            except Exception as err:  # safetensors' own types for truncated/garbage files
                raise TraceError(f"{where}: not a readable safetensors file "
                                 f"({one_line(' '.join(str(err).split()), 200)})") from None

        meta, names = read(False)
        if meta.get("format") != FORMAT:
            raise TraceError(f"{where}: metadata format must be '{FORMAT}', "
                             f"got {shown(meta.get('format'))}")
        version = meta.get("version")
        if version not in VERSIONS:
            raise TraceError(f"{where}: unsupported version {shown(version)} "
                             f"(this reader handles versions {', '.join(VERSIONS)})")
        size = path.stat().st_size
        if size > MAX_BYTES[version]:
            raise TraceError(f"{where}: cannot read ({size:,} bytes, over the limit of "
                             f"{size_text(MAX_BYTES[version])} for version {version})")
        unknown_meta = sorted(set(meta) - set(REQUIRED_META) - set(OPTIONAL_META))
        if unknown_meta:
            raise TraceError(f"{where}: unknown metadata keys {shown(unknown_meta, 200)}")
        missing_meta = [k for k in REQUIRED_META if k not in meta]
        if missing_meta:
            raise TraceError(f"{where}: missing metadata keys {missing_meta}")
        missing = [k for k in REQUIRED_TENSORS if k not in names]
        if missing:
            raise TraceError(f"{where}: missing tensors {missing} "
                             f"(found {shown(sorted(names), 200)})")
        allowed = REQUIRED_TENSORS + OPTIONAL_TENSORS + (V2_TENSORS if version == "2" else ())
        unknown = sorted(names - set(allowed))
        if unknown:
            later = " (q, w and keys need version 2)" if set(unknown) & set(V2_TENSORS) else ""
            raise TraceError(f"{where}: unknown tensors {shown(unknown, 200)} "
                             f"(allowed in version {version}: {list(allowed)}){later}")
        tensors = read(True)

        def meta_int(key: str) -> Optional[int]:
            if key not in meta:
                return None
            value = meta[key]
            if not (value.isascii() and value.isdigit() and len(value) <= 19):
                raise TraceError(f"{where}: metadata {key} must be an integer, "
                                 f"got {shown(value)}")
            return int(value)           # its range: validate()

        trace = cls(scores=tensors["scores"], row_len=tensors["row_len"],
                    query_pos=tensors["query_pos"], index_topk=meta_int("index_topk"),
                    block_size=meta_int("block_size"), turn_start=tensors.get("turn_start"),
                    accepted=tensors.get("accepted"), compress_ratio=meta_int("compress_ratio"),
                    source=meta.get("source"), q=tensors.get("q"), w=tensors.get("w"),
                    keys=tensors.get("keys"), name=printable(path))
        if trace.row_len.dim() == 3 and meta_int("next_n") != trace.next_n:
            raise TraceError(f"{where}: metadata next_n = {shown(meta['next_n'])} but row_len has "
                             f"{trace.next_n} rows per step")
        return trace.validate()
