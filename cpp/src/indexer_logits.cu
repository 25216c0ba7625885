// spin::indexer_logits: z[i] = sum_h w_h ReLU(q_h . k_i) over the selected blocks only, from the
// FP8 paged indexer K cache. A CTA of 4 warps takes kBlocksPerCta selected blocks of one request;
// pages stream in through a two-stage cp.async pipeline; for each page (read once, for all
// MTP rows) every warp computes S[h, s] = q_h . k_s for its 16
// heads x 64 slots on FP8 tensor cores (mma.sync m16n8k32 e4m3, fp32 accumulate, one k-step per
// MMA so the sum over the 128 dims is done in fp32 FMA units), then reduces over heads.
#include <cuda_fp8.h>

#include "common.cuh"

namespace spin {
namespace {

constexpr int kWarps = 4;                          // 4 x 16 heads
constexpr int kThreads = kWarps * 32;
constexpr int kPitch = kHeadDim + 16;              // padded smem row: conflict-free B loads
constexpr int kBlocksPerCta = 8;

__device__ __forceinline__ void mma_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f), "f"(0.0f),
        "f"(0.0f), "f"(0.0f));
}

// torch.relu semantics: NaN stays NaN.
__device__ __forceinline__ float relu(float x) { return x > 0.0f ? x : (x != x ? x : 0.0f); }

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  const unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(saddr), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::); }

__global__ void __launch_bounds__(kThreads) logits_kernel(LogitsParams p) {
  // two page buffers: the next page streams in (cp.async) while this one is scored
  __shared__ __align__(16) uint8_t k_rows[2][kBlockSize * kPitch];
  __shared__ __align__(16) float scales[2][kBlockSize];
  __shared__ float partial[kWarps][kBlockSize];

  const int b = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t width = static_cast<int64_t>(p.m_cap) * kBlockSize;
  const int count = min(p.counts[b * p.counts_stride], p.m_cap);
  const int c_begin = blockIdx.x * kBlocksPerCta;
  const int c_end = min(c_begin + kBlocksPerCta, p.m_cap);

  auto block_of = [&](int c) { return c < count ? p.block_ids[b * p.ids_stride + c] : -1; };
  auto page_of = [&](int c) {  // -1: nothing to read (never dereference outside the cache)
    const int j = block_of(c);
    const int page = (j >= 0 && j < p.max_pages) ? p.block_table[b * p.table_stride + j] : -1;
    return (page >= 0 && page < p.num_pages) ? page : -1;
  };
  auto issue = [&](int c, int buf) {
    const int page = page_of(c);
    if (page < 0) return;
    const uint8_t* src = p.kv_cache + static_cast<int64_t>(page) * kBlockSize * kSlotBytes;
    for (int idx = threadIdx.x; idx < kBlockSize * kHeadDim / 16; idx += kThreads) {
      const int row = idx / (kHeadDim / 16), col = idx % (kHeadDim / 16);
      cp_async16(&k_rows[buf][row * kPitch + col * 16], src + idx * 16);
    }
    if (threadIdx.x < kBlockSize / 4)
      cp_async16(&scales[buf][threadIdx.x * 4], src + kBlockSize * kHeadDim + threadIdx.x * 16);
  };

  if (c_begin < c_end) issue(c_begin, 0);
  cp_async_commit();
  for (int c = c_begin; c < c_end; ++c) {
    const int buf = (c - c_begin) & 1;
    if (c + 1 < c_end) issue(c + 1, buf ^ 1);
    cp_async_commit();
    cp_async_wait_one();
    __syncthreads();
    if (page_of(c) < 0) {
      for (int idx = threadIdx.x; idx < p.rows * kBlockSize; idx += kThreads) {
        const int r = idx / kBlockSize, s = idx % kBlockSize;
        p.out[(static_cast<int64_t>(b) * p.rows + r) * width + c * kBlockSize + s] = -CUDART_INF_F;
      }
      __syncthreads();
      continue;
    }
    const int64_t slot0 = static_cast<int64_t>(block_of(c)) * kBlockSize;
    for (int r = 0; r < p.rows; ++r) {
      const int64_t qrow = static_cast<int64_t>(b) * p.rows + r;
      const uint8_t* qh = p.q + (qrow * kHeads + warp * 16 + g) * kHeadDim;
      uint32_t a[4][4];
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const int d = ks * 32 + t * 4;
        a[ks][0] = __ldg(reinterpret_cast<const uint32_t*>(qh + d));
        a[ks][1] = __ldg(reinterpret_cast<const uint32_t*>(qh + 8 * kHeadDim + d));
        a[ks][2] = __ldg(reinterpret_cast<const uint32_t*>(qh + d + 16));
        a[ks][3] = __ldg(reinterpret_cast<const uint32_t*>(qh + 8 * kHeadDim + d + 16));
      }
      const float w_lo = __ldg(p.weights + qrow * kHeads + warp * 16 + g);
      const float w_hi = __ldg(p.weights + qrow * kHeads + warp * 16 + g + 8);
#pragma unroll
      for (int nt = 0; nt < kBlockSize / 8; ++nt) {
        const uint8_t* krow = k_rows[buf] + (nt * 8 + g) * kPitch + t * 4;
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          float d[4];
          mma_e4m3(d, a[ks], *reinterpret_cast<const uint32_t*>(krow + ks * 32),
                   *reinterpret_cast<const uint32_t*>(krow + ks * 32 + 16));
#pragma unroll
          for (int e = 0; e < 4; ++e) s[e] += d[e];
        }
        const int s0 = nt * 8 + 2 * t;
        const float sc0 = scales[buf][s0], sc1 = scales[buf][s0 + 1];
        float v0 = w_lo * relu(s[0] * sc0) + w_hi * relu(s[2] * sc0);
        float v1 = w_lo * relu(s[1] * sc1) + w_hi * relu(s[3] * sc1);
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
          v0 += __shfl_xor_sync(0xffffffffu, v0, o);
          v1 += __shfl_xor_sync(0xffffffffu, v1, o);
        }
        if (g == 0) {
          partial[warp][s0] = v0;
          partial[warp][s0 + 1] = v1;
        }
      }
      __syncthreads();
      if (threadIdx.x < kBlockSize) {
        const int s = threadIdx.x;
        const float z = (partial[0][s] + partial[1][s]) + (partial[2][s] + partial[3][s]);
        const bool visible = slot0 + s < p.context_lens[b * p.rows + r];
        p.out[qrow * width + c * kBlockSize + s] = visible ? z : -CUDART_INF_F;
      }
      __syncthreads();
    }
  }
}

}  // namespace

cudaError_t launch_indexer_logits(const LogitsParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.m_cap == 0) return cudaSuccess;
  dim3 grid((p.m_cap + kBlocksPerCta - 1) / kBlocksPerCta, p.batch);
  logits_kernel<<<grid, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace spin
