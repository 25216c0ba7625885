// spin::indexer_logits: z[i] = sum_h w_h ReLU(q_h . k_i) over the selected blocks only, from the
// FP8 paged indexer K cache.
//
// A CTA (one warpgroup, 4 warps) takes a run of selected blocks of one request. Pages stream
// through a kStages-deep cp.async ring into shared memory in the 128-byte swizzled layout the
// tensor cores read; each page is read once for all MTP rows. Per (page, row) the tensor cores
// compute S[slot, head] = k_slot . q_head (M = 64 slots, N = 64 heads, K = 128 dims): on sm_90a
// with wgmma (FP8 e4m3, m64n64k32, the four k-steps accumulated in the tensor core as in
// DeepGEMM's FP8 MQA logits: about 1.4e-4 of the row norm from exact on random data), elsewhere
// with mma.sync m16n8k32 summed in fp32. A warp owns 16 slots x 64 heads, so the weighted ReLU
// sum over heads needs two shuffles and no shared memory.
#include <cuda_fp8.h>

#include "common.cuh"

namespace spin {
namespace {

constexpr int kThreads = 128;                       // one warpgroup
constexpr int kStages = 4;                          // pages in flight per CTA
constexpr int kPageKeyBytes = kBlockSize * kHeadDim;  // 8 KB of fp8 keys, then 64 fp32 scales
constexpr int kQBytes = kHeads * kHeadDim;          // one MTP row's q: 8 KB
constexpr int kKSteps = kHeadDim / 32;              // 32 fp8 dims per MMA k-step
constexpr int kMaxBlocksPerCta = 16;
// A page's 512 16-byte chunks: thread t copies chunks t + 128 u (u = 0..3), i.e. rows
// t / 8 + 16 u, all with the same swizzle (16 u is a multiple of 8): offsets + 2048 u.
constexpr int kChunksPerThread = kPageKeyBytes / 16 / kThreads;
static_assert(kChunksPerThread * kThreads * 16 == kPageKeyBytes && kThreads % 8 == 0, "page split");

// Shared-memory layout (offsets from a 1024-byte aligned base: the swizzle atom is 8 x 128 B).
struct Smem {
  int rows;
  __host__ __device__ int q(int r) const { return r * kQBytes; }
  __host__ __device__ int page(int s) const { return rows * kQBytes + s * kPageKeyBytes; }
  __host__ __device__ int scales(int s) const {
    return rows * kQBytes + kStages * kPageKeyBytes + s * kBlockSize * 4;
  }
  __host__ __device__ int weights(int r) const {
    return rows * kQBytes + kStages * (kPageKeyBytes + kBlockSize * 4) + r * kHeads * 4;
  }
  __host__ __device__ int bytes() const { return weights(rows) + 1024; }  // + alignment slack
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

// acc[nt * 4 + e] holds S[slot, head] with slot = 16 * warp + g (e < 2) or + 8 (e >= 2) and
// head = 8 * nt + 2 * t + (e & 1), g = lane / 4, t = lane % 4: the accumulator layout of both
// wgmma m64n64 and mma.sync m16n8.
using Acc = float[32];

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// Shared-memory matrix descriptor: K-major, 128B swizzle, 8-row groups 1024 B apart.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_m64n64k32(float (&d)[32], uint64_t a, uint64_t b,
                                                int accumulate) {
  asm volatile(
      "{\n"
      ".reg .pred zero_init;\n"
      "setp.ne.b32 zero_init, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, zero_init, 1, 1;\n"
      "}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(accumulate));
}

// Keeps the compiler from moving accumulator reads/writes across the asynchronous MMA.
__device__ __forceinline__ void fence_acc(Acc& acc) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(acc[i])::"memory");
}

__device__ __forceinline__ void page_scores(Acc& acc, uint32_t page, uint32_t q) {
  fence_acc(acc);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks)  // the first k-step overwrites, the others accumulate
    wgmma_m64n64k32(acc, smem_desc(page + ks * 32), smem_desc(q + ks * 32), ks > 0);
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  fence_acc(acc);
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
// 8-head groups are B (a 32-bit fragment word is 4 consecutive dims of one 16-byte chunk).
__device__ __forceinline__ void page_scores(Acc& acc, uint32_t page, uint32_t q) {
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
    for (int nt = 0; nt < kHeads / 8; ++nt) {
      const int h = nt * 8 + g;
      float d[4];
      mma_e4m3(d, a, lds32(q + swizzled(h, c0) + t * 4), lds32(q + swizzled(h, c1) + t * 4));
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt * 4 + e] = (ks > 0 ? acc[nt * 4 + e] : 0.0f) + d[e];
    }
  }
}
#endif

__global__ void __launch_bounds__(kThreads) logits_kernel(LogitsParams p, int blocks_per_cta) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  const Smem lay{p.rows};

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

  // block id and page of each of this CTA's selected blocks, looked up once
  __shared__ int block_s[kMaxBlocksPerCta], page_s[kMaxBlocksPerCta];
  if (threadIdx.x < c_end - c_begin) {
    const int c = c_begin + threadIdx.x;
    const int j = c < count ? p.block_ids[b * p.ids_stride + c] : -1;
    const int page = (j >= 0 && j < p.max_pages) ? p.block_table[b * p.table_stride + j] : -1;
    block_s[threadIdx.x] = j;
    page_s[threadIdx.x] = (page >= 0 && page < p.num_pages) ? page : -1;  // -1: never read
  }
  __syncthreads();
  auto page_of = [&](int c) { return page_s[c - c_begin]; };
  const uint32_t chunk_dst = swizzled(threadIdx.x / 8, threadIdx.x % 8);
  auto issue_page = [&](int c, int stage) {
    const int page = c < c_end ? page_of(c) : -1;
    if (page < 0) return;
    const uint8_t* src = p.kv_cache + static_cast<int64_t>(page) * kBlockSize * kSlotBytes +
                         threadIdx.x * 16;
    const uint32_t dst = base + lay.page(stage) + chunk_dst;
#pragma unroll
    for (int u = 0; u < kChunksPerThread; ++u) cp_async16(dst + u * 2048, src + u * 2048);
    if (threadIdx.x < kBlockSize / 4)  // the 64 scales after the keys
      cp_async16(base + lay.scales(stage) + threadIdx.x * 16, src + kPageKeyBytes);
  };

  // q and weights of every row, with the first page (group 0).
  for (int idx = threadIdx.x; idx < p.rows * kQBytes / 16; idx += kThreads) {
    const int r = idx / (kQBytes / 16), i = idx % (kQBytes / 16);
    cp_async16(base + lay.q(r) + swizzled(i / 8, i % 8),
               p.q + (static_cast<int64_t>(b) * p.rows + r) * kQBytes + i * 16);
  }
  for (int idx = threadIdx.x; idx < p.rows * kHeads / 4; idx += kThreads)
    cp_async16(base + lay.weights(0) + idx * 16,
               p.weights + static_cast<int64_t>(b) * p.rows * kHeads + idx * 4);
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    issue_page(c_begin + s, s);
    cp_async_commit();
  }

  Acc acc;
#pragma unroll
  for (int i = 0; i < 32; ++i) acc[i] = 0.0f;

  for (int c = c_begin; c < c_end; ++c) {
    const int stage = (c - c_begin) % kStages;
    cp_async_wait<kStages - 2>();  // this thread's copies of page c have landed
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // visible to wgmma
#endif
    __syncthreads();  // ... for every thread; the stage refilled below is no longer read
    issue_page(c + kStages - 1, (c - c_begin + kStages - 1) % kStages);
    cp_async_commit();

    const int page = page_of(c);
    if (page < 0) {  // past the selection or outside the cache
      for (int idx = threadIdx.x; idx < p.rows * kBlockSize; idx += kThreads) {
        const int r = idx / kBlockSize, s = idx % kBlockSize;
        p.out[(static_cast<int64_t>(b) * p.rows + r) * width + c * kBlockSize + s] = -CUDART_INF_F;
      }
      continue;
    }
    const int64_t slot0 = static_cast<int64_t>(block_s[c - c_begin]) * kBlockSize;
    const float* scales = reinterpret_cast<const float*>(smem + lay.scales(stage));
    const int s_lo = warp * 16 + g, s_hi = s_lo + 8;
    const float sc_lo = scales[s_lo], sc_hi = scales[s_hi];
    for (int r = 0; r < p.rows; ++r) {
      page_scores(acc, base + lay.page(stage), base + lay.q(r));
      const float* w = reinterpret_cast<const float*>(smem + lay.weights(r));
      float z_lo = 0.0f, z_hi = 0.0f;
      auto sum_heads = [&](float scale_lo, float scale_hi) {
#pragma unroll
        for (int nt = 0; nt < kHeads / 8; ++nt) {
          const float2 wv = *reinterpret_cast<const float2*>(w + nt * 8 + 2 * t);
          const float* s = acc + nt * 4;
          z_lo += wv.x * relu(s[0] * scale_lo) + wv.y * relu(s[1] * scale_lo);
          z_hi += wv.x * relu(s[2] * scale_hi) + wv.y * relu(s[3] * scale_hi);
        }
      };
      if (sc_lo >= 0.0f && sc_hi >= 0.0f && sc_lo < CUDART_INF_F && sc_hi < CUDART_INF_F) {
        // relu(s * scale) = scale * relu(s) for a finite scale >= 0: scale once per slot
        sum_heads(1.0f, 1.0f);
        z_lo *= sc_lo;
        z_hi *= sc_hi;
      } else {
        sum_heads(sc_lo, sc_hi);
      }
      z_lo += __shfl_xor_sync(0xffffffffu, z_lo, 1);
      z_hi += __shfl_xor_sync(0xffffffffu, z_hi, 1);
      z_lo += __shfl_xor_sync(0xffffffffu, z_lo, 2);
      z_hi += __shfl_xor_sync(0xffffffffu, z_hi, 2);
      if (t < 2) {
        const int s = t == 0 ? s_lo : s_hi;
        const float z = t == 0 ? z_lo : z_hi;
        const bool visible = slot0 + s < p.context_lens[b * p.rows + r];
        p.out[(static_cast<int64_t>(b) * p.rows + r) * width + c * kBlockSize + s] =
            visible ? z : -CUDART_INF_F;
      }
    }
  }
  cp_async_wait<0>();  // no copy may outlive the CTA's shared memory
}

}  // namespace

cudaError_t launch_indexer_logits(const LogitsParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.m_cap == 0) return cudaSuccess;
  if (p.rows < 1 || p.rows > kMaxRows) return cudaErrorInvalidValue;
  int device = 0, sms = 132;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  // Long runs of pages per CTA amortize its q load; short ones keep every SM busy when the
  // batch is small (about 8 CTAs per SM).
  int blocks_per_cta = kMaxBlocksPerCta;
  while (blocks_per_cta > 2 &&
         static_cast<int64_t>(p.batch) * ((p.m_cap + blocks_per_cta - 1) / blocks_per_cta) <
             8ll * sms)
    blocks_per_cta /= 2;
  const int smem = Smem{p.rows}.bytes();
  cudaError_t err = allow_dynamic_smem(logits_kernel, smem);
  if (err != cudaSuccess) return err;
  dim3 grid((p.m_cap + blocks_per_cta - 1) / blocks_per_cta, p.batch);
  logits_kernel<<<grid, kThreads, smem, stream>>>(p, blocks_per_cta);
  return cudaGetLastError();
}

}  // namespace spin
