// Thin torch bindings of the cpp/ launchers, registered as spin_native::*. The public ops
// (torch.ops.spin.*) are defined in spin_trtllm/ops.py, which validates every argument and
// then calls these on CUDA tensors.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "spin/spin_kernels.h"

namespace {

// Raised whenever an op's meaning changes under the same schema; spin_trtllm.ops.NATIVE_ABI must
// match, so that a library built before the change is not used. 2: update's layer -1 (every
// layer in one launch), remap's scores. 3: update's beside_previous. 4: select's
// beside_previous and one layer from V/D.
constexpr int64_t kAbiVersion = 4;
int64_t spin_abi_version() { return kAbiVersion; }

void check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "spin::", what, " launch failed: ", cudaGetErrorString(err));
}

spin::StateView state_view(at::Tensor& V, at::Tensor& D, at::Tensor& last_seen, at::Tensor& decode_steps) {
  TORCH_CHECK(V.is_cuda() && V.is_contiguous() && D.is_contiguous() && last_seen.is_contiguous() &&
              decode_steps.is_contiguous(), "spin: state tensors must be contiguous CUDA tensors");
  spin::StateView s;
  s.V = V.data_ptr();
  s.D = D.data_ptr();
  s.last_seen = last_seen.data_ptr<int64_t>();
  s.decode_steps = decode_steps.data_ptr<int64_t>();
  const auto dtype = V.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kFloat8_e4m3fn,
              "spin: V must be float32, float16 or float8_e4m3fn, got ", dtype);
  TORCH_CHECK(D.scalar_type() == dtype, "spin: D must have V's dtype ", dtype);
  s.type = dtype == at::kHalf ? spin::kStateF16
         : dtype == at::kFloat8_e4m3fn ? spin::kStateE4M3 : spin::kStateF32;
  s.cap = V.size(2);
  s.block_cap = last_seen.size(2);
  s.num_layers = static_cast<int>(V.size(1));
  s.num_slots = static_cast<int>(V.size(0));
  return s;
}

// The fields every launcher takes from a [B, m_cap] block-id view and its [B] counts (both may
// be strided layer views of select's [B, L, ...] outputs, or those outputs themselves).
template <typename Params>
void set_selection(Params& p, at::Tensor& block_ids, at::Tensor& counts) {
  p.block_ids = block_ids.data_ptr<int32_t>();
  p.counts = counts.data_ptr<int32_t>();
  p.m_cap = static_cast<int>(block_ids.size(-1));
  p.ids_stride = block_ids.stride(0);
  p.counts_stride = counts.stride(0);
}

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
  p.state = state_view(V, D, last_seen, decode_steps);
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
  p.max_blocks = static_cast<int>((max_context_len + spin::kBlockSize - 1) / spin::kBlockSize);
  if (block_scores.has_value()) {
    p.block_scores = block_scores->data_ptr<float>();
    p.scores_stride_b = block_scores->stride(0);
    p.scores_stride_r = block_scores->stride(1);
    p.scores_width = static_cast<int>(block_scores->size(2));
    p.merge_history = merge_history;
  }
  p.layer = static_cast<int>(layer);
  p.beside_previous = beside_previous;
  check(spin::launch_select(p, c10::cuda::getCurrentCUDAStream()), "select");
}

void spin_indexer_logits(at::Tensor q, at::Tensor kv_cache, at::Tensor weights, at::Tensor context_lens,
                    at::Tensor block_table, at::Tensor block_ids, at::Tensor counts, at::Tensor out) {
  const c10::cuda::CUDAGuard guard(q.device());
  spin::LogitsParams p;
  p.q = static_cast<const uint8_t*>(q.data_ptr());
  p.kv_cache = static_cast<const uint8_t*>(kv_cache.data_ptr());
  p.weights = weights.data_ptr<float>();
  p.context_lens = context_lens.data_ptr<int32_t>();
  p.block_table = block_table.data_ptr<int32_t>();
  set_selection(p, block_ids, counts);
  p.batch = static_cast<int>(context_lens.size(0));
  p.rows = static_cast<int>(context_lens.size(1));
  p.max_pages = static_cast<int>(block_table.size(1));
  p.num_pages = kv_cache.size(0);
  p.table_stride = block_table.stride(0);
  p.out = out.data_ptr<float>();
  check(spin::launch_indexer_logits(p, c10::cuda::getCurrentCUDAStream()), "indexer_logits");
}

void spin_topk(at::Tensor logits, at::Tensor block_ids, at::Tensor counts, int64_t next_n, at::Tensor out,
               const c10::optional<at::Tensor>& row_lens) {
  const c10::cuda::CUDAGuard guard(logits.device());
  spin::TopKParams p;
  p.logits = logits.data_ptr<float>();
  set_selection(p, block_ids, counts);
  p.batch = static_cast<int>(block_ids.size(0));
  p.rows = static_cast<int>(next_n);
  p.k = static_cast<int>(out.size(1));
  p.logits_stride = logits.stride(0);
  p.out = out.data_ptr<int32_t>();
  p.row_lens = row_lens.has_value() ? row_lens->data_ptr<int32_t>() : nullptr;
  check(spin::launch_topk(p, c10::cuda::getCurrentCUDAStream()), "topk");
}

void spin_update(at::Tensor V, at::Tensor D, at::Tensor last_seen, at::Tensor decode_steps,
            at::Tensor state_slot, at::Tensor logits, at::Tensor block_ids, at::Tensor counts,
            at::Tensor context_lens, at::Tensor query_pos, at::Tensor accepted, at::Tensor step,
            int64_t layer, double ema_decay, bool row0_only, int64_t max_context_len,
            bool beside_previous) {
  const c10::cuda::CUDAGuard guard(V.device());
  spin::UpdateParams p;
  p.state = state_view(V, D, last_seen, decode_steps);
  p.state_slot = state_slot.data_ptr<int32_t>();
  p.logits = logits.data_ptr<float>();
  set_selection(p, block_ids, counts);
  p.layer = static_cast<int>(layer);
  if (layer < 0) {  // every layer: logits [L, B*R, W], block_ids [B, L, m_cap], counts [B, L]
    p.layer = 0;
    p.layers = static_cast<int>(logits.size(0));
    p.logits_layer_stride = logits.stride(0);
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
  p.max_blocks = static_cast<int>((max_context_len + spin::kBlockSize - 1) / spin::kBlockSize);
  p.beside_previous = beside_previous;
  check(spin::launch_update(p, c10::cuda::getCurrentCUDAStream()), "update");
}

void spin_compact(at::Tensor block_ids, at::Tensor counts, at::Tensor context_lens, at::Tensor block_table,
                  int64_t page_slots, at::Tensor compact_table, at::Tensor compact_lens) {
  const c10::cuda::CUDAGuard guard(block_ids.device());
  spin::CompactParams p;
  set_selection(p, block_ids, counts);
  p.context_lens = context_lens.data_ptr<int32_t>();
  p.block_table = block_table.data_ptr<int32_t>();
  p.batch = static_cast<int>(context_lens.size(0));
  p.rows = static_cast<int>(context_lens.size(1));
  p.max_pages = static_cast<int>(block_table.size(1));
  p.page_slots = static_cast<int>(page_slots);
  p.table_stride = block_table.stride(0);
  p.compact_table = compact_table.data_ptr<int32_t>();
  p.compact_stride = compact_table.stride(0);
  p.width = static_cast<int>(compact_table.size(1));
  p.compact_lens = compact_lens.data_ptr<int32_t>();
  check(spin::launch_compact(p, c10::cuda::getCurrentCUDAStream()), "compact");
}

void spin_remap(at::Tensor positions, at::Tensor block_ids, at::Tensor counts, int64_t next_n, at::Tensor out,
                const c10::optional<at::Tensor>& values, bool ascending,
                const c10::optional<at::Tensor>& scores) {
  const c10::cuda::CUDAGuard guard(positions.device());
  spin::RemapParams p;
  p.positions = positions.data_ptr<int32_t>();
  p.values = values ? values->data_ptr<float>() : nullptr;
  p.values_stride = values ? values->stride(0) : 0;
  p.scores = scores ? scores->data_ptr<float>() : nullptr;
  p.scores_stride = scores ? scores->stride(0) : 0;
  p.ascending = ascending;
  set_selection(p, block_ids, counts);
  p.batch = static_cast<int>(block_ids.size(0));
  p.rows = static_cast<int>(next_n);
  p.k = static_cast<int>(out.size(1));
  p.positions_stride = positions.stride(0);
  p.out = out.data_ptr<int32_t>();
  check(spin::launch_remap(p, c10::cuda::getCurrentCUDAStream()), "remap");
}

void spin_summarize(at::Tensor kv_cache, at::Tensor pages, at::Tensor fill, at::Tensor summaries) {
  const c10::cuda::CUDAGuard guard(kv_cache.device());
  spin::SummarizeParams p;
  p.kv_cache = static_cast<const uint8_t*>(kv_cache.data_ptr());
  p.pages = pages.data_ptr<int32_t>();
  p.fill = fill.data_ptr<int32_t>();
  p.count = static_cast<int>(pages.size(0));
  p.num_pages = kv_cache.size(0);
  p.summaries = summaries.data_ptr<uint8_t>();
  check(spin::launch_summarize(p, c10::cuda::getCurrentCUDAStream()), "summarize");
}

void spin_probe(at::Tensor q, at::Tensor summaries, at::Tensor weights, at::Tensor context_lens,
                at::Tensor block_table, at::Tensor out) {
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
  check(spin::launch_probe(p, c10::cuda::getCurrentCUDAStream()), "probe");
}

}  // namespace

TORCH_LIBRARY(spin_native, m) {
  m.def("abi_version", &spin_abi_version);
  m.def("select(Tensor V, Tensor D, Tensor last_seen, Tensor decode_steps, Tensor state_slot, "
        "Tensor context_lens, Tensor query_pos, Tensor request_id, Tensor step, Tensor(a!) block_ids, "
        "Tensor(b!) counts, float target_sparsity, float exploration, int policy, int index_topk, "
        "int warmup_steps, bool keep_sink, bool keep_newest, int pooling, bool mtp_union, int seed, "
        "int max_context_len, Tensor? block_scores=None, int layer=-1, bool merge_history=False, "
        "bool beside_previous=False) -> ()");
  m.def("indexer_logits(Tensor q, Tensor kv_cache, Tensor weights, Tensor context_lens, "
        "Tensor block_table, Tensor block_ids, Tensor counts, Tensor(a!) out) -> ()");
  m.def("topk(Tensor logits, Tensor block_ids, Tensor counts, int next_n, Tensor(a!) out, "
        "Tensor? row_lens=None) -> ()");
  m.def("update(Tensor(a!) V, Tensor(b!) D, Tensor(c!) last_seen, Tensor(d!) decode_steps, "
        "Tensor state_slot, Tensor logits, Tensor block_ids, Tensor counts, Tensor context_lens, "
        "Tensor query_pos, Tensor accepted, Tensor step, int layer, float ema_decay, bool row0_only, "
        "int max_context_len, bool beside_previous=False) -> ()");
  m.def("compact(Tensor block_ids, Tensor counts, Tensor context_lens, Tensor block_table, "
        "int page_slots, Tensor(a!) compact_table, Tensor(b!) compact_lens) -> ()");
  m.def("remap(Tensor positions, Tensor block_ids, Tensor counts, int next_n, Tensor(a!) out, "
        "Tensor? values=None, bool ascending=False, Tensor? scores=None) -> ()");
  m.def("summarize(Tensor kv_cache, Tensor pages, Tensor fill, Tensor(a!) summaries) -> ()");
  m.def("probe(Tensor q, Tensor summaries, Tensor weights, Tensor context_lens, Tensor block_table, "
        "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(spin_native, CUDA, m) {
  m.impl("select", &spin_select);
  m.impl("indexer_logits", &spin_indexer_logits);
  m.impl("topk", &spin_topk);
  m.impl("update", &spin_update);
  m.impl("compact", &spin_compact);
  m.impl("remap", &spin_remap);
  m.impl("summarize", &spin_summarize);
  m.impl("probe", &spin_probe);
}
