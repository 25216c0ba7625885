"""Requests: what a caller submits (Request), what comes back (RequestOutput), the checks a
request passes before it is queued, and the engine's record of a live request (Live)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from ...errors import SpinError
from ...limits import BLOCK_SLOTS
from ..config import DsaLiteConfig


class RequestError(SpinError):
    """A request that cannot be served as given (the engine and other requests carry on)."""


Prompt = str | bytes | Sequence[int]


@dataclass
class Request:
    prompt: Prompt
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    turns: Sequence[Prompt] = ()          # follow-up user turns, each continues the context
    stop_token: Optional[int] = None
    request_id: Optional[int] = None      # assigned by the engine when None
    forced: Optional[Sequence[int]] = None  # teacher forcing: emit these instead of sampling


@dataclass
class RequestOutput:
    request_id: int
    turns: list[list[int]]                # generated tokens of each turn
    finish_reason: str                    # "length", "stop" (both per last turn) or "context"
    decode_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    logprobs: list[float] = field(default_factory=list)   # natural log p of each token

    @property
    def tokens(self) -> list[int]:
        return [t for turn in self.turns for t in turn]

    def text(self) -> str:
        return bytes(t for t in self.tokens if t < 256).decode("utf-8", "replace")


@dataclass
class Live:
    """A request the engine holds: queued, or admitted with a cache slot."""
    req: Request
    rid: int
    prompts: list[list[int]]
    slot: int = -1
    context: list[int] = field(default_factory=list)   # tokens in the KV cache, in order
    pending: int = -1                                   # sampled, not yet in the cache
    drafts: list[int] = field(default_factory=list)
    turn: int = 0
    out: list[list[int]] = field(default_factory=list)
    step: int = 0                                       # decode steps since admission
    hidden: Optional[torch.Tensor] = None               # MTP input: hidden of the last row
    drafted: int = 0
    accepted: int = 0
    reserved_pages: int = 0
    logprobs: list[float] = field(default_factory=list)
    spin_stale: bool = False                            # sat out SPIN steps: reset on return


def tokens(prompt: Prompt, vocab: int, what: str) -> list[int]:
    """Token ids of a prompt: text, bytes, or a list/tuple/range (or 1-D integer tensor or
    array) of ints. Bools, floats (even integral ones) and mappings are refused, not cast."""
    if isinstance(prompt, str):
        prompt = prompt.encode("utf-8")
    if isinstance(prompt, (bytes, bytearray)):
        toks = list(prompt)
    elif isinstance(prompt, (torch.Tensor, np.ndarray)):
        integer = prompt.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8) \
            if isinstance(prompt, torch.Tensor) else np.issubdtype(prompt.dtype, np.integer)
        if not integer or prompt.ndim != 1:
            raise RequestError(f"{what}: a tensor or array prompt must be 1-D integer token ids, "
                               f"got {prompt.dtype} with {prompt.ndim} dims")
        toks = [int(t) for t in prompt.tolist()]
    elif isinstance(prompt, (list, tuple, range)):
        toks = []
        for t in prompt:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise RequestError(f"{what}: token ids must be ints, got "
                                   f"{type(t).__name__} {str(t)[:40]}")
            toks.append(int(t))
    else:
        raise RequestError(f"{what}: must be text, bytes or a list of token ids, got "
                           f"{type(prompt).__name__}")
    if not toks:
        raise RequestError(f"{what}: empty prompt")
    bad = [t for t in toks if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"{what}: token id {bad[0]} outside the vocabulary [0, {vocab})")
    return toks


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_id(rid, what: str, in_use: set[int]) -> None:
    if rid is not None and (not is_int(rid) or rid < 0 or rid >= 1 << 62):
        raise RequestError(f"{what}: request_id must be an int in [0, 2^62)")
    if rid is not None and rid in in_use:
        raise RequestError(f"{what}: request_id already in use")


def parse(req: Request, cfg: DsaLiteConfig, what: str) -> tuple[list[list[int]], int]:
    """(the token ids of the prompt and of each turn, the most positions the request can
    take); RequestError for anything the engine cannot serve as given."""
    if not is_int(req.max_new_tokens) or req.max_new_tokens < 1:
        raise RequestError(f"{what}: max_new_tokens must be an int >= 1, got "
                           f"{req.max_new_tokens!r}")
    if isinstance(req.temperature, bool) or not isinstance(req.temperature, (int, float)) \
            or not 0 <= req.temperature < math.inf:
        raise RequestError(f"{what}: temperature must be a finite number >= 0, got "
                           f"{req.temperature!r}")
    if not is_int(req.top_k) or req.top_k < 0:
        raise RequestError(f"{what}: top_k must be an int >= 0, got {req.top_k!r}")
    if not is_int(req.seed) or not 0 <= req.seed < 1 << 32:
        raise RequestError(f"{what}: seed must be an int in [0, 2^32), got {req.seed!r}")
    if req.stop_token is not None and (not is_int(req.stop_token) or
                                       not 0 <= req.stop_token < cfg.vocab_size):
        raise RequestError(f"{what}: stop_token must be a token id in [0, {cfg.vocab_size}), "
                           f"got {req.stop_token!r}")
    if not isinstance(req.turns, (list, tuple)):
        raise RequestError(f"{what}: turns must be a list of prompts, got "
                           f"{type(req.turns).__name__}")
    if req.forced is not None:
        forced = tokens(req.forced, cfg.vocab_size, f"{what} forced")
        if req.turns:
            raise RequestError(f"{what}: forced tokens work with one turn only")
        if len(forced) < req.max_new_tokens:
            raise RequestError(f"{what}: {len(forced)} forced tokens, fewer than "
                               f"max_new_tokens {req.max_new_tokens}")
    prompts = [tokens(req.prompt, cfg.vocab_size, f"{what} prompt")]
    prompts += [tokens(t, cfg.vocab_size, f"{what} turn {i + 1}")
                for i, t in enumerate(req.turns)]
    worst = sum(len(p) for p in prompts) + len(prompts) * req.max_new_tokens + cfg.next_n
    if worst > cfg.max_context:
        raise RequestError(f"{what}: prompts ({sum(len(p) for p in prompts)} tokens) plus "
                           f"{len(prompts)} x max_new_tokens ({req.max_new_tokens}) need up "
                           f"to {worst} positions; max_context is {cfg.max_context}")
    return prompts, worst


def pages_for(positions: int, index_ratio: int, page_slots: int = BLOCK_SLOTS) -> int:
    """Indexer K-cache pages (of page_slots slots) that `positions` tokens of context can fill."""
    return math.ceil((positions // index_ratio + 1) / page_slots)


def needs_logits(req: Request) -> bool:
    """The request's target rows are sampled or forced, not argmax: its logits go to the host."""
    return req.temperature > 0 or req.forced is not None
