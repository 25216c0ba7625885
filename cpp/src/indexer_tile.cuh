// The FP8 tile product shared by spin::indexer_logits (indexer_logits.cu) and spin::probe
// (probe.cu): a CTA of one warpgroup (4 warps) scores a 64-row tile of fp8 keys (a K-cache page,
// or 64 blocks' summary rows) against the q rows of one request, z = sum_h w_h ReLU(q_h . k).
// A warp owns 16 rows (slots) x all 64 heads, so the weighted ReLU sum over heads needs two
// shuffles and no shared memory. The MTP rows go through the tensor cores in groups of G = 1, 2
// or 4, side by side as the N dimension (as DeepGEMM's MQA logits do with next_n x heads):
// M = 64 slots, N = 64 G, K = 128 dims. On sm_90a wgmma (FP8 e4m3, m64n{64,128,256}k32, the four
// k-steps accumulated in the tensor core: about 1.4e-4 of the row norm from exact on random
// data), elsewhere mma.sync m16n8k32 summed in fp32. Tiles sit in shared memory in the 128-byte
// swizzled layout. Included by those two files only; its definitions are internal to each.
#pragma once
#include <cuda_fp8.h>

#include "common.cuh"

namespace spin {
namespace {

constexpr int kThreads = 128;                       // one warpgroup
constexpr int kPageKeyBytes = kBlockSize * kHeadDim;  // 8 KB of fp8 keys, then 64 fp32 scales
constexpr int kQBytes = kHeads * kHeadDim;          // one MTP row's q: 8 KB
constexpr int kKSteps = kHeadDim / 32;              // 32 fp8 dims per MMA k-step
// On sm_89 the threads copy a page's 512 16-byte chunks: thread t takes chunks t + 128 u
// (u = 0..3), rows t / 8 + 16 u, all with the same swizzle (16 u is a multiple of 8): + 2048 u.
constexpr int kChunksPerThread = kPageKeyBytes / 16 / kThreads;
static_assert(kChunksPerThread * kThreads * 16 == kPageKeyBytes && kThreads % 8 == 0, "page split");

// Rows per MMA group: all of them up to 2, else groups of 4 (rows 3, 5..8 pad the last group
// with zero q rows, computed and dropped).
__host__ __device__ constexpr int group_for(int rows) { return rows <= 2 ? rows : 4; }
// The kernels with one group (G <= 2) take G == rows: their rows' weights stay in registers.
static_assert(group_for(1) == 1 && group_for(2) == 2, "G <= 2 must mean G == rows");

// 16-byte chunk `chunk` (0..7) of 128-byte row `row` in the 128B-swizzled layout.
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * 128 + ((chunk ^ (row & 7)) << 4);
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Every thread's cp.asyncs landed and, for wgmma (the async proxy), visible; then the block's
// barrier: the tiles are ready for the MMA.
__device__ __forceinline__ void tiles_ready() {
  cp_async_wait<0>();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
  __syncthreads();
}

// torch.relu semantics: NaN stays NaN (one max.NaN instruction).
__device__ __forceinline__ float relu(float x) {
  float y;
  asm("max.NaN.f32 %0, %1, 0f00000000;\n" : "=f"(y) : "f"(x));
  return y;
}

// acc[32 j + nt * 4 + e] holds S[slot, head] of the group's row j with slot = 16 * warp + g
// (e < 2) or + 8 (e >= 2) and head = 8 * nt + 2 * t + (e & 1), g = lane / 4, t = lane % 4: the
// accumulator layout of wgmma m64nN (N index 64 j + head) and of mma.sync m16n8.
template <int G>
using Acc = float[32 * G];

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Shared-memory matrix descriptor: K-major, 128B swizzle, 8-row groups 1024 B apart.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

template <int N>
__device__ __forceinline__ void wgmma_fp8(float (&d)[N / 2], uint64_t a, uint64_t b, int accumulate);
// The 16 fp32 accumulators of an m64n32 wgmma, the same way.
#define SPIN_WGMMA_ACC16_TEXT \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define SPIN_WGMMA_ACC16(d)                                                                   \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
      "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
      "+f"(d[14]), "+f"(d[15])

template <>
__device__ __forceinline__ void wgmma_fp8<32>(float (&d)[16], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred zero_init;\n"
      "setp.ne.b32 zero_init, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 " SPIN_WGMMA_ACC16_TEXT ", "
      "%16, %17, zero_init, 1, 1;\n"
      "}\n"
      : SPIN_WGMMA_ACC16(d)
      : "l"(a), "l"(b), "r"(accumulate));
}
// The 32 fp32 accumulators of an m64n64 wgmma: their registers in the instruction's text, and
// their operands.
#define SPIN_WGMMA_ACC32_TEXT                                                                 \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "   \
  "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define SPIN_WGMMA_ACC32(d)                                                                   \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),        \
      "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
      "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),           \
      "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),           \
      "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

template <>
__device__ __forceinline__ void wgmma_fp8<64>(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred zero_init;\n"
      "setp.ne.b32 zero_init, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " SPIN_WGMMA_ACC32_TEXT ", "
      "%32, %33, zero_init, 1, 1;\n"
      "}\n"
      : SPIN_WGMMA_ACC32(d)
      : "l"(a), "l"(b), "r"(accumulate));
}
template <>
__device__ __forceinline__ void wgmma_fp8<128>(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred zero_init;\n"
      "setp.ne.b32 zero_init, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, zero_init, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
        "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
        "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),
        "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b), "r"(accumulate));
}
template <>
__device__ __forceinline__ void wgmma_fp8<256>(float (&d)[128], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred zero_init;\n"
      "setp.ne.b32 zero_init, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, "
      "%36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, "
      "%53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, "
      "%70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, "
      "%87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, "
      "%103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, "
      "%117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, zero_init, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
        "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
        "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),
        "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]),
        "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]),
        "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]),
        "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]),
        "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]),
        "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]),
        "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]),
        "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]),
        "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(a), "l"(b), "r"(accumulate));
}
// Keeps the compiler from moving accumulator reads/writes across the asynchronous MMA.
template <int G>
__device__ __forceinline__ void fence_acc(Acc<G>& acc) {
#pragma unroll
  for (int i = 0; i < 32 * G; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

// S for one page against the G q rows at q (one tile of 64 G rows), complete on return;
// in_flight() runs while the tensor cores work (it must not touch acc).
template <int G, typename InFlight>
__device__ __forceinline__ void page_scores(Acc<G>& acc, uint32_t page, uint32_t q,
                                            InFlight in_flight) {
  fence_acc<G>(acc);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks)  // the first k-step overwrites, the others accumulate
    wgmma_fp8<64 * G>(acc, smem_desc(page) + ks * 2, smem_desc(q) + ks * 2, ks > 0);  // +32 B
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  in_flight();
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  fence_acc<G>(acc);
}
#else
__device__ __forceinline__ void mma_e4m3(float* d, const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.0f), "f"(0.0f),
        "f"(0.0f), "f"(0.0f));
}

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}

// m16n8k32's A fragment for k-step ks: the warp's 16 rows (warp * 16 + g and + 8) of a
// swizzled tile, its chunks 2 ks and 2 ks + 1.
__device__ __forceinline__ void load_a_fragment(uint32_t tile, int ks, uint32_t (&a)[4]) {
  const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
  const int s_lo = (threadIdx.x >> 5) * 16 + g, s_hi = s_lo + 8;
  const int c0 = ks * 2, c1 = c0 + 1;
  a[0] = lds32(tile + swizzled(s_lo, c0) + t * 4);
  a[1] = lds32(tile + swizzled(s_hi, c0) + t * 4);
  a[2] = lds32(tile + swizzled(s_lo, c1) + t * 4);
  a[3] = lds32(tile + swizzled(s_hi, c1) + t * 4);
}

// Same product from the same swizzled tiles with mma.sync: the warp's 16 slots are A, the
// 8-head groups of each row are B (a 32-bit fragment word is 4 consecutive dims of one chunk).
template <int G, typename InFlight>
__device__ __forceinline__ void page_scores(Acc<G>& acc, uint32_t page, uint32_t q,
                                            InFlight in_flight) {
  in_flight();  // nothing runs asynchronously here: first, like the wgmma path's issue order
  const int lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    const int c0 = ks * 2, c1 = ks * 2 + 1;  // the k-step's two 16-byte chunks
    uint32_t a[4];
    load_a_fragment(page, ks, a);
#pragma unroll
    for (int nt = 0; nt < 8 * G; ++nt) {  // q rows of the group are consecutive 64-row tiles
      const int h = nt * 8 + g;
      float d[4];
      mma_e4m3(d, a, lds32(q + swizzled(h, c0) + t * 4), lds32(q + swizzled(h, c1) + t * 4));
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt * 4 + e] = (ks > 0 ? acc[nt * 4 + e] : 0.0f) + d[e];
    }
  }
}
#endif

// The four lanes of a quad (t = 0..3) each hold part of slots s_lo's and s_hi's sums: every lane
// gets the whole.
__device__ __forceinline__ void quad_sum(float& z_lo, float& z_hi) {
  z_lo += __shfl_xor_sync(0xffffffffu, z_lo, 1);
  z_hi += __shfl_xor_sync(0xffffffffu, z_hi, 1);
  z_lo += __shfl_xor_sync(0xffffffffu, z_lo, 2);
  z_hi += __shfl_xor_sync(0xffffffffu, z_hi, 2);
}

// Per thread: sum over its 16 heads of w_h relu(scale * S) for its two slots (scale applied
// only when kScaleIn; four independent sums keep the FMA chains short). w(nt) is the thread's
// float2 of heads 8 nt + 2 t, +1.
template <bool kScaleIn, typename W>
__device__ __forceinline__ void weighted_relu_sum(const float* s, W w, float sc_lo, float sc_hi,
                                                  float& z_lo, float& z_hi) {
  float zl0 = 0.0f, zl1 = 0.0f, zh0 = 0.0f, zh1 = 0.0f;
#pragma unroll
  for (int nt = 0; nt < kHeads / 8; ++nt) {
    const float2 wv = w(nt);
    zl0 = fmaf(wv.x, relu(kScaleIn ? s[nt * 4 + 0] * sc_lo : s[nt * 4 + 0]), zl0);
    zl1 = fmaf(wv.y, relu(kScaleIn ? s[nt * 4 + 1] * sc_lo : s[nt * 4 + 1]), zl1);
    zh0 = fmaf(wv.x, relu(kScaleIn ? s[nt * 4 + 2] * sc_hi : s[nt * 4 + 2]), zh0);
    zh1 = fmaf(wv.y, relu(kScaleIn ? s[nt * 4 + 3] * sc_hi : s[nt * 4 + 3]), zh1);
  }
  z_lo = zl0 + zl1;
  z_hi = zh0 + zh1;
}

// z of the lane's two slots for one row of the tile (all lanes of a slot end with it):
// relu(s * scale) = scale * relu(s) for a finite scale >= 0 (`factored`: scale once per slot).
template <typename W>
__device__ __forceinline__ void slot_scores(const float* s, W w, float sc_lo, float sc_hi,
                                            bool factored, float& z_lo, float& z_hi) {
  if (factored) {
    weighted_relu_sum<false>(s, w, 1.0f, 1.0f, z_lo, z_hi);
    z_lo *= sc_lo;
    z_hi *= sc_hi;
  } else {
    weighted_relu_sum<true>(s, w, sc_lo, sc_hi, z_lo, z_hi);
  }
  quad_sum(z_lo, z_hi);
}

// The rows' q (swizzled, q_rows * 8 KB from `base`, rows past `rows` zeroed: they pad the
// last MMA group and their z is never stored) and weights (at weights_at) of request b. The
// copies are issued, not committed.
__device__ __forceinline__ void load_queries(const uint8_t* q, const float* weights, int b,
                                             int rows, int q_rows, uint32_t base,
                                             unsigned char* smem, uint32_t weights_at) {
  for (int idx = threadIdx.x; idx < rows * kQBytes / 16; idx += kThreads) {
    const int r = idx / (kQBytes / 16), i = idx % (kQBytes / 16);
    cp_async16(base + r * kQBytes + swizzled(i / 8, i % 8),
               q + (static_cast<int64_t>(b) * rows + r) * kQBytes + i * 16);
  }
  for (int idx = threadIdx.x; idx < (q_rows - rows) * kQBytes / 16; idx += kThreads)
    *reinterpret_cast<uint4*>(smem + rows * kQBytes + idx * 16) = make_uint4(0, 0, 0, 0);
  for (int idx = threadIdx.x; idx < rows * kHeads / 4; idx += kThreads)
    cp_async16(base + weights_at + idx * 16,
               weights + static_cast<int64_t>(b) * rows * kHeads + idx * 4);
}

// Every row's z for the 64-row tile at `tile`: the rows in MMA groups of G (G <= 2: one group of
// exactly `rows`), then store(r, z) on the lanes with t < 2 (z of slot s_lo for t == 0, s_hi for
// t == 1). w(r, j, nt) gives row r's head weights (j = r % G); in_flight() runs during the
// first group's MMA, tile_read() once the last MMA has read the tile.
template <int G, typename W, typename InFlight, typename TileRead, typename Store>
__device__ __forceinline__ void score_tile(Acc<G>& acc, uint32_t tile, uint32_t q_base, int rows,
                                           float sc_lo, float sc_hi, bool factored, W w,
                                           InFlight in_flight, TileRead tile_read, Store store) {
  const int t = threadIdx.x & 3;
  const int groups = G <= 2 ? 1 : (rows + G - 1) / G;
  for (int group = 0; group < groups; ++group) {
    if (group == 0) page_scores<G>(acc, tile, q_base, in_flight);
    else page_scores<G>(acc, tile, q_base + group * G * kQBytes, [] {});
    if (group == groups - 1) tile_read();
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const int r = group * G + j;
      if (G > 2 && r >= rows) break;
      float z_lo, z_hi;
      slot_scores(acc + 32 * j, [&](int nt) { return w(r, j, nt); }, sc_lo, sc_hi, factored,
                  z_lo, z_hi);
      if (t < 2) store(r, t == 0 ? z_lo : z_hi);
    }
  }
}

}  // namespace
}  // namespace spin
