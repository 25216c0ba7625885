// spin::topk: top-K of the compact logits of each row, written as request-local slot ids in
// ascending order, -1 padded (TensorRT-LLM's topk_indices_buffer format). Ties at the K-th
// value go to the lower slot id.
//
// One CTA per row (or, with few rows, a cluster of up to 8 CTAs per row, each taking a
// contiguous share of whole blocks; with more rows than SMs, CTAs of 512 threads, two an SM,
// where they fit), each warp owning a contiguous segment; a share up to 48K slots (47K in a
// cluster, 22K for two CTAs an SM; on sm_90) is copied to shared memory as ordered keys (where
// the device gives a CTA that much: sm_90) in the same pass as A below. One CTA a row whose
// row is not cached (past 48K slots, 22K for two CTAs an SM), with K <= 512, tries a shorter way
// first (A'): a sample of the row (one float4 in 8) gives a threshold with about 2 K entries
// above it, one pass lists those entries and their keys, radix passes rank them alone, and C
// writes the taken ones; where the pass lists fewer than min(K, finite entries) or more than it
// keeps, the row starts again at A.
//   A. a 2048-bin histogram of a coarse digit (the top 11 bits of the fp16-rounded value, which
//      is monotone in the value), whose scan gives the finite count and the bin holding the
//      K-th value;
//   B. the entries of that bin (one range of keys) become candidates, and the entries of higher
//      bins, all taken, are marked in a bitmap of the share (a bit a slot, in shared memory).
//      Up to kRankCand candidates (the usual case: a few dozen) are ranked by counting, each
//      against all; up to kCandCap go through radix passes; beyond that the exact search runs
//      over the whole row (and a pass marks what it takes). Either finds the exact K-th key
//      and, among entries equal to it, the last position taken; the candidates taken are
//      marked;
//   C. each warp counts the marks of a run of the bitmap's words, a scan over warps (and CTAs)
//      gives offsets, and each warp writes its run's positions in order, a word a lane. A share
//      whose bitmap does not fit beside the kernel (past about 1.5M slots a CTA on sm_90) is
//      written by warps instead: each counts its selected entries, then writes them after a
//      scan.
#include <cooperative_groups.h>
#include <cuda_fp16.h>

#include "common.cuh"

namespace spin {
namespace {

namespace cg = cooperative_groups;

// Thread-block clusters (sm_90+). Launches with more than one CTA per row happen only on such
// devices; elsewhere these are never reached.
__device__ __forceinline__ int cluster_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return static_cast<int>(cg::this_cluster().block_rank());
#else
  return 0;
#endif
}
__device__ __forceinline__ void cluster_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cg::this_cluster().sync();
#else
  __trap();
#endif
}
// A cluster barrier split in two: arrive once this CTA's reads of peers are done, wait before
// it leaves (peers may still read its shared memory), with the work between overlapping it.
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}
template <typename T>
__device__ __forceinline__ T* cluster_peer(T* ptr, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return cg::this_cluster().map_shared_rank(ptr, rank);
#else
  __trap();
  return ptr;
#endif
}

// A row's CTA: 1024 threads, or 512 where more rows than SMs are ranked one CTA a row (two
// CTAs an SM: the rows in one wave, not two)
constexpr int kThreads = 1024, kHalfThreads = 512;
constexpr int kBins = 2048;                     // the coarse digit's 11 bits
constexpr int kCandCap = 4096;
// Candidates ranked by counting, a warp per candidate against all: a handful of barriers
// instead of the radix passes' dozens (cluster barriers included), which cost more than the
// counting with the few dozen candidates a row usually has.
constexpr int kRankCand = 256;
// A' (one CTA a row, not cached): one float4 in kSampleStride sampled, a threshold with about
// kSampleAlpha K entries above it, candidates listed up to kSampleCap (positions, then keys, in
// cand), for K up to kSampleMaxK and rows of at least kSampleMinSlots
constexpr int kSampleStride = 8, kSampleAlpha = 2;
constexpr int kSampleCap = kCandCap / 2;
constexpr int kSampleMaxK = kSampleCap / 4;
constexpr int kSampleMinSlots = 8192;
static_assert(kRankCand <= kHalfThreads && 2 * kRankCand <= kBins,
              "a cluster's candidates are gathered one per thread into hist_all (keys, positions)");
// shares up to 48K slots stay in shared memory where the share's bitmap (a 32nd of the keys)
// and the kernel's static shared memory fit beside them in what a CTA may have: 227 KB on sm_90
// (beside a cluster kernel's 33 KB: 754 blocks, 48,256 slots), 99 KB on sm_89 and sm_120
// (launch_cluster checks the device's limit)
constexpr size_t kMaxCachedBytes = 192 * 1024;

// Slots of a row's share for each of `cluster` CTAs: whole blocks, so that a word of a share's
// bitmap lies in one block (the launcher's and the kernel's layout of the dynamic shared memory:
// the share's keys when cached, then the share's bitmap).
__host__ __device__ __forceinline__ int64_t share_slots(int m_cap, int cluster) {
  return (static_cast<int64_t>(m_cap) + cluster - 1) / cluster * kBlockSize;
}
// Bytes of the bitmap of `slots` slots (whole 32-bit words).
__host__ __device__ __forceinline__ int64_t bitmap_bytes(int64_t slots) {
  return (slots + 31) / 32 * 4;
}
__device__ __forceinline__ uint32_t dynamic_smem_bytes() {
  uint32_t bytes;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return bytes;
}
constexpr int kWarpStep = kTopKLoadStep;        // a warp loads 4 float4 per lane per step
static_assert(kWarpStep == 4 * 128, "walk_segment's loads: 4 float4 a lane");

// Bins of the fp16-rounded value: float -> half is monotone, so a higher bin is a larger value.
__device__ __forceinline__ int coarse_digit(uint32_t key) {
  const uint32_t bits = (key & 0x80000000u) ? (key & 0x7FFFFFFFu) : ~key;
  uint16_t h = __half_as_ushort(__float2half_rn(__uint_as_float(bits)));
  if ((h & 0x7FFFu) == 0) h = 0;  // -0 ties +0
  const uint32_t k16 = (h & 0x8000u) ? static_cast<uint16_t>(~h) : (h | 0x8000u);
  return static_cast<int>(k16 >> 5);
}

__device__ __forceinline__ uint32_t key_of(float v) { return isfinite(v) ? ordered_key(v) : 0u; }

// The keys of finite floats (ordered_key(-FLT_MAX) .. ordered_key(FLT_MAX)), where coarse_digit
// is monotone: a bin is one key range.
constexpr uint32_t kMinFiniteKey = 0x00800000u, kMaxFiniteKey = 0xFF7FFFFFu;

// The smallest finite-float key whose coarse digit is >= digit (kMaxFiniteKey + 1 if none),
// searched by one warp in 32-way steps (7 rounds); every lane returns it. Comparing keys with
// a bin's range costs two instructions where its digit costs a conversion and a dozen more.
__device__ uint32_t first_key_of_digit(int digit) {
  const int lane = threadIdx.x & 31;
  uint64_t lo = kMinFiniteKey, hi = uint64_t{kMaxFiniteKey} + 1;  // the answer is in [lo, hi]
  while (lo < hi) {
    const uint64_t step = (hi - lo + 31) / 32;
    const uint64_t x = lo + lane * step;
    const unsigned at_least = __ballot_sync(
        0xffffffffu, x >= hi || coarse_digit(static_cast<uint32_t>(x)) >= digit);
    if (at_least == 0) {
      lo += 31 * step + 1;
      continue;
    }
    const int f = __ffs(at_least) - 1;
    if (f == 0) return static_cast<uint32_t>(lo);
    hi = min(hi, lo + f * step);
    lo += (f - 1) * step + 1;
  }
  return static_cast<uint32_t>(hi);
}

// Request-local slot id of offset `off` in block `block`; -1 for a negative block id or one
// whose slots do not fit int32 (past kMaxSlotBlock: the reference's rule).
__device__ __forceinline__ int32_t slot_id(int32_t block, int off) {
  const int64_t slot = static_cast<int64_t>(block) * kBlockSize + off;
  return block < 0 || slot > INT32_MAX ? -1 : static_cast<int32_t>(slot);
}

// Row access: 4 consecutive ordered keys (0 = not taking part) from the shared-memory copy or
// from global memory; positions from `end` on take no part.
template <bool kCached>
struct Row {
  const float* z;
  const uint32_t* cached;  // keys of positions [base, ...) when kCached (already cut at end)
  int base;
  int end;
  __device__ __forceinline__ uint32_t key_at(int pos, float v) const {
    return pos < end ? key_of(v) : 0u;
  }
  // raw4 then keys4: a walk issues all its loads before it converts any (they are in flight
  // together, not each waiting for the conversion of the one before)
  __device__ __forceinline__ uint4 raw4(int pos) const {
    if (kCached) return *reinterpret_cast<const uint4*>(cached + (pos - base));
    const float4 v = __ldg(reinterpret_cast<const float4*>(z + pos));
    return make_uint4(__float_as_uint(v.x), __float_as_uint(v.y), __float_as_uint(v.z),
                      __float_as_uint(v.w));
  }
  __device__ __forceinline__ uint4 keys4(int pos, uint4 raw) const {
    if (kCached) return raw;
    return make_uint4(key_at(pos, __uint_as_float(raw.x)), key_at(pos + 1, __uint_as_float(raw.y)),
                      key_at(pos + 2, __uint_as_float(raw.z)),
                      key_at(pos + 3, __uint_as_float(raw.w)));
  }
  __device__ __forceinline__ uint32_t key(int pos) const {
    return kCached ? cached[pos - base] : key_at(pos, __ldg(z + pos));
  }
};

// Calls fn(pos, keys) for the warp's segment [begin, end) in warp-uniform steps of kWarpStep
// positions (4 loads in flight per lane); lanes past `end` get zero keys at a position >= end.
template <bool kCached, typename Fn>
__device__ __forceinline__ void walk_segment(const Row<kCached>& row, int begin, int end, Fn fn) {
  const int lane = threadIdx.x & 31;
  for (int base = begin; base < end; base += kWarpStep) {
    uint4 raw[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int pos = base + u * 128 + lane * 4;
      raw[u] = pos < end ? row.raw4(pos) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int pos = base + u * 128 + lane * 4;
      fn(pos, pos < end ? row.keys4(pos, raw[u]) : make_uint4(0u, 0u, 0u, 0u));
    }
  }
}

// The entries counted in hist (kBins bins; returned), and for T = min(k, that) below it the
// bin holding the T-th largest entry (bins scanned from the top) and how many entries lie in
// higher bins, in bcast[0] and bcast[1]. Each of the THREADS threads scans kBins / THREADS bins.
template <int THREADS>
__device__ int find_bin(const int* hist, int k, int* warp_sums, int* bcast) {
  constexpr int kPerThread = kBins / THREADS;
  static_assert(kBins % THREADS == 0, "whole bins a thread");
  const int hi = kBins - 1 - kPerThread * static_cast<int>(threadIdx.x);
  int h[kPerThread], sum = 0;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) sum += h[j] = hist[hi - j];
  int total;
  int before = block_exclusive_sum<THREADS>(sum, warp_sums, total);
  const int T = min(k, total);
  if (T < total && before < T && before + sum >= T) {
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) {
      if (before + h[j] >= T) {
        bcast[0] = hi - j;
        bcast[1] = before;
        break;
      }
      before += h[j];
    }
  }
  __syncthreads();
  return total;
}

// The row's scored length: slots of the selected blocks, cut at the row's compact length.
__device__ __forceinline__ int row_limit(const TopKParams& p, int row_id) {
  const int b = row_id / p.rows;
  int limit = max(0, min(p.counts[b * p.counts_stride], p.m_cap)) * kBlockSize;  // no wrap
  if (p.row_lens != nullptr) limit = max(0, min(limit, p.row_lens[row_id]));
  return limit;
}

// Among n candidates (keys, positions) the one ranked T_bin - 1 by (key descending, position
// ascending), the last one taken: its key in thr_key, its position in last_tie. A warp ranks
// one candidate at a time, its lanes splitting the others.
template <int kT>
__device__ void rank_by_counting(const uint32_t* keys, const int* positions, int n, int T_bin,
                                 int* bcast, uint32_t& thr_key, int& last_tie) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int c = warp; c < n; c += kT / 32) {
    const uint32_t mine = keys[c];
    const int pos = positions[c];
    int ahead = 0;
    for (int j = lane; j < n; j += 32) {
      const uint32_t other = keys[j];
      ahead += other > mine || (other == mine && positions[j] < pos);
    }
    for (int o = 16; o > 0; o >>= 1) ahead += __shfl_xor_sync(0xffffffffu, ahead, o);
    if (lane == 0 && ahead == T_bin - 1) {
      bcast[0] = static_cast<int>(mine);
      bcast[1] = pos;
    }
  }
  __syncthreads();
  thr_key = static_cast<uint32_t>(bcast[0]);
  last_tie = bcast[1];
}

// The T_bin-th largest key among `count` entries (entry i: key(i) at row position pos_of(i),
// taking part where eligible(i), which every entry with an eligible key must be) in thr_key
// and, when not all the entries equal to it are taken, the last tied position taken in
// last_tie (ties go to the lower position). sum(v) is v summed over the CTAs sharing the
// selection; merged and merge as radix_threshold's.
template <int kT, typename PosOf, typename Key, typename Eligible, typename Merge, typename Sum>
__device__ void exact_threshold(int count, int T_bin, PosOf pos_of, Key key, Eligible eligible,
                                int* hist, const int* merged, Merge merge, Sum sum, int* bcast,
                                long long* scratch, uint32_t& thr_key, int& last_tie) {
  int need = 0;
  radix_threshold<kT>(count, T_bin, key, eligible, hist, merged, merge, bcast, thr_key, need);
  long long ties = 0;
  for (int i = threadIdx.x; i < count; i += kT) ties += key(i) == thr_key;
  ties = sum(block_sum<kT>(ties, scratch));
  if (need < ties) {  // the first `need` tied positions: largest of ~pos
    auto neg_pos = [&](int i) { return ~static_cast<uint32_t>(pos_of(i)); };
    auto tied = [&](int i) { return key(i) == thr_key; };
    uint32_t thr_pos;
    int one;
    radix_threshold<kT>(count, need, neg_pos, tied, hist, merged, merge, bcast, thr_pos, one);
    last_tie = static_cast<int>(~thr_pos);
  }
}

// The same within one CTA, every entry taking part (a CTA's listed candidates).
template <int kT, typename PosOf, typename Key>
__device__ void exact_threshold(int count, int T_bin, PosOf pos_of, Key key, int* hist,
                                int* bcast, long long* scratch, uint32_t& thr_key, int& last_tie) {
  exact_threshold<kT>(count, T_bin, pos_of, key, [](int) { return true; }, hist, hist, [] {},
                      [](long long v) { return v; }, bcast, scratch, thr_key, last_tie);
}

// This warp's run [w0, w1) of a bitmap's `words` words (contiguous, in warp order) and the bits
// set in it (every lane has the count). Its lanes take 32 words at a time, so no lane writes
// more than 32 positions in a row where the taken slots are dense (a window of recent slots).
template <int kT>
struct BitmapRun {
  int w0, w1, marked = 0;
  __device__ BitmapRun(const uint32_t* bitmap, int words) {
    const int per_warp = (words + kT / 32 - 1) / (kT / 32);
    w0 = min(static_cast<int>(threadIdx.x >> 5) * per_warp, words);
    w1 = min(w0 + per_warp, words);
    for (int w = w0 + static_cast<int>(threadIdx.x & 31); w < w1; w += 32)
      marked += __popc(bitmap[w]);
    for (int o = 16; o > 0; o >>= 1) marked += __shfl_xor_sync(0xffffffffu, marked, o);
  }
  // The run's positions (first_pos + bit) as slot ids into out[at, k), in order; every lane
  // gives the same `at`. first_pos is a multiple of kBlockSize (or the run is empty): a word's
  // slots lie in one block, whose id is loaded once.
  __device__ void write(const uint32_t* bitmap, int first_pos, int at, int k, int32_t* out,
                        const int32_t* ids) const {
    static_assert(kBlockSize % 32 == 0, "a bitmap word within one block");
    for (int base = w0; base < w1; base += 32) {
      const int w = base + static_cast<int>(threadIdx.x & 31);
      uint32_t bits = w < w1 ? bitmap[w] : 0u;
      const int n = __popc(bits), incl = warp_inclusive_sum(n);
      const int word_pos = first_pos + w * 32;
      const int32_t block = bits != 0u ? ids[word_pos / kBlockSize] : 0;
      for (int c = at + incl - n; bits != 0u; bits &= bits - 1u, ++c)
        if (c < k) out[c] = slot_id(block, word_pos % kBlockSize + __ffs(bits) - 1);
      at += __shfl_sync(0xffffffffu, incl, 31);
    }
  }
};

// The output offset of this warp's run (the marks of the warps below it); the CTA's marks in
// `total`. warp_sums as block_exclusive_sum's.
template <int kT>
__device__ __forceinline__ int run_offset(const BitmapRun<kT>& run, int* warp_sums, int& total) {
  const int lane0 = block_exclusive_sum<kT>((threadIdx.x & 31) == 0 ? run.marked : 0, warp_sums,
                                            total);
  return __shfl_sync(0xffffffffu, lane0, 0);
}

// Sets bits `four` (bit e: position rel + e) of a bitmap; rel is a multiple of 4, so the four
// lie in one word.
__device__ __forceinline__ void mark4(uint32_t* bitmap, int rel, uint32_t four) {
  if (four) atomicOr(&bitmap[rel >> 5], four << (rel & 31));
}

// Sets bit rel of a bitmap.
__device__ __forceinline__ void mark1(uint32_t* bitmap, int rel) {
  atomicOr(&bitmap[rel >> 5], 1u << (rel & 31));
}

// ---- Many long rows: a histogram pass and a filter pass over all SMs, then one CTA a row -----
// A (topk_histogram_kernel): CTAs of kSlice slots add their slice's coarse-digit histogram to
// their row's in the workspace. B (topk_filter_kernel): each finds the row's threshold bin in it
// and appends to the row's lists the positions in higher bins (fewer than K: all taken) and the
// entries of the bin (the candidates, up to kFilterCap). Then topk_kernel ranks the candidates
// alone and writes the taken positions in order through a bitmap of the row; a row whose bin
// holds more than kFilterCap entries (many equal values) takes the whole-row path instead. Each
// score is read twice by CTAs on every SM, where one CTA a row reads it three or four times on
// one SM.
constexpr int kPassThreads = 512;
constexpr int kPassGroups = 8;                                // float4 loads a thread
constexpr int kSlice = kPassThreads * kPassGroups * 4;        // slots a pass CTA
static_assert(kSlice == kFilterSliceSlots, "the filter's bounds (spin_kernels.h) count slices");
constexpr int kFilterCap = kCandCap;                          // candidates a row keeps
// filter -1 (auto): kFilterAutoMinRows to kFilterAutoMaxRows rows of tables of at least 16
// slices, where the filter beat one CTA a row on full rows (1.04-1.13x) and on most half-full
// ones; one CTA won at 8 and at 64-192 rows, and on half-full 128K-slot tables by more than the
// filter won full ones (RESULTS.md, top-K)
constexpr int kCountsStride = kBins + 2;                      // a row's histogram, n_above, n_cand

// The workspace: counts [rows, kCountsStride] (zeroed before A), then above [rows,
// kFilterMaxK], candidate positions and keys [rows, kFilterCap] each.
struct FilterLists {
  int* counts;
  int* above;
  int* cand_pos;
  uint32_t* cand_key;
  __host__ __device__ explicit FilterLists(const TopKParams& p) {
    const int64_t rows = static_cast<int64_t>(p.batch) * p.rows;
    counts = static_cast<int*>(p.workspace);
    above = counts + rows * kCountsStride;
    cand_pos = above + rows * kFilterMaxK;
    cand_key = reinterpret_cast<uint32_t*>(cand_pos + rows * kFilterCap);
  }
};

// Position of element e of group u of this thread in the slice from `base`.
__device__ __forceinline__ int slice_pos(int base, int u, int e) {
  return base + u * kPassThreads * 4 + 4 * static_cast<int>(threadIdx.x) + e;
}

// The keys of this thread's positions of the slice from `base` (0: not taking part). Whole
// 16-byte loads: a group starting before `limit` lies inside the row's m_cap * 64 columns.
__device__ __forceinline__ void load_slice(const TopKParams& p, int row_id, int base, int limit,
                                           uint32_t (&keys)[kPassGroups][4]) {
  const float* z = p.logits + static_cast<int64_t>(row_id) * p.logits_stride;
  float4 v[kPassGroups];
#pragma unroll
  for (int u = 0; u < kPassGroups; ++u) {
    const int pos = slice_pos(base, u, 0);
    v[u] = pos < limit ? __ldg(reinterpret_cast<const float4*>(z + pos))
                       : make_float4(0.f, 0.f, 0.f, 0.f);
  }
#pragma unroll
  for (int u = 0; u < kPassGroups; ++u) {
    const float vs[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) keys[u][e] = slice_pos(base, u, e) < limit ? key_of(vs[e]) : 0u;
  }
}

// grid (slices, rows)
__global__ void __launch_bounds__(kPassThreads) topk_histogram_kernel(TopKParams p) {
  __shared__ int hist[kBins];
  const int row_id = blockIdx.y, base = blockIdx.x * kSlice, limit = row_limit(p, row_id);
  if (base >= limit) return;
  uint32_t keys[kPassGroups][4];
  load_slice(p, row_id, base, limit, keys);
  for (int d = threadIdx.x; d < kBins; d += kPassThreads) hist[d] = 0;
  __syncthreads();
#pragma unroll
  for (int u = 0; u < kPassGroups; ++u)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      if (keys[u][e]) atomicAdd(&hist[coarse_digit(keys[u][e])], 1);
  __syncthreads();
  int* const row_hist = FilterLists(p).counts + static_cast<int64_t>(row_id) * kCountsStride;
  for (int d = threadIdx.x; d < kBins; d += kPassThreads)
    if (hist[d]) atomicAdd(&row_hist[d], hist[d]);
}

// grid (slices, rows)
__global__ void __launch_bounds__(kPassThreads) topk_filter_kernel(TopKParams p) {
  __shared__ int warp_sums[kPassThreads / 32];
  __shared__ int bcast[2];
  __shared__ uint32_t bin_keys[2];
  const int row_id = blockIdx.y, base = blockIdx.x * kSlice, limit = row_limit(p, row_id);
  if (base >= limit) return;
  const FilterLists lists(p);
  int* const row_counts = lists.counts + static_cast<int64_t>(row_id) * kCountsStride;
  uint32_t keys[kPassGroups][4];
  load_slice(p, row_id, base, limit, keys);  // in flight during the bin search
  const int finite = find_bin<kPassThreads>(row_counts, p.k, warp_sums, bcast);
  const int T = min(p.k, finite);
  if (T == 0) return;
  // taken: keys >= above_from; candidates: keys in [cand_from, above_from). With T == finite
  // every finite entry is taken (their keys are all >= 1).
  uint32_t cand_from = 1, above_from = 1;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (T < finite) {
    if (warp < 2) {
      const uint32_t key = first_key_of_digit(bcast[0] + warp);
      if (lane == 0) bin_keys[warp] = key;
    }
    __syncthreads();
    cand_from = bin_keys[0];
    above_from = bin_keys[1];
  }
  int n_above = 0, n_cand = 0;
#pragma unroll
  for (int u = 0; u < kPassGroups; ++u)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      n_above += keys[u][e] >= above_from;
      n_cand += keys[u][e] >= cand_from && keys[u][e] < above_from;
    }
  // one atomic a warp and list: this thread's entries go after the warp's lanes below it
  const int above_incl = warp_inclusive_sum(n_above), cand_incl = warp_inclusive_sum(n_cand);
  int above_at = 0, cand_at = 0;
  if (lane == 31) {
    if (above_incl > 0) above_at = atomicAdd(&row_counts[kBins], above_incl);
    if (cand_incl > 0) cand_at = atomicAdd(&row_counts[kBins + 1], cand_incl);
  }
  above_at = __shfl_sync(0xffffffffu, above_at, 31) + above_incl - n_above;
  cand_at = __shfl_sync(0xffffffffu, cand_at, 31) + cand_incl - n_cand;
  int* const above = lists.above + static_cast<int64_t>(row_id) * kFilterMaxK;
  int* const cand_pos = lists.cand_pos + static_cast<int64_t>(row_id) * kFilterCap;
  uint32_t* const cand_key = lists.cand_key + static_cast<int64_t>(row_id) * kFilterCap;
#pragma unroll
  for (int u = 0; u < kPassGroups; ++u)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const uint32_t key = keys[u][e];
      if (key >= above_from) {
        if (above_at < kFilterMaxK) above[above_at] = slice_pos(base, u, e);  // fewer than T
        ++above_at;
      } else if (key >= cand_from) {
        if (cand_at < kFilterCap) {
          cand_pos[cand_at] = slice_pos(base, u, e);
          cand_key[cand_at] = key;
        }
        ++cand_at;
      }
    }
}

// topk_kernel's row after A and B: the threshold among the candidates, then the taken
// positions marked in `bitmap` (a bit a slot of the row) and written in order. False, with
// nothing written, where the threshold bin held more than kFilterCap entries.
template <int kT>
__device__ bool rank_filtered(const TopKParams& p, int row_id, int* hist, int* cand,
                              long long* scratch, int* warp_sums, int* bcast, uint32_t* bitmap) {
  const FilterLists lists(p);
  const int* const row_counts = lists.counts + static_cast<int64_t>(row_id) * kCountsStride;
  const int finite = find_bin<kT>(row_counts, p.k, warp_sums, bcast);
  const int T = min(p.k, finite);
  const int n_above = row_counts[kBins], n_cand = row_counts[kBins + 1];
  // every thread read the same counts; lists that disagree with the histogram (never: the
  // passes bin the same keys) are not used
  if (n_cand > kFilterCap || n_above > T || T - n_above > n_cand) return false;
  // the bitmap (the launcher sizes it for the whole row) was zeroed before the wait
  const int limit = row_limit(p, row_id), words = (limit + 31) / 32;
  const int* const cand_pos = lists.cand_pos + static_cast<int64_t>(row_id) * kFilterCap;
  const uint32_t* const cand_key = lists.cand_key + static_cast<int64_t>(row_id) * kFilterCap;
  uint32_t thr_key = 0;    // candidates taken: key > thr_key, or key == thr_key at a position
  int last_tie = INT_MAX;  // <= last_tie
  if (n_cand > 0) {        // T < finite: the T_bin first of the candidates are taken
    const int T_bin = T - n_above;
    if (n_cand <= kRankCand) {
      uint32_t* const keys = reinterpret_cast<uint32_t*>(hist);
      for (int i = threadIdx.x; i < n_cand; i += kT) {
        keys[i] = cand_key[i];
        cand[i] = cand_pos[i];
      }
      __syncthreads();
      rank_by_counting<kT>(keys, cand, n_cand, T_bin, bcast, thr_key, last_tie);
    } else {
      exact_threshold<kT>(n_cand, T_bin, [&](int i) { return cand_pos[i]; },
                          [&](int i) { return cand_key[i]; }, hist, bcast, scratch, thr_key,
                          last_tie);
    }
  }
  __syncthreads();  // every thread has read the ranking's bcast (find_bin's barriers ordered
                    // the pre-wait zeroing of the bitmap before any mark)
  const int* const above = lists.above + static_cast<int64_t>(row_id) * kFilterMaxK;
  for (int i = threadIdx.x; i < n_above; i += kT)
    mark1(bitmap, above[i]);
  for (int i = threadIdx.x; i < n_cand; i += kT) {
    const uint32_t key = cand_key[i];
    const int pos = cand_pos[i];
    if (key > thr_key || (key == thr_key && pos <= last_tie))
      mark1(bitmap, pos);
  }
  __syncthreads();
  // each warp writes the taken positions of a run of words, after those of the warps below
  const BitmapRun<kT> run(bitmap, words);
  int total;
  const int at = run_offset(run, warp_sums, total);
  int32_t* const out = p.out + static_cast<int64_t>(row_id) * p.k;
  run.write(bitmap, 0, at, p.k, out, p.block_ids + (row_id / p.rows) * p.ids_stride);
  for (int c = T + threadIdx.x; c < p.k; c += kT) out[c] = -1;
  return true;
}

// One row per CTA, or per thread-block cluster of kCluster CTAs when there are few rows: each
// CTA then takes a contiguous share of the row, and histograms, counts and offsets are summed
// over the cluster through distributed shared memory. Every cluster-wide decision is made from
// those sums, so all CTAs take the same branches (each cluster barrier is reached by all).
template <bool kCached, int kCluster, int kT>
__global__ void __launch_bounds__(kT, kThreads / kT) topk_kernel(TopKParams p) {
  constexpr int kW = kT / 32;
  extern __shared__ uint32_t cached[];
  __shared__ int hist[kBins];
  __shared__ int hist_all[kCluster > 1 ? kBins : 1];  // cluster sums
  __shared__ int cand[kCandCap];
  __shared__ long long scratch[kW];
  __shared__ int warp_sums[kW];
  __shared__ int bcast[2];
  __shared__ uint32_t bin_keys[2];  // the threshold bin's keys: [bin_keys[0], bin_keys[1])
  static_assert(kCluster <= kW, "warp_sums holds the cluster's candidate counts too");
  __shared__ int n_cand;
  __shared__ int n_above;  // this CTA's entries above the threshold bin (clusters)
  __shared__ int n_above_before;  // the same, summed over the lower ranks
  __shared__ long long shared_value;  // this CTA's term of a cluster-wide sum

  // Launched beside its predecessor (launch_rows), the kernel may start before the logits are
  // written: nothing is read before the wait. Then an update launched beside this kernel
  // (UpdateParams::beside_previous) may start: it reads the same logits and writes nothing
  // this kernel reads; waiting first keeps it behind the logits too. Below about 64 rows this
  // kernel's CTAs leave most SMs idle. The shared counters are zeroed before the wait (they
  // depend on nothing written before), while the kernel before may still be running; the
  // bitmap whole, as the row's length is read only after the wait.
  // The share's bitmap comes after its keys when cached; without room for it (huge shares) the
  // warps write the taken entries themselves (C).
  const int64_t share_cap = share_slots(p.m_cap, kCluster);
  uint32_t* const bitmap = cached + (kCached ? share_cap : 0);
  const bool marks = static_cast<int64_t>(dynamic_smem_bytes()) >=
                     (kCached ? share_cap * 4 : 0) + bitmap_bytes(share_cap);
  for (int d = threadIdx.x; d < kBins; d += kT) hist[d] = 0;
  if (marks)
    for (int w = threadIdx.x; w < bitmap_bytes(share_cap) / 4; w += kT) bitmap[w] = 0u;
  if (threadIdx.x == 0) n_cand = 0, n_above = 0, n_above_before = 0;
  pdl_wait();
  pdl_launch_dependents();
  const int rank = kCluster > 1 ? cluster_rank() : 0;
  const int row_id = blockIdx.x / kCluster, b = row_id / p.rows;
  if constexpr (!kCached && kCluster == 1) {  // the dynamic shared memory is the row's bitmap
    if (p.workspace != nullptr &&
        rank_filtered<kT>(p, row_id, hist, cand, scratch, warp_sums, bcast, cached))
      return;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* z = p.logits + static_cast<int64_t>(row_id) * p.logits_stride;
  int32_t* out = p.out + static_cast<int64_t>(row_id) * p.k;
  const int32_t* ids = p.block_ids + b * p.ids_stride;
  // only slots of the selected blocks (and within the row's compact length, when given) with a
  // finite score take part; segments stay whole 16-byte loads, and CTAs take whole blocks
  // (share_slots)
  const int limit = row_limit(p, row_id);
  const int scored = (limit + 3) & ~3;
  const int blocks = (scored + kBlockSize - 1) / kBlockSize;
  const int cta_seg = static_cast<int>(share_slots(blocks, kCluster));
  const int cta_begin = min(rank * cta_seg, scored), cta_end = min(cta_begin + cta_seg, scored);
  const int seg = ((cta_end - cta_begin) / 4 + kW - 1) / kW * 4;
  const int seg_begin = min(cta_begin + warp * seg, cta_end);
  const int seg_end = min(seg_begin + seg, cta_end);
  const Row<kCached> row{z, cached, cta_begin, limit};
  const int words = (cta_end - cta_begin + 31) / 32;

  // Sum of one value over the cluster's CTAs (every thread gets it); the value of this CTA is
  // given by every thread.
  auto cluster_sum = [&](long long mine) -> long long {
    if (kCluster == 1) return mine;
    __syncthreads();
    if (threadIdx.x == 0) shared_value = mine;
    cluster_barrier();
    long long total = 0;
    for (int r = 0; r < kCluster; ++r) total += *cluster_peer(&shared_value, r);
    cluster_barrier();  // shared_value may be written again
    return total;
  };
  // Histogram bins summed over the cluster into hist_all (hist itself when kCluster == 1).
  auto merge_bins = [&](int bins) {
    if (kCluster == 1) return;
    cluster_barrier();
    for (int d = threadIdx.x; d < bins; d += kT) {
      int total = 0;
      for (int r = 0; r < kCluster; ++r) total += cluster_peer(hist, r)[d];
      hist_all[d] = total;
    }
    cluster_barrier();  // hist may be cleared again
  };
  const int* merged = kCluster > 1 ? hist_all : hist;
  auto merge256 = [&] { merge_bins(256); };

  __syncthreads();  // the counters are zeroed

  const Row<false> global_row{z, nullptr, 0, limit};
  int finite = 0, T = 0;   // the finite entries, and the entries taken: min(K, finite)
  uint32_t thr_key = 0;    // select key > thr_key, or key == thr_key at a position <= last_tie
  int last_tie = INT_MAX;
  // the candidates (n_cand of them in cand) with their keys in `hist` (kKeysKept; A' keeps them
  // in cand's second half), or read from the row (kKeysInRow); none listed: the taken entries
  // are marked by a pass after the search
  enum { kNotListed, kKeysKept, kKeysInRow } listed = kNotListed;
  int offset_known = -1;  // this CTA's first output place, where the gather gave it
  const uint32_t* cand_key = reinterpret_cast<const uint32_t*>(hist);

  // A' (see the top). Exact wherever the pass lists at least T entries and at most kSampleCap:
  // every entry taken is listed. Too few: the sampled positions held the larger values; too
  // many: many entries tie near the threshold (ReLU-like or narrow rows). Cached rows skip it:
  // there A and B cost less than the sample's extra round trip and the radix passes.
  bool sampled = false;
  if constexpr (kCluster == 1) {
    // not after the filter gave up (its bin held more than A' keeps); K 0 takes nothing
    if (!kCached && marks && p.workspace == nullptr && p.k >= 1 && p.k <= kSampleMaxK &&
        scored >= kSampleMinSlots) {
      constexpr int kSpan = kSampleStride * 4;  // slots from one sampled float4 to the next
      for (int j0 = threadIdx.x; j0 * kSpan < scored; j0 += 4 * kT) {
        uint4 raw[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int pos = (j0 + u * kT) * kSpan;
          raw[u] = pos < scored ? global_row.raw4(pos) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int pos = (j0 + u * kT) * kSpan;
          const uint4 k = pos < scored ? global_row.keys4(pos, raw[u]) : make_uint4(0u, 0u, 0u, 0u);
          const uint32_t ks[4] = {k.x, k.y, k.z, k.w};
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (ks[e]) atomicAdd(&hist[coarse_digit(ks[e])], 1);
        }
      }
      __syncthreads();
      const int want = (kSampleAlpha * p.k + kSampleStride - 1) / kSampleStride;
      uint32_t from = 1u;  // every finite entry, where the sample holds no more than `want`
      if (want < find_bin<kT>(hist, want, warp_sums, bcast)) {
        if (warp == 0) {
          const uint32_t key = first_key_of_digit(bcast[0]);
          if (lane == 0) bin_keys[0] = key;
        }
        __syncthreads();
        from = bin_keys[0];
      }
      // The pass compares raw floats with the threshold's value (finite floats order as their
      // keys; NaN never passes, -inf is below -FLT_MAX, +inf is dropped) and makes keys of the
      // listed entries alone. It counts no finite entries: T is K where K or more are listed,
      // and the listed count where the threshold let every finite entry through.
      const bool every_finite = from == 1u;
      const float from_value = value_of_key(max(from, kMinFiniteKey));
      int* const keys_out = cand + kSampleCap;
      for (int base = seg_begin; base < seg_end; base += kWarpStep) {
        // past kSampleCap the row starts again at A: stop listing (no barrier in this loop)
        if (__any_sync(0xffffffffu, *reinterpret_cast<volatile int*>(&n_cand) > kSampleCap))
          break;
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int pos = base + u * 128 + lane * 4;
          v[u] = pos < seg_end ? __ldg(reinterpret_cast<const float4*>(z + pos))
                               : make_float4(-CUDART_INF_F, -CUDART_INF_F, -CUDART_INF_F,
                                             -CUDART_INF_F);
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const float vs[4] = {v[u].x, v[u].y, v[u].z, v[u].w};
          if (!(vs[0] >= from_value || vs[1] >= from_value || vs[2] >= from_value ||
                vs[3] >= from_value))
            continue;
          const int pos = base + u * 128 + lane * 4;
          bool take[4];
          int mine = 0;
#pragma unroll
          for (int e = 0; e < 4; ++e)
            mine += take[e] = vs[e] >= from_value && vs[e] < CUDART_INF_F && pos + e < limit;
          int at = mine ? atomicAdd(&n_cand, mine) : 0;  // one atomic a float4
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (take[e]) {
              if (at < kSampleCap) {
                cand[at] = pos + e;
                keys_out[at] = static_cast<int>(ordered_key(vs[e]));
              }
              ++at;
            }
        }
      }
      __syncthreads();  // every append before n_cand is read
      const int listed_n = n_cand;
      sampled = listed_n <= kSampleCap && (listed_n >= p.k || every_finite);
      T = min(p.k, listed_n);
      if (sampled) {
        listed = kKeysKept;
        cand_key = reinterpret_cast<const uint32_t*>(keys_out);
        if (T > 0 && listed_n > T)
          exact_threshold<kT>(listed_n, T, [&](int i) { return cand[i]; },
                              [&](int i) { return cand_key[i]; }, hist, bcast, scratch, thr_key,
                              last_tie);
      } else {
        __syncthreads();  // every thread has read n_cand
        for (int d = threadIdx.x; d < kBins; d += kT) hist[d] = 0;
        if (threadIdx.x == 0) n_cand = 0;
        __syncthreads();
      }
    }
  }
  if (!sampled) {
    // A. histogram of the coarse digit, in the pass that caches the share's keys
    walk_segment(global_row, seg_begin, seg_end, [&](int pos, uint4 k) {
      if (kCached && pos < seg_end) *reinterpret_cast<uint4*>(cached + (pos - cta_begin)) = k;
      const uint32_t ks[4] = {k.x, k.y, k.z, k.w};
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (ks[e]) atomicAdd(&hist[coarse_digit(ks[e])], 1);
    });
    __syncthreads();
    merge_bins(kBins);
    finite = find_bin<kT>(merged, p.k, warp_sums, bcast);
    T = min(p.k, finite);
    if (T > 0 && T < finite) {
      const int bin = bcast[0], in_bin = merged[bin], T_bin = T - bcast[1];
      if (warp < 2) {
        const uint32_t key = first_key_of_digit(bin + warp);
        if (lane == 0) bin_keys[warp] = key;
      }
      __syncthreads();  // hist (and hist_all) are reused below
      const uint32_t bin_lo = bin_keys[0], bin_end = bin_keys[1];
      auto in_the_bin = [&](uint32_t k) { return k >= bin_lo && k < bin_end; };  // k 0: never
      auto exact = [&](int count, auto pos_of, auto key, auto eligible) {
        exact_threshold<kT>(count, T_bin, pos_of, key, eligible, hist, merged, merge256,
                            cluster_sum, bcast, scratch, thr_key, last_tie);
      };
      // B. candidates: the entries of the threshold bin (each CTA keeps those of its share, with
      // their keys in `hist` when they are to be ranked by counting); the entries of higher bins,
      // all taken, are marked
      auto collect = [&](bool with_keys) {
        uint32_t* const keys_out = reinterpret_cast<uint32_t*>(hist);
        int above_mine = 0;
        walk_segment(row, seg_begin, seg_end, [&](int pos, uint4 k) {
          const uint32_t ks[4] = {k.x, k.y, k.z, k.w};
          int mine = 0;
          uint32_t above = 0;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            mine += in_the_bin(ks[e]);
            above |= static_cast<uint32_t>(ks[e] >= bin_end) << e;  // k 0: never
          }
          if (marks) mark4(bitmap, pos - cta_begin, above);
          if (kCluster > 1 && marks && with_keys) above_mine += __popc(above);
          if (mine) {
            int at = atomicAdd(&n_cand, mine);
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (in_the_bin(ks[e])) {
                if (with_keys) keys_out[at] = ks[e];
                cand[at++] = pos + e;
              }
          }
        });
        listed = with_keys ? kKeysKept : kKeysInRow;
        if (kCluster > 1 && marks && with_keys) {  // read by higher ranks at the gather
          for (int o = 16; o > 0; o >>= 1)
            above_mine += __shfl_xor_sync(0xffffffffu, above_mine, o);
          if (lane == 0 && above_mine) atomicAdd(&n_above, above_mine);
        }
        __syncthreads();
      };
      if (in_bin <= kRankCand) {
        collect(true);
        const uint32_t* keys = cand_key;
        const int* positions = cand;
        if constexpr (kCluster > 1) {  // every CTA gathers the cluster's candidates
          cluster_barrier();
          int* const peer_counts = warp_sums;  // free after find_bin
          if (threadIdx.x < kCluster)
            peer_counts[threadIdx.x] = *cluster_peer(&n_cand, threadIdx.x);
          if (threadIdx.x < rank) atomicAdd(&n_above_before, *cluster_peer(&n_above, threadIdx.x));
          __syncthreads();
          if (threadIdx.x < in_bin) {
            int r = 0, i = threadIdx.x;
            for (; r < kCluster - 1 && i >= peer_counts[r]; ++r) i -= peer_counts[r];
            hist_all[threadIdx.x] = static_cast<int>(cluster_peer(cand_key, r)[i]);
            hist_all[kRankCand + threadIdx.x] = cluster_peer(cand, r)[i];
          }
          __syncthreads();  // this CTA's lists are not written again: peers may still read them
          // the arrive and the wait before leaving keep this CTA's lists alive for the peers
          if (marks) cluster_arrive();
          keys = reinterpret_cast<const uint32_t*>(hist_all);
          positions = hist_all + kRankCand;
        }
        rank_by_counting<kT>(keys, positions, in_bin, T_bin, bcast, thr_key, last_tie);
        if (kCluster > 1 && marks) {  // this CTA's offset: what the lower ranks take
          const int i = threadIdx.x;
          const bool before =
              i < in_bin && positions[i] < cta_begin &&
              (keys[i] > thr_key || (keys[i] == thr_key && positions[i] <= last_tie));
          offset_known = __syncthreads_count(before) + n_above_before;
        }
      } else if (in_bin <= kCandCap) {
        collect(false);
        auto cand_pos = [&](int i) { return cand[i]; };
        exact(n_cand, cand_pos, [&](int i) { return row.key(cand[i]); }, [](int) { return true; });
      } else {
        // too many in one bin (many equal values): the exact search over the whole row
        auto row_pos = [&](int i) { return cta_begin + i; };
        exact(cta_end - cta_begin, row_pos, [&](int i) { return row.key(cta_begin + i); },
              [&](int i) { return in_the_bin(row.key(cta_begin + i)); });
      }
    }
  }
  // This CTA's first output place: the counts of the cluster's CTAs before it (rank order).
  auto cluster_offset = [&](int cta_count) -> int {
    if (kCluster == 1) return 0;
    if (threadIdx.x == 0) shared_value = cta_count;
    cluster_barrier();
    int before = 0;
    for (int r = 0; r < rank; ++r) before += static_cast<int>(*cluster_peer(&shared_value, r));
    cluster_barrier();  // every CTA has read the counts before any CTA leaves
    return before;
  };
  auto selected = [&](int pos, uint32_t k) {
    return k != 0u && (k > thr_key || (k == thr_key && pos <= last_tie));
  };

  // C. the taken candidates marked (or every taken entry, where B listed none); each warp's
  // run of the bitmap counted, offsets (CTAs of a cluster in rank order), ordered writes
  if (T > 0 && marks) {
    if (listed != kNotListed) {
      for (int i = threadIdx.x; i < n_cand; i += kT) {
        const int pos = cand[i];
        if (selected(pos, listed == kKeysKept ? cand_key[i] : row.key(pos)))
          mark1(bitmap, pos - cta_begin);
      }
    } else {
      walk_segment(row, seg_begin, seg_end, [&](int pos, uint4 k) {
        mark4(bitmap, pos - cta_begin,
              static_cast<uint32_t>(selected(pos, k.x)) | selected(pos + 1, k.y) << 1 |
                  selected(pos + 2, k.z) << 2 | selected(pos + 3, k.w) << 3);
      });
    }
    __syncthreads();
    const BitmapRun<kT> run(bitmap, words);
    int cta_count;
    const int at = run_offset(run, warp_sums, cta_count);
    run.write(bitmap, cta_begin,
              at + (offset_known >= 0 ? offset_known : cluster_offset(cta_count)), p.k, out, ids);
  } else if (T > 0) {
    // The warps write what they take: per-warp counts, offsets, ordered writes. The share's
    // block ids go to shared memory first (hist_all, or cand without a cluster: peers may
    // still read this CTA's candidates), off the writes' path.
    const int first_block = cta_begin / kBlockSize;
    const int share_blocks = (cta_end + kBlockSize - 1) / kBlockSize - first_block;
    int* const ids_s = kCluster > 1 ? hist_all : cand;
    const bool ids_in_smem = share_blocks <= (kCluster > 1 ? kBins : kCandCap);
    if (ids_in_smem)
      for (int i = threadIdx.x; i < share_blocks; i += kT) ids_s[i] = ids[first_block + i];
    int mine = 0;
    walk_segment(row, seg_begin, seg_end, [&](int pos, uint4 k) {
      mine += selected(pos, k.x) + selected(pos + 1, k.y) + selected(pos + 2, k.z) +
              selected(pos + 3, k.w);
    });
    int cta_count;
    const int before = block_exclusive_sum<kT>(mine, warp_sums, cta_count);
    int at = __shfl_sync(0xffffffffu, before, 0) + cluster_offset(cta_count);
    walk_segment(row, seg_begin, seg_end, [&](int pos, uint4 k) {
      const uint32_t ks[4] = {k.x, k.y, k.z, k.w};
      bool sel[4];
      int n = 0;
#pragma unroll
      for (int e = 0; e < 4; ++e) n += sel[e] = selected(pos + e, ks[e]);
      const int incl = warp_inclusive_sum(n);
      int r = at + incl - n;
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (sel[e]) {
          const int block = (pos + e) / kBlockSize;
          out[r++] = slot_id(ids_in_smem ? ids_s[block - first_block] : ids[block],
                             (pos + e) % kBlockSize);
        }
      at += __shfl_sync(0xffffffffu, incl, 31);
    });
  }
  if (rank == 0)
    for (int c = max(T, 0) + threadIdx.x; c < p.k; c += kT) out[c] = -1;
  if (kCluster > 1 && offset_known >= 0) cluster_wait();
}

template <bool kCached, int kCluster, int kT = kThreads>
cudaError_t launch_rows(const TopKParams& p, size_t smem, cudaStream_t stream) {
  auto kernel = topk_kernel<kCached, kCluster, kT>;
  cudaError_t err = allow_dynamic_smem(kernel, smem);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.batch * p.rows * kCluster);
  cfg.blockDim = dim3(kT);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  // the CTAs may be scheduled while the kernel before them finishes (its launch latency hidden
  // behind that kernel's tail, as TensorRT-LLM launches its top-K); the kernel waits before it
  // reads anything (sm_90+, where clusters are)
  cudaLaunchAttribute attr[2];
  allow_beside_previous(cfg, attr, true);
  if (kCluster == 1) return cudaLaunchKernelEx(&cfg, kernel, p);
  attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
  attr[cfg.numAttrs].val.clusterDim.x = kCluster;
  attr[cfg.numAttrs].val.clusterDim.y = 1;
  attr[cfg.numAttrs].val.clusterDim.z = 1;
  // every row's cluster must be resident at once, or a smaller cluster does better (asked with
  // the cluster attribute alone)
  cudaLaunchConfig_t query = cfg;
  query.attrs = attr + cfg.numAttrs;
  query.numAttrs = 1;
  int clusters = 0;
  err = cudaOccupancyMaxActiveClusters(&clusters, kernel, &query);
  if (err != cudaSuccess) cudaGetLastError();  // the query's error is not sticky: clear it
  if (err != cudaSuccess || clusters < p.batch * p.rows) return cudaErrorNotSupported;
  cfg.numAttrs += 1;
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

// A kernel's static shared memory (SIZE_MAX: unknown).
template <typename Kernel>
size_t static_smem(Kernel kernel) {
  cudaFuncAttributes attr;
  return cudaFuncGetAttributes(&attr, kernel) == cudaSuccess ? attr.sharedSizeBytes : SIZE_MAX;
}

// Whether `dynamic` bytes fit beside a kernel's static shared memory in what the device lets a
// CTA have (227 KB on sm_90, 99 KB on sm_89 and sm_120).
bool fits_beside(size_t static_bytes, size_t dynamic, int smem_optin) {
  return static_bytes != SIZE_MAX && static_bytes + dynamic <= static_cast<size_t>(smem_optin);
}

template <int kCluster>
cudaError_t launch_cluster(const TopKParams& p, int smem_optin, cudaStream_t stream) {
  // each CTA caches its share of the row, with the share's bitmap after it, when both fit;
  // else the bitmap alone, where it fits (else C's warps write the taken entries)
  const int64_t share = share_slots(p.m_cap, kCluster);
  const size_t keys = static_cast<size_t>(share) * sizeof(uint32_t);
  const size_t bitmap = static_cast<size_t>(bitmap_bytes(share));
  static const size_t cached_static = static_smem(topk_kernel<true, kCluster, kThreads>);
  static const size_t uncached_static = static_smem(topk_kernel<false, kCluster, kThreads>);
  if (keys <= kMaxCachedBytes && fits_beside(cached_static, keys + bitmap, smem_optin))
    return launch_rows<true, kCluster>(p, keys + bitmap, stream);
  return launch_rows<false, kCluster>(
      p, fits_beside(uncached_static, bitmap, smem_optin) ? bitmap : 0, stream);
}

// Whether the rows are more than the SMs and two CTAs of `kernel` (a kHalfThreads instance)
// with `dynamic` bytes of shared memory each are resident on an SM (asked of the runtime, with
// the carveout set to shared memory first): then they run in one wave, where CTAs of kThreads
// (one an SM) take two.
template <typename Kernel>
bool two_ctas_an_sm(const TopKParams& p, Kernel kernel, size_t dynamic) {
  const int sms = current_device_attribute(cudaDevAttrMultiProcessorCount);
  if (static_cast<int64_t>(p.batch) * p.rows <= sms) return false;
  int blocks = 0;
  if (allow_dynamic_smem(kernel, dynamic) != cudaSuccess ||
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           cudaSharedmemCarveoutMaxShared) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kHalfThreads, dynamic) !=
          cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it, and take CTAs of kThreads
    return false;
  }
  return blocks >= 2;
}

// One CTA a row: of kHalfThreads, two an SM, where there are more rows than SMs and two fit
// (the share cached when it fits so, else its bitmap alone); else launch_cluster<1>.
cudaError_t launch_one_cta_a_row(const TopKParams& p, int smem_optin, cudaStream_t stream) {
  const int64_t share = share_slots(p.m_cap, 1);
  const size_t keys = static_cast<size_t>(share) * sizeof(uint32_t);
  const size_t bitmap = static_cast<size_t>(bitmap_bytes(share));
  if (keys <= kMaxCachedBytes &&
      two_ctas_an_sm(p, topk_kernel<true, 1, kHalfThreads>, keys + bitmap))
    return launch_rows<true, 1, kHalfThreads>(p, keys + bitmap, stream);
  if (two_ctas_an_sm(p, topk_kernel<false, 1, kHalfThreads>, bitmap))
    return launch_rows<false, 1, kHalfThreads>(p, bitmap, stream);
  return launch_cluster<1>(p, smem_optin, stream);
}

// Whether rows of these shapes are ranked through the filter (given the workspace).
bool filter_shapes(const TopKParams& p) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.rows;
  const int64_t slots = static_cast<int64_t>(p.m_cap) * kBlockSize;
  if (p.filter == 0 || p.k < 1 || p.k > kFilterMaxK) return false;
  if (p.filter < 0 &&
      (rows < kFilterAutoMinRows || rows > kFilterAutoMaxRows || slots < kFilterAutoMinSlots))
    return false;
  return slots > kSlice && slots <= kFilterMaxSlots && rows <= kFilterMaxRows;
}

// Whether topk_kernel<false, 1> has room for the bitmap of these rows beside its static shared
// memory (sm_89 and sm_120 give a CTA 99 KB).
bool filter_fits(const TopKParams& p) {
  static const size_t static_bytes = static_smem(topk_kernel<false, 1, kThreads>);
  return fits_beside(static_bytes, static_cast<size_t>(bitmap_bytes(share_slots(p.m_cap, 1))),
                     current_device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin));
}

cudaError_t launch_filtered(const TopKParams& p, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.rows;
  const int64_t slots = static_cast<int64_t>(p.m_cap) * kBlockSize;
  cudaError_t err = cudaMemsetAsync(p.workspace, 0, rows * kCountsStride * sizeof(int), stream);
  if (err != cudaSuccess) return err;
  const dim3 grid(static_cast<unsigned>((slots + kSlice - 1) / kSlice),
                  static_cast<unsigned>(rows));
  topk_histogram_kernel<<<grid, kPassThreads, 0, stream>>>(p);
  topk_filter_kernel<<<grid, kPassThreads, 0, stream>>>(p);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const size_t bitmap = static_cast<size_t>(bitmap_bytes(slots));
  if (two_ctas_an_sm(p, topk_kernel<false, 1, kHalfThreads>, bitmap))
    return launch_rows<false, 1, kHalfThreads>(p, bitmap, stream);
  return launch_rows<false, 1>(p, bitmap, stream);
}

}  // namespace

size_t topk_workspace_bytes(const TopKParams& p) {
  if (!filter_shapes(p) || !filter_fits(p)) return 0;  // ranked whole: no workspace
  const size_t rows = static_cast<size_t>(p.batch) * p.rows;
  return rows * sizeof(int) * (kCountsStride + kFilterMaxK + 2 * kFilterCap);
}

cudaError_t launch_topk(const TopKParams& params, cudaStream_t stream) {
  if (params.batch == 0 || params.rows == 0) return cudaSuccess;
  if (filter_shapes(params) && params.workspace != nullptr &&
      params.workspace_bytes >= topk_workspace_bytes(params) && filter_fits(params))
    return launch_filtered(params, stream);
  TopKParams p = params;
  p.workspace = nullptr;  // topk_kernel ranks the whole row
  int device = 0, sms = 132, major = 0, optin = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (major < 9) return launch_one_cta_a_row(p, optin, stream);  // no thread-block clusters
  // Few rows leave most SMs idle: split long rows over a cluster (at most 8 CTAs, which fit in
  // one GPC) so that about every SM takes a share. Clusters of 8 only from 64K slots: below, 4
  // CTAs a row are faster (benchmarks/bench_topk.py).
  const int64_t rows = static_cast<int64_t>(p.batch) * p.rows;
  const int64_t slots = static_cast<int64_t>(p.m_cap) * kBlockSize;
  cudaError_t err = cudaErrorNotSupported;  // a cluster size that cannot be scheduled: smaller
  if (slots >= 8 * 8192 && rows * 8 <= sms) err = launch_cluster<8>(p, optin, stream);
  if (err == cudaErrorNotSupported && slots >= 4 * 4096 && rows * 4 <= sms)
    err = launch_cluster<4>(p, optin, stream);
  if (err == cudaErrorNotSupported && slots >= 2 * 4096 && rows * 2 <= sms)
    err = launch_cluster<2>(p, optin, stream);
  if (err == cudaErrorNotSupported) err = launch_one_cta_a_row(p, optin, stream);
  return err;
}

}  // namespace spin
