"""Upstream: tensorrt_llm/_torch/speculative/mtp.py @aa91fbc1 (MTPWorker).
Stand-in for the MTP worker's use of the attention metadata inside the model's forward (so
inside its CUDA graph), in upstream's order:
- sample_and_accept_draft_tokens(logits, attn_metadata, spec_metadata) -> (accepted_tokens
  [batch, max_draft_len + 1], num_accepted_tokens int32 [batch], bonus token included, so 1
  for a context request and 1 + accepted drafts for a generation request);
- change_attn_metadata(num_accepted_tokens, attn_metadata): the generation rows' sequence
  lengths lose one token (on_update()), then kv_lens_cuda[num_contexts:batch_size] -=
  mtp_num_modules + 1 - num_accepted_tokens[num_contexts:batch_size], clamped at
  mtp_num_modules, then on_update_kv_lens(): the draft layers attend to the accepted prefix;
- the draft loop over the MTP layers (draft_forward, a callable given by the caller);
- _restore_attn_metadata_from_spec_dec: sequence lengths back (kv_lens_cuda is not restored);
- returns new_tokens, new_tokens_lens (= num_accepted_tokens), next_draft_tokens.
Simplified: acceptance is not sampled from logits: the stand-in accepts
spec_metadata.num_accepted_draft_tokens_cuda[b] drafts of generation request b (a static
device buffer the caller fills before each forward, as a sampler would decide on the
device); no draft-token sampling, hidden-state updates or guided decoding.
"""
from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass
class MTPSpecMetadata:
    max_draft_len: int
    num_accepted_draft_tokens_cuda: torch.Tensor      # int32 [max_batch] (stand-in input)


class MTPWorker:
    def __init__(self, spec_config, draft_forward: Optional[Callable] = None):
        self.spec_config = spec_config
        self.mtp_num_modules = spec_config.num_nextn_predict_layers
        self.draft_forward = draft_forward

    def forward(self, input_ids, position_ids, hidden_states, logits, attn_metadata,
                spec_metadata, draft_model=None):
        accepted_tokens, num_accepted_tokens = self.sample_and_accept_draft_tokens(
            logits, attn_metadata, spec_metadata)
        saved = self.change_attn_metadata(num_accepted_tokens, attn_metadata)
        if self.draft_forward is not None:
            for _ in range(self.mtp_num_modules):
                self.draft_forward(attn_metadata)
        self._restore_attn_metadata_from_spec_dec(attn_metadata, saved)
        return {"logits": logits, "new_tokens": accepted_tokens,
                "new_tokens_lens": num_accepted_tokens}

    def sample_and_accept_draft_tokens(self, logits, attn_metadata, spec_metadata):
        batch_size = attn_metadata.num_seqs
        num_contexts = attn_metadata.num_contexts
        device = attn_metadata.kv_lens_cuda.device
        accepted_tokens = torch.zeros(batch_size, self.mtp_num_modules + 1, dtype=torch.int,
                                      device=device)
        num_accepted_tokens = torch.ones(batch_size, dtype=torch.int, device=device)
        drafts = spec_metadata.num_accepted_draft_tokens_cuda[:batch_size - num_contexts]
        num_accepted_tokens[num_contexts:batch_size] += drafts.clamp(0, self.mtp_num_modules)
        return accepted_tokens, num_accepted_tokens

    def change_attn_metadata(self, num_accepted_tokens, attn_metadata):
        batch_size = attn_metadata.num_seqs
        num_contexts = attn_metadata.num_contexts
        saved = attn_metadata.num_tokens
        # one token less per generation row, on the host and (in place) on the device
        attn_metadata._seq_lens[num_contexts:batch_size] -= 1
        attn_metadata.seq_lens_cuda[num_contexts:batch_size] -= 1
        attn_metadata.num_tokens = int(attn_metadata._seq_lens.sum())
        attn_metadata.kv_lens_cuda[num_contexts:batch_size] -= (
            self.mtp_num_modules + 1 - num_accepted_tokens[num_contexts:batch_size])
        attn_metadata.kv_lens_cuda[num_contexts:batch_size].clamp_(min=self.mtp_num_modules)
        attn_metadata.on_update_kv_lens()
        return saved

    def _restore_attn_metadata_from_spec_dec(self, attn_metadata, saved) -> None:
        batch_size = attn_metadata.num_seqs
        num_contexts = attn_metadata.num_contexts
        attn_metadata._seq_lens[num_contexts:batch_size] += 1
        attn_metadata.seq_lens_cuda[num_contexts:batch_size] += 1
        attn_metadata.num_tokens = saved
