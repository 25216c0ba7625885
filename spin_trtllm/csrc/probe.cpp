// spin_native::summarize, summarize_newest, their gauss forms, probe and gauss ->
// spin::launch_summarize, launch_probe, launch_gauss (cpp/src/probe.cu): page summaries and
// the query-aware block scores read from them.
#include "binding.h"

namespace {

// p: how the launch finds its `count` pages (listed, or from the step's lengths).
void summarize_rows(const char* op, at::Tensor kv_cache, spin::SummarizeParams p, int count,
                    at::Tensor summaries, bool with_std) {
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  p.kv_cache = static_cast<const uint8_t*>(kv_cache.data_ptr());
  p.count = count;
  p.num_pages = kv_cache.size(0);
  p.summaries = summaries.data_ptr<uint8_t>();
  // a page's bytes tell the four layouts apart (64 or 32 slots of 132 or 68 bytes)
  const int64_t page_bytes = kv_cache[0].numel();
  for (const int slot_bytes : {spin::kSlotBytes, spin::kFp4SlotBytes})
    for (const int slots : {spin::kBlockSize, spin::kBlockSize / 2})
      if (page_bytes == int64_t{slots} * slot_bytes) {
        p.page_slots = slots;
        p.slot_bytes = slot_bytes;
      }
  p.row_bytes = static_cast<int>(summaries.size(1));
  p.with_std = with_std;
  spin_native::check(spin::launch_summarize(p, c10::cuda::getCurrentCUDAStream()), op);
}

void summarize_listed(at::Tensor kv_cache, at::Tensor pages, at::Tensor fill,
                      at::Tensor summaries, bool with_std) {
  spin::SummarizeParams p;
  p.pages = pages.data_ptr<int32_t>();
  p.fill = fill.data_ptr<int32_t>();
  summarize_rows(with_std ? "summarize_gauss" : "summarize", kv_cache, p,
                 static_cast<int>(pages.size(0)), summaries, with_std);
}

void spin_summarize(at::Tensor kv_cache, at::Tensor pages, at::Tensor fill, at::Tensor summaries) {
  summarize_listed(kv_cache, pages, fill, summaries, false);
}

void spin_summarize_gauss(at::Tensor kv_cache, at::Tensor pages, at::Tensor fill,
                          at::Tensor summaries) {
  summarize_listed(kv_cache, pages, fill, summaries, true);
}

// The newest pages of each request, found by the kernel from context_lens [B, R] and the block
// table: two listings a request.
void summarize_newest_rows(at::Tensor kv_cache, at::Tensor context_lens, at::Tensor block_table,
                           int64_t max_len, at::Tensor summaries, bool with_std) {
  spin::SummarizeParams p;
  p.context_lens = context_lens.data_ptr<int32_t>();
  p.block_table = block_table.data_ptr<int32_t>();
  p.rows = static_cast<int>(context_lens.size(1));
  p.max_pages = static_cast<int>(block_table.size(1));
  p.table_stride = block_table.stride(0);
  p.max_len = static_cast<int>(max_len);
  summarize_rows(with_std ? "summarize_newest_gauss" : "summarize_newest", kv_cache, p,
                 2 * static_cast<int>(context_lens.size(0)), summaries, with_std);
}

void spin_summarize_newest(at::Tensor kv_cache, at::Tensor context_lens, at::Tensor block_table,
                           int64_t max_len, at::Tensor summaries) {
  summarize_newest_rows(kv_cache, context_lens, block_table, max_len, summaries, false);
}

void spin_summarize_newest_gauss(at::Tensor kv_cache, at::Tensor context_lens,
                                 at::Tensor block_table, int64_t max_len, at::Tensor summaries) {
  summarize_newest_rows(kv_cache, context_lens, block_table, max_len, summaries, true);
}

// spin_native::probe and gauss: the same arguments, the same columns; `launch` scores them.
void score_columns(const char* op, cudaError_t (*launch)(const spin::ProbeParams&, cudaStream_t),
                   at::Tensor q, at::Tensor summaries, at::Tensor weights,
                   at::Tensor context_lens, at::Tensor block_table, int64_t page_slots,
                   at::Tensor out) {
  const c10::cuda::CUDAGuard guard(q.device());
  spin::ProbeParams p;
  p.q = static_cast<const uint8_t*>(q.data_ptr());
  p.summaries = summaries.data_ptr<uint8_t>();
  p.weights = weights.data_ptr<float>();
  p.context_lens = context_lens.data_ptr<int32_t>();
  p.block_table = block_table.data_ptr<int32_t>();
  p.batch = static_cast<int>(context_lens.size(0));
  p.rows = static_cast<int>(context_lens.size(1));
  p.num_blocks = static_cast<int>(out.size(1));
  p.max_pages = static_cast<int>(block_table.size(1));
  p.num_pages = summaries.size(0);
  p.table_stride = block_table.stride(0);
  p.out = out.data_ptr<float>();
  p.page_slots = static_cast<int>(page_slots);
  p.summary_bytes = static_cast<int>(summaries.size(1));
  spin_native::check(launch(p, c10::cuda::getCurrentCUDAStream()), op);
}

void spin_probe(at::Tensor q, at::Tensor summaries, at::Tensor weights, at::Tensor context_lens,
                at::Tensor block_table, int64_t page_slots, at::Tensor out) {
  score_columns("probe", spin::launch_probe, q, summaries, weights, context_lens, block_table,
                page_slots, out);
}

void spin_gauss(at::Tensor q, at::Tensor summaries, at::Tensor weights, at::Tensor context_lens,
                at::Tensor block_table, int64_t page_slots, at::Tensor out) {
  score_columns("gauss", spin::launch_gauss, q, summaries, weights, context_lens, block_table,
                page_slots, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spin_native, m) {
  m.def("summarize(Tensor kv_cache, Tensor pages, Tensor fill, Tensor(a!) summaries) -> ()");
  m.def("summarize_gauss(Tensor kv_cache, Tensor pages, Tensor fill, Tensor(a!) summaries) -> ()");
  m.def("summarize_newest(Tensor kv_cache, Tensor context_lens, Tensor block_table, int max_len, "
        "Tensor(a!) summaries) -> ()");
  m.def("summarize_newest_gauss(Tensor kv_cache, Tensor context_lens, Tensor block_table, "
        "int max_len, Tensor(a!) summaries) -> ()");
  m.def("probe(Tensor q, Tensor summaries, Tensor weights, Tensor context_lens, Tensor block_table, "
        "int page_slots, Tensor(a!) out) -> ()");
  m.def("gauss(Tensor q, Tensor summaries, Tensor weights, Tensor context_lens, Tensor block_table, "
        "int page_slots, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(spin_native, CUDA, m) {
  m.impl("summarize", &spin_summarize);
  m.impl("summarize_gauss", &spin_summarize_gauss);
  m.impl("summarize_newest", &spin_summarize_newest);
  m.impl("summarize_newest_gauss", &spin_summarize_newest_gauss);
  m.impl("probe", &spin_probe);
  m.impl("gauss", &spin_gauss);
}
