// spin_native::select -> spin::launch_select (cpp/src/select.cu).
#include "binding.h"

namespace {

void spin_select(at::Tensor V, at::Tensor D, at::Tensor last_seen, at::Tensor decode_steps,
                 at::Tensor state_slot, at::Tensor context_lens, at::Tensor query_pos,
                 at::Tensor request_id, at::Tensor step, at::Tensor block_ids, at::Tensor counts,
                 double target_sparsity, double exploration, int64_t policy, int64_t index_topk,
                 int64_t warmup_steps, bool keep_sink, bool keep_newest, int64_t pooling,
                 bool mtp_union, int64_t seed, int64_t max_context_len,
                 const c10::optional<at::Tensor>& block_scores, int64_t layer, bool merge_history,
                 bool beside_previous) {
  const c10::cuda::CUDAGuard guard(V.device());
  spin::SelectParams p;
  p.state = spin_native::state_view(V, D, last_seen, decode_steps);
  p.state_slot = state_slot.data_ptr<int32_t>();
  p.n = context_lens.data_ptr<int32_t>();
  p.q = query_pos.data_ptr<int32_t>();
  p.request_id = request_id.data_ptr<int64_t>();
  p.step = step.data_ptr<int64_t>();
  p.batch = static_cast<int>(context_lens.size(0));
  p.rows = static_cast<int>(context_lens.size(1));
  p.rho = target_sparsity;
  p.gamma = exploration;
  p.index_topk = static_cast<int>(index_topk);
  p.warmup_steps = static_cast<int>(warmup_steps);
  p.keep_sink = keep_sink;
  p.keep_newest = keep_newest;
  p.mtp_union = mtp_union;
  p.pooling = static_cast<int>(pooling);
  p.policy = static_cast<int>(policy);
  p.seed = static_cast<uint32_t>(seed);
  p.block_ids = block_ids.data_ptr<int32_t>();
  p.counts = counts.data_ptr<int32_t>();
  p.m_cap = static_cast<int>(block_ids.size(2));
  p.max_context = static_cast<int>(max_context_len);
  p.max_blocks = spin_native::max_blocks(max_context_len);
  if (block_scores.has_value()) {
    p.block_scores = block_scores->data_ptr<float>();
    p.scores_stride_b = block_scores->stride(0);
    p.scores_stride_r = block_scores->stride(1);
    p.scores_width = static_cast<int>(block_scores->size(2));
    p.merge_history = merge_history;
  }
  p.layer = static_cast<int>(layer);
  p.beside_previous = beside_previous;
  spin_native::check(spin::launch_select(p, c10::cuda::getCurrentCUDAStream()), "select");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spin_native, m) {
  m.def("select(Tensor V, Tensor D, Tensor last_seen, Tensor decode_steps, Tensor state_slot, "
        "Tensor context_lens, Tensor query_pos, Tensor request_id, Tensor step, Tensor(a!) block_ids, "
        "Tensor(b!) counts, float target_sparsity, float exploration, int policy, int index_topk, "
        "int warmup_steps, bool keep_sink, bool keep_newest, int pooling, bool mtp_union, int seed, "
        "int max_context_len, Tensor? block_scores=None, int layer=-1, bool merge_history=False, "
        "bool beside_previous=False) -> ()");
}

TORCH_LIBRARY_IMPL(spin_native, CUDA, m) {
  m.impl("select", &spin_select);
}
