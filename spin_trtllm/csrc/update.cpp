// spin_native::update -> spin::launch_update (cpp/src/update.cu).
#include "binding.h"

namespace {

void spin_update(at::Tensor V, at::Tensor D, at::Tensor last_seen, at::Tensor decode_steps,
                 at::Tensor state_slot, at::Tensor logits, at::Tensor block_ids, at::Tensor counts,
                 at::Tensor context_lens, at::Tensor query_pos, at::Tensor accepted,
                 at::Tensor step, int64_t layer, double ema_decay, bool row0_only,
                 int64_t max_context_len, bool beside_previous, bool ema) {
  const c10::cuda::CUDAGuard guard(V.device());
  spin::UpdateParams p;
  p.state = spin_native::state_view(V, D, last_seen, decode_steps);
  p.state_slot = state_slot.data_ptr<int32_t>();
  p.logits = logits.data_ptr<float>();
  spin_native::set_selection(p, block_ids, counts);
  p.layer = static_cast<int>(layer);
  if (layer < 0) {  // every layer: logits [L, B*R, W], block_ids [B, L, m_cap], counts [B, L]
    p.layer = 0;
    p.layers = static_cast<int>(block_ids.size(1));
    // without the EMAs the logits are not read (a placeholder of any shape)
    p.logits_layer_stride = ema ? logits.stride(0) : 0;
    p.ids_layer_stride = block_ids.stride(1);
    p.counts_layer_stride = counts.stride(1);
  }
  p.n = context_lens.data_ptr<int32_t>();
  p.q = query_pos.data_ptr<int32_t>();
  p.accepted = accepted.data_ptr<int32_t>();
  p.step = step.data_ptr<int64_t>();
  p.batch = static_cast<int>(context_lens.size(0));
  p.rows = static_cast<int>(context_lens.size(1));
  p.logits_stride = logits.stride(logits.dim() - 2);
  p.alpha = static_cast<float>(ema_decay);
  p.one_minus_alpha = static_cast<float>(1.0 - ema_decay);
  p.row0_only = row0_only;
  p.max_context = static_cast<int>(max_context_len);
  p.max_blocks = spin_native::max_blocks(max_context_len);
  p.beside_previous = beside_previous;
  p.ema = ema;
  spin_native::check(spin::launch_update(p, c10::cuda::getCurrentCUDAStream()), "update");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spin_native, m) {
  m.def("update(Tensor(a!) V, Tensor(b!) D, Tensor(c!) last_seen, Tensor(d!) decode_steps, "
        "Tensor state_slot, Tensor logits, Tensor block_ids, Tensor counts, Tensor context_lens, "
        "Tensor query_pos, Tensor accepted, Tensor step, int layer, float ema_decay, bool row0_only, "
        "int max_context_len, bool beside_previous=False, bool ema=True) -> ()");
}

TORCH_LIBRARY_IMPL(spin_native, CUDA, m) {
  m.impl("update", &spin_update);
}
