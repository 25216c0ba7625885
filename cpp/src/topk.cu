// spin::topk: top-K of the compact logits of each row, written as request-local slot ids in
// ascending order, -1 padded (TensorRT-LLM's topk_indices_buffer format). Ties at the K-th
// value go to the lower slot id. One CTA per row; a bitwise search for the K-th key.
#include "common.cuh"

namespace spin {
namespace {

constexpr int kThreads = 512;

__global__ void __launch_bounds__(kThreads) topk_kernel(TopKParams p) {
  __shared__ long long scratch[kThreads / 32];
  __shared__ int warp_total[kThreads / 32];
  const int row = blockIdx.x, b = row / p.rows;
  const int width = p.m_cap * kBlockSize;
  const float* z = p.logits + static_cast<int64_t>(row) * width;
  int32_t* out = p.out + static_cast<int64_t>(row) * p.k;
  const int32_t* ids = p.block_ids + b * p.ids_stride;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // only slots of the selected blocks with a finite score take part
  const int scored = min(p.counts[b * p.counts_stride], p.m_cap) * kBlockSize;
  auto valid = [&](int pos) { return pos < scored && isfinite(z[pos]); };

  int low_bits = 0;
  while ((1 << low_bits) < width) ++low_bits;
  // key = ordered(value) : (width - 1 - pos)
  auto key = [&](int pos) {
    return (static_cast<uint64_t>(ordered_key(z[pos])) << 32) | static_cast<uint32_t>(width - 1 - pos);
  };
  long long finite = 0;
  for (int pos = threadIdx.x; pos < width; pos += kThreads) finite += valid(pos);
  finite = block_sum<kThreads>(finite, scratch);
  const long long T = min(static_cast<long long>(p.k), finite);

  uint64_t thr = ~0ull;
  if (T > 0) {
    uint64_t prefix = 0;
    for (int bit = 63; bit >= 0; --bit) {
      if (bit < 32 && bit >= low_bits) continue;  // position bits above width are all zero
      const uint64_t cand = prefix | (1ull << bit);
      long long c = 0;
      for (int pos = threadIdx.x; pos < width; pos += kThreads)
        c += valid(pos) && key(pos) >= cand;
      if (block_sum<kThreads>(c, scratch) >= T) prefix = cand;
    }
    thr = prefix;
  }
  int written = 0;
  for (int start = 0; start < width; start += kThreads) {
    const int pos = start + threadIdx.x;
    const bool f = T > 0 && pos < width && valid(pos) && key(pos) >= thr;
    const unsigned ballot = __ballot_sync(0xffffffffu, f);
    __syncthreads();
    if (lane == 0) warp_total[warp] = __popc(ballot);
    __syncthreads();
    int rank = written + __popc(ballot & ((1u << lane) - 1));
    for (int w = 0; w < warp; ++w) rank += warp_total[w];
    if (f && rank < p.k) out[rank] = ids[pos / kBlockSize] * kBlockSize + pos % kBlockSize;
    for (int w = 0; w < kThreads / 32; ++w) written += warp_total[w];
  }
  for (int c = written + threadIdx.x; c < p.k; c += kThreads) out[c] = -1;
}

}  // namespace

cudaError_t launch_topk(const TopKParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.rows == 0) return cudaSuccess;
  topk_kernel<<<p.batch * p.rows, kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace spin
