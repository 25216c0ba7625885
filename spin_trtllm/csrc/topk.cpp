// spin_native::topk -> spin::launch_topk (cpp/src/topk.cu).
#include "binding.h"

namespace {

void spin_topk(at::Tensor logits, at::Tensor block_ids, at::Tensor counts, int64_t next_n,
               at::Tensor out, const c10::optional<at::Tensor>& row_lens) {
  const c10::cuda::CUDAGuard guard(logits.device());
  spin::TopKParams p;
  p.logits = logits.data_ptr<float>();
  spin_native::set_selection(p, block_ids, counts);
  p.batch = static_cast<int>(block_ids.size(0));
  p.rows = static_cast<int>(next_n);
  p.k = static_cast<int>(out.size(1));
  p.logits_stride = logits.stride(0);
  p.out = out.data_ptr<int32_t>();
  p.row_lens = row_lens.has_value() ? row_lens->data_ptr<int32_t>() : nullptr;
  spin_native::check(spin::launch_topk(p, c10::cuda::getCurrentCUDAStream()), "topk");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spin_native, m) {
  m.def("topk(Tensor logits, Tensor block_ids, Tensor counts, int next_n, Tensor(a!) out, "
        "Tensor? row_lens=None) -> ()");
}

TORCH_LIBRARY_IMPL(spin_native, CUDA, m) {
  m.impl("topk", &spin_topk);
}
