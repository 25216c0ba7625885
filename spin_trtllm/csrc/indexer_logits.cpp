// spin_native::indexer_logits -> spin::launch_indexer_logits (cpp/src/indexer_logits.cu).
#include "binding.h"

namespace {

void spin_indexer_logits(at::Tensor q, at::Tensor kv_cache, at::Tensor weights,
                         at::Tensor context_lens, at::Tensor block_table, at::Tensor block_ids,
                         at::Tensor counts, at::Tensor out) {
  const c10::cuda::CUDAGuard guard(q.device());
  spin::LogitsParams p;
  p.q = static_cast<const uint8_t*>(q.data_ptr());
  p.kv_cache = static_cast<const uint8_t*>(kv_cache.data_ptr());
  p.weights = weights.data_ptr<float>();
  p.context_lens = context_lens.data_ptr<int32_t>();
  p.block_table = block_table.data_ptr<int32_t>();
  spin_native::set_selection(p, block_ids, counts);
  p.batch = static_cast<int>(context_lens.size(0));
  p.rows = static_cast<int>(context_lens.size(1));
  p.max_pages = static_cast<int>(block_table.size(1));
  p.num_pages = kv_cache.size(0);
  p.table_stride = block_table.stride(0);
  p.out = out.data_ptr<float>();
  spin_native::check(spin::launch_indexer_logits(p, c10::cuda::getCurrentCUDAStream()),
                     "indexer_logits");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spin_native, m) {
  m.def("indexer_logits(Tensor q, Tensor kv_cache, Tensor weights, Tensor context_lens, "
        "Tensor block_table, Tensor block_ids, Tensor counts, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(spin_native, CUDA, m) {
  m.impl("indexer_logits", &spin_indexer_logits);
}
