// How spin::select scores blocks from the V/D history (select.cu holds the selection): a block's
// score is its slots' max(V[i], D[q - i]) pooled (max, mean or top-4 mean). One CTA of kThreads
// per (request, layer) stream walks the row's blocks. Max pooling on vector-readable state
// (score_blocks): a group of 64 / kVec lanes per block, 16-byte loads, several blocks' loads in
// flight per group; the interior blocks (all slots visible, whole D window inside the state) of
// fp16/fp8 state on a lean path with a packed fp16 max. Other pooling or layouts: one warp per
// block, two slots a lane (block_values, pool_block). Included by select.cu only.
#pragma once
#include "common.cuh"

namespace spin {
namespace {

constexpr int kThreads = 256;
constexpr int kGivenThreads = 1024;  // CTA of the given-scores launch (select.cu)
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

// The entries of one 32-bit word of fp16 or fp8 state as a packed fp16 pair whose max is
// theirs (exact: fp8 converts to fp16 exactly).
template <int kType>
__device__ __forceinline__ __half2 word_max2(uint32_t w) {
  if constexpr (kType == kStateF16) return *reinterpret_cast<const __half2*>(&w);
  else return __hmax2(e4m3x2_to_half2(w), e4m3x2_to_half2(w >> 16));
}

// The lean path's walk over the interior blocks [j_lo, j_end), kPer blocks a lane group in
// flight: lane h of block j's group loads its V vector kGroup j + h and D vector
// dvec0 - kGroup j + h, and where `tail`, the D vector kGroup further (its tail; zero
// elsewhere); then body(j, v, d, t) runs in every lane for each block of the step (j >= j_end
// past the end: the body's shuffles stay warp-uniform).
template <int kType, int kVec, int kPer, typename Body>
__device__ __forceinline__ void for_interior_blocks(const void* V_row, const void* D_row,
                                                    int j_lo, int j_end, int dvec0, bool tail,
                                                    Body body) {
  using Vec = StateVec<kType, kVec>;
  constexpr int kGroup = kBlockSize / kVec, kPerWarp = 32 / kGroup, kWarps = kThreads / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, group = lane / kGroup;
  const int h = lane % kGroup;
#pragma unroll 1
  for (int jw = j_lo + kPerWarp * warp; jw < j_end; jw += kPerWarp * kPer * kWarps) {
    Vec v[kPer], d[kPer], t[kPer];
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int j = jw + kPerWarp * u * kWarps + group;
#pragma unroll
      for (int k = 0; k < Vec::kWords; ++k) t[u].w[k] = 0u;
      if (j < j_end) {
        v[u].load_vec(V_row, kGroup * j + h);
        d[u].load_vec(D_row, dvec0 - kGroup * j + h);
        if (tail) t[u].load_vec(D_row, dvec0 - kGroup * j + kGroup + h);
      }
    }
#pragma unroll
    for (int u = 0; u < kPer; ++u) body(jw + kPerWarp * u * kWarps + group, v[u], d[u], t[u]);
  }
}

// Blocks [lo, end) of a row are interior (see MaxBlockWindow): 64j + 64 <= min(n, cap),
// 64j + 63 <= q and q - 64j <= cap - 1 (end < lo: none).
struct InteriorRange {
  int lo, end;
  __device__ InteriorRange(const StateView& s, int B, int n, int q) {
    const int64_t visible = min(static_cast<int64_t>(n), s.cap);
    end = static_cast<int>(min(min(visible / kBlockSize,
                                   (static_cast<int64_t>(q) + 1) / kBlockSize) - 1,
                               static_cast<int64_t>(B) - 1)) + 1;
    const int64_t below = static_cast<int64_t>(q) - s.cap + 1;
    lo = below <= 0 ? 0 : static_cast<int>(min((below + kBlockSize - 1) / kBlockSize,
                                               static_cast<int64_t>(B)));
  }
};

// A stream's V or D row of state of kType from `base`.
template <int kType>
__device__ __forceinline__ const void* state_row(const void* state, int64_t base) {
  return static_cast<const char*>(state) + base * state_bytes(kType);
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
  constexpr int kGroup = kBlockSize / kVec;
  using Vec = StateVec<kType, kVec>;
  constexpr int kWords = Vec::kWords;
  constexpr int kPerWord = kVec / kWords;   // entries per 32-bit word: 2 (fp16) or 4 (fp8)
  constexpr int kBits = 32 / kPerWord;
  constexpr uint32_t kEntryMask = (1u << kBits) - 1u;
  const bool lead = threadIdx.x % kGroup == 0;
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
  for_interior_blocks<kType, kVec, kPer>(
      V_row, D_row, j_lo, j_end, dvec0, tail, [&](int j, const Vec& v, const Vec& d,
                                                  const Vec& t) {
        float m = -CUDART_INF_F;
        if (j < j_end) {
          __half2 acc = __float2half2_rn(-CUDART_INF_F);
#pragma unroll
          for (int k = 0; k < kWords; ++k) {
            const uint32_t dw = (t.w[k] & from_tail[k]) | (d.w[k] & ~from_tail[k]);
            acc = __hmax2(acc, __hmax2(word_max2<kType>(v.w[k]), word_max2<kType>(dw)));
          }
          m = fmaxf(__low2float(acc), __high2float(acc));
        }
        for (int o = kGroup / 2; o > 0; o >>= 1)
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lead && j < j_end) score[j] = m;
      });
}

// Blocks 0..B-1 of a row: with fp16 or fp8 state the interior ones on the lean path, the rest
// (the newest block, and blocks whose slots or D window reach past the state) on the general one.
// 4 blocks a lane group in flight, or 3 CTAs an SM, were slower than kMaxPerStep 2 at 4 CTAs an
// SM (benchmarks/bench_kernel_times.py).
template <int kType, int kVec, int kPer>
__device__ void score_blocks(const StateView& s, int64_t base, int B, int n, int q,
                             float* score) {
  if constexpr (kType == kStateF32) {  // no lean path: it would spill more registers
    score_blocks_max<kType, kVec>(s, base, B, n, q, score);
  } else {
    const InteriorRange interior(s, B, n, q);
    const int j_lo = interior.lo, j_end = max(interior.end, interior.lo);
    score_interior_blocks<kType, kVec, kPer>(state_row<kType>(s.V, base),
                                             state_row<kType>(s.D, base), j_lo, j_end, q, score);
    // the few other blocks one at a time (fewer registers beside the lean path's)
    score_blocks_max<kType, kVec, 1, false>(s, base, B, n, q, score, j_lo, j_end);
  }
}

// Max-pooled scores of the MTP rows r < R of one request whose queries are q0 + r, on fp16 or
// fp8 state, from one read of V and D: row r's scores into score(r)[0, B_r). A block interior to
// every row (see MaxBlockWindow) has the same 64 V entries in each, and row r's D window
// [q0 + r - 64j - 63, q0 + r - 64j] is row 0's moved up by r. So the lean path's loads, the
// V vector and the aligned D vectors of lane h, serve every row: with skew = (q0 - 63) % kVec,
// row r leaves out the first c = clamp(skew + r - kVec h, 0, kVec) entries of lane h's D vector
// and takes the first c of the vector kGroup further (its tail), which lane h loads where any
// row needs it. With R = 1 this is score_interior_blocks' row. The other blocks of each row go
// one at a time on the general path. Row 0's scores go to score0, row r's to
// more_scores + (r - 1) * stride.
template <int kType, int kVec, int kPer>
__device__ void score_rows_together(const StateView& s, int64_t base, int R,
                                    const int* n, const int* B, int q0, float* score0,
                                    float* more_scores, int stride) {
  auto score = [&](int r) { return r == 0 ? score0 : more_scores + (r - 1) * stride; };
  constexpr int kGroup = kBlockSize / kVec;
  using Vec = StateVec<kType, kVec>;
  constexpr int kWords = Vec::kWords;
  constexpr int kPerWord = kVec / kWords;
  constexpr int kBits = 32 / kPerWord;
  int j_lo = 0, j_end = B[0];  // blocks interior to every row
  for (int r = 0; r < R; ++r) {
    const InteriorRange interior(s, B[r], n[r], q0 + r);
    j_lo = max(j_lo, interior.lo);
    j_end = min(j_end, interior.end);
  }
  j_end = max(j_end, j_lo);
  const int h = threadIdx.x % kGroup;
  const int dvec0 = (q0 - (kBlockSize - 1)) / kVec, skew = (q0 - (kBlockSize - 1)) & (kVec - 1);
  // entries of lane h's D vector that row r takes from the tail instead
  auto from_tail_count = [&](int r) { return min(max(skew + r - kVec * h, 0), kVec); };
  const bool tail = from_tail_count(R - 1) > 0;
  for_interior_blocks<kType, kVec, kPer>(
      state_row<kType>(s.V, base), state_row<kType>(s.D, base), j_lo, j_end, dvec0, tail,
      [&](int j, const Vec& v, const Vec& d, const Vec& t) {
        __half2 vmax = __float2half2_rn(-CUDART_INF_F);
#pragma unroll
        for (int k = 0; k < kWords; ++k) vmax = __hmax2(vmax, word_max2<kType>(v.w[k]));
        auto row_max = [&](int r) {  // this lane's max of row r (-inf past the rows)
          const int c = from_tail_count(r);
          __half2 acc = r < R ? vmax : __float2half2_rn(-CUDART_INF_F);
#pragma unroll
          for (int k = 0; k < kWords; ++k) {
            const int taken = min(max(c - kPerWord * k, 0), kPerWord);
            const uint32_t mask =
                taken == kPerWord ? 0xFFFFFFFFu : (1u << (kBits * taken)) - 1u;
            if (r < R) acc = __hmax2(acc, word_max2<kType>((t.w[k] & mask) | (d.w[k] & ~mask)));
          }
          return __hmax(__low2half(acc), __high2half(acc));
        };
        // two rows a shuffle: the maxima are fp16 values, so a packed pair holds them exactly
#pragma unroll 1
        for (int r = 0; r < R; r += 2) {  // warp-uniform: the shuffles run in every lane
          __half2 m = j < j_end ? __halves2half2(row_max(r), row_max(r + 1))
                                : __float2half2_rn(-CUDART_INF_F);
          for (int o = kGroup / 2; o > 0; o >>= 1)
            m = __hmax2(m, __shfl_xor_sync(0xffffffffu, m, o));
          if (h == 0 && j < j_end) {
            score(r)[j] = __low2float(m);
            if (r + 1 < R) score(r + 1)[j] = __high2float(m);
          }
        }
      });
  for (int r = 0; r < R; ++r)
    score_blocks_max<kType, kVec, 1, false>(s, base, B[r], n[r], q0 + r, score(r), j_lo, j_end);
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

}  // namespace
}  // namespace spin
