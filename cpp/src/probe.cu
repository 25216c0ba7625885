// spin::summarize and spin::probe: query-aware block scores from per-page summaries.
// summarize: one CTA per listed page, thread d = key dim d: the page's mean key in the
// reference's arithmetic, re-quantized to e4m3 into a kSummaryBytes row (gauss: and the
// per-dimension std into the row after it).
// probe: one CTA (one warpgroup) per (request, 64 consecutive page columns): their summary rows,
// gathered through the block table with cp.async, make one 64-row tile that goes through the
// indexer's tile product (indexer_tile.cuh: same MMA and epilogue as a K-cache page).
#include "indexer_tile.cuh"

namespace spin {
namespace {

// The value of a 4-bit E2M1 code (sign, 2 exponent bits, 1 mantissa bit).
__device__ __forceinline__ float e2m1_value(uint32_t code) {
  const uint32_t exp = (code >> 1) & 3u, man = code & 1u;
  const float mag = exp == 0 ? 0.5f * man : ldexpf(1.0f + 0.5f * man, static_cast<int>(exp) - 1);
  return (code & 8u) ? -mag : mag;
}

// Dim d of slot s's key in the reference's arithmetic (an fp32 product, key times its scale).
// FP8 keys: e4m3 bytes, then an fp32 scale per slot; MXFP4 keys: E2M1 pairs (the even element
// in the low nibble), then a UE8M0 exponent e per 32 values, scale 2^(e - 127).
__device__ __forceinline__ float page_key(const SummarizeParams& p, const uint8_t* page, int s,
                                          int d) {
  if (p.slot_bytes == kFp4SlotBytes) {
    const uint32_t pair = page[s * (kHeadDim / 2) + d / 2];
    const uint8_t e = page[p.page_slots * (kHeadDim / 2) + s * (kHeadDim / kFp4Block) +
                           d / kFp4Block];
    return __fmul_rn(e2m1_value((d & 1) ? pair >> 4 : pair & 0xFu),
                     ldexpf(1.0f, static_cast<int>(e) - 127));
  }
  const float scale = reinterpret_cast<const float*>(page + p.page_slots * kHeadDim)[s];
  return __fmul_rn(static_cast<float>(*reinterpret_cast<const __nv_fp8_e4m3*>(
                       page + s * kHeadDim + d)), scale);
}

// Thread d's `value` of a 128-dim row re-quantized like a key into dst: e4m3 bytes with scale
// max(amax / 448, 1e-12), then the fp32 scale. Called by all kHeadDim threads.
__device__ __forceinline__ void store_row(float value, uint8_t* dst) {
  __shared__ float warp_max[kHeadDim / 32];
  const int d = threadIdx.x;
  float amax = fabsf(value);
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if ((d & 31) == 0) warp_max[d >> 5] = amax;
  __syncthreads();
  amax = fmaxf(fmaxf(warp_max[0], warp_max[1]), fmaxf(warp_max[2], warp_max[3]));
  __syncthreads();  // warp_max is read by every thread before the next row writes it
  const float scale = fmaxf(__fdiv_rn(amax, kE4M3Max), 1e-12f);
  dst[d] = static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(__fdiv_rn(value, scale), __NV_SATFINITE, __NV_E4M3));
  if (d == 0) *reinterpret_cast<float*>(dst + kHeadDim) = scale;
}

// One CTA per listed page (of page_slots slots), thread d = key dim d: the mean of the page's
// first `fill` keys (summed in fp64, as the reference) into the summary row; with_std also the
// population standard deviation (squared deviations from the fp64 mean, summed in fp64, each
// product and sum rounded on its own as the reference's) into the row after it.
__global__ void __launch_bounds__(kHeadDim) summarize_kernel(SummarizeParams p) {
  const int64_t page = p.pages[blockIdx.x];
  if (page < 0 || page >= p.num_pages) return;
  const int fill = min(max(p.fill[blockIdx.x], 0), p.page_slots);
  const int d = threadIdx.x;
  const uint8_t* src = p.kv_cache + page * p.page_slots * p.slot_bytes;
  double total = 0.0;
  for (int s = 0; s < fill; ++s) total += static_cast<double>(page_key(p, src, s, d));
  const double count = static_cast<double>(max(fill, 1));
  const double mean = total / count;
  uint8_t* dst = p.summaries + page * p.row_bytes;
  store_row(static_cast<float>(mean), dst);
  if (!p.with_std) return;
  double squares = 0.0;
  for (int s = 0; s < fill; ++s) {
    const double dev = __dsub_rn(static_cast<double>(page_key(p, src, s, d)), mean);
    squares = __dadd_rn(squares, __dmul_rn(dev, dev));
  }
  store_row(static_cast<float>(sqrt(squares / count)), dst + kSummaryBytes);
}

// One CTA per (request, 64 consecutive blocks): the blocks' summary rows, gathered through the
// block table, make one 64-row tile scored like a K-cache page (same MMA and epilogue).
template <int G>
__global__ void __launch_bounds__(kThreads) probe_kernel(ProbeParams p) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  const int q_rows = (p.rows + G - 1) / G * G;
  const uint32_t tile = q_rows * kQBytes, scales_at = tile + kPageKeyBytes;
  const uint32_t weights_at = scales_at + kBlockSize * 4;
  const int b = blockIdx.y, j0 = blockIdx.x * kBlockSize;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;

  __shared__ int valid_s[kBlockSize], ctx_s[kMaxNextN];
  int max_ctx = 0;
  for (int r = 0; r < p.rows; ++r) max_ctx = max(max_ctx, p.context_lens[b * p.rows + r]);
  if (threadIdx.x < p.rows) ctx_s[threadIdx.x] = p.context_lens[b * p.rows + threadIdx.x];
  // a row is read only for a block someone sees, inside the table and the summaries
  auto page_of = [&](int i) -> int64_t {
    const int j = j0 + i;
    if (j >= p.num_blocks || j >= p.max_pages ||
        static_cast<int64_t>(j) * p.page_slots >= max_ctx)
      return -1;
    const int64_t page = p.block_table[b * p.table_stride + j];
    return page >= 0 && page < p.num_pages ? page : -1;
  };
  if (threadIdx.x < kBlockSize) {
    const int64_t page = page_of(threadIdx.x);
    valid_s[threadIdx.x] = page >= 0;
    *reinterpret_cast<float*>(smem + scales_at + threadIdx.x * 4) =
        page >= 0 ? *reinterpret_cast<const float*>(p.summaries + page * kSummaryBytes + kHeadDim)
                  : 0.0f;
  }
  // rows t / 8 + 16 u, chunk t % 8; rows of unread blocks are zero
  for (int u = 0; u < kChunksPerThread; ++u) {
    const int row = threadIdx.x / 8 + 16 * u, chunk = threadIdx.x % 8;
    const int64_t page = page_of(row);
    const uint32_t dst = tile + swizzled(row, chunk);
    if (page >= 0)
      cp_async16(base + dst, p.summaries + page * kSummaryBytes + chunk * 16);
    else
      *reinterpret_cast<uint4*>(smem + dst) = make_uint4(0, 0, 0, 0);
  }
  load_queries(p.q, p.weights, b, p.rows, q_rows, base, smem, weights_at);
  cp_async_commit();
  cp_async_wait<0>();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // visible to wgmma
#endif
  __syncthreads();

  const int s_lo = warp * 16 + g, s_hi = s_lo + 8;
  const int s_mine = t == 0 ? s_lo : s_hi;
  const float* scales = reinterpret_cast<const float*>(smem + scales_at);
  const float sc_lo = scales[s_lo], sc_hi = scales[s_hi];
  const bool factored =
      sc_lo >= 0.0f && sc_hi >= 0.0f && sc_lo < CUDART_INF_F && sc_hi < CUDART_INF_F;
  const int j = j0 + s_mine;
  Acc<G> acc;
  auto weight = [&](int r, int, int nt) {
    return reinterpret_cast<const float2*>(smem + weights_at + r * kHeads * 4)[t + nt * 4];
  };
  score_tile<G>(acc, base + tile, base, p.rows, sc_lo, sc_hi, factored, weight, [] {}, [] {},
                [&](int r, float z) {
                  if (j >= p.num_blocks) return;
                  const bool visible =
                      valid_s[s_mine] && static_cast<int64_t>(j) * p.page_slots < ctx_s[r];
                  p.out[(static_cast<int64_t>(b) * p.rows + r) * p.num_blocks + j] =
                      visible ? z : -CUDART_INF_F;
                });
}

template <int G>
cudaError_t launch_probe_as(const ProbeParams& p, cudaStream_t stream) {
  const int q_rows = (p.rows + G - 1) / G * G;
  const int smem = q_rows * kQBytes + kPageKeyBytes + kBlockSize * 4 + p.rows * kHeads * 4 + 1024;
  cudaError_t err = allow_dynamic_smem(probe_kernel<G>, smem);
  if (err != cudaSuccess) return err;
  dim3 grid((p.num_blocks + kBlockSize - 1) / kBlockSize, p.batch);
  probe_kernel<G><<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_summarize(const SummarizeParams& p, cudaStream_t stream) {
  if (p.count == 0) return cudaSuccess;
  if (p.page_slots != kBlockSize && p.page_slots != kBlockSize / 2) return cudaErrorInvalidValue;
  if (p.row_bytes < (p.with_std ? 2 : 1) * kSummaryBytes) return cudaErrorInvalidValue;
  summarize_kernel<<<p.count, kHeadDim, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_probe(const ProbeParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.num_blocks == 0) return cudaSuccess;
  if (p.rows < 1 || p.rows > kMaxNextN) return cudaErrorInvalidValue;
  if (p.page_slots != kBlockSize && p.page_slots != kBlockSize / 2) return cudaErrorInvalidValue;
  switch (group_for(p.rows)) {
    case 1: return launch_probe_as<1>(p, stream);
    case 2: return launch_probe_as<2>(p, stream);
    default: return launch_probe_as<4>(p, stream);
  }
}

}  // namespace spin
