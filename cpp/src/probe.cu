// spin::summarize, spin::probe and their gauss forms: query-aware block scores from page summaries.
// summarize: one CTA per listed page, thread d = key dim d: the page's mean key in the
// reference's arithmetic, re-quantized to e4m3 into a kSummaryBytes row (gauss: and the
// per-dimension std into the row after it). summarize_newest: the same over two page columns
// a request, found from the step's lengths on the device.
// gauss: the same grid over gauss rows (mean, then std): per row and head the mean's product
// as the probe's, the variance's on fp16 squares (wgmma on sm_90a), then the expected ReLU
// under a normal.
// probe: one CTA (one warpgroup) per (request, 64 consecutive page columns): their summary rows,
// gathered through the block table with cp.async, make one 64-row tile that goes through the
// indexer's tile product (indexer_tile.cuh: same MMA and epilogue as a K-cache page).
#include <cuda_fp16.h>

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
// max(amax / 448, 1e-12), then the fp32 scale. Called by all kHeadDim threads; a second call
// needs a barrier before it (every thread has read warp_max).
__device__ __forceinline__ void store_row(float value, uint8_t* dst) {
  __shared__ float warp_max[kHeadDim / 32];
  const int d = threadIdx.x;
  float amax = fabsf(value);
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if ((d & 31) == 0) warp_max[d >> 5] = amax;
  __syncthreads();
  amax = fmaxf(fmaxf(warp_max[0], warp_max[1]), fmaxf(warp_max[2], warp_max[3]));
  const float scale = fmaxf(__fdiv_rn(amax, kE4M3Max), 1e-12f);
  dst[d] = static_cast<uint8_t>(
      __nv_cvt_float_to_fp8(__fdiv_rn(value, scale), __NV_SATFINITE, __NV_E4M3));
  if (d == 0) *reinterpret_cast<float*>(dst + kHeadDim) = scale;
}

// Listing i of a summarize launch: its page (-1: skipped) and fill. From the step's lengths
// (SummarizeParams::context_lens): the two page columns that may hold request i / 2's newest
// `rows` slots, so a captured step needs no page list made on the host.
__device__ __forceinline__ int64_t listed_page(const SummarizeParams& p, int i, int& fill) {
  if (p.context_lens == nullptr) {
    fill = min(max(p.fill[i], 0), p.page_slots);
    return p.pages[i];
  }
  const int b = i >> 1;
  const int n = min(max(p.context_lens[static_cast<int64_t>(b) * p.rows + p.rows - 1], 0),
                    p.max_len);
  const int column = max(n - p.rows, 0) / p.page_slots + (i & 1);
  const int64_t written = n - static_cast<int64_t>(column) * p.page_slots;
  if (written <= 0 || column >= p.max_pages) return -1;
  fill = static_cast<int>(min(written, static_cast<int64_t>(p.page_slots)));
  return p.block_table[b * p.table_stride + column];
}

// One CTA per listed page (of page_slots slots), thread d = key dim d: the mean of the page's
// first `fill` keys (summed in fp64, as the reference) into the summary row; with_std also the
// population standard deviation (squared deviations from the fp64 mean, summed in fp64, each
// product and sum rounded on its own as the reference's) into the row after it.
__global__ void __launch_bounds__(kHeadDim) summarize_kernel(SummarizeParams p) {
  int fill = 0;
  const int64_t page = listed_page(p, blockIdx.x, fill);
  if (page < 0 || page >= p.num_pages) return;
  const int d = threadIdx.x;
  // the whole page into shared memory first, every copy in flight at once (read slot by slot
  // from global memory, the sums waited for one load after another)
  __shared__ __align__(16) uint8_t src[kBlockSize * kSlotBytes];
  const int page_bytes = p.page_slots * p.slot_bytes;
  const uint8_t* page_at = p.kv_cache + page * page_bytes;
  const uint32_t src_at = static_cast<uint32_t>(__cvta_generic_to_shared(src));
  for (int i = d; i < page_bytes / 16; i += kHeadDim)
    cp_async16(src_at + 16 * i, page_at + 16 * i);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  double total = 0.0;
  for (int s = 0; s < fill; ++s) total += static_cast<double>(page_key(p, src, s, d));
  const double count = static_cast<double>(max(fill, 1));
  const double mean = total / count;
  uint8_t* dst = p.summaries + page * p.row_bytes;
  store_row(static_cast<float>(mean), dst);
  if (!p.with_std) return;
  __syncthreads();  // store_row's warp_max is read by every thread before the std row writes it
  double squares = 0.0;
  for (int s = 0; s < fill; ++s) {
    const double dev = __dsub_rn(static_cast<double>(page_key(p, src, s, d)), mean);
    squares = __dadd_rn(squares, __dmul_rn(dev, dev));
  }
  store_row(static_cast<float>(sqrt(squares / count)), dst + kSummaryBytes);
}

// What the probe and gauss kernels share. The rows' lengths (into ctx_s), and the page of column
// j0 + i of request b: -1 where no row sees it, it lies past the table or its page outside the
// summaries (never read).
struct ColumnPages {
  const ProbeParams& p;
  int b, j0, max_ctx = 0;
  __device__ ColumnPages(const ProbeParams& params, int request, int first, int* ctx_s)
      : p(params), b(request), j0(first) {
    for (int r = 0; r < p.rows; ++r) max_ctx = max(max_ctx, p.context_lens[b * p.rows + r]);
    if (threadIdx.x < p.rows) ctx_s[threadIdx.x] = p.context_lens[b * p.rows + threadIdx.x];
  }
  __device__ int64_t operator()(int i) const {
    const int j = j0 + i;
    if (j >= p.num_blocks || j >= p.max_pages ||
        static_cast<int64_t>(j) * p.page_slots >= max_ctx)
      return -1;
    const int64_t page = p.block_table[b * p.table_stride + j];
    return page >= 0 && page < p.num_pages ? page : -1;
  }
};

// The 64 columns' summary rows (their first 128 bytes) into the swizzled tile at `tile` with
// cp.async, not committed; zero rows where not read. Thread t: rows t / 8 + 16 u, chunk t % 8.
__device__ __forceinline__ void load_summary_tile(const ProbeParams& p, const ColumnPages& page_of,
                                                  uint32_t base, unsigned char* smem,
                                                  uint32_t tile) {
  for (int u = 0; u < kChunksPerThread; ++u) {
    const int row = threadIdx.x / 8 + 16 * u, chunk = threadIdx.x % 8;
    const int64_t page = page_of(row);
    const uint32_t dst = tile + swizzled(row, chunk);
    if (page >= 0)
      cp_async16(base + dst, p.summaries + page * p.summary_bytes + chunk * 16);
    else
      *reinterpret_cast<uint4*>(smem + dst) = make_uint4(0, 0, 0, 0);
  }
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
  const ColumnPages page_of(p, b, j0, ctx_s);
  if (threadIdx.x < kBlockSize) {
    const int64_t page = page_of(threadIdx.x);
    valid_s[threadIdx.x] = page >= 0;
    *reinterpret_cast<float*>(smem + scales_at + threadIdx.x * 4) =
        page >= 0 ? *reinterpret_cast<const float*>(p.summaries + page * p.summary_bytes + kHeadDim)
                  : 0.0f;
  }
  load_summary_tile(p, page_of, base, smem, tile);
  load_queries(p.q, p.weights, b, p.rows, q_rows, base, smem, weights_at);
  cp_async_commit();
  tiles_ready();

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

// ---- gauss ------------------------------------------------------------------------------------
// The variance product runs in fp16 on squares of e4m3 values prescaled by 2^-6: (v 2^-6)^2 fits
// fp16 (448: 49) and is exact for |v| >= 1/8 (below, within 2^-25 of it: 1e-9 of the largest
// square); the scale comes back as 2^24 in the column's variance scale.
constexpr float kSquarePrescale = 0x1p-6f;
constexpr float kSquareUnscale = 0x1p24f;
// e^(-a^2/2) = 2^(-(k a)^2) with k^2 = log2(e) / 2: the kernel carries a' = k a.
constexpr float kExpScale = 0.84932180028801907f;

__device__ __forceinline__ float rsqrt_approx(float x) {
  float y;
  asm("rsqrt.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// 8 e4m3 bytes -> their prescaled squares, 8 fp16 values.
__device__ __forceinline__ uint4 f16_squares(uint2 bytes) {
  const uint32_t in[2] = {bytes.x, bytes.y};
  const __half2 prescale = __float2half2_rn(kSquarePrescale);
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>(in[i / 2] >> (16 * (i & 1)));
    const __half2 v = __hmul2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)), prescale);
    const __half2 sq = __hmul2(v, v);
    out[i] = *reinterpret_cast<const uint32_t*>(&sq);
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Dims 8 c .. 8 c + 7 (`lo`) and 64 + 8 c .. (`hi`) of `row` as prescaled fp16 squares into the
// K-major 128B-swizzled fp16 tile at `tile` (dims 0-63, then 64-127, 8 KB each): chunk c of both
// regions, so a quarter-warp (8 lanes, one row, c = 0..7) stores to eight bank groups.
__device__ __forceinline__ void store_f16_squares(uint2 lo, uint2 hi, unsigned char* tile, int row,
                                                  int c) {
  *reinterpret_cast<uint4*>(tile + swizzled(row, c)) = f16_squares(lo);
  *reinterpret_cast<uint4*>(tile + kPageKeyBytes + swizzled(row, c)) = f16_squares(hi);
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// mu = the mean tile's product with q (page_scores<1>'s four fp8 k-steps) and sq = the squares'
// (eight fp16 k-steps of 16 dims: 32 bytes into a 128-byte row of the region of dims 0-63, then
// of 64-127), issued together, complete on return.
__device__ __forceinline__ void gauss_products(Acc<1>& mu, Acc<1>& sq, uint32_t mean_tile,
                                               uint32_t q, uint32_t std2, uint32_t q2) {
  fence_acc<1>(mu);
  fence_acc<1>(sq);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks)
    wgmma_fp8<64>(mu, smem_desc(mean_tile) + ks * 2, smem_desc(q) + ks * 2, ks > 0);
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    const uint32_t at = (ks / 4) * kPageKeyBytes;
    wgmma_f16(sq, smem_desc(std2 + at) + (ks % 4) * 2, smem_desc(q2 + at) + (ks % 4) * 2, ks > 0);
  }
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  fence_acc<1>(mu);
  fence_acc<1>(sq);
}
#else
__device__ __forceinline__ void mma_f16(float* d, uint32_t a0, uint32_t a1, uint32_t a2,
                                        uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The same products with mma.sync from the same tiles (a 32-bit word: two fp16 dims).
__device__ __forceinline__ void gauss_products(Acc<1>& mu, Acc<1>& sq, uint32_t mean_tile,
                                               uint32_t q, uint32_t std2, uint32_t q2) {
  page_scores<1>(mu, mean_tile, q, [] {});
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int s_lo = warp * 16 + g, s_hi = s_lo + 8;
#pragma unroll
  for (int i = 0; i < 32; ++i) sq[i] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    const uint32_t at = (ks / 4) * kPageKeyBytes;
    const int c0 = (ks % 4) * 2, c1 = c0 + 1;  // dims 16 ks .. + 7, then + 8 .. + 15
    const uint32_t a0 = lds32(std2 + at + swizzled(s_lo, c0) + t * 4);
    const uint32_t a1 = lds32(std2 + at + swizzled(s_hi, c0) + t * 4);
    const uint32_t a2 = lds32(std2 + at + swizzled(s_lo, c1) + t * 4);
    const uint32_t a3 = lds32(std2 + at + swizzled(s_hi, c1) + t * 4);
#pragma unroll
    for (int nt = 0; nt < kHeads / 8; ++nt) {
      const int h = nt * 8 + g;
      mma_f16(sq + nt * 4, a0, a1, a2, a3, lds32(q2 + at + swizzled(h, c0) + t * 4),
              lds32(q2 + at + swizzled(h, c1) + t * 4));
    }
  }
}
#endif

// E[relu(X)] for X ~ N(mu, var), var = k^2 sq var_scale: mu Phi(a) + sd phi(a) = relu(mu) +
// e (sd phi(0) - |mu| Phi(-|a|) / e) with a = mu / sd and e = phi(a) / phi(0) = 2^-(k a)^2;
// Phi's tail in erfc's Abramowitz-Stegun 7.1.26 form (|error| < 1e-7), whose exponential is e.
// 1e-30 is added to var / k^2: where var is 0, k |a| is then above 1e15 |mu| and the result
// relu(mu) within 1e-15. Three MUFU and 16 FMA-pipe operations: the kernel's main cost.
__device__ __forceinline__ float expected_relu(float mu, float sq, float var_scale) {
  const float var_k = fmaf(sq, var_scale, 1e-30f);  // var / k^2
  const float inv_sd = rsqrt_approx(var_k);
  const float a = mu * inv_sd, sd = var_k * inv_sd;  // k mu / sd = k a, and sd / k
  const float t = rcp_approx(fmaf(0.3275911f * 0.70710678f / kExpScale, fabsf(a), 1.0f));
  const float tail = t * fmaf(t, fmaf(t, fmaf(t, fmaf(t, 0.5f * 1.061405429f,
                                                      0.5f * -1.453152027f),
                                              0.5f * 1.421413741f),
                                      0.5f * -0.284496736f),
                              0.5f * 0.254829592f);  // Phi(-|a|) / e
  const float e = exp2_approx(-a * a);
  return fmaf(e, fmaf(sd, kExpScale * 0.3989422804014327f, -fabsf(mu) * tail), relu(mu));
}

// One CTA per (request, 64 consecutive page columns), a warp 16 columns x 64 heads, one row at a
// time: mu = scale_mean (q_h . mean) on the tile product (fp8 wgmma), var = scale_std^2
// sum_d q_hd^2 std_d^2 (fp16 wgmma on the prescaled squares, fp32 sums), z = sum_h w_h
// expected_relu(mu, var); -inf where the column's page is not read or has no visible slot.
__global__ void __launch_bounds__(kThreads) gauss_kernel(ProbeParams p) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  // q rows first (load_queries writes them at base), then the mean rows' tile (e4m3), the std
  // rows' and q's prescaled squares (fp16, 16 KB each), the rows' scales, the weights; the
  // tiles K-major in the 128B-swizzled layout
  const uint32_t mean_tile = p.rows * kQBytes;
  const uint32_t std2_at = mean_tile + kPageKeyBytes;
  const uint32_t q2_at = std2_at + 2 * kPageKeyBytes;
  const uint32_t scales_at = q2_at + 2 * kPageKeyBytes;
  const uint32_t weights_at = scales_at + 2 * kBlockSize * 4;
  const int b = blockIdx.y, j0 = blockIdx.x * kBlockSize;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;

  __shared__ int page_s[kBlockSize], ctx_s[kMaxNextN];
  const ColumnPages page_of(p, b, j0, ctx_s);
  float* const scales = reinterpret_cast<float*>(smem + scales_at);  // [64] mean, [64] std
  if (threadIdx.x < kBlockSize) {
    const int64_t page = page_of(threadIdx.x);
    page_s[threadIdx.x] = static_cast<int>(page);
    const uint8_t* row = p.summaries + page * p.summary_bytes;
    scales[threadIdx.x] = page >= 0 ? *reinterpret_cast<const float*>(row + kHeadDim) : 0.0f;
    scales[kBlockSize + threadIdx.x] =
        page >= 0 ? *reinterpret_cast<const float*>(row + kSummaryBytes + kHeadDim) : 0.0f;
  }
  // Thread t: chunk t % 8 of rows t / 8 + 16 u (load_summary_tile's split) of the mean rows
  // (cp.async); dims 8 c .. 8 c + 7 and 64 + 8 c .. of the same rows of the std rows and of row
  // 0's query heads (into registers, c = t % 8). Every load in flight at once: the kernel is
  // bound by their latency, not by bytes
  const uint8_t* const q_b = p.q + static_cast<int64_t>(b) * p.rows * kQBytes;
  const int chunk = threadIdx.x % 8;
  static_assert(kHeads == kBlockSize, "the query heads share the page rows' load split");
  uint2 std_bytes[kChunksPerThread][2], q_bytes[kChunksPerThread][2];
#pragma unroll
  for (int u = 0; u < kChunksPerThread; ++u) {
    const int row = threadIdx.x / 8 + 16 * u;
    const int64_t page = page_of(row);
    const uint32_t dst = mean_tile + swizzled(row, chunk);
    if (page >= 0) {
      const uint8_t* summary = p.summaries + page * p.summary_bytes;
      cp_async16(base + dst, summary + chunk * 16);
#pragma unroll
      for (int k = 0; k < 2; ++k)
        std_bytes[u][k] =
            *reinterpret_cast<const uint2*>(summary + kSummaryBytes + 64 * k + 8 * chunk);
    } else {
      *reinterpret_cast<uint4*>(smem + dst) = make_uint4(0, 0, 0, 0);
      std_bytes[u][0] = std_bytes[u][1] = make_uint2(0, 0);
    }
#pragma unroll
    for (int k = 0; k < 2; ++k)
      q_bytes[u][k] = *reinterpret_cast<const uint2*>(q_b + row * kHeadDim + 64 * k + 8 * chunk);
  }
  load_queries(p.q, p.weights, b, p.rows, p.rows, base, smem, weights_at);
  cp_async_commit();
#pragma unroll
  for (int u = 0; u < kChunksPerThread; ++u) {
    const int row = threadIdx.x / 8 + 16 * u;
    store_f16_squares(std_bytes[u][0], std_bytes[u][1], smem + std2_at, row, chunk);
    store_f16_squares(q_bytes[u][0], q_bytes[u][1], smem + q2_at, row, chunk);
  }
  tiles_ready();

  const int s_lo = warp * 16 + g, s_hi = s_lo + 8;
  const int s_mine = t == 0 ? s_lo : s_hi;
  const float mean_lo = scales[s_lo], mean_hi = scales[s_hi];
  // sq's scale to var / k^2: the std scale squared, the squares' prescale undone
  const float std_lo = scales[kBlockSize + s_lo], std_hi = scales[kBlockSize + s_hi];
  const float var_lo = std_lo * std_lo * (kSquareUnscale / (kExpScale * kExpScale));
  const float var_hi = std_hi * std_hi * (kSquareUnscale / (kExpScale * kExpScale));
  const int j = j0 + s_mine;
  for (int r = 0; r < p.rows; ++r) {
    if (r > 0) {  // row r's query squares, from its q tile (row 0's came with the tiles)
#pragma unroll
      for (int u = 0; u < kChunksPerThread; ++u)
#pragma unroll
        for (int k = 0; k < 2; ++k)  // dims 64 k + 8 c: byte 8 (c % 2) of 16-byte chunk 4 k + c / 2
          q_bytes[u][k] = *reinterpret_cast<const uint2*>(
              smem + r * kQBytes + swizzled(threadIdx.x / 8 + 16 * u, 4 * k + chunk / 2) +
              8 * (chunk % 2));
      __syncthreads();  // every warp's products of row r - 1 are done
#pragma unroll
      for (int u = 0; u < kChunksPerThread; ++u)
        store_f16_squares(q_bytes[u][0], q_bytes[u][1], smem + q2_at, threadIdx.x / 8 + 16 * u,
                          chunk);
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
      __syncthreads();
    }
    Acc<1> mu, sq;
    gauss_products(mu, sq, base + mean_tile, base + r * kQBytes, base + std2_at, base + q2_at);
    const float* w = reinterpret_cast<const float*>(smem + weights_at) + r * kHeads;
    float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // slot lo, hi x two heads: short FMA chains
#pragma unroll
    for (int nt = 0; nt < kHeads / 8; ++nt) {
      const float2 wv = reinterpret_cast<const float2*>(w)[nt * 4 + t];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const bool lo = e < 2;
        z[e] = fmaf((e & 1) ? wv.y : wv.x,
                    expected_relu(mu[nt * 4 + e] * (lo ? mean_lo : mean_hi), sq[nt * 4 + e],
                                  lo ? var_lo : var_hi),
                    z[e]);
      }
    }
    float z_lo = z[0] + z[1], z_hi = z[2] + z[3];
    quad_sum(z_lo, z_hi);
    if (t < 2 && j < p.num_blocks) {
      const bool visible = page_s[s_mine] >= 0 && static_cast<int64_t>(j) * p.page_slots < ctx_s[r];
      p.out[(static_cast<int64_t>(b) * p.rows + r) * p.num_blocks + j] =
          visible ? (t == 0 ? z_lo : z_hi) : -CUDART_INF_F;
    }
  }
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
  if (p.slot_bytes != kSlotBytes && p.slot_bytes != kFp4SlotBytes) return cudaErrorInvalidValue;
  static_assert(kSlotBytes * kBlockSize / 2 % 16 == 0 && kFp4SlotBytes * kBlockSize / 2 % 16 == 0,
                "pages copied in 16-byte chunks");
  if (reinterpret_cast<uintptr_t>(p.kv_cache) % 16 != 0) return cudaErrorMisalignedAddress;
  if (p.row_bytes < (p.with_std ? kGaussSummaryBytes : kSummaryBytes)) return cudaErrorInvalidValue;
  if (p.context_lens != nullptr && ((p.block_table == nullptr && p.max_pages > 0) ||
                                     p.rows < 1 || p.max_len < 0 || p.count % 2 != 0))
    return cudaErrorInvalidValue;
  summarize_kernel<<<p.count, kHeadDim, 0, stream>>>(p);
  return cudaGetLastError();
}

// What probe and gauss launches need: rows of at least min_row_bytes, 16-byte aligned for
// cp.async, and page sizes the column lookup knows.
static bool columns_launchable(const ProbeParams& p, int min_row_bytes) {
  return p.rows >= 1 && p.rows <= kMaxNextN &&
         (p.page_slots == kBlockSize || p.page_slots == kBlockSize / 2) &&
         p.summary_bytes >= min_row_bytes && p.summary_bytes % 16 == 0;
}

cudaError_t launch_gauss(const ProbeParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.num_blocks == 0) return cudaSuccess;
  if (!columns_launchable(p, kGaussSummaryBytes)) return cudaErrorInvalidValue;
  const int smem = p.rows * kQBytes + 5 * kPageKeyBytes + 2 * kBlockSize * 4 +
                   p.rows * kHeads * 4 + 1024;
  cudaError_t err = allow_dynamic_smem(gauss_kernel, smem);
  if (err != cudaSuccess) return err;
  dim3 grid((p.num_blocks + kBlockSize - 1) / kBlockSize, p.batch);
  gauss_kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_probe(const ProbeParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.num_blocks == 0) return cudaSuccess;
  if (!columns_launchable(p, kSummaryBytes)) return cudaErrorInvalidValue;
  switch (group_for(p.rows)) {
    case 1: return launch_probe_as<1>(p, stream);
    case 2: return launch_probe_as<2>(p, stream);
    default: return launch_probe_as<4>(p, stream);
  }
}

}  // namespace spin
