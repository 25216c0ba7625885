// spin::indexer_logits: z[i] = sum_h w_h ReLU(q_h . k_i) over the selected blocks only, from the
// FP8 paged indexer K cache. The tile product (MMA and epilogue) is indexer_tile.cuh, shared
// with spin::probe (probe.cu).
//
// Grid (runs, requests): a CTA (one warpgroup, 4 warps) takes a run of up to kMaxBlocksPerCta
// selected blocks of one request, a warp 16 slots of each page. Pages stream through a
// kStages-deep ring of shared-memory stages in the 128-byte swizzled layout the tensor cores
// read, each stage with a "full" and an "empty" mbarrier: on sm_90 one thread loads a page's keys
// with the bulk tensor copy engine; on sm_89 every thread cp.asyncs its chunks. Once every warp's
// MMA has read a page, its stage is refilled while the next page's MMA runs (on sm_90 the loading
// thread's warp would otherwise hold the warpgroup back at every MMA), and no block-wide barrier
// runs per page. Each page is read once for all MTP rows. The threads read a stage's scales
// themselves, and racecheck flags every refill of memory other threads read that only an
// mbarrier orders (tests/gpu/race_repro), so the scales are handed back in one of two ways:
// - one row (G 1), and sm_89: a stage's 64 scales are four parts of 16, one per warp; each warp
//   reads only its own part and refills it itself (a bulk copy or cp.async completing on the
//   same "full" barrier) once it has read it;
// - MTP rows (G 2, 4) on sm_90: the loading thread refills all 64 with the keys, and the "empty"
//   handoff is a hardware named barrier per stage (warps 1-3 arrive once the page is read, warp
//   0 syncs before its refill), which racecheck checks. Same-run A/B against the kernel that
//   relied on the mbarrier alone (RESULTS.md section 3): per-warp refills cost 2-10% at G 2 and
//   the named barrier none; at G 1 the named barrier cost 3% and per-warp refills 1%.
#include <algorithm>
#include <atomic>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "indexer_tile.cuh"

namespace spin {
namespace {

// Pages in flight per CTA: 3 with one row (G 1), so that 6 CTAs fit an SM (35 KB of shared
// memory each, 63 registers with wgmma) instead of 5 with 4 stages, which was faster at most
// shapes (benchmarks/bench_decode_indexer.py). The mma.sync build keeps the register choice.
template <int G>
__host__ __device__ constexpr int stages_for() { return G == 1 ? 3 : 4; }
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr int kMinCtasOneRow = 6;
#else
constexpr int kMinCtasOneRow = 1;
#endif
constexpr int kMaxBlocksPerCta = 64;
constexpr int kScalesPerWarp = kBlockSize / (kThreads / 32);  // a warp scores 16 slots of a page
static_assert(kScalesPerWarp % 4 == 0, "whole 16-byte chunks of scales per warp");
static_assert(kMaxBlocksPerCta <= kThreads, "one lookup per thread");
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
// The "empty" handoff of stage s as named barrier s + 1 (0 is __syncthreads) over the warpgroup:
// warp 0 syncs (stage_read_sync) once warps 1-3 have arrived (stage_read_arrive). A register id
// makes ptxas reserve all 16 barriers (immediates, chosen by a branch per page, were as slow at
// G 2 as per-warp refills).
__device__ __forceinline__ void stage_read_sync(int stage) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(stage + 1), "n"(kThreads) : "memory");
}
#else
// One arrival on `bar` once this thread's earlier cp.asyncs have landed.
__device__ __forceinline__ void cp_async_arrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
#endif
__device__ __forceinline__ void stage_read_arrive(int stage) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(stage + 1), "n"(kThreads) : "memory");
}

template <int G>
__global__ void __launch_bounds__(kThreads, G == 1 ? kMinCtasOneRow : 1)
    logits_kernel(LogitsParams p, int blocks_per_cta, const __grid_constant__ CUtensorMap keys) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023u) & ~1023u;
  unsigned char* const smem = smem_raw + (base - raw);
  constexpr int kStages = stages_for<G>();
#if __CUDA_ARCH__ >= 900
  constexpr bool kNamedHandoff = G > 1;  // else per-warp scale refills (see the top)
#else
  constexpr bool kNamedHandoff = false;
#endif
  const Smem lay{(p.rows + G - 1) / G * G, kStages};

  const int b = blockIdx.y;
  // the warp index through a shuffle: ptxas then knows it is warp-uniform (CUTLASS's
  // canonical_warp_idx_sync), so the warp 0 / warps 1-3 branches keep the uniform datapath
  const int warp = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x >> 5), 0);
  const int lane = threadIdx.x & 31;
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
  __shared__ int block_s[kMaxBlocksPerCta], page_s[kMaxBlocksPerCta], ctx_s[kMaxNextN];
  __shared__ __align__(8) uint64_t full_s[kStages], empty_s[kStages];
  const uint32_t full0 = static_cast<uint32_t>(__cvta_generic_to_shared(full_s));
  const uint32_t empty0 = static_cast<uint32_t>(__cvta_generic_to_shared(empty_s));
  if (threadIdx.x < p.rows) ctx_s[threadIdx.x] = p.context_lens[b * p.rows + threadIdx.x];
  if (threadIdx.x < c_end - c_begin) {
    const int c = c_begin + threadIdx.x;
    const int j = c < count ? p.block_ids[b * p.ids_stride + c] : -1;
    // a block past kMaxSlotBlock holds no slot an int32 context reaches: never read, -inf
    const int page = (j >= 0 && j < p.max_pages && j <= kMaxSlotBlock)
                         ? p.block_table[b * p.table_stride + j] : -1;
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
  // Page i's scales of this warp's 16 slots into its part of stage i % kStages, on that stage's
  // "full" barrier (whose expected bytes, set in issue(i), count all four parts).
  auto load_warp_scales = [&](int i) {
    if (i >= run || page_s[i] < 0) return;
    const int stage = stage_of<kStages>(i);
    const uint8_t* src = p.kv_cache + static_cast<int64_t>(page_s[i]) * kBlockSize * kSlotBytes +
                         kPageKeyBytes + warp * kScalesPerWarp * 4;
    const uint32_t dst = base + lay.scales(stage) + warp * kScalesPerWarp * 4;
#if __CUDA_ARCH__ >= 900
    if (lane == 0) bulk_load(dst, src, kScalesPerWarp * 4, full0 + 8 * stage);
#else
    if (lane < kScalesPerWarp / 4) cp_async16(dst + lane * 16, src + lane * 16);
#endif
  };
  // Page i's keys into its stage once every warp has read page i - kStages there; its scales
  // too with the named handoff, else the first kStages pages' only (later ones:
  // load_warp_scales). Called by every thread.
  auto issue = [&](int i) {
    if (i >= run) return;
    const int stage = stage_of<kStages>(i);
    const uint32_t full = full0 + 8 * stage;
#if __CUDA_ARCH__ >= 900
    if (kNamedHandoff) {
      if (warp != 0) return;
      if (i >= kStages) stage_read_sync(stage);  // the whole warp
    }
    if (threadIdx.x != 0) return;  // one thread drives the copy engine
    if (!kNamedHandoff && i >= kStages) mbar_wait(empty0 + 8 * stage, parity_of<kStages>(i) ^ 1);
#else
    if (i >= kStages) mbar_wait(empty0 + 8 * stage, parity_of<kStages>(i) ^ 1);
#endif
    const int page = page_s[i];
    if (page < 0) {  // a block outside the cache: nothing to load, its z is dropped
      mbar_arrive(full);
      return;
    }
    const uint8_t* src = p.kv_cache + static_cast<int64_t>(page) * kBlockSize * kSlotBytes;
#if __CUDA_ARCH__ >= 900
    mbar_expect_tx(full, kPageKeyBytes + kBlockSize * 4);
    tma_load_keys(base + lay.page(stage), &keys, page, full);
    if (kNamedHandoff || i < kStages)
      bulk_load(base + lay.scales(stage), src + kPageKeyBytes, kBlockSize * 4, full);
#else
    const uint32_t dst = base + lay.page(stage) + swizzled(threadIdx.x / 8, threadIdx.x % 8);
#pragma unroll
    for (int u = 0; u < kChunksPerThread; ++u)
      cp_async16(dst + u * 2048, src + threadIdx.x * 16 + u * 2048);
    if (i < kStages && threadIdx.x < kBlockSize / 4)  // the 64 scales after the keys
      cp_async16(base + lay.scales(stage) + threadIdx.x * 16,
                 src + kPageKeyBytes + threadIdx.x * 16);
    cp_async_arrive(full);  // after this thread's load_warp_scales of page i too
#endif
  };

  // the first pages; they and q complete and visible to the tensor cores before the first MMA
#pragma unroll
  for (int i = 0; i < kStages; ++i) issue(i);
  tiles_ready();

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
    if (!kNamedHandoff) {
      __syncwarp();  // every lane has read this warp's part
      load_warp_scales(i + kStages);
    }
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
                    if constexpr (!kNamedHandoff) {
                      if (lane == 0) mbar_arrive(empty0 + 8 * stage);
                    } else if (warp != 0 && i + kStages < run) {  // no refill, no arrival
                      stage_read_arrive(stage);
                    }
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
  static std::atomic<int> cached[kCachedDevices][kMaxNextN + 1] = {};
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
  // of 16 (many waves, a small tail). A power of two also beats the shortest run that fits
  // (benchmarks/bench_decode_indexer.py, RESULTS.md section 3).
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

cudaError_t launch_indexer_logits(const LogitsParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.m_cap == 0) return cudaSuccess;
  if (p.rows < 1 || p.rows > kMaxNextN) return cudaErrorInvalidValue;
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
