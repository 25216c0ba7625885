// spin_native::topk -> spin::launch_topk (cpp/src/topk.cu).
#include <cstdlib>
#include <cstring>

#include <ATen/ops/empty.h>

#include "binding.h"

namespace {

// SPIN_TOPK_FILTER: 0 never ranks rows through the filter, 1 wherever the shapes allow, auto
// (or unset, or empty) for many long rows (TopKParams::filter). Read at every call, so tests can
// switch it.
int filter_mode() {
  const char* v = std::getenv("SPIN_TOPK_FILTER");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return -1;
  if (std::strcmp(v, "0") == 0) return 0;
  TORCH_CHECK(std::strcmp(v, "1") == 0, "SPIN_TOPK_FILTER must be 0, 1 or auto, got '", v, "'");
  return 1;
}

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
  p.filter = filter_mode();
  // freed at return, reused in stream order (a kernel beside the top-K: ops/_topk.py's contract)
  at::Tensor workspace;
  p.workspace_bytes = spin::topk_workspace_bytes(p);
  if (p.workspace_bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(p.workspace_bytes)},
                          logits.options().dtype(at::kByte));
    p.workspace = workspace.data_ptr();
  }
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
