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

// Two e4m3 bytes (the low 16 bits) -> their prescaled squares as fp16x2, the lower dim low.
__device__ __forceinline__ uint32_t f16_square_pair(uint32_t bytes) {
  const __half2 v =
      __hmul2(__half2(__nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(bytes),
                                                   __NV_E4M3)),
              __float2half2_rn(kSquarePrescale));
  const __half2 sq = __hmul2(v, v);
  return *reinterpret_cast<const uint32_t*>(&sq);
}

// The variance product's k order. Its A operand (the std rows' squares) comes from registers
// with the fragment layout of m16n8k16 (thread t of a quad holds k = 2t, 2t + 1 in a0 / a1 and
// 2t + 8, 2t + 9 in a2 / a3 of each 16-wide k-step); a sum over dims takes them in any order, so
// thread t takes dims 4t .. 4t + 3 of each 16 (one 32-bit word of a std row: dims 4t, 4t + 1 ->
// k 2t, 2t + 1, dims 4t + 2, 4t + 3 -> k 2t + 8, 2t + 9), and q's squares are stored in the
// same order: of a 16-dim block's pairs of dims P0..P7, the first 8 k hold P0 P2 P4 P6, the
// next 8 P1 P3 P5 P7.
// 16 e4m3 bytes (dims 16 c .. 16 c + 15 of q row `row`) -> their prescaled squares in that order,
// two 16-byte chunks of the K-major 128B-swizzled fp16 tile at `tile` (dims 0-63, then 64-127, 8
// KB each).
__device__ __forceinline__ void store_q_squares(uint4 bytes, unsigned char* tile, int row, int c) {
  const uint32_t in[4] = {bytes.x, bytes.y, bytes.z, bytes.w};
  uint32_t even[4], odd[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    even[i] = f16_square_pair(in[i] & 0xFFFFu);
    odd[i] = f16_square_pair(in[i] >> 16);
  }
  unsigned char* const region = tile + (c / 4) * kPageKeyBytes;
  *reinterpret_cast<uint4*>(region + swizzled(row, 2 * (c % 4))) =
      make_uint4(even[0], even[1], even[2], even[3]);
  *reinterpret_cast<uint4*>(region + swizzled(row, 2 * (c % 4) + 1)) =
      make_uint4(odd[0], odd[1], odd[2], odd[3]);
}

// The warp's A fragments of the variance product for its rows s_lo and s_hi: per k-step ks the
// squares of std bytes 16 ks + 4 t .. + 3 (`std_lo[ks]`, `std_hi[ks]`) as a0 a1 a2 a3.
struct StdSquares {
  uint32_t a[kHeadDim / 16][4];
  __device__ StdSquares(const uint32_t (&std_lo)[kHeadDim / 16],
                        const uint32_t (&std_hi)[kHeadDim / 16]) {
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) {
      a[ks][0] = f16_square_pair(std_lo[ks] & 0xFFFFu);
      a[ks][1] = f16_square_pair(std_hi[ks] & 0xFFFFu);
      a[ks][2] = f16_square_pair(std_lo[ks] >> 16);
      a[ks][3] = f16_square_pair(std_hi[ks] >> 16);
    }
  }
};

// The products go in two passes of 32 heads (kPassHeads): 16 accumulators each for mu and sq
// beside the 32 registers of A keep the kernel at kGaussCtas CTAs per SM.
constexpr int kPassHeads = 32;
using PassAcc = float[kPassHeads / 2];

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// m64n32k16 on fp16, A from registers, B K-major in shared memory.
__device__ __forceinline__ void wgmma_f16_rs(PassAcc& d, const uint32_t (&a)[4], uint64_t b,
                                             int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred zero_init;\n"
      "setp.ne.b32 zero_init, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 " SPIN_WGMMA_ACC16_TEXT ", "
      "{%16, %17, %18, %19}, %20, zero_init, 1, 1, 0;\n"
      "}\n"
      : SPIN_WGMMA_ACC16(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
}

__device__ __forceinline__ void fence_pass(PassAcc& acc) {
#pragma unroll
  for (int i = 0; i < kPassHeads / 2; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// For heads 32 pass .. + 31: mu = the mean tile's product with q (four fp8 k-steps) and sq = the
// squares' (eight fp16 k-steps of 16 k: 32 bytes into a 128-byte row of q2's region of k 0-63,
// then of 64-127), issued together, complete on return. The pass's heads are rows 32 pass ..
// of q's and q2's tiles: 4 KB in, whole 8-row swizzle groups.
__device__ __forceinline__ void gauss_products(PassAcc& mu, PassAcc& sq, uint32_t mean_tile,
                                               uint32_t q, StdSquares& std2, uint32_t q2,
                                               int pass) {
  const uint32_t heads = pass * kPassHeads * 128;
  fence_pass(mu);
  fence_pass(sq);
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks)  // A's registers are written before wgmma.fence
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(std2.a[ks][i])::"memory");
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks)
    wgmma_fp8<kPassHeads>(mu, smem_desc(mean_tile) + ks * 2, smem_desc(q + heads) + ks * 2, ks > 0);
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks)
    wgmma_f16_rs(sq, std2.a[ks], smem_desc(q2 + (ks / 4) * kPageKeyBytes + heads) + (ks % 4) * 2,
                 ks > 0);
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  fence_pass(mu);
  fence_pass(sq);
}
#else
__device__ __forceinline__ void mma_f16(float* d, const uint32_t (&a)[4], uint32_t b0,
                                        uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same products with mma.sync (a 32-bit word of the tiles: four e4m3 dims of q, two fp16 k
// of q2).
__device__ __forceinline__ void gauss_products(PassAcc& mu, PassAcc& sq, uint32_t mean_tile,
                                               uint32_t q, StdSquares& std2, uint32_t q2,
                                               int pass) {
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int i = 0; i < kPassHeads / 2; ++i) mu[i] = sq[i] = 0.0f;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    const int c0 = ks * 2, c1 = ks * 2 + 1;
    uint32_t a[4];
    load_a_fragment(mean_tile, ks, a);
#pragma unroll
    for (int nt = 0; nt < kPassHeads / 8; ++nt) {
      const int h = pass * kPassHeads + nt * 8 + g;
      float d[4];
      mma_e4m3(d, a, lds32(q + swizzled(h, c0) + t * 4), lds32(q + swizzled(h, c1) + t * 4));
#pragma unroll
      for (int e = 0; e < 4; ++e) mu[nt * 4 + e] += d[e];
    }
  }
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    const uint32_t at = q2 + (ks / 4) * kPageKeyBytes;
    const int c0 = (ks % 4) * 2, c1 = c0 + 1;  // k 16 ks .. + 7, then + 8 .. + 15
#pragma unroll
    for (int nt = 0; nt < kPassHeads / 8; ++nt) {
      const int h = pass * kPassHeads + nt * 8 + g;
      mma_f16(sq + nt * 4, std2.a[ks], lds32(at + swizzled(h, c0) + t * 4),
              lds32(at + swizzled(h, c1) + t * 4));
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
// sum_d q_hd^2 std_d^2 (fp16 wgmma on the prescaled squares, the std rows' from registers,
// fp32 sums), z = sum_h w_h expected_relu(mu, var); -inf where the column's page is not read or
// has no visible slot. The kernel waits on its loads (a block-table read, then the summary rows'):
// shared memory (the q rows, the mean rows, q's squares) is kept small for kGaussCtas per SM.
constexpr int kGaussCtas = 5;
__global__ void __launch_bounds__(kThreads, kGaussCtas) gauss_kernel(ProbeParams p) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  // q rows first (load_queries writes them at base), then the mean rows' tile (e4m3), q's
  // prescaled squares (fp16, 16 KB), the rows' scales, the weights; the tiles K-major in the
  // 128B-swizzled layout
  const uint32_t mean_tile = p.rows * kQBytes;
  const uint32_t q2_at = mean_tile + kPageKeyBytes;
  const uint32_t scales_at = q2_at + 2 * kPageKeyBytes;
  const uint32_t weights_at = scales_at + 2 * kBlockSize * 4;
  const int b = blockIdx.y, j0 = blockIdx.x * kBlockSize;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int s_lo = warp * 16 + g, s_hi = s_lo + 8;

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
  // Every load in flight at once: the mean rows (cp.async, load_summary_tile's split), the
  // thread's words of its two std rows (StdSquares), row 0's query heads (thread t: 16 bytes c
  // = t / 8 % 8 of heads t % 8 + 8 (t / 64) + 16 u, so a quarter-warp's square stores fall on
  // eight rows' swizzles)
  uint32_t std_w[2][kHeadDim / 16];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int64_t page = page_of(k == 0 ? s_lo : s_hi);
    const uint8_t* row = p.summaries + page * p.summary_bytes + kSummaryBytes + 4 * t;
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks)
      std_w[k][ks] = page >= 0 ? *reinterpret_cast<const uint32_t*>(row + 16 * ks) : 0u;
  }
  load_summary_tile(p, page_of, base, smem, mean_tile);
  const uint8_t* const q_b = p.q + static_cast<int64_t>(b) * p.rows * kQBytes;
  const int q_chunk = threadIdx.x / 8 % 8;
  static_assert(kHeads == kBlockSize && kHeads == 2 * kPassHeads,
                "q's heads take the page rows' load split, and two passes");
  const int q_head0 = threadIdx.x % 8 + 8 * (threadIdx.x / 64);
  auto q_head = [&](int u) { return q_head0 + 16 * u; };
  uint4 q_bytes[kChunksPerThread];
#pragma unroll
  for (int u = 0; u < kChunksPerThread; ++u)
    q_bytes[u] = *reinterpret_cast<const uint4*>(q_b + q_head(u) * kHeadDim + q_chunk * 16);
  load_queries(p.q, p.weights, b, p.rows, p.rows, base, smem, weights_at);
  cp_async_commit();
#pragma unroll
  for (int u = 0; u < kChunksPerThread; ++u)
    store_q_squares(q_bytes[u], smem + q2_at, q_head(u), q_chunk);
  StdSquares std2(std_w[0], std_w[1]);
  tiles_ready();

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
        q_bytes[u] = *reinterpret_cast<const uint4*>(smem + r * kQBytes +
                                                     swizzled(q_head(u), q_chunk));
      __syncthreads();  // every warp's products of row r - 1 are done
#pragma unroll
      for (int u = 0; u < kChunksPerThread; ++u)
        store_q_squares(q_bytes[u], smem + q2_at, q_head(u), q_chunk);
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
      __syncthreads();
    }
    const float* w = reinterpret_cast<const float*>(smem + weights_at) + r * kHeads;
    float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // slot lo, hi x two heads: short FMA chains
#pragma unroll 1
    for (int pass = 0; pass < kHeads / kPassHeads; ++pass) {
      PassAcc mu, sq;
      gauss_products(mu, sq, base + mean_tile, base + r * kQBytes, std2, base + q2_at, pass);
#pragma unroll
      for (int nt = 0; nt < kPassHeads / 8; ++nt) {
        const float2 wv = reinterpret_cast<const float2*>(w + pass * kPassHeads)[nt * 4 + t];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const bool lo = e < 2;
          z[e] = fmaf((e & 1) ? wv.y : wv.x,
                      expected_relu(mu[nt * 4 + e] * (lo ? mean_lo : mean_hi), sq[nt * 4 + e],
                                    lo ? var_lo : var_hi),
                      z[e]);
        }
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
  const int smem = p.rows * kQBytes + 3 * kPageKeyBytes + 2 * kBlockSize * 4 +
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
