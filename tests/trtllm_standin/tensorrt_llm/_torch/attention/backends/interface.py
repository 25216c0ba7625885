"""Upstream: tensorrt_llm/_torch/attention/backends/interface.py (not read; names from the imports
and field reads of dsa/indexer.py @0b228a79, dsa/metadata.py @186080bb and
deepseek_v4/backend.py @1a681e4c).
Stand-in for tensorrt_llm/_torch/attention/backends/interface.py.

Mirrored names: AttentionMetadata (seq_lens / num_contexts setters deriving num_tokens,
num_ctx_tokens, num_generations), get_empty(), on_update_kv_lens(); MLAParams;
PositionalEmbeddingParams; AttentionInputType; AttentionForwardArgs.

Simplified: plain CPU tensors stand for the *_cuda ones; no beam search, helix, cross
attention, spec-dec trees; only the fields the sparse-attention path reads.
"""
import enum
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from ...._utils import standin_device
from ...metadata import KVCacheParams


@dataclass
class MLAParams:
    hidden_size: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_append: bool = True


@dataclass
class PositionalEmbeddingParams:
    rope: Any = None
    is_neox: bool = True


class AttentionInputType(enum.IntEnum):
    mixed = 0
    context_only = 1
    generation_only = 2


@dataclass
class AttentionForwardArgs:
    attention_input_type: AttentionInputType = AttentionInputType.mixed
    sparse_backend_args: Any = None
    sparse_runtime_params: Any = None


@dataclass
class RuntimeFeatures:
    chunked_prefill: bool = False
    cache_reuse: bool = False


@dataclass(kw_only=True)
class AttentionMetadata:
    max_num_requests: int
    max_num_tokens: int
    kv_cache_manager: Any
    max_num_sequences: Optional[int] = None
    mapping: Any = None
    is_cuda_graph: bool = False
    cuda_graph_buffers: Any = None
    request_ids: Optional[List[int]] = None
    prompt_lens: Optional[List[int]] = None
    kv_cache_params: Optional[KVCacheParams] = None
    seq_lens_kv: Optional[torch.Tensor] = None
    draft_kv_cache_manager: Any = None
    enable_context_mla_with_cached_kv: bool = False
    runtime_features: RuntimeFeatures = field(default_factory=RuntimeFeatures)
    beam_width: int = 1
    is_cross: bool = False
    enable_helix: bool = False
    _seq_lens: Optional[torch.Tensor] = field(default=None, repr=False)
    _num_contexts: int = 0

    def __post_init__(self):
        if self.max_num_sequences is None:
            self.max_num_sequences = self.max_num_requests * self.beam_width

    @property
    def seq_lens(self) -> Optional[torch.Tensor]:
        return self._seq_lens

    @seq_lens.setter
    def seq_lens(self, value: Optional[torch.Tensor]) -> None:
        self._seq_lens = None if value is None else torch.as_tensor(value, dtype=torch.int32)
        if self._seq_lens is not None:
            self.num_tokens = int(self._seq_lens.sum())
            # a device buffer of fixed address (CUDA graphs read it), refilled from the host
            n = self._seq_lens.numel()
            buf = getattr(self, "_seq_lens_cuda_buffer", None)
            if buf is None or buf.numel() < n:
                buf = torch.zeros(max(n, self.max_num_sequences or 0), dtype=torch.int32,
                                  device=standin_device())
                self._seq_lens_cuda_buffer = buf
            buf[:n].copy_(self._seq_lens)
            self.seq_lens_cuda = buf[:n]
            self._seq_lens_cuda = self.seq_lens_cuda
            if not self.is_cross:
                self.seq_lens_kv = self._seq_lens
            self.num_ctx_tokens = int(self._seq_lens[:self._num_contexts].sum())

    @property
    def num_contexts(self) -> int:
        return self._num_contexts

    @num_contexts.setter
    def num_contexts(self, value: int) -> None:
        self._num_contexts = int(value)
        if self._seq_lens is not None:
            self.num_ctx_tokens = int(self._seq_lens[:value].sum())

    @property
    def num_seqs(self) -> int:
        return 0 if self._seq_lens is None else int(self._seq_lens.numel())

    @property
    def num_generations(self) -> int:
        return self.num_seqs - self.num_contexts

    @staticmethod
    def get_empty(buffers, tensor_shape, dtype, cache_name: str, capture_graph: bool = False):
        if buffers is None:
            return torch.zeros(tuple(tensor_shape), dtype=dtype, device=standin_device())
        return buffers.get_buffer(tuple(tensor_shape), dtype, buffer_name=cache_name,
                                  reserve_buffer=capture_graph)

    def prepare(self) -> None:
        pass

    def on_update_kv_lens(self) -> None:
        pass
