"""One torch intra-op thread for a stretch of small ops."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def one_thread() -> Iterator[None]:
    """Small, memory-bound ops barely gain from intra-op threads, and on a busy machine their
    barriers made loops of them 2-10x slower, some runs and not others."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
