from types import SimpleNamespace

import torch


class DSAtrtllmAttentionMetadata:
    """Fields as the DSA indexer reads them; the test sets the inputs, prepare() derives."""

    def __init__(self, **fields):
        self.skip_indexer_for_gen_reqs = False
        for k, v in fields.items():
            setattr(self, k, v)

    def prepare(self):
        cached = torch.as_tensor(self.kv_cache_params.num_cached_tokens_per_seq)
        self.kv_lens = cached + self.seq_lens_kv
        self.num_ctx_tokens = int(self.seq_lens_kv[:self.num_contexts].sum())
        self.num_tokens = int(self.seq_lens_kv.sum())


def cache_manager(max_seq_len, caches):
    return SimpleNamespace(max_seq_len=max_seq_len,
                           get_indexer_k_cache_buffers=lambda layer: caches[layer])
