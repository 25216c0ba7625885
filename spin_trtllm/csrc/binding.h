// What every spin_native binding shares: the launch check, the V/D state view and the block
// selection fields. Each op's binding lives in its own file (select.cpp, ...) next to its
// schema; library.cpp holds the library's version.
#pragma once
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "spin/spin_kernels.h"

namespace spin_native {

inline void check(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "spin::", what, " launch failed: ", cudaGetErrorString(err));
}

inline spin::StateView state_view(at::Tensor& V, at::Tensor& D, at::Tensor& last_seen,
                                  at::Tensor& decode_steps) {
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

// Blocks of max_context_len slots: sizes select's and update's shared memory.
inline int max_blocks(int64_t max_context_len) {
  return static_cast<int>((max_context_len + spin::kBlockSize - 1) / spin::kBlockSize);
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

}  // namespace spin_native
