// spin::indexer_logits: z[i] = sum_h w_h ReLU(q_h . k_i) over the selected blocks only, from the
// FP8 paged indexer K cache. Also spin::summarize (a page's mean key) and spin::probe (blocks'
// summaries scored like slots), which share the tiles, MMA and epilogue.
//
// A CTA (one warpgroup, 4 warps) takes a run of selected blocks of one request. Pages stream
// through a kStages-deep ring of shared-memory stages in the 128-byte swizzled layout the tensor
// cores read, each stage with a "full" and an "empty" mbarrier: on sm_90 one thread loads a page
// with the bulk tensor copy engine (keys) and a bulk copy (scales); on sm_89 every thread cp.asyncs
// its chunks. Once every warp's MMA has read a page, its stage is refilled while the next page's
// MMA runs (on sm_90 the loading thread's warp would otherwise hold the warpgroup back at every
// MMA), and no block-wide barrier runs per page. Each page is read once for all MTP rows. The MTP
// rows go through the tensor cores in groups of G = 1, 2 or 4 (the rows of a group side by side as
// the N dimension, as DeepGEMM's MQA logits do with next_n x heads): per (page, group) S[slot,
// (row, head)] = k_slot . q_(row, head) with M = 64 slots, N = 64 G, K = 128 dims, so the page is
// read from shared memory once per group. On sm_90a with wgmma (FP8 e4m3, m64n{64,128,256}k32, the
// four k-steps accumulated in the tensor core: about 1.4e-4 of the row norm from exact on random
// data), elsewhere with mma.sync m16n8k32 summed in fp32. A warp owns 16 slots x all heads, so the
// weighted ReLU sum over heads needs two shuffles and no shared memory.
#include <algorithm>
#include <atomic>

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_fp8.h>

#include "common.cuh"

namespace spin {
namespace {

constexpr int kThreads = 128;                       // one warpgroup
// Pages in flight per CTA: 3 with one row (G 1), so that 6 CTAs fit an SM (35 KB of shared
// memory each, 63 registers with wgmma) instead of 5 with 4 stages: H200, same runs, 1-4% less
// time at 5 of 6 shapes (1-2% more at 32 x 128K). The mma.sync build keeps the register choice.
template <int G>
__host__ __device__ constexpr int stages_for() { return G == 1 ? 3 : 4; }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr int kMinCtasOneRow = 6;
#else
constexpr int kMinCtasOneRow = 1;
#endif
constexpr int kPageKeyBytes = kBlockSize * kHeadDim;  // 8 KB of fp8 keys, then 64 fp32 scales
constexpr int kQBytes = kHeads * kHeadDim;          // one MTP row's q: 8 KB
constexpr int kKSteps = kHeadDim / 32;              // 32 fp8 dims per MMA k-step
constexpr int kMaxBlocksPerCta = 64;
static_assert(kMaxBlocksPerCta <= kThreads, "one lookup per thread");
// On sm_89 the threads copy a page's 512 16-byte chunks: thread t takes chunks t + 128 u
// (u = 0..3), rows t / 8 + 16 u, all with the same swizzle (16 u is a multiple of 8): + 2048 u.
constexpr int kChunksPerThread = kPageKeyBytes / 16 / kThreads;
static_assert(kChunksPerThread * kThreads * 16 == kPageKeyBytes && kThreads % 8 == 0, "page split");

// Rows per MMA group: all of them up to 2, else groups of 4 (rows 3, 5..8 pad the last group
// with zero q rows, computed and dropped).
__host__ __device__ constexpr int group_for(int rows) { return rows <= 2 ? rows : 4; }
// The kernels with one group (G <= 2) take G == rows: their rows' weights stay in registers.
static_assert(group_for(1) == 1 && group_for(2) == 2, "G <= 2 must mean G == rows");
// Page i (>= 0) of a CTA's run goes through stage i % S; its barriers' phase parity.
template <int S>
__device__ __forceinline__ int stage_of(int i) { return static_cast<unsigned>(i) % S; }
template <int S>
__device__ __forceinline__ uint32_t parity_of(int i) {
  return (static_cast<unsigned>(i) / S) & 1;
}

// Shared-memory layout (offsets from a 1024-byte aligned base: the swizzle atom is 8 x 128 B).
// q (row r at r * kQBytes) holds q_rows = rows rounded up to the group.
struct Smem {
  int q_rows, stages;
  __host__ __device__ int page(int s) const { return q_rows * kQBytes + s * kPageKeyBytes; }
  __host__ __device__ int scales(int s) const {
    return q_rows * kQBytes + stages * kPageKeyBytes + s * kBlockSize * 4;
  }
  __host__ __device__ int weights(int r) const {
    return q_rows * kQBytes + stages * (kPageKeyBytes + kBlockSize * 4) + r * kHeads * 4;
  }
  __host__ __device__ int bytes() const { return weights(q_rows) + 1024; }  // + alignment slack
};

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
template <>
__device__ __forceinline__ void wgmma_fp8<64>(float (&d)[32], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred zero_init;\n"
      "setp.ne.b32 zero_init, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
      "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, zero_init, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
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

// Same product from the same swizzled tiles with mma.sync: the warp's 16 slots are A, the
// 8-head groups of each row are B (a 32-bit fragment word is 4 consecutive dims of one chunk).
template <int G, typename InFlight>
__device__ __forceinline__ void page_scores(Acc<G>& acc, uint32_t page, uint32_t q,
                                            InFlight in_flight) {
  in_flight();  // nothing runs asynchronously here: first, like the wgmma path's issue order
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int s_lo = warp * 16 + g, s_hi = s_lo + 8;
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    const int c0 = ks * 2, c1 = ks * 2 + 1;  // the k-step's two 16-byte chunks
    uint32_t a[4];
    a[0] = lds32(page + swizzled(s_lo, c0) + t * 4);
    a[1] = lds32(page + swizzled(s_hi, c0) + t * 4);
    a[2] = lds32(page + swizzled(s_lo, c1) + t * 4);
    a[3] = lds32(page + swizzled(s_hi, c1) + t * 4);
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
  z_lo += __shfl_xor_sync(0xffffffffu, z_lo, 1);
  z_hi += __shfl_xor_sync(0xffffffffu, z_hi, 1);
  z_lo += __shfl_xor_sync(0xffffffffu, z_lo, 2);
  z_hi += __shfl_xor_sync(0xffffffffu, z_hi, 2);
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

// mbarrier helpers (shared-memory addresses).
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
#else
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done) : "r"(bar), "r"(parity) : "memory");
#endif
  } while (!done);
}
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n"
               ::"r"(bar), "r"(bytes) : "memory");
}
// The page's 64 x 128 keys through the tensor map (128-byte swizzle), completing on `bar`.
__device__ __forceinline__ void tma_load_keys(uint32_t dst, const CUtensorMap* map, int page,
                                              uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes "
      "[%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(0), "r"(0), "r"(page), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
#else
// One arrival on `bar` once this thread's earlier cp.asyncs have landed.
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
#endif

template <int G>
__global__ void __launch_bounds__(kThreads, G == 1 ? kMinCtasOneRow : 1)
    logits_kernel(LogitsParams p, int blocks_per_cta, const __grid_constant__ CUtensorMap keys) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  constexpr int kStages = stages_for<G>();
  const Smem lay{(p.rows + G - 1) / G * G, kStages};

  const int b = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int64_t width = static_cast<int64_t>(p.m_cap) * kBlockSize;
  const int count = min(p.counts[b * p.counts_stride], p.m_cap);
  const int c_begin = blockIdx.x * blocks_per_cta;
  const int c_end = min(c_begin + blocks_per_cta, p.m_cap);
  if (c_begin >= c_end) return;
  if (c_begin >= count) {  // nothing selected here: no q or page to load
    for (int idx = threadIdx.x; idx < p.rows * (c_end - c_begin) * kBlockSize; idx += kThreads) {
      const int r = idx / ((c_end - c_begin) * kBlockSize), s = idx % ((c_end - c_begin) * kBlockSize);
      p.out[(static_cast<int64_t>(b) * p.rows + r) * width + c_begin * kBlockSize + s] = -CUDART_INF_F;
    }
    return;
  }
  // q and weights of every row (zero padding rows included) first: their latency then overlaps
  // the dependent loads of the page lookups below
  load_queries(p.q, p.weights, b, p.rows, lay.q_rows, base, smem, lay.weights(0));
  cp_async_commit();

  // block id and page of each of this CTA's selected blocks, looked up once; rows' lengths;
  // per stage a "full" barrier (the page has landed) and an "empty" one (every warp has read it)
  __shared__ int block_s[kMaxBlocksPerCta], page_s[kMaxBlocksPerCta], ctx_s[kMaxRows];
  __shared__ __align__(8) uint64_t full_s[kStages], empty_s[kStages];
  const uint32_t full0 = static_cast<uint32_t>(__cvta_generic_to_shared(full_s));
  const uint32_t empty0 = static_cast<uint32_t>(__cvta_generic_to_shared(empty_s));
  if (threadIdx.x < p.rows) ctx_s[threadIdx.x] = p.context_lens[b * p.rows + threadIdx.x];
  if (threadIdx.x < c_end - c_begin) {
    const int c = c_begin + threadIdx.x;
    const int j = c < count ? p.block_ids[b * p.ids_stride + c] : -1;
    const int page = (j >= 0 && j < p.max_pages) ? p.block_table[b * p.table_stride + j] : -1;
    block_s[threadIdx.x] = j;
    page_s[threadIdx.x] = (page >= 0 && page < p.num_pages) ? page : -1;  // -1: never read
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
#if __CUDA_ARCH__ >= 900
      mbar_init(full0 + 8 * s, 1);              // thread 0's arrive with the bytes to expect
#else
      mbar_init(full0 + 8 * s, kThreads);       // every thread's cp.async arrival
#endif
      mbar_init(empty0 + 8 * s, kThreads / 32);  // one arrival per warp
    }
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
  }
  __syncthreads();

  const int c_last = min(c_end, count);
  const int run = c_last - c_begin;  // pages scored here; page i of the run uses stage i % kStages
  // Page i into its stage once every warp has read page i - kStages there.
  auto issue = [&](int i) {
    if (i >= run) return;
#if __CUDA_ARCH__ >= 900
    if (threadIdx.x != 0) return;  // one thread drives the copy engine
#endif
    const int stage = stage_of<kStages>(i);
    const uint32_t full = full0 + 8 * stage;
    if (i >= kStages) mbar_wait(empty0 + 8 * stage, parity_of<kStages>(i) ^ 1);
    const int page = page_s[i];
    if (page < 0) {  // a block outside the cache: nothing to load, its z is dropped
      mbar_arrive(full);
      return;
    }
    const uint8_t* src = p.kv_cache + static_cast<int64_t>(page) * kBlockSize * kSlotBytes;
#if __CUDA_ARCH__ >= 900
    mbar_expect_tx(full, kPageKeyBytes + kBlockSize * 4);
    tma_load_keys(base + lay.page(stage), &keys, page, full);
    bulk_load(base + lay.scales(stage), src + kPageKeyBytes, kBlockSize * 4, full);
#else
    const uint32_t dst = base + lay.page(stage) + swizzled(threadIdx.x / 8, threadIdx.x % 8);
#pragma unroll
    for (int u = 0; u < kChunksPerThread; ++u)
      cp_async16(dst + u * 2048, src + threadIdx.x * 16 + u * 2048);
    if (threadIdx.x < kBlockSize / 4)  // the 64 scales after the keys
      cp_async16(base + lay.scales(stage) + threadIdx.x * 16,
                 src + kPageKeyBytes + threadIdx.x * 16);
    cp_async_arrive(full);
#endif
  };

  // the first pages; they and q complete and visible to the tensor cores before the first MMA
#pragma unroll
  for (int i = 0; i < kStages; ++i) issue(i);
  cp_async_wait<0>();
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
  __syncthreads();

  // blocks past the selection: -inf, no page read
  for (int idx = threadIdx.x; idx < p.rows * (c_end - c_last) * kBlockSize; idx += kThreads) {
    const int r = idx / ((c_end - c_last) * kBlockSize), s = idx % ((c_end - c_last) * kBlockSize);
    p.out[(static_cast<int64_t>(b) * p.rows + r) * width + c_last * kBlockSize + s] = -CUDART_INF_F;
  }

  const int s_lo = warp * 16 + g, s_hi = s_lo + 8;
  const int s_mine = t == 0 ? s_lo : s_hi;  // the slot whose z this lane stores (t < 2)
  float* const out_b = p.out + static_cast<int64_t>(b) * p.rows * width + s_mine;
  // With one MMA group (rows <= 2) the rows' weights and lengths stay in registers.
  float2 w_reg[G][kHeads / 8];
  int ctx_reg[G];
  if constexpr (G <= 2) {
#pragma unroll
    for (int j = 0; j < G; ++j) {
      const float2* w = reinterpret_cast<const float2*>(smem + lay.weights(j)) + t;
#pragma unroll
      for (int nt = 0; nt < kHeads / 8; ++nt) w_reg[j][nt] = w[nt * 4];
      ctx_reg[j] = ctx_s[j];
    }
  }
  auto weight = [&](int r, int j, int nt) {
    if constexpr (G <= 2) return w_reg[j][nt];
    return reinterpret_cast<const float2*>(smem + lay.weights(r))[t + nt * 4];
  };
  auto row_len = [&](int r) {
    if constexpr (G <= 2) return ctx_reg[r];
    return ctx_s[r];
  };
  Acc<G> acc;
  for (int i = 0; i < run; ++i) {
    const int c = c_begin + i, stage = stage_of<kStages>(i);
    mbar_wait(full0 + 8 * stage, parity_of<kStages>(i));
    const float* scales = reinterpret_cast<const float*>(smem + lay.scales(stage));
    const float sc_lo = scales[s_lo], sc_hi = scales[s_hi];
    const bool factored =
        sc_lo >= 0.0f && sc_hi >= 0.0f && sc_lo < CUDART_INF_F && sc_hi < CUDART_INF_F;
    // a block outside the cache was never loaded: its stage holds stale data, dropped below
    const int slot = page_s[i] >= 0 ? block_s[i] * kBlockSize + s_mine : INT_MAX;
    float* const out_c = out_b + c * kBlockSize;
    score_tile<G>(acc, base + lay.page(stage), base, p.rows, sc_lo, sc_hi, factored, weight,
                  [&] {  // under this page's MMA (off the warpgroup's path): the previous
                         // page's stage, which every warp has read, takes page i - 1 + kStages
                    if (i > 0) issue(i - 1 + kStages);
                    __syncwarp();  // converged again for the warpgroup's wait
                  },
                  [&] {  // this page's stage is read
                    __syncwarp();
                    if (lane == 0) mbar_arrive(empty0 + 8 * stage);
                  },
                  [&](int r, float z) {
                    out_c[r * width] = slot < row_len(r) ? z : -CUDART_INF_F;
                  });
  }
}

// CTAs of logits_kernel<G> per SM with q_rows rows of q in shared memory: a property of the
// kernel and the device, asked once per (device, q_rows) instead of at every launch.
template <int G>
cudaError_t ctas_per_sm(int device, int q_rows, int smem, int* out) {
  constexpr int kCachedDevices = 64;
  static std::atomic<int> cached[kCachedDevices][kMaxRows + 1] = {};
  std::atomic<int>* slot = device < kCachedDevices ? &cached[device][q_rows] : nullptr;
  if (slot != nullptr && (*out = slot->load(std::memory_order_relaxed)) > 0) return cudaSuccess;
  const cudaError_t err =
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(out, logits_kernel<G>, kThreads, smem);
  if (err == cudaSuccess && slot != nullptr) slot->store(*out, std::memory_order_relaxed);
  return err;
}

template <int G>
cudaError_t launch(const LogitsParams& p, int device, int sms, const CUtensorMap& keys,
                   cudaStream_t stream) {
  const int q_rows = (p.rows + G - 1) / G * G;
  const int smem = Smem{q_rows, stages_for<G>()}.bytes();
  cudaError_t err = allow_dynamic_smem(logits_kernel<G>, smem);
  if (err != cudaSuccess) return err;
  int per_sm = 0;
  err = ctas_per_sm<G>(device, q_rows, smem, &per_sm);
  if (err != cudaSuccess) return err;
  // Blocks per CTA: when the whole grid fits in one wave with runs of at most 64 blocks, the
  // shortest power of two that does, so that every CTA starts at once with even work; else runs
  // of 16 (many waves, a small tail). H200, dense, us, next_n 1 / 2, run sweep of one build
  // (benchmarks/results_logits_run_sweep.json): 8 x 32K slots 14.7 / 19.2 with 8 (the rule's
  // pick), 15.8 / 19.9 with 16; 32 x 32K and 8 x 128K 42.1 / 52.4 and 41.6 / 52.6 with 32 (the
  // pick), 46.9 / 54.9 and 49.3 / 54.8 with 16; 96 x 32K 114.3 with 16 (4.7 waves), 130.4 with
  // 32; 96 x 128K 457.4 with 16, 468.8 with 64. The rule's first version took the shortest run
  // that fits (7, 26 and 25 at those three shapes: 15.3, 42.8 and 42.4 us next_n 1, another run).
  const int64_t resident = static_cast<int64_t>(max(per_sm, 1)) * sms;
  int blocks_per_cta = 16;
  if (p.batch <= resident) {
    const int64_t ctas_per_request = resident / p.batch;
    const int64_t needed = (p.m_cap + ctas_per_request - 1) / ctas_per_request;
    int run = 2;
    while (run < needed && run < kMaxBlocksPerCta) run <<= 1;
    if (run >= needed) blocks_per_cta = run;
  }
  dim3 grid((p.m_cap + blocks_per_cta - 1) / blocks_per_cta, p.batch);
  logits_kernel<G><<<grid, kThreads, smem, stream>>>(p, blocks_per_cta, keys);
  return cudaGetLastError();
}

// ---- block summaries and the probe ---------------------------------------------------------

// One CTA per listed page, thread d = key dim d: the mean in the reference's arithmetic (fp32
// products fp8 * scale, summed in fp64), amax over the 128 dims, re-quantized to e4m3.
__global__ void __launch_bounds__(kHeadDim) summarize_kernel(SummarizeParams p) {
  const int64_t page = p.pages[blockIdx.x];
  if (page < 0 || page >= p.num_pages) return;
  const int fill = min(max(p.fill[blockIdx.x], 0), kBlockSize);
  const int d = threadIdx.x;
  const uint8_t* src = p.kv_cache + page * kBlockSize * kSlotBytes;
  const float* scales = reinterpret_cast<const float*>(src + kPageKeyBytes);
  double total = 0.0;
  for (int s = 0; s < fill; ++s) {
    const __nv_fp8_e4m3 key = *reinterpret_cast<const __nv_fp8_e4m3*>(src + s * kHeadDim + d);
    total += static_cast<double>(__fmul_rn(static_cast<float>(key), scales[s]));
  }
  const float mean = static_cast<float>(total / static_cast<double>(max(fill, 1)));
  __shared__ float warp_max[kHeadDim / 32];
  float amax = fabsf(mean);
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  if ((d & 31) == 0) warp_max[d >> 5] = amax;
  __syncthreads();
  amax = fmaxf(fmaxf(warp_max[0], warp_max[1]), fmaxf(warp_max[2], warp_max[3]));
  const float scale = fmaxf(__fdiv_rn(amax, 448.0f), 1e-12f);
  uint8_t* dst = p.summaries + page * kSummaryBytes;
  dst[d] = static_cast<uint8_t>(__nv_cvt_float_to_fp8(__fdiv_rn(mean, scale), __NV_SATFINITE, __NV_E4M3));
  if (d == 0) *reinterpret_cast<float*>(dst + kHeadDim) = scale;
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

  __shared__ int valid_s[kBlockSize], ctx_s[kMaxRows];
  int max_ctx = 0;
  for (int r = 0; r < p.rows; ++r) max_ctx = max(max_ctx, p.context_lens[b * p.rows + r]);
  if (threadIdx.x < p.rows) ctx_s[threadIdx.x] = p.context_lens[b * p.rows + threadIdx.x];
  // a row is read only for a block someone sees, inside the table and the summaries
  auto page_of = [&](int i) -> int64_t {
    const int j = j0 + i;
    if (j >= p.num_blocks || j >= p.max_pages || static_cast<int64_t>(j) * kBlockSize >= max_ctx)
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
                      valid_s[s_mine] && static_cast<int64_t>(j) * kBlockSize < ctx_s[r];
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

// The K cache's keys as a 3-D tensor [num_pages][64 slots][128 B] (pages 64 * 132 B apart) for
// the bulk tensor copy, 128-byte swizzle. Left zero (never read) below sm_90 or without pages.
cudaError_t keys_tensor_map(const LogitsParams& p, int major, CUtensorMap* map) {
  *map = CUtensorMap{};
  if (major < 9 || p.num_pages <= 0) return cudaSuccess;
  if (p.num_pages > (int64_t{1} << 32)) return cudaErrorInvalidValue;  // the copy engine's limit
  // looked up once per process (a driver without it fails every launch on sm_90 alike)
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  if (encode == nullptr) return cudaErrorNotSupported;
  const cuuint64_t dims[3] = {kHeadDim, kBlockSize, static_cast<cuuint64_t>(p.num_pages)};
  const cuuint64_t strides[2] = {kHeadDim, kBlockSize * kSlotBytes};  // bytes, dims 1 and 2
  const cuuint32_t box[3] = {kHeadDim, kBlockSize, 1};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 3, const_cast<uint8_t*>(p.kv_cache),
                            dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_summarize(const SummarizeParams& p, cudaStream_t stream) {
  if (p.count == 0) return cudaSuccess;
  summarize_kernel<<<p.count, kHeadDim, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_probe(const ProbeParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.num_blocks == 0) return cudaSuccess;
  if (p.rows < 1 || p.rows > kMaxRows) return cudaErrorInvalidValue;
  switch (group_for(p.rows)) {
    case 1: return launch_probe_as<1>(p, stream);
    case 2: return launch_probe_as<2>(p, stream);
    default: return launch_probe_as<4>(p, stream);
  }
}

cudaError_t launch_indexer_logits(const LogitsParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.m_cap == 0) return cudaSuccess;
  if (p.rows < 1 || p.rows > kMaxRows) return cudaErrorInvalidValue;
  int device = 0, sms = 132, major = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  CUtensorMap keys;
  cudaError_t err = keys_tensor_map(p, major, &keys);
  if (err != cudaSuccess) return err;
  switch (group_for(p.rows)) {
    case 1: return launch<1>(p, device, sms, keys, stream);
    case 2: return launch<2>(p, device, sms, keys, stream);
    default: return launch<4>(p, device, sms, keys, stream);
  }
}

}  // namespace spin
