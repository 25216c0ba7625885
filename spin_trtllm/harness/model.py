"""dsa-lite model: weights, caches and one batched forward pass over [B, R] query rows.

The same forward serves decode steps (R = next_n rows: the pending token and its MTP drafts)
and prefill chunks (R = up to prefill_chunk prompt tokens of one request). Every shape depends
only on (B, R) and every write goes to a static location, so a decode step can be captured in
a CUDA graph. Rows of a request sit at consecutive positions; their KV is written before
anyone reads it, and causality comes from masks.
"""

from __future__ import annotations

import math
import os
import resource
from pathlib import Path
from typing import Any, Mapping, Optional, Protocol

import torch
from safetensors.torch import load_file, save_file

from .._inputs import (CHECKPOINT_MAX_BYTES, approx_size, check_input_file, library_path,
                       shown)
from .._outputs import write_output
from ..errors import SpinError
from .. import reference as ref
from ..limits import BLOCK_SLOTS, KEY_BYTES, PAGE_SIZES, SLOT_BYTES
from ..limits import HEAD_DIM, INDEX_HEADS
from .config import INDEX_RATIOS, DsaLiteConfig

FP8_MAX = 448.0


def check_page_slots(page_slots: int) -> int:
    """page_slots (slots per indexer K-cache page) as given, or SpinError naming it."""
    if page_slots not in PAGE_SIZES:
        raise SpinError(f"page_slots must be one of {', '.join(map(str, PAGE_SIZES))} (slots "
                        f"per indexer K-cache page), got {page_slots!r}")
    return page_slots


class Indexer(Protocol):
    def layer(self, layer: int, q: torch.Tensor, weights: torch.Tensor,
              kv_cache: torch.Tensor) -> torch.Tensor: ...


# ---- weights ----------------------------------------------------------------------------------
def _layer_shapes(cfg: DsaLiteConfig, r: int) -> dict[str, tuple[int, ...]]:
    H, hd = cfg.hidden, cfg.head_dim
    shapes = {"attn_norm": (H,), "wq": (H, cfg.heads * hd), "wk": (H, hd), "wv": (H, hd),
              "wo": (cfg.heads * hd, H), "ffn_norm": (H,), "w1": (H, cfg.ffn),
              "w3": (H, cfg.ffn), "w2": (cfg.ffn, H)}
    if r:
        shapes |= {"comp_gate": (hd,), "comp_bias": (r,)}
    if r in INDEX_RATIOS:
        shapes |= {"wiq": (H, INDEX_HEADS * HEAD_DIM), "wiw": (H, INDEX_HEADS),
                   "wik": (H, HEAD_DIM), "icomp_gate": (HEAD_DIM,), "icomp_bias": (r,)}
    return shapes


def weight_shapes(cfg: DsaLiteConfig) -> dict[str, tuple[int, ...]]:
    shapes = {"embed": (cfg.vocab_size, cfg.hidden), "final_norm": (cfg.hidden,),
              "lm_head": (cfg.hidden, cfg.vocab_size)}
    for i, r in enumerate(cfg.compress_ratios):
        shapes |= {f"layers.{i}.{k}": s for k, s in _layer_shapes(cfg, r).items()}
    if cfg.mtp_depth:
        shapes |= _mtp_shapes(cfg)
    return shapes


def _mtp_shapes(cfg: DsaLiteConfig) -> dict[str, tuple[int, ...]]:
    """The MTP head (one head, whatever the draft depth)."""
    H = cfg.hidden
    return {"mtp.norm_h": (H,), "mtp.norm_e": (H,), "mtp.proj": (2 * H, H),
            "mtp.ffn_norm": (H,), "mtp.w1": (H, cfg.ffn), "mtp.w3": (H, cfg.ffn),
            "mtp.w2": (cfg.ffn, H)}


def weight_count(cfg: DsaLiteConfig) -> int:
    """Parameters of the model `cfg` describes (computed from the shapes, nothing allocated)."""
    return sum(math.prod(s) for s in weight_shapes(cfg).values())


# the dtypes a weight may have (torch, and as a safetensors header names them)
WEIGHT_DTYPES = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
                 torch.float64: "F64"}
_STORED_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


def _allowed_shapes(cfg: DsaLiteConfig) -> tuple[dict, dict]:
    """(the tensors the model needs, those it may be given besides): a config without MTP
    (mtp_depth 0) may be given an MTP head it does not use (a checkpoint trained with one)."""
    return weight_shapes(cfg), ({} if cfg.mtp_depth else _mtp_shapes(cfg))


def _check_names(cfg: DsaLiteConfig, names, what: str) -> dict[str, tuple[int, ...]]:
    needed, optional = _allowed_shapes(cfg)
    bad = [k for k in names if not isinstance(k, str)]
    if bad:
        raise SpinError(f"{what}: tensor names must be strings, got {shown(bad[0], 60)}")
    missing = sorted(set(needed) - set(names))
    extra = sorted(set(names) - set(needed) - set(optional))
    if missing or extra:
        parts = [f"{label} {shown(names[:5], 300)}" + (f" ({len(names):,} in all)"
                                                         if len(names) > 5 else "")
                 for label, names in (("missing", missing), ("unexpected", extra)) if names]
        raise SpinError(f"{what}: {', '.join(parts)} against the config's model")
    return needed | optional


def check_weights(cfg: DsaLiteConfig, weights: Any, what: str = "weights") -> None:
    """The one check every path that takes weights runs (load_checkpoint, Engine): exactly
    the tensors weight_shapes(cfg) names (plus an unused MTP head, see _allowed_shapes), each
    a dense tensor of a floating dtype (float16, bfloat16, float32, float64) with exactly its
    shape (a [1]-shaped norm would broadcast silently), every value finite and within the
    range of the model's dtype (NaN weights give NaN logits, argmax 0 on every row)."""
    if not isinstance(weights, Mapping):
        raise SpinError(f"{what}: expected a mapping of name -> tensor, got "
                        f"{type(weights).__name__}")
    shapes = _check_names(cfg, list(weights), what)
    for name, v in weights.items():
        if not isinstance(v, torch.Tensor):
            raise SpinError(f"{what}: {name} is a {type(v).__name__}, not a tensor")
        if v.layout != torch.strided or v.device.type == "meta":
            raise SpinError(f"{what}: {name} must be a dense tensor with data, got layout "
                            f"{v.layout} on {v.device}")
        if v.dtype not in WEIGHT_DTYPES:
            raise SpinError(f"{what}: {name} has dtype {v.dtype}; weights are float16, "
                            f"bfloat16, float32 or float64")
        if tuple(v.shape) != shapes[name]:
            raise SpinError(f"{what}: {name} has shape {list(v.shape)}, expected "
                            f"{list(shapes[name])}")
    top = torch.finfo(getattr(torch, cfg.dtype)).max
    for name, v in weights.items():
        if not bool(torch.isfinite(v).all()):
            bad = int((~torch.isfinite(v)).sum())
            raise SpinError(f"{what}: {name} has {bad:,} NaN or infinite values")
        if torch.finfo(v.dtype).max > top and float(v.abs().max()) > top:
            raise SpinError(f"{what}: {name} has values up to {float(v.abs().max()):.3g}, "
                            f"beyond {cfg.dtype}'s range (the model's dtype)")


def init_weights(cfg: DsaLiteConfig) -> dict[str, torch.Tensor]:
    """Seeded random weights (fan-in scaled normals; norms at 1; biases 0)."""
    g = torch.Generator().manual_seed(cfg.seed)
    out = {}
    for name, shape in weight_shapes(cfg).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("norm") or leaf.startswith("norm"):
            out[name] = torch.ones(shape)
        elif leaf.endswith("bias"):
            out[name] = torch.zeros(shape)
        elif len(shape) == 1:
            out[name] = torch.randn(shape, generator=g) / math.sqrt(shape[0])
        elif name == "embed":
            out[name] = torch.randn(shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g) * (cfg.init_std / math.sqrt(shape[0]))
    return out


def save_checkpoint(path: str | Path, cfg: DsaLiteConfig, weights: dict[str, torch.Tensor],
                    dtype: torch.dtype = torch.float32, extra: Optional[dict[str, str]] = None) -> None:
    """safetensors with the DsaLiteConfig (and `extra` strings) in its metadata; float16
    storage halves a shipped checkpoint (weights load back into the config's dtype)."""
    meta = {"format": "dsa-lite", "config": cfg.to_json(), **(extra or {})}
    tensors = {k: v.detach().to(dtype).cpu().contiguous() for k, v in weights.items()}
    write_output(path, "checkpoint", writer=lambda tmp: save_file(tensors, tmp, metadata=meta))


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    with library_path(path) as name:
        return load_file(name)


def load_checkpoint(path: str | Path) -> tuple[DsaLiteConfig, dict[str, torch.Tensor]]:
    """A safetensors checkpoint with its DsaLiteConfig in the metadata, as float32 tensors.
    Checked before any tensor is read: the file (a regular file of at most 4 GiB), its config
    (DsaLiteConfig.from_json: ranges, types, JSON depth), the header's names, dtypes and
    shapes against the config, and the memory loading takes; then check_weights."""
    from safetensors import safe_open

    what = f"checkpoint {path}"
    path = check_input_file(path, what, CHECKPOINT_MAX_BYTES, verb="not a readable safetensors file")
    try:
        with library_path(path) as name, safe_open(name, "pt") as f:
            meta = f.metadata() or {}
            header = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape()))
                      for k in f.keys()}
    except Exception as err:  # safetensors raises several types for bad files
        raise SpinError(f"{what}: not a readable safetensors file ({err})") from None
    if meta.get("format") != "dsa-lite" or "config" not in meta:
        raise SpinError(f"{what}: metadata must have format=dsa-lite and a config")
    cfg = DsaLiteConfig.from_json(meta["config"], f"{what}: config")
    shapes = _check_names(cfg, list(header), what)
    for name, (dtype, shape) in header.items():
        if dtype not in _STORED_BYTES:
            raise SpinError(f"{what}: {name} is stored as {shown(dtype, 20)}; weights are F16, "
                            f"BF16, F32 or F64")
        if shape != shapes[name]:
            raise SpinError(f"{what}: {name} has shape {list(shape)}, expected "
                            f"{list(shapes[name])}")
    # read in the stored dtype, then a float32 copy of each
    need = sum(math.prod(shape) * (_STORED_BYTES[dtype] + 4) for dtype, shape in header.values())
    check_memory(need, "cpu", f"{what}: loading it")
    weights = {k: v.float() for k, v in _load_tensors(path).items()}
    check_weights(cfg, weights, what)
    return cfg, weights


# ---- memory -------------------------------------------------------------------------------------
def _proc_kib(path: str, key: str) -> Optional[int]:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_free() -> Optional[int]:
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as a, open(usage) as b:
                cap, used = a.read().strip(), int(b.read().strip())
        except (OSError, ValueError):
            continue
        if cap.isdigit() and int(cap) < 1 << 60:
            return int(cap) - used
    return None


def host_free_memory() -> tuple[int, str]:
    """Bytes this process may still allocate on the host, and what bounds them: the host's
    available memory (MemAvailable; else its physical memory), a cgroup's limit, and the
    process's address-space limit (RLIMIT_AS) less what it has mapped."""
    avail = _proc_kib("/proc/meminfo", "MemAvailable")
    options = [(avail, "available on the host")] if avail is not None else \
        [(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "of host memory")]
    cgroup = _cgroup_free()
    if cgroup is not None:
        options.append((cgroup, "left under the cgroup's memory limit"))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        mapped = _proc_kib("/proc/self/status", "VmSize") or 0
        options.append((soft - mapped, "left under the address-space limit (ulimit -v)"))
    free, where = min(options)
    return max(free, 0), where


def free_memory(device: torch.device | str) -> tuple[int, str]:
    """Bytes this process may still allocate on `device` (CUDA: free device memory plus what
    torch's allocator holds unused; CPU: host_free_memory) and what bounds them."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + held, f"free on {device}"
    return host_free_memory()


def check_memory(need: int, device: torch.device | str, what: str) -> None:
    """SpinError (one line) when an estimate of `need` bytes exceeds free_memory(device)."""
    free, where = free_memory(device)
    if need > free:
        raise SpinError(f"{what} needs about {approx_size(need)} of memory; "
                        f"{approx_size(free)} {where}")


# ---- caches -----------------------------------------------------------------------------------
class Caches:
    """Per-request KV of every layer plus the paged FP8 indexer K cache of the CSA layers.

    Cache slot `max_requests` is scratch: rows that must not write anywhere write there, so
    every write in a forward pass has a static shape. Indexer pages (page_slots slots each:
    64, or 32 where a SPIN block spans two pages; the block table counts pages) are handed out
    as contexts grow; page `num_pages` is scratch in the same way.
    """

    def __init__(self, cfg: DsaLiteConfig, max_requests: int, num_pages: int,
                 device: torch.device, page_slots: int = BLOCK_SLOTS):
        dt = getattr(torch, cfg.dtype)
        S = max_requests + 1
        self.page_slots = P = check_page_slots(page_slots)
        self.cfg, self.max_requests, self.num_pages = cfg, max_requests, num_pages
        self.scratch_slot, self.scratch_page = max_requests, num_pages
        hd = cfg.head_dim
        self.ring_k = [torch.zeros(S, cfg.ring, hd, dtype=dt, device=device)
                       for _ in cfg.compress_ratios]
        self.ring_v = [torch.zeros_like(t) for t in self.ring_k]
        # compressed entries: one vector per group, used as key and value (shared KV)
        self.comp = {i: torch.zeros(S, cfg.max_context // r + 1, hd, dtype=dt, device=device)
                     for i, r in enumerate(cfg.compress_ratios) if r}
        self.ring_ik = {i: torch.zeros(S, cfg.ring, HEAD_DIM, dtype=dt, device=device)
                        for i in cfg.csa_layers}
        self.index = [torch.zeros(num_pages + 1, P, 1, SLOT_BYTES, dtype=torch.uint8,
                                  device=device) for _ in cfg.csa_layers]
        self.max_pages = math.ceil(cfg.index_slots / P)
        self.block_table = torch.full((S, self.max_pages), -1, dtype=torch.int32, device=device)
        self._pages: dict[int, list[int]] = {}
        self._free = list(range(num_pages - 1, -1, -1))

    def nbytes(self) -> int:
        tensors = self.ring_k + self.ring_v + list(self.comp.values()) + \
            list(self.ring_ik.values()) + self.index
        return sum(t.numel() * t.element_size() for t in tensors)

    @staticmethod
    def estimate_bytes(cfg: DsaLiteConfig, max_requests: int, num_pages: int,
                       page_slots: int = BLOCK_SLOTS) -> int:
        """What __init__ allocates (nbytes() plus the block table and the free-page list),
        computed without allocating: memory estimates check it before the caches exist."""
        S, dt = max_requests + 1, getattr(torch, cfg.dtype).itemsize
        rings = (2 * len(cfg.compress_ratios) * cfg.head_dim + len(cfg.csa_layers) * HEAD_DIM) \
            * S * cfg.ring * dt
        comp = sum(S * (cfg.max_context // r + 1) * cfg.head_dim * dt
                   for r in cfg.compress_ratios if r)
        index = len(cfg.csa_layers) * (num_pages + 1) * page_slots * SLOT_BYTES
        table = S * math.ceil(cfg.index_slots / page_slots) * 4
        return rings + comp + index + table + 36 * num_pages      # a Python int per free page

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def ensure_pages(self, slot: int, index_slots: int) -> None:
        """Give cache slot `slot` pages for `index_slots` indexer slots."""
        pages = self._pages.setdefault(slot, [])
        need = math.ceil(index_slots / self.page_slots)
        if need > self.max_pages:
            raise SpinError(f"{index_slots} indexer slots exceed the cache's {self.max_pages} "
                            f"pages per request")
        if need - len(pages) > len(self._free):
            raise SpinError(f"indexer K cache out of pages ({len(self._free)} free, "
                            f"{need - len(pages)} needed)")
        new = []
        while len(pages) < need:
            new.append(self._free.pop())
            pages.append(new[-1])
        if new:
            start = len(pages) - len(new)
            self.block_table[slot, start:len(pages)] = torch.tensor(new, dtype=torch.int32)

    def release(self, slot: int) -> None:
        pages = self._pages.pop(slot, [])
        self._free.extend(reversed(pages))
        self.block_table[slot] = -1

    def fill_random(self, slot: int, context_tokens: int, seed: int) -> None:
        """Seeded random contents for cache slot `slot`'s KV rings, compressed entries and the
        indexer pages of `context_tokens` tokens (benchmarks: step times do not depend on the
        values). The slot's pages must be there (ensure_pages)."""
        device, P = self.block_table.device, self.page_slots
        g = torch.Generator(device).manual_seed(seed)
        for t in self.ring_k + self.ring_v + list(self.ring_ik.values()) + list(self.comp.values()):
            t[slot] = torch.randn(t.shape[1:], generator=g, device=device).to(t.dtype)
        pages = self.block_table[slot, :math.ceil((context_tokens // self.cfg.index_ratio + 1)
                                                  / P)]
        for kv in self.index:
            keys = torch.randn(len(pages), P * KEY_BYTES, generator=g,
                               device=device).to(torch.float8_e4m3fn).view(torch.uint8)
            scales = (torch.rand(len(pages), P, generator=g, device=device)
                      * 0.01 + 0.001).view(torch.uint8)
            kv.view(kv.shape[0], -1)[pages.long()] = torch.cat([keys, scales], 1)


# ---- the prefill indexer ------------------------------------------------------------------------
class PrefillIndexer:
    """Dense top-K for the rows of one prefill chunk (plain PyTorch over the request's pages):
    every 64-slot block of the request, each page_slots-slot page read through its block
    table (a block spans 64 / page_slots pages)."""

    def __init__(self, k: int, dtype: torch.dtype, page_slots: int = BLOCK_SLOTS):
        self.k, self.dtype = k, dtype
        self.page_slots = check_page_slots(page_slots)

    def prepare(self, context_lens: torch.Tensor, block_table: torch.Tensor) -> None:
        self.context_lens, self.block_table = context_lens, block_table
        self.blocks = math.ceil(int(context_lens.max()) / BLOCK_SLOTS)

    def layer(self, layer, q, weights, kv_cache) -> torch.Tensor:
        rows, nb = q.shape[0], self.blocks
        if nb == 0:
            return torch.full((rows, self.k), -1, dtype=torch.int32, device=q.device)
        # the request's pages, gathered so that page column c is page c of the copy
        per = BLOCK_SLOTS // self.page_slots
        pages = kv_cache[self.block_table[0, :nb * per].long()]
        cols = torch.arange(pages.shape[0], dtype=torch.int32, device=q.device).view(1, -1)
        ids = torch.arange(nb, dtype=torch.int32, device=q.device).view(1, -1)
        counts = torch.tensor([nb], dtype=torch.int32, device=q.device)
        dt = torch.float64 if self.dtype == torch.float64 else torch.float32
        logits = ref.masked_indexer_logits(q, pages, weights, self.context_lens, cols, ids,
                                           counts, dtype=dt)
        return ref.topk_slots(logits, ids, counts, rows, self.k)


# ---- the forward pass ---------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float, dims: Optional[int] = None) -> torch.Tensor:
    """Rotate the first `dims` (all) channels of x [..., D] by positions pos (broadcast to
    x[..., 0]); pairs are (i, i + dims/2)."""
    D = x.shape[-1] if dims is None else dims
    half = D // 2
    freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float64) / half)
    ang = pos.to(torch.float64).unsqueeze(-1) * freq
    while ang.dim() < x.dim():
        ang = ang.unsqueeze(-2)
    # angles and their cos/sin in float64: positions in the thousands lose the angle in bf16
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b, rest = x[..., :half], x[..., half:D], x[..., D:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos, rest], -1)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 with an fp32 scale: x ~= fp8 * scale (scale = amax / 448)."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (xf / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def ffn(w: dict, p: str, h: torch.Tensor) -> torch.Tensor:
    """SwiGLU feed-forward of block `p` (a layer's, or "mtp.")."""
    x = rms_norm(h, w[p + "ffn_norm"])
    return (torch.nn.functional.silu(x @ w[p + "w1"]) * (x @ w[p + "w3"])) @ w[p + "w2"]


def mtp_step(w: dict, hidden: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP head: hidden state at t and token t + 1 -> (its hidden state, logits for t + 2)."""
    e = w["embed"][token]
    x = torch.cat([rms_norm(hidden, w["mtp.norm_h"]), rms_norm(e, w["mtp.norm_e"])], -1)
    hidden = x @ w["mtp.proj"]
    hidden = hidden + ffn(w, "mtp.", hidden)
    return hidden, (rms_norm(hidden, w["final_norm"]) @ w["lm_head"]).float()


class DsaLiteModel:
    def __init__(self, cfg: DsaLiteConfig, weights: dict[str, torch.Tensor],
                 device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.dtype = getattr(torch, cfg.dtype)
        self.w = {k: v.to(self.device, self.dtype) for k, v in weights.items()}
        self.csa_index = {layer: i for i, layer in enumerate(cfg.csa_layers)}
        self.head_scale = 1.0 / math.sqrt(cfg.head_dim)
        self.index_scale = 1.0 / math.sqrt(INDEX_HEADS * HEAD_DIM)

    # one (B, R) forward -------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor,
                block_table: torch.Tensor, caches: Caches, indexer: Indexer
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, pos: int64 [B, R] (consecutive positions per request); slot: int64 [B] cache
        slots; block_table: int32 [B, pages] indexer pages. Returns float32 logits [B, R, V]
        and the last hidden state [B, R, hidden]."""
        cfg, w = self.cfg, self.w
        B, R = tokens.shape
        h = w["embed"][tokens]
        last = torch.arange(R, device=pos.device) == R - 1
        ring_idx = pos % cfg.ring
        rows_slot = slot.unsqueeze(1).expand(B, R)
        for i, r in enumerate(cfg.compress_ratios):
            p = f"layers.{i}."
            x = rms_norm(h, w[p + "attn_norm"])
            q = rope((x @ w[p + "wq"]).view(B, R, cfg.heads, cfg.head_dim), pos, cfg.rope_theta)
            k = rope(x @ w[p + "wk"], pos, cfg.rope_theta)
            caches.ring_k[i][rows_slot, ring_idx] = k
            caches.ring_v[i][rows_slot, ring_idx] = x @ w[p + "wv"]
            # sliding window: positions pos - window + 1 .. pos
            wpos = pos.unsqueeze(-1) - torch.arange(cfg.window, device=pos.device)
            wslot = slot.view(B, 1, 1)
            keys = caches.ring_k[i][wslot, wpos % cfg.ring]
            values = caches.ring_v[i][wslot, wpos % cfg.ring]
            valid = wpos >= 0
            if r:
                comp = self._compress(i, r, pos, slot, last, caches, p)
                if r in INDEX_RATIOS:
                    ids = self._index(i, x, pos, slot, last, block_table, caches, indexer, p)
                    ckeys = comp[wslot, ids.clamp(min=0)]
                    cvalid = ids >= 0
                else:
                    n = comp.shape[1]
                    ids = torch.arange(n, device=pos.device)
                    ckeys = comp[slot].unsqueeze(1).expand(B, R, n, cfg.head_dim)
                    cvalid = ids < ((pos + 1) // r).unsqueeze(-1)
                keys = torch.cat([keys, ckeys], 2)
                values = torch.cat([values, ckeys], 2)
                valid = torch.cat([valid, cvalid], 2)
            att = torch.einsum("brhd,brnd->brhn", q, keys) * self.head_scale
            # torch.where, not masked_fill: masked_fill clones through a memcpy, which a
            # captured graph may run on a copy engine (a stall between kernels)
            att = torch.where(valid.unsqueeze(2), att, float("-inf")).softmax(-1)
            out = torch.einsum("brhn,brnd->brhd", att, values).reshape(B, R, -1)
            h = h + out @ w[p + "wo"]
            h = h + ffn(w, p, h)
        logits = (rms_norm(h, w["final_norm"]) @ w["lm_head"]).float()
        return logits, h

    def _group(self, ring: torch.Tensor, r: int, pos: torch.Tensor, slot: torch.Tensor,
               gate: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Softmax-gated pooling of the group holding each row: tokens g*r .. min(g*r + r - 1,
        the request's last row); rows of one group get identical values."""
        B, R = pos.shape
        gpos = (pos // r * r).unsqueeze(-1) + torch.arange(r, device=pos.device)   # [B, R, r]
        x = ring[slot.view(B, 1, 1), gpos % self.cfg.ring]                         # [B, R, r, d]
        score = x @ gate + bias
        score = torch.where(gpos > pos[:, -1:].unsqueeze(-1), float("-inf"), score)
        return (score.softmax(-1).unsqueeze(-1) * x).sum(-2)

    def _write_rows(self, pos: torch.Tensor, r: int, last: torch.Tensor) -> torch.Tensor:
        """Rows that store their group: the group's last token, or the request's last row."""
        return ((pos + 1) % r == 0) | last

    def _compress(self, i: int, r: int, pos, slot, last, caches: Caches, p: str) -> torch.Tensor:
        w = self.w
        value = self._group(caches.ring_k[i], r, pos, slot, w[p + "comp_gate"], w[p + "comp_bias"])
        store = self._write_rows(pos, r, last)
        tslot = torch.where(store, slot.unsqueeze(1), caches.scratch_slot)
        caches.comp[i][tslot, torch.where(store, pos // r, 0)] = value
        return caches.comp[i]

    def _index(self, i: int, x, pos, slot, last, block_table, caches: Caches,
               indexer: Indexer, p: str) -> torch.Tensor:
        """The lightning indexer of CSA layer i: store this step's compressed key, then ask the
        indexer for the top-K compressed slots of every row."""
        w, cfg = self.w, self.cfg
        B, R = pos.shape
        ci = self.csa_index[i]
        caches.ring_ik[i][slot.unsqueeze(1).expand(B, R), pos % cfg.ring] = x @ w[p + "wik"]
        ratio = cfg.index_ratio
        key = self._group(caches.ring_ik[i], ratio, pos, slot, w[p + "icomp_gate"],
                          w[p + "icomp_bias"])
        g = pos // ratio
        key = rope(key, g, cfg.rope_theta, dims=HEAD_DIM // 2)
        k8, kscale = quantize_rows_fp8(key)
        store = self._write_rows(pos, ratio, last)
        S = caches.page_slots                          # slot g: page column g // S, row g % S
        page = block_table.to(torch.int64).gather(1, (g // S).clamp(max=block_table.shape[1] - 1))
        store = store & (page >= 0)
        page = torch.where(store, page, caches.scratch_page)
        off = torch.where(store, g % S, 0)
        flat = caches.index[ci].view(-1)
        base = page * (S * SLOT_BYTES)
        kb = torch.arange(KEY_BYTES, device=pos.device)
        sb = torch.arange(4, device=pos.device)
        flat[(base + off * KEY_BYTES).unsqueeze(-1) + kb] = k8.view(torch.uint8)
        flat[(base + S * KEY_BYTES + off * 4).unsqueeze(-1) + sb] = \
            kscale.contiguous().view(torch.uint8).view(B, R, 4)
        # queries: RoPE on half of each head at the row's position in slot units
        iq = (x @ w[p + "wiq"]).view(B, R, INDEX_HEADS, HEAD_DIM)
        iq = rope(iq, pos.to(torch.float64) / ratio, cfg.rope_theta, dims=HEAD_DIM // 2)
        q8, qscale = quantize_rows_fp8(iq.reshape(B, R, -1))
        weights = (x @ w[p + "wiw"]).float() * (qscale.unsqueeze(-1) * self.index_scale)
        return indexer.layer(ci, q8.view(B * R, INDEX_HEADS, HEAD_DIM),
                             weights.view(B * R, INDEX_HEADS).contiguous(),
                             caches.index[ci]).view(B, R, -1).to(torch.int64)

    # MTP draft head ------------------------------------------------------------------------------
    def draft(self, hidden: torch.Tensor, token: torch.Tensor, depth: int) -> torch.Tensor:
        """Greedy drafts [B, depth] from the last accepted hidden state [B, H] and token [B]."""
        out = []
        for _ in range(depth):
            hidden, logits = mtp_step(self.w, hidden, token)
            token = logits.argmax(-1)
            out.append(token)
        return torch.stack(out, -1)
