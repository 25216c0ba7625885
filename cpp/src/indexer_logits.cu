// spin::indexer_logits: z[i] = sum_h w_h ReLU(q_h . k_i) over the selected blocks only, from the
// FP8 paged indexer K cache. One CTA per (selected block, request) scores all MTP rows of the
// request from one read of the page. Correct first; the tensor-core version is issue 4's.
#include <cuda_fp8.h>

#include "common.cuh"

namespace spin {
namespace {

constexpr int kThreads = 256;                     // 64 slots x 4 head groups
constexpr int kGroups = kThreads / kBlockSize;
constexpr int kHeadsPerGroup = kHeads / kGroups;
constexpr int kRowPitch = kHeadDim + 4;           // padded smem row: conflict-free slot reads

__device__ __forceinline__ float4 fp8x4_to_float4(uint32_t v) {
  const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v & 0xFFFFu), __NV_E4M3);
  const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v >> 16), __NV_E4M3);
  const float2 a = __half22float2(__half2(lo));
  const float2 b = __half22float2(__half2(hi));
  return make_float4(a.x, a.y, b.x, b.y);
}

__global__ void __launch_bounds__(kThreads) logits_kernel(LogitsParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  uint8_t* k_rows = smem;                                        // [64][kRowPitch]
  float* scales = reinterpret_cast<float*>(k_rows + kBlockSize * kRowPitch);
  uint8_t* qs = reinterpret_cast<uint8_t*>(scales + kBlockSize); // [R][64][128]
  float* ws = reinterpret_cast<float*>(qs + p.rows * kHeads * kHeadDim);  // [R][64]
  float* partial = ws + p.rows * kHeads;                         // [kGroups][64]

  const int c = blockIdx.x, b = blockIdx.y;
  const int slot = threadIdx.x % kBlockSize, group = threadIdx.x / kBlockSize;
  const int64_t width = static_cast<int64_t>(p.m_cap) * kBlockSize;
  const int count = min(p.counts[b * p.counts_stride], p.m_cap);
  const int j = c < count ? p.block_ids[b * p.ids_stride + c] : -1;
  const int page = (j >= 0 && j < p.max_pages) ? p.block_table[b * p.table_stride + j] : -1;

  if (page < 0 || page >= p.num_pages) {  // never dereference an entry outside the cache
    for (int idx = threadIdx.x; idx < p.rows * kBlockSize; idx += kThreads) {
      const int r = idx / kBlockSize, s = idx % kBlockSize;
      p.out[(static_cast<int64_t>(b) * p.rows + r) * width + c * kBlockSize + s] = -CUDART_INF_F;
    }
    return;
  }
  const uint8_t* src = p.kv_cache + static_cast<int64_t>(page) * kBlockSize * kSlotBytes;
  for (int idx = threadIdx.x; idx < kBlockSize * kHeadDim / 16; idx += kThreads) {
    const int row = idx / (kHeadDim / 16), col = idx % (kHeadDim / 16);
    const uint4 v = reinterpret_cast<const uint4*>(src)[idx];
    uint32_t* dst = reinterpret_cast<uint32_t*>(k_rows + row * kRowPitch + col * 16);
    dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
  }
  if (threadIdx.x < kBlockSize)
    scales[threadIdx.x] = reinterpret_cast<const float*>(src + kBlockSize * kHeadDim)[threadIdx.x];
  const uint4* qsrc = reinterpret_cast<const uint4*>(p.q + static_cast<int64_t>(b) * p.rows * kHeads * kHeadDim);
  for (int idx = threadIdx.x; idx < p.rows * kHeads * kHeadDim / 16; idx += kThreads)
    reinterpret_cast<uint4*>(qs)[idx] = qsrc[idx];
  for (int idx = threadIdx.x; idx < p.rows * kHeads; idx += kThreads)
    ws[idx] = p.weights[static_cast<int64_t>(b) * p.rows * kHeads + idx];
  __syncthreads();

  const int64_t i = static_cast<int64_t>(j) * kBlockSize + slot;
  const float scale = scales[slot];
  for (int r = 0; r < p.rows; ++r) {
    float acc[kHeadsPerGroup];
#pragma unroll
    for (int h = 0; h < kHeadsPerGroup; ++h) acc[h] = 0.0f;
    const uint8_t* qrow = qs + (r * kHeads + group * kHeadsPerGroup) * kHeadDim;
#pragma unroll 4
    for (int d = 0; d < kHeadDim; d += 4) {
      const float4 k4 = fp8x4_to_float4(*reinterpret_cast<const uint32_t*>(k_rows + slot * kRowPitch + d));
#pragma unroll
      for (int h = 0; h < kHeadsPerGroup; ++h) {
        const float4 q4 = fp8x4_to_float4(*reinterpret_cast<const uint32_t*>(qrow + h * kHeadDim + d));
        acc[h] += q4.x * k4.x + q4.y * k4.y + q4.z * k4.z + q4.w * k4.w;
      }
    }
    float z = 0.0f;
#pragma unroll
    for (int h = 0; h < kHeadsPerGroup; ++h) {
      const float x = acc[h] * scale;
      const float relu = x > 0.0f ? x : (x != x ? x : 0.0f);  // NaN stays NaN, as torch.relu
      z += ws[r * kHeads + group * kHeadsPerGroup + h] * relu;
    }
    partial[group * kBlockSize + slot] = z;
    __syncthreads();
    if (group == 0) {
      float total = 0.0f;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) total += partial[g * kBlockSize + slot];
      const bool visible = i < p.context_lens[b * p.rows + r];
      p.out[(static_cast<int64_t>(b) * p.rows + r) * width + c * kBlockSize + slot] =
          visible ? total : -CUDART_INF_F;
    }
    __syncthreads();
  }
}

}  // namespace

cudaError_t launch_indexer_logits(const LogitsParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.m_cap == 0) return cudaSuccess;
  const size_t smem = kBlockSize * kRowPitch + kBlockSize * sizeof(float) +
                      static_cast<size_t>(p.rows) * kHeads * kHeadDim +
                      static_cast<size_t>(p.rows) * kHeads * sizeof(float) +
                      kGroups * kBlockSize * sizeof(float);
  cudaError_t err = cudaFuncSetAttribute(logits_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  dim3 grid(p.m_cap, p.batch);
  logits_kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace spin
