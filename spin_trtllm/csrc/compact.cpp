// spin_native::compact and spin_native::remap -> spin::launch_compact, spin::launch_remap
// (cpp/src/compact.cu): SPIN's selection driving an external paged indexer-logits kernel.
#include "binding.h"

namespace {

void spin_compact(at::Tensor block_ids, at::Tensor counts, at::Tensor context_lens,
                  at::Tensor block_table, int64_t page_slots, at::Tensor compact_table,
                  at::Tensor compact_lens, const c10::optional<at::Tensor>& schedule,
                  const c10::optional<at::Tensor>& workspace) {
  const c10::cuda::CUDAGuard guard(block_ids.device());
  const bool layered = block_ids.dim() == 3;  // [B, L, m_cap]: every layer at once
  spin::CompactParams p;
  spin_native::set_selection(p, block_ids, counts);
  p.context_lens = context_lens.data_ptr<int32_t>();
  p.block_table = block_table.data_ptr<int32_t>();
  p.batch = static_cast<int>(context_lens.size(0));
  p.rows = static_cast<int>(context_lens.size(1));
  p.max_pages = static_cast<int>(block_table.size(1));
  p.page_slots = static_cast<int>(page_slots);
  p.table_stride = block_table.stride(0);
  p.compact_table = compact_table.data_ptr<int32_t>();
  p.compact_stride = compact_table.stride(-2);
  p.width = static_cast<int>(compact_table.size(-1));
  p.compact_lens = compact_lens.data_ptr<int32_t>();
  if (layered) {
    p.layers = static_cast<int>(block_ids.size(1));
    p.ids_layer_stride = block_ids.stride(1);
    p.counts_layer_stride = counts.stride(1);
    p.compact_layer_stride = compact_table.stride(0);
  }
  if (schedule) {
    TORCH_CHECK(workspace.has_value(), "spin_native::compact: a schedule needs a workspace");
    p.schedule = schedule->data_ptr<int32_t>();
    p.num_sms = static_cast<int>(schedule->size(-2)) - 1;
    p.done = workspace->data_ptr<int32_t>();
  }
  spin_native::check(spin::launch_compact(p, c10::cuda::getCurrentCUDAStream()), "compact");
}

void spin_remap(at::Tensor positions, at::Tensor block_ids, at::Tensor counts, int64_t next_n,
                at::Tensor out, const c10::optional<at::Tensor>& values, bool ascending,
                const c10::optional<at::Tensor>& scores) {
  const c10::cuda::CUDAGuard guard(positions.device());
  spin::RemapParams p;
  p.positions = positions.data_ptr<int32_t>();
  p.values = values ? values->data_ptr<float>() : nullptr;
  p.values_stride = values ? values->stride(0) : 0;
  p.scores = scores ? scores->data_ptr<float>() : nullptr;
  p.scores_stride = scores ? scores->stride(0) : 0;
  p.ascending = ascending;
  spin_native::set_selection(p, block_ids, counts);
  p.batch = static_cast<int>(block_ids.size(0));
  p.rows = static_cast<int>(next_n);
  p.k = static_cast<int>(out.size(1));
  p.positions_stride = positions.stride(0);
  p.out = out.data_ptr<int32_t>();
  spin_native::check(spin::launch_remap(p, c10::cuda::getCurrentCUDAStream()), "remap");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spin_native, m) {
  m.def("compact(Tensor block_ids, Tensor counts, Tensor context_lens, Tensor block_table, "
        "int page_slots, Tensor(a!) compact_table, Tensor(b!) compact_lens, "
        "Tensor(c!)? schedule=None, Tensor(d!)? workspace=None) -> ()");
  m.def("remap(Tensor positions, Tensor block_ids, Tensor counts, int next_n, Tensor(a!) out, "
        "Tensor? values=None, bool ascending=False, Tensor? scores=None) -> ()");
}

TORCH_LIBRARY_IMPL(spin_native, CUDA, m) {
  m.impl("compact", &spin_compact);
  m.impl("remap", &spin_remap);
}
