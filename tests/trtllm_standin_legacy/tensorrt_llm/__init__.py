"""Stand-in for tensorrt_llm/__init__.py of the release-1.2 layout (the DSA code in one file,
_torch/attention_backend/sparse/dsa.py). Minimal: FP8 keys, decode only; see dsa.py.

Registers a CPU `torch.ops.trtllm.indexer_topk_decode` with the legacy schema
(logits, seq_lens, indices, next_n, index_topk=2048). Import this package in its own process:
the main stand-in (tests/trtllm_standin) is also named tensorrt_llm.
"""
import torch

from . import deep_gemm  # noqa: F401

__version__ = "1.2.0"

_LIB = torch.library.Library("trtllm", "FRAGMENT")


def _indexer_topk_decode(logits, seq_lens, indices, next_n, index_topk=2048):
    """Row j of request b keeps the top index_topk of positions < seq_len - next_n + j + 1."""
    if indices.shape[1] < index_topk:
        raise RuntimeError("indices second dimension must be at least index_topk")
    for r in range(logits.shape[0]):
        b, j = divmod(r, next_n)
        n = int(seq_lens[b]) - next_n + j + 1
        indices[r, :index_topk] = -1
        if n <= index_topk:
            indices[r, :n] = torch.arange(n, dtype=indices.dtype)
        else:
            indices[r, :index_topk] = torch.topk(logits[r, :n], index_topk).indices.to(
                indices.dtype)


if not hasattr(torch.ops.trtllm, "indexer_topk_decode"):
    _LIB.define("indexer_topk_decode(Tensor logits, Tensor seq_lens, Tensor(a!) indices, "
                "int next_n, int index_topk=2048) -> ()")
    _LIB.impl("indexer_topk_decode", _indexer_topk_decode, "CompositeExplicitAutograd")
