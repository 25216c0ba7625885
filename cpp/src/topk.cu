// spin::topk: top-K of the compact logits of each row, written as request-local slot ids in
// ascending order, -1 padded (TensorRT-LLM's topk_indices_buffer format). Ties at the K-th
// value go to the lower slot id. One CTA per row: 8-bit radix passes find the K-th value,
// one ordered pass writes the ids.
#include "common.cuh"

namespace spin {
namespace {

constexpr int kThreads = 512;
constexpr size_t kMaxCachedBytes = 192 * 1024;  // rows up to 48K slots stay in shared memory

// kCached: the row's keys are first copied to shared memory (rows up to kMaxCached slots),
// so the radix passes read shared memory instead of global memory. Key 0 marks "not taking
// part": no finite float maps to it.
template <bool kCached>
__global__ void __launch_bounds__(kThreads) topk_kernel(TopKParams p) {
  extern __shared__ uint32_t cached[];
  __shared__ long long scratch[kThreads / 32];
  __shared__ int hist[256];
  __shared__ int bcast[2];
  __shared__ int warp_counts[2 * kThreads / 32];
  const int row = blockIdx.x, b = row / p.rows;
  const int width = p.m_cap * kBlockSize;
  const float* z = p.logits + static_cast<int64_t>(row) * width;
  int32_t* out = p.out + static_cast<int64_t>(row) * p.k;
  const int32_t* ids = p.block_ids + b * p.ids_stride;
  // only slots of the selected blocks with a finite score take part
  const int scored = min(p.counts[b * p.counts_stride], p.m_cap) * kBlockSize;
  if (kCached) {
    for (int pos = threadIdx.x; pos < scored; pos += kThreads) {
      const float v = z[pos];
      cached[pos] = isfinite(v) ? ordered_key(v) : 0u;
    }
    __syncthreads();
  }
  auto valid = [&](int pos) { return kCached ? cached[pos] != 0u : isfinite(z[pos]); };
  auto key = [&](int pos) { return kCached ? cached[pos] : ordered_key(z[pos]); };

  long long finite = 0;
  for (int pos = threadIdx.x; pos < scored; pos += kThreads) finite += valid(pos);
  finite = block_sum<kThreads>(finite, scratch);
  const int T = static_cast<int>(min(static_cast<long long>(p.k), finite));
  int written = 0;
  if (T > 0) {
    uint32_t thr;
    int need;
    radix_threshold<kThreads>(scored, T, key, valid, hist, bcast, thr, need);
    written = ordered_take<kThreads>(scored, thr, need, key, valid, [&](int pos, int rank) {
      out[rank] = ids[pos / kBlockSize] * kBlockSize + pos % kBlockSize;
    }, warp_counts);
  }
  for (int c = written + threadIdx.x; c < p.k; c += kThreads) out[c] = -1;
}

}  // namespace

cudaError_t launch_topk(const TopKParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.rows == 0) return cudaSuccess;
  const size_t smem = static_cast<size_t>(p.m_cap) * kBlockSize * sizeof(uint32_t);
  if (smem <= kMaxCachedBytes) {
    cudaError_t err = cudaFuncSetAttribute(topk_kernel<true>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
    if (err != cudaSuccess) return err;
    topk_kernel<true><<<p.batch * p.rows, kThreads, smem, stream>>>(p);
  } else {
    topk_kernel<false><<<p.batch * p.rows, kThreads, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace spin
