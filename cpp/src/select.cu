// spin::select: predict block scores from V/D (or take given ones, one layer), apply budget, forced blocks, exploration and
// the MTP union, for every (request, layer) stream in one launch. One CTA per stream; the
// top-m blocks come from 8-bit radix passes over the score keys (16-bit keys when the scores
// are pooled fp16 or fp8 state, 32-bit otherwise), ties to the lower block id.
#include <cfloat>
#include <type_traits>

#include "common.cuh"

namespace spin {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxPerStep = 2;  // blocks in flight per lane group on the max-pooling path
// A launch of few CTAs (one layer's, beside the previous layer's top-K) cannot hide the loads'
// latency by occupancy: its interior blocks keep more loads in flight per lane group (one CTA
// an SM, the registers to hold them).
constexpr int kWidePerStep = 8;

// max(V[i], D[q - i]) of this lane's two slots of block j (-inf past the visible slots).
__device__ __forceinline__ void block_values(const StateView& s, int64_t base, int j, int n,
                                             int q, float (&v)[2]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t i = static_cast<int64_t>(j) * kBlockSize + lane + 32 * h;
    if (i < n) {
      const int64_t o = static_cast<int64_t>(q) - i;
      const float vv = i < s.cap ? load_state(s.V, s.type, base + i) : 0.0f;
      const float dd = (o >= 0 && o < s.cap) ? load_state(s.D, s.type, base + o) : 0.0f;
      v[h] = fmaxf(vv, dd);
    } else {
      v[h] = -CUDART_INF_F;
    }
  }
}

// Max pooling on vector-readable state: a group of kGroup = 64 / kVec lanes takes one block.
// Lane h reads V of the block's slots kVec*h.., and kVec aligned D entries of the block's
// offset window (lane 0 one more vector when the window is not aligned). The block's max of
// max(V[i], D[q - i]) over visible slots is the max of both sets, so V and D need not be
// paired slot by slot. Every lane loads 16 bytes (8 in fp16 with kVec 4), so fp16 state takes
// half the steps of fp32 for the same bytes in flight.
// Interior blocks (all 64 slots visible and inside the state, the whole D window
// [q - first - 63, q - first] inside [0, cap)) take a path without per-entry bounds checks.
template <int kType, int kVec>
struct MaxBlockLoads {
  StateVec<kType, kVec> v, d, d_tail;
  bool interior;
};

// The group's view of block j: lane's first slot i0, visible D window [o_lo, o_hi], the
// lane's D vector at a. Recomputed where needed rather than kept in registers.
template <int kVec>
struct MaxBlockWindow {
  static constexpr int kGroup = kBlockSize / kVec;
  int64_t i0, o_lo, o_hi, a;
  bool interior;
  __device__ __forceinline__ MaxBlockWindow(const StateView& s, int j, int n, int q) {
    const int64_t first = static_cast<int64_t>(j) * kBlockSize;
    const int h = threadIdx.x % kGroup;
    i0 = first + kVec * h;
    o_hi = min(static_cast<int64_t>(q) - first, s.cap - 1);
    o_lo = max(max(static_cast<int64_t>(q) - first - (kBlockSize - 1),
                   static_cast<int64_t>(q) - n + 1), int64_t{0});
    interior = first + kBlockSize <= min(static_cast<int64_t>(n), s.cap) &&
               o_lo == static_cast<int64_t>(q) - first - (kBlockSize - 1) &&
               o_hi == static_cast<int64_t>(q) - first;
    // the window spans <= 64 + kVec - 1 entries from a's aligned start
    a = (o_lo & ~static_cast<int64_t>(kVec - 1)) + kVec * h;
  }
};

// kInterior false: the caller passes no interior block (the lean path took them)
template <int kType, int kVec, bool kInterior = true>
__device__ __forceinline__ void load_block_max(const StateView& s, int64_t base, int j, int n,
                                               int q, MaxBlockLoads<kType, kVec>& L) {
  const MaxBlockWindow<kVec> w(s, j, n, q);
  const bool lead = threadIdx.x % MaxBlockWindow<kVec>::kGroup == 0;
  L.interior = kInterior && w.interior;
  if (L.interior) {
    L.v.load(s.V, base + w.i0);
    L.d.load(s.D, base + w.a);
    if (lead && (w.o_lo & (kVec - 1))) L.d_tail.load(s.D, base + w.a + kBlockSize);
    return;
  }
  if (w.i0 < n && w.i0 < s.cap) L.v.load(s.V, base + w.i0);
  if (w.o_lo <= w.o_hi && w.a <= w.o_hi) L.d.load(s.D, base + w.a);
  if (lead && w.a + kBlockSize <= w.o_hi) L.d_tail.load(s.D, base + w.a + kBlockSize);
}

// Every lane of the warp must call this (shuffles); `active`: the group's block exists.
template <int kType, int kVec, bool kInterior = true>
__device__ __forceinline__ float reduce_block_max(const StateView& s, int j, int n, int q,
                                                  const MaxBlockLoads<kType, kVec>& L,
                                                  bool active) {
  constexpr int kGroup = MaxBlockWindow<kVec>::kGroup;
  const bool lead = threadIdx.x % kGroup == 0;
  float m = -CUDART_INF_F;
  if (kInterior && active && L.interior) {
    // the lead lane's entries below the window start are replaced by the tail past a + 63
    const int skew = (q - j * kBlockSize - (kBlockSize - 1)) & (kVec - 1);
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      m = fmaxf(m, fmaxf(L.v[e], lead && e < skew ? L.d_tail[e] : L.d[e]));
  } else if (active) {
    const MaxBlockWindow<kVec> w(s, j, n, q);
#pragma unroll
    for (int e = 0; e < kVec; ++e) {
      const int64_t i = w.i0 + e;
      if (i < n) {
        m = fmaxf(m, i < s.cap ? L.v[e] : 0.0f);
        const int64_t o = q - i;
        if (o < 0 || o >= s.cap) m = fmaxf(m, 0.0f);  // D outside the state counts as 0
      }
      if (w.a + e >= w.o_lo && w.a + e <= w.o_hi) m = fmaxf(m, L.d[e]);
      if (lead && w.a + kBlockSize + e <= w.o_hi) m = fmaxf(m, L.d_tail[e]);
    }
  }
  for (int o = kGroup / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
}

// Max-pooled scores of blocks 0..B-1 into score[]: 32 / kGroup blocks per warp (one per group)
// x kMaxPerStep per step, all loads issued first; the loop and its shuffles stay warp-uniform.
// Blocks [skip_lo, skip_end) are left out (the lean path scores them): k counts the others.
template <int kType, int kVec, int kSteps = kMaxPerStep, bool kInterior = true>
__device__ void score_blocks_max(const StateView& s, int64_t base, int B, int n, int q,
                                 float* score, int skip_lo = 0, int skip_end = 0) {
  constexpr int kGroup = MaxBlockWindow<kVec>::kGroup, kPerWarp = 32 / kGroup;
  constexpr int kWarps = kThreads / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, group = lane / kGroup;
  const int gap = skip_end - skip_lo, blocks = B - gap;
  auto block_of = [&](int k) { return k < skip_lo ? k : k + gap; };
  for (int kw = kPerWarp * warp; kw < blocks; kw += kPerWarp * kSteps * kWarps) {
    MaxBlockLoads<kType, kVec> L[kSteps];
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int k = kw + kPerWarp * u * kWarps + group;
      if (k < blocks) load_block_max<kType, kVec, kInterior>(s, base, block_of(k), n, q, L[u]);
    }
#pragma unroll
    for (int u = 0; u < kSteps; ++u) {
      const int k = kw + kPerWarp * u * kWarps + group, j = block_of(k);
      const float m = reduce_block_max<kType, kVec, kInterior>(s, j, n, q, L[u], k < blocks);
      if (lane % kGroup == 0 && k < blocks) score[j] = m;
    }
  }
}

// The interior blocks [j_lo, j_end) of a row of fp16 or fp8 state (see MaxBlockWindow): the
// same loads and the same max as score_blocks_max, on 32-bit vector indices from the row's base
// (a row's positions fit 32 bits), with no per-block window arithmetic: V vector kGroup*j + h,
// D vector dvec0 - kGroup*j + h, the lead lane's tail kGroup further, where
// dvec0 = (q - 63) / kVec. The max runs on packed fp16 pairs (exact: fp8 converts to them
// exactly, two entries at a time); the lead lane's first `skew` D entries come from the tail by
// a mask fixed for the row: a few instructions a vector instead of a conversion and a branch per
// entry.
template <int kType, int kVec, int kPer>
__device__ void score_interior_blocks(const void* V_row, const void* D_row, int j_lo, int j_end,
                                      int q, float* score) {
  constexpr int kGroup = kBlockSize / kVec, kPerWarp = 32 / kGroup;
  constexpr int kWarps = kThreads / 32;
  using Vec = StateVec<kType, kVec>;
  constexpr int kWords = Vec::kWords;
  constexpr int kPerWord = kVec / kWords;   // entries per 32-bit word: 2 (fp16) or 4 (fp8)
  constexpr int kBits = 32 / kPerWord;
  constexpr uint32_t kEntryMask = (1u << kBits) - 1u;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, group = lane / kGroup;
  const int h = lane % kGroup;
  const bool lead = h == 0;
  const int dvec0 = (q - (kBlockSize - 1)) / kVec, skew = (q - (kBlockSize - 1)) & (kVec - 1);
  const bool tail = lead && skew != 0;
  uint32_t from_tail[kWords];  // per word, the entries taken from the tail
#pragma unroll
  for (int k = 0; k < kWords; ++k) {
    from_tail[k] = 0u;
#pragma unroll
    for (int e = 0; e < kPerWord; ++e)
      if (tail && kPerWord * k + e < skew) from_tail[k] |= kEntryMask << (kBits * e);
  }
#pragma unroll 1
  for (int jw = j_lo + kPerWarp * warp; jw < j_end; jw += kPerWarp * kPer * kWarps) {
    Vec v[kPer], d[kPer], t[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int j = jw + kPerWarp * u * kWarps + group;
#pragma unroll
      for (int k = 0; k < kWords; ++k) t[u].w[k] = 0u;
      if (j < j_end) {
        v[u].load_vec(V_row, kGroup * j + h);
        d[u].load_vec(D_row, dvec0 - kGroup * j + h);
        if (tail) t[u].load_vec(D_row, dvec0 - kGroup * j + kGroup);
      }
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int j = jw + kPerWarp * u * kWarps + group;
      float m = -CUDART_INF_F;
      if (j < j_end) {
        __half2 acc = __float2half2_rn(-CUDART_INF_F);
#pragma unroll
        for (int k = 0; k < kWords; ++k) {
          const uint32_t dw = (t[u].w[k] & from_tail[k]) | (d[u].w[k] & ~from_tail[k]);
          if constexpr (kType == kStateF16) {
            acc = __hmax2(acc, __hmax2(*reinterpret_cast<const __half2*>(&v[u].w[k]),
                                       *reinterpret_cast<const __half2*>(&dw)));
          } else {  // fp8: the max of the exact fp16 images
            acc = __hmax2(acc, __hmax2(__hmax2(e4m3x2_to_half2(v[u].w[k]),
                                               e4m3x2_to_half2(v[u].w[k] >> 16)),
                                       __hmax2(e4m3x2_to_half2(dw), e4m3x2_to_half2(dw >> 16))));
          }
        }
        m = fmaxf(__low2float(acc), __high2float(acc));
      }
      for (int o = kGroup / 2; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
      if (lead && j < j_end) score[j] = m;
    }
  }
}

// Blocks 0..B-1 of a row: with fp16 or fp8 state the interior ones on the lean path, the rest
// (the newest block, and blocks whose slots or D window reach past the state) on the general one.
// H200, all 21 layers in one launch, us a layer: 96 x 128K slots 18.65 -> 18.32, 96 x 32K
// 6.34 -> 6.08, 32 x 128K 8.12 -> 7.92, 8 x 32K 1.12 -> 1.06
// (benchmarks/results_select_update_vectors_s16.json; 4 blocks a lane group in flight, or 3
// CTAs an SM, were slower at 3 of the 4 shapes). With the packed fp16 max, 16-bit keys and
// one-barrier takes: 18.18 -> 15.33, 5.94 -> 4.80, 7.80 -> 6.51, 0.99 -> 0.75
// (benchmarks/results_select_s18.jsonl).
template <int kType, int kVec, int kPer>
__device__ void score_blocks(const StateView& s, int64_t base, int B, int n, int q,
                             float* score) {
  if constexpr (kType == kStateF32) {  // the lean path was not timed there and spills more (40 B)
    score_blocks_max<kType, kVec>(s, base, B, n, q, score);
  } else {
    // interior: 64j + 64 <= min(n, cap), 64j + 63 <= q and q - 64j <= cap - 1
    const int64_t visible = min(static_cast<int64_t>(n), s.cap);
    const int j_hi = static_cast<int>(min(min(visible / kBlockSize,
                                              (static_cast<int64_t>(q) + 1) / kBlockSize) - 1,
                                          static_cast<int64_t>(B) - 1));
    const int64_t below = static_cast<int64_t>(q) - s.cap + 1;
    const int j_lo = below <= 0 ? 0 : static_cast<int>(min((below + kBlockSize - 1) / kBlockSize,
                                                           static_cast<int64_t>(B)));
    const int j_end = max(j_hi + 1, j_lo);
    score_interior_blocks<kType, kVec, kPer>(
        static_cast<const char*>(s.V) + base * state_bytes(kType),
        static_cast<const char*>(s.D) + base * state_bytes(kType), j_lo, j_end, q, score);
    // the few other blocks one at a time (fewer registers beside the lean path's)
    score_blocks_max<kType, kVec, 1, false>(s, base, B, n, q, score, j_lo, j_end);
  }
}

// Pool one block's values across the warp.
__device__ float pool_block(float (&v)[2], int pooling) {
  const int lane = threadIdx.x & 31;
  if (pooling == kPoolMax) {
    float m = fmaxf(v[0], v[1]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
  }
  if (pooling == kPoolMean) {
    float sum = (v[0] > -CUDART_INF_F ? v[0] : 0.0f) + (v[1] > -CUDART_INF_F ? v[1] : 0.0f);
    int cnt = (v[0] > -CUDART_INF_F) + (v[1] > -CUDART_INF_F);
    for (int o = 16; o > 0; o >>= 1) {
      sum += __shfl_xor_sync(0xffffffffu, sum, o);
      cnt += __shfl_xor_sync(0xffffffffu, cnt, o);
    }
    return cnt > 0 ? sum / cnt : -CUDART_INF_F;
  }
  // top4: mean of up to the 4 largest visible values, summed largest first
  float sum = 0.0f;
  int cnt = 0;
  for (int k = 0; k < 4; ++k) {
    float m = fmaxf(v[0], v[1]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (!(m > -CUDART_INF_F)) break;
    sum = k == 0 ? m : sum + m;
    ++cnt;
    // remove one occurrence: the lowest lane (then lower half) holding m
    const unsigned holders = __ballot_sync(0xffffffffu, v[0] == m || v[1] == m);
    if (lane == __ffs(holders) - 1) {
      if (v[0] == m) v[0] = -CUDART_INF_F; else v[1] = -CUDART_INF_F;
    }
  }
  return cnt > 0 ? sum / cnt : -CUDART_INF_F;
}

// Flags what radix_threshold selected: every eligible entry with a key >= thr when `whole`,
// else those above thr and the first `need` ties in index order. A warp walks one contiguous
// range, so the tie ranks cost one block barrier (not two per kThreads entries).
// `warp_ties` holds kThreads / 32 ints; the caller syncs before its next use.
template <typename Key, typename Eligible, typename Flag>
__device__ void flag_taken(int count, uint32_t thr, int need, bool whole, Key key,
                           Eligible eligible, Flag flag, int* warp_ties) {
  if (whole) {
    for (int j = threadIdx.x; j < count; j += kThreads)
      if (eligible(j) && key(j) >= thr) flag(j);
    return;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int span = (count + kThreads - 1) / kThreads * 32;
  const int lo = warp * span, hi = min(lo + span, count);
  int ties = 0;
  for (int j0 = lo; j0 < hi; j0 += 32) {  // warp-uniform: j0 is the same in every lane
    const int j = j0 + lane;
    ties += __popc(__ballot_sync(0xffffffffu, j < hi && eligible(j) && key(j) == thr));
  }
  if (lane == 0) warp_ties[warp] = ties;
  __syncthreads();
  int rank = 0;
  for (int w = 0; w < warp; ++w) rank += warp_ties[w];
  for (int j0 = lo; j0 < hi; j0 += 32) {
    const int j = j0 + lane;
    bool gt = false, tie = false;
    if (j < hi && eligible(j)) {
      const uint32_t k = key(j);
      gt = k > thr;
      tie = k == thr;
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, tie);
    if (gt || (tie && rank + __popc(ballot & ((1u << lane) - 1)) < need)) flag(j);
    rank += __popc(ballot);
  }
}

// Sorts a[0, P) and b[0, P) ascending (P a power of two), bitonic. Thread t owns entries
// t + kThreads * e: a compare-exchange stride >= kThreads stays in one thread and one < 32 in
// one warp, so only the stages next to strides 32..kThreads/2 wait for the whole block.
__device__ void bitonic_sort_pair(uint32_t* a, uint32_t* b, int P) {
  for (int k = 2; k <= P; k <<= 1)
    for (int stride = k >> 1; stride > 0; stride >>= 1) {
      if (stride >= 16 && stride < kThreads) __syncthreads(); else __syncwarp();
      for (int i = threadIdx.x; i < P; i += kThreads) {
        const int l = i ^ stride;
        if (l < i) continue;
        const bool ascending = (i & k) == 0;
        const uint32_t ai = a[i], al = a[l], bi = b[i], bl = b[l];
        if ((ai > al) == ascending) { a[i] = al; a[l] = ai; }
        if ((bi > bl) == ascending) { b[i] = bl; b[l] = bi; }
      }
    }
  __syncthreads();
}

// #{j' < B : sorted key < key}: the first position of key in sorted[0, B).
__device__ __forceinline__ int lower_rank(const uint32_t* sorted, int B, uint32_t key) {
  int first = 0, last = B;
  while (first < last) {
    const int mid = (first + last) >> 1;
    if (sorted[mid] < key) first = mid + 1; else last = mid;
  }
  return first;
}

// Keys in a bitonic sort of n: the power of two >= n (at least 2).
__host__ __device__ inline int sort_capacity(int n) {
  int capacity = 2;
  while (capacity < n) capacity <<= 1;
  return capacity;
}

// The hybrid in place of score[] (SPIN's pooled V/D prediction): max of the rank shares of
// score and of given[0, width) (-inf past width) over blocks j < B, as reference.hybrid_scores.
__device__ void merge_by_rank(float* score, const float* given, int width, int B,
                              uint32_t* sorted_s, uint32_t* sorted_p) {
  auto given_at = [&](int j) { return j < width ? given[j] : -CUDART_INF_F; };
  auto key_of = [](float x) { return ordered_key(x != x ? -CUDART_INF_F : x); };  // NaN as -inf
  const int P = sort_capacity(B);
  __syncthreads();
  for (int i = threadIdx.x; i < P; i += kThreads) {  // padding sorts after every score
    sorted_s[i] = i < B ? key_of(score[i]) : 0xFFFFFFFFu;
    sorted_p[i] = i < B ? key_of(given_at(i)) : 0xFFFFFFFFu;
  }
  bitonic_sort_pair(sorted_s, sorted_p, P);
  const float denom = static_cast<float>(max(B - 1, 1));
  for (int j = threadIdx.x; j < B; j += kThreads) {
    const int rank = max(lower_rank(sorted_s, B, key_of(score[j])),
                         lower_rank(sorted_p, B, key_of(given_at(j))));
    score[j] = __fdiv_rn(static_cast<float>(rank), denom);
  }
}

// kVec > 0: max pooling on state of kType read kVec entries per load; 0: the paired path
// (any pooling, any state layout). One kernel per layout keeps each at 64 registers (kPer, the
// interior blocks in flight per lane group: kMaxPerStep, or kWidePerStep at one CTA an SM).
template <int kType, int kVec, int kPer>
__global__ void __launch_bounds__(kThreads, kPer > kMaxPerStep ? 1 : 4)
    select_kernel(SelectParams p) {
  extern __shared__ unsigned char smem[];
  float* score = reinterpret_cast<float*>(smem);
  uint8_t* row_flag = reinterpret_cast<uint8_t*>(score + p.max_blocks);
  uint8_t* union_flag = row_flag + p.max_blocks;
  // merge_history only: two sort buffers of pow2 >= max_blocks keys, after the flags
  uint32_t* sorted_s = reinterpret_cast<uint32_t*>(
      smem + static_cast<size_t>(p.max_blocks) * 4 +
      (static_cast<size_t>(p.max_blocks) * 2 + 3) / 4 * 4);
  uint32_t* sorted_p = sorted_s + sort_capacity(p.max_blocks);
  __shared__ float fscratch[kThreads / 32];
  __shared__ int hist[256];
  __shared__ int bcast[3];
  __shared__ int warp_counts[kThreads / 32];

  // an update launched beside this kernel (the previous layer's) may start now
  pdl_launch_dependents();
  const int layer = p.layer >= 0 ? p.layer : blockIdx.x, b = blockIdx.y;
  const StateView& s = p.state;
  int32_t* out = p.block_ids + (static_cast<int64_t>(b) * s.num_layers + layer) * p.m_cap;
  const int slot_id = p.state_slot[b];
  if (slot_id < 0 || slot_id >= s.num_slots) {  // no state: select nothing
    for (int c = threadIdx.x; c < p.m_cap; c += kThreads) out[c] = -1;
    if (threadIdx.x == 0) p.counts[static_cast<int64_t>(b) * s.num_layers + layer] = 0;
    return leave_after_previous(p.beside_previous);
  }
  auto clamp_n = [&](int r) { return min(max(p.n[b * p.rows + r], 0), p.max_context); };
  const int64_t stream = static_cast<int64_t>(p.state_slot[b]) * s.num_layers + layer;
  const int64_t base = stream * s.cap;
  const int64_t* last_seen = s.last_seen + stream * s.block_cap;
  const bool dense = s.decode_steps[stream] < p.warmup_steps;
  const int64_t step = p.step[b];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  int nb_all = 0;
  for (int r = 0; r < p.rows; ++r) {
    const int n = clamp_n(r);
    nb_all = max(nb_all, min((n + kBlockSize - 1) / kBlockSize, p.max_blocks));
  }
  for (int j = threadIdx.x; j < nb_all; j += kThreads) union_flag[j] = 0;
  const int nb0 = min((clamp_n(0) + kBlockSize - 1) / kBlockSize, p.max_blocks);

  for (int r = 0; r < p.rows; ++r) {
    const int n = clamp_n(r);
    const int q = p.q[b * p.rows + r];
    const int B = min((n + kBlockSize - 1) / kBlockSize, p.max_blocks);
    if (!p.mtp_union && r > 0) {  // row0 sharing: only the blocks row 0 cannot see
      __syncthreads();
      for (int j = nb0 + threadIdx.x; j < B; j += kThreads) union_flag[j] = 1;
      continue;
    }
    __syncthreads();
    if (dense) {
      for (int j = threadIdx.x; j < B; j += kThreads) union_flag[j] = 1;
      continue;
    }
    constexpr int kWarps = kThreads / 32, kPerStep = 4;
    const bool history = p.block_scores == nullptr || p.merge_history;
    if constexpr (kVec > 0) {
      if (history) score_blocks<kType, kVec, kPer>(s, base, B, n, q, score);
    }
    // 4 blocks per warp per step, all loads issued first: the pass is bound by load latency
    for (int j0 = warp; kVec == 0 && history && j0 < B; j0 += kPerStep * kWarps) {
      float v[kPerStep][2];
#pragma unroll
      for (int u = 0; u < kPerStep; ++u) block_values(s, base, j0 + u * kWarps, n, q, v[u]);
#pragma unroll
      for (int u = 0; u < kPerStep; ++u) {
        const int j = j0 + u * kWarps;
        if (j >= B) break;
        const float m = pool_block(v[u], p.pooling);
        if (lane == 0) score[j] = m;
      }
    }
    if (p.block_scores != nullptr) {  // given scores (e.g. the probe's) instead of V/D
      const float* given = p.block_scores + b * p.scores_stride_b + r * p.scores_stride_r;
      if (p.merge_history)
        merge_by_rank(score, given, p.scores_width, B, sorted_s, sorted_p);
      else
        for (int j = threadIdx.x; j < B; j += kThreads)
          score[j] = j < p.scores_width ? given[j] : -CUDART_INF_F;
    }
    const int n_forced = (p.keep_sink ? 1 : 0) + ((p.keep_newest && !(p.keep_sink && B == 1)) ? 1 : 0);
    const double keep = ceil((1.0 - p.rho) * static_cast<double>(B) - 1e-6);
    // the floor holds K visible slots whichever blocks it takes: one more block when the
    // newest is partly filled
    const int empty = max(B * kBlockSize - n, 0);
    const int min_blocks = (p.index_topk + empty + kBlockSize - 1) / kBlockSize;
    long long m = min(static_cast<long long>(B), max(static_cast<long long>(min_blocks),
                                                     static_cast<long long>(keep)));
    m = max(m, static_cast<long long>(min(n_forced, B)));
    long long e = 0;
    if (p.gamma > 0.0) {
      e = static_cast<long long>(floor(p.gamma * static_cast<double>(m) + 1e-6));
      e = min(e, m - n_forced);
      e = max(e, 0ll);
    }
    const long long top = m - e - n_forced;
    auto forced = [&](int j) { return (p.keep_sink && j == 0) || (p.keep_newest && j == B - 1); };
    __syncthreads();
    for (int j = threadIdx.x; j < B; j += kThreads) row_flag[j] = forced(j);
    __syncthreads();
    uint32_t thr;
    int need;
    bool whole;
    auto rest = [&](int j) { return !forced(j); };
    auto take_top = [&](auto key_of_score, auto key_bits) {
      auto score_key = [&](int j) { return key_of_score(score[j]); };
      radix_threshold<kThreads, decltype(key_bits)::value>(B, static_cast<int>(top), score_key,
                                                            rest, hist, bcast, thr, need, &whole);
      flag_taken(B, thr, need, whole, score_key, rest, [&](int j) { row_flag[j] = 1; },
                 warp_counts);
    };
    using Bits16 = std::integral_constant<int, 16>;
    using Bits32 = std::integral_constant<int, 32>;
    auto key32 = [](float x) { return ordered_key(x); };
    if (top > 0) {
      // pooled fp16 state is fp16 values: 16-bit keys, two radix passes
      if constexpr (kType != kStateF32 && kVec > 0) {
        if (p.block_scores == nullptr)
          take_top([](float x) { return ordered_key16(x); }, Bits16{});
        else
          take_top(key32, Bits32{});
      } else {
        take_top(key32, Bits32{});
      }
    }
    __syncthreads();
    if (e > 0) {
      auto candidate = [&](int j) { return row_flag[j] == 0; };
      float lo = CUDART_INF_F, hi = -CUDART_INF_F;
      if (p.policy == kExploreStaleness) {
        for (int j = threadIdx.x; j < B; j += kThreads)
          if (candidate(j)) { lo = fminf(lo, score[j]); hi = fmaxf(hi, score[j]); }
        lo = block_min_max<kThreads>(lo, false, fscratch);
        hi = block_min_max<kThreads>(hi, true, fscratch);
      }
      const float span = __fsub_rn(hi, lo);
      const uint32_t stream_hash = p.policy == kExploreRandom
          ? counter_hash_stream(p.seed, p.request_id[b], layer, step) : 0u;
      auto priority = [&](int j) -> uint32_t {
        if (p.policy == kExploreRandom) return counter_hash_block(stream_hash, j);
        long long age = step - (j < s.block_cap ? last_seen[j] : 0);
        age = max(age, 0ll);  // the reference clamps too
        if (p.policy == kExploreAge) return static_cast<uint32_t>(min(age, 0xFFFFFFFFll));
        const float norm = span > 0.0f ? __fdiv_rn(__fsub_rn(score[j], lo), span) : 0.0f;
        return ordered_key(__fmul_rn(static_cast<float>(age), __fadd_rn(1.0f, norm)));
      };
      // each priority once, over the scores: they are not read again for this row
      uint32_t* prio = reinterpret_cast<uint32_t*>(score);
      for (int j = threadIdx.x; j < B; j += kThreads)
        if (candidate(j)) {
          const uint32_t key = priority(j);
          prio[j] = key;
        }
      __syncthreads();
      auto prio_key = [&](int j) { return prio[j]; };
      radix_threshold<kThreads>(B, static_cast<int>(e), prio_key, candidate, hist, bcast, thr, need,
                                &whole);
      flag_taken(B, thr, need, whole, prio_key, candidate, [&](int j) { row_flag[j] = 2; },
                 warp_counts);
    }
    __syncthreads();
    for (int j = threadIdx.x; j < B; j += kThreads)
      if (row_flag[j]) union_flag[j] = 1;
  }
  __syncthreads();

  // Compact the union into ascending ids: a warp counts one contiguous range, one barrier.
  __shared__ int warp_total[kThreads / 32];
  const int span = (nb_all + kThreads - 1) / kThreads * 32;
  const int lo = warp * span, hi = min(lo + span, nb_all);
  int mine = 0;
  for (int j0 = lo; j0 < hi; j0 += 32)
    mine += __popc(__ballot_sync(0xffffffffu, j0 + lane < hi && union_flag[j0 + lane]));
  if (lane == 0) warp_total[warp] = mine;
  __syncthreads();
  int rank = 0, written = 0;
  for (int w = 0; w < kThreads / 32; ++w) {
    if (w < warp) rank += warp_total[w];
    written += warp_total[w];
  }
  for (int j0 = lo; j0 < hi; j0 += 32) {
    const int j = j0 + lane;
    const bool f = j < hi && union_flag[j];
    const unsigned ballot = __ballot_sync(0xffffffffu, f);
    const int at = rank + __popc(ballot & ((1u << lane) - 1));
    if (f && at < p.m_cap) out[at] = j;
    rank += __popc(ballot);
  }
  for (int c = written + threadIdx.x; c < p.m_cap; c += kThreads) out[c] = -1;
  if (threadIdx.x == 0) p.counts[static_cast<int64_t>(b) * s.num_layers + layer] = written;
  leave_after_previous(p.beside_previous);
}

}  // namespace

template <int kType, int kVec, int kPer = kMaxPerStep>
cudaError_t launch_select_as(const SelectParams& p, size_t smem, cudaStream_t stream) {
  cudaError_t err = allow_dynamic_smem(select_kernel<kType, kVec, kPer>, smem);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.layer >= 0 ? 1 : p.state.num_layers, p.batch);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  allow_beside_previous(cfg, attr, p.beside_previous);
  return cudaLaunchKernelEx(&cfg, select_kernel<kType, kVec, kPer>, p);
}

cudaError_t launch_select(const SelectParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.state.num_layers == 0) return cudaSuccess;
  size_t smem = static_cast<size_t>(p.max_blocks) * (sizeof(float) + 2);
  const StateView& s = p.state;
  if (p.block_scores != nullptr && !p.merge_history)
    return launch_select_as<kStateF32, 0>(p, smem, stream);  // no V/D read
  if (p.block_scores != nullptr) {  // merge_history: two sort buffers of a power of two
    if (p.max_blocks > kMaxHybridBlocks) return cudaErrorInvalidValue;
    smem = (smem + 3) / 4 * 4 + static_cast<size_t>(sort_capacity(p.max_blocks)) * 2 * 4;
  }
  // max pooling: 16-byte loads where the rows allow them (fp16, fp8), else 8-byte (16 for fp32)
  // Few CTAs (one layer's launch of at most 66 requests on an H200) have the SMs to themselves
  // and the SMs a top-K beside them leaves (one a row): the wide kernel then. H200, fp16, one
  // layer alone, us: 8 x 32K 14.0 -> 13.4, 8 x 128K 35.1 -> 29.4; beside the top-K (bench_update_
  // overlap.py "chain", select + update per layer) 32 x 128K 21.3 -> 8.2, 8 x 128K 31.2 -> 19.9;
  // at 96 x 32K it was slower there, 13.1 -> 21.3 (3 rounds on the 36 SMs the top-K leaves).
  const int ctas = (p.layer >= 0 ? 1 : s.num_layers) * p.batch;
  const bool wide = 2 * ctas <= current_device_attribute(cudaDevAttrMultiProcessorCount);
  if (p.pooling == kPoolMax) {
    switch (s.type) {
      case kStateF32:
        if (state_vectorizable(s, 4)) return launch_select_as<kStateF32, 4>(p, smem, stream);
        break;
      case kStateF16:
        if (state_vectorizable(s, 8))
          return wide ? launch_select_as<kStateF16, 8, kWidePerStep>(p, smem, stream)
                           : launch_select_as<kStateF16, 8>(p, smem, stream);
        if (state_vectorizable(s, 4)) return launch_select_as<kStateF16, 4>(p, smem, stream);
        break;
      case kStateE4M3:
        if (state_vectorizable(s, 16))
          return wide ? launch_select_as<kStateE4M3, 16, kWidePerStep>(p, smem, stream)
                           : launch_select_as<kStateE4M3, 16>(p, smem, stream);
        if (state_vectorizable(s, 8)) return launch_select_as<kStateE4M3, 8>(p, smem, stream);
        break;
      default: return cudaErrorInvalidValue;
    }
  }
  if (s.type < kStateF32 || s.type > kStateE4M3) return cudaErrorInvalidValue;
  // the paired path (kVec 0) reads V/D by s.type; its template type is not used
  return launch_select_as<kStateF32, 0>(p, smem, stream);
}

}  // namespace spin
