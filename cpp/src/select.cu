// spin::select: per (request, layer) stream, the blocks each MTP row attends to. Block scores
// come from the V/D history (select_scores.cuh; MTP rows at consecutive queries from one read of
// the state, on fp16 and fp8 state) or are given (one layer; merge_history: the max of both rank
// shares), then budget, forced sink/newest blocks, exploration and the union over the rows.
// One CTA of kThreads per stream (kGivenThreads with given scores alone), grid (layers,
// requests) or (1, requests) for one layer; the top-m blocks come from 8-bit radix passes over
// the score keys (16-bit keys when the scores are pooled fp16 or fp8 state, 32-bit otherwise),
// ties to the lower block id, and each warp flags and compacts one contiguous range of blocks.
#include <cfloat>
#include <type_traits>

#include "select_scores.cuh"

namespace spin {
namespace {

// Flags what radix_threshold selected: every eligible entry with a key >= thr when `whole`,
// else those above thr and the first `need` ties in index order. A warp walks one contiguous
// range, so the tie ranks cost one block barrier (not two per kThreads entries).
// `warp_ties` holds kCta / 32 ints; the caller syncs before its next use.
template <int kCta, typename Key, typename Eligible, typename Flag>
__device__ void flag_taken(int count, uint32_t thr, int need, bool whole, Key key,
                           Eligible eligible, Flag flag, int* warp_ties) {
  if (whole) {
    for (int j = threadIdx.x; j < count; j += kCta)
      if (eligible(j) && key(j) >= thr) flag(j);
    return;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int span = (count + kCta - 1) / kCta * 32;
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
// kGiven: the scores are given and no V/D is read (the query-aware predictors' one-layer
// launch); its CTAs of kGivenThreads have an SM each, so the radix passes over the row's blocks
// run on four times the warps.
// kRows: MTP rows at consecutive queries are scored together (score_rows_together), into
// score buffers of max_blocks floats for rows 1.. after the others in shared memory; an
// instance of its own, so that the kernel of one row keeps its registers.
template <int kType, int kVec, int kPer, bool kGiven = false, bool kRows = false>
__global__ void __launch_bounds__(kGiven ? kGivenThreads : kThreads,
                                  kGiven || kPer > kMaxPerStep ? 1 : 4)
    select_kernel(SelectParams p) {
  constexpr int kCta = kGiven ? kGivenThreads : kThreads;
  extern __shared__ unsigned char smem[];
  float* score0 = reinterpret_cast<float*>(smem);
  uint8_t* row_flag = reinterpret_cast<uint8_t*>(score0 + p.max_blocks);
  uint8_t* union_flag = row_flag + p.max_blocks;
  // merge_history only: two sort buffers of pow2 >= max_blocks keys, after the flags
  uint32_t* sorted_s = reinterpret_cast<uint32_t*>(
      smem + static_cast<size_t>(p.max_blocks) * 4 +
      (static_cast<size_t>(p.max_blocks) * 2 + 3) / 4 * 4);
  uint32_t* sorted_p = sorted_s + sort_capacity(p.max_blocks);
  // kRows only: rows 1..'s scores, after the sort buffers where they are
  float* more_scores = reinterpret_cast<float*>(
      p.merge_history ? sorted_p + sort_capacity(p.max_blocks) : sorted_s);
  __shared__ float fscratch[kCta / 32];
  __shared__ int hist[256];
  __shared__ int bcast[3];
  __shared__ int warp_counts[kCta / 32];

  // an update launched beside this kernel (the previous layer's) may start now
  pdl_launch_dependents();
  const int layer = p.layer >= 0 ? p.layer : blockIdx.x, b = blockIdx.y;
  const StateView& s = p.state;
  int32_t* out = p.block_ids + (static_cast<int64_t>(b) * s.num_layers + layer) * p.m_cap;
  const int slot_id = p.state_slot[b];
  if (slot_id < 0 || slot_id >= s.num_slots) {  // no state: select nothing
    for (int c = threadIdx.x; c < p.m_cap; c += kCta) out[c] = -1;
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
  for (int j = threadIdx.x; j < nb_all; j += kCta) union_flag[j] = 0;
  const int nb0 = min((clamp_n(0) + kBlockSize - 1) / kBlockSize, p.max_blocks);
  const bool history = !kGiven && (p.block_scores == nullptr || p.merge_history);

  // MTP rows at consecutive queries: every row's V/D scores from one read of the state
  bool together = false;
  if constexpr (kRows) {
    static_assert(!kGiven && kVec > 0 && kType != kStateF32, "the lean path's state");
    together = history && !dense && p.mtp_union && p.rows > 1;
    for (int r = 1; together && r < p.rows; ++r)
      together = p.q[b * p.rows + r] == p.q[b * p.rows] + r;
    if (together) {
      __shared__ int rows_n[kMaxNextN], rows_blocks[kMaxNextN];
      if (threadIdx.x < p.rows) {
        rows_n[threadIdx.x] = clamp_n(threadIdx.x);
        rows_blocks[threadIdx.x] =
            min((rows_n[threadIdx.x] + kBlockSize - 1) / kBlockSize, p.max_blocks);
      }
      __syncthreads();
      // half the blocks in flight: each carries every row's max (at kPer the fp16 kernel
      // spilled 176 bytes a thread, at half 40)
      score_rows_together<kType, kVec, kPer / 2>(s, base, p.rows, rows_n, rows_blocks,
                                                 p.q[b * p.rows], score0, more_scores,
                                                 p.max_blocks);
    }
  }

  for (int r = 0; r < p.rows; ++r) {
    const int n = clamp_n(r);
    const int q = p.q[b * p.rows + r];
    const int B = min((n + kBlockSize - 1) / kBlockSize, p.max_blocks);
    if (!p.mtp_union && r > 0) {  // row0 sharing: only the blocks row 0 cannot see
      __syncthreads();
      for (int j = nb0 + threadIdx.x; j < B; j += kCta) union_flag[j] = 1;
      continue;
    }
    __syncthreads();
    if (dense) {
      for (int j = threadIdx.x; j < B; j += kCta) union_flag[j] = 1;
      continue;
    }
    // this row's scores (scored already where the rows go together)
    float* score = together && r > 0 ? more_scores + (r - 1) * p.max_blocks : score0;
    if constexpr (!kGiven) {  // the V/D history's scores
      constexpr int kWarps = kCta / 32, kPerStep = 4;
      if constexpr (kVec > 0) {
        if (history && !together) score_blocks<kType, kVec, kPer>(s, base, B, n, q, score);
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
    }
    if (p.block_scores != nullptr) {  // given scores (e.g. the probe's) instead of V/D
      const float* given = p.block_scores + b * p.scores_stride_b + r * p.scores_stride_r;
      if (history) {
        if constexpr (!kGiven) merge_by_rank(score, given, p.scores_width, B, sorted_s, sorted_p);
      } else
        for (int j = threadIdx.x; j < B; j += kCta) {
          const float x = j < p.scores_width ? given[j] : -CUDART_INF_F;
          score[j] = x == x ? x : -CUDART_INF_F;  // NaN ranks as -inf (the reference's rule)
        }
    }
    const int n_forced = (p.keep_sink ? 1 : 0) + ((p.keep_newest && !(p.keep_sink && B == 1)) ? 1 : 0);
    const double keep = ceil((1.0 - p.rho) * static_cast<double>(B) - 1e-6);
    // the floor holds K visible slots whichever blocks it takes: one more block when the
    // newest is partly filled
    const long long empty = max(static_cast<long long>(B) * kBlockSize - n, 0ll);
    const long long min_blocks = (p.index_topk + empty + kBlockSize - 1) / kBlockSize;
    long long m = min(static_cast<long long>(B), max(min_blocks, static_cast<long long>(keep)));
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
    for (int j = threadIdx.x; j < B; j += kCta) row_flag[j] = forced(j);
    __syncthreads();
    uint32_t thr;
    int need;
    bool whole;
    auto rest = [&](int j) { return !forced(j); };
    auto take_top = [&](auto key_of_score, auto key_bits) {
      auto score_key = [&](int j) { return key_of_score(score[j]); };
      radix_threshold<kCta, decltype(key_bits)::value>(B, static_cast<int>(top), score_key,
                                                            rest, hist, bcast, thr, need, &whole);
      flag_taken<kCta>(B, thr, need, whole, score_key, rest, [&](int j) { row_flag[j] = 1; },
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
      if (p.policy == kExploreStaleness) {  // over the candidates' finite scores
        for (int j = threadIdx.x; j < B; j += kCta)
          if (candidate(j) && isfinite(score[j])) {
            lo = fminf(lo, score[j]);
            hi = fmaxf(hi, score[j]);
          }
        lo = block_min_max<kCta>(lo, false, fscratch);
        hi = block_min_max<kCta>(hi, true, fscratch);
      }
      const float span = __fsub_rn(hi, lo);
      const uint32_t stream_hash = p.policy == kExploreRandom
          ? counter_hash_stream(p.seed, p.request_id[b], layer, step) : 0u;
      auto priority = [&](int j) -> uint32_t {
        if (p.policy == kExploreRandom) return counter_hash_block(stream_hash, j);
        long long age = step - (j < s.block_cap ? last_seen[j] : 0);
        age = max(age, 0ll);  // the reference clamps too
        if (p.policy == kExploreAge) return static_cast<uint32_t>(min(age, 0xFFFFFFFFll));
        const float norm =  // a non-finite score: the age alone
            span > 0.0f && isfinite(score[j]) ? __fdiv_rn(__fsub_rn(score[j], lo), span) : 0.0f;
        return ordered_key(__fmul_rn(static_cast<float>(age), __fadd_rn(1.0f, norm)));
      };
      // each priority once, over the scores: they are not read again for this row
      uint32_t* prio = reinterpret_cast<uint32_t*>(score);
      for (int j = threadIdx.x; j < B; j += kCta)
        if (candidate(j)) {
          const uint32_t key = priority(j);
          prio[j] = key;
        }
      __syncthreads();
      auto prio_key = [&](int j) { return prio[j]; };
      radix_threshold<kCta>(B, static_cast<int>(e), prio_key, candidate, hist, bcast, thr, need,
                                &whole);
      flag_taken<kCta>(B, thr, need, whole, prio_key, candidate, [&](int j) { row_flag[j] = 2; },
                 warp_counts);
    }
    __syncthreads();
    for (int j = threadIdx.x; j < B; j += kCta)
      if (row_flag[j]) union_flag[j] = 1;
  }
  __syncthreads();

  // Compact the union into ascending ids: a warp counts one contiguous range, one barrier.
  __shared__ int warp_total[kCta / 32];
  const int span = (nb_all + kCta - 1) / kCta * 32;
  const int lo = warp * span, hi = min(lo + span, nb_all);
  int mine = 0;
  for (int j0 = lo; j0 < hi; j0 += 32)
    mine += __popc(__ballot_sync(0xffffffffu, j0 + lane < hi && union_flag[j0 + lane]));
  if (lane == 0) warp_total[warp] = mine;
  __syncthreads();
  int rank = 0, written = 0;
  for (int w = 0; w < kCta / 32; ++w) {
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
  for (int c = written + threadIdx.x; c < p.m_cap; c += kCta) out[c] = -1;
  if (threadIdx.x == 0) p.counts[static_cast<int64_t>(b) * s.num_layers + layer] = written;
  leave_after_previous(p.beside_previous);
}

}  // namespace

// Shared memory up to which MTP rows are scored together: the extra rows' score buffers keep
// four CTAs an SM on the kernel of many CTAs (228 KB an SM, less each CTA's static 1.2 KB and
// its 1 KB reserved); past it rows are scored one at a time.
constexpr size_t kRowsTogetherSmem = 53 * 1024;
// fp8 rows go together from tables of this many blocks: below, a request's state is a few KB,
// the per-row masks cost more than the reads they save (H100, bench_select_rows.py: next_n 2 at
// 32K slots 0.90-0.95x, at 128K 1.17-1.20x)
constexpr int kRowsTogetherMinBlocksFp8 = 1024;

template <int kType, int kVec, int kPer = kMaxPerStep, bool kGiven = false, bool kRows = false>
cudaError_t launch_select_as(const SelectParams& p, size_t smem, cudaStream_t stream) {
  if constexpr (!kGiven && kVec > 0 && kType != kStateF32 && !kRows) {
    // the buffers start 4-byte aligned after the others (select_kernel's more_scores)
    const size_t at = (smem + 3) / 4 * 4;
    const size_t extra = static_cast<size_t>(p.rows - 1) * p.max_blocks * sizeof(float);
    if (p.rows > 1 && p.mtp_union && at + extra <= kRowsTogetherSmem &&
        (kType != kStateE4M3 || p.max_blocks >= kRowsTogetherMinBlocksFp8))
      return launch_select_as<kType, kVec, kPer, false, true>(p, at + extra, stream);
  }
  auto* kernel = select_kernel<kType, kVec, kPer, kGiven, kRows>;
  cudaError_t err = allow_dynamic_smem(kernel, smem);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(p.layer >= 0 ? 1 : p.state.num_layers, p.batch);
  cfg.blockDim = dim3(kGiven ? kGivenThreads : kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  allow_beside_previous(cfg, attr, p.beside_previous);
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

cudaError_t launch_select(const SelectParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.state.num_layers == 0) return cudaSuccess;
  if (p.rows < 1 || p.rows > kMaxNextN) return cudaErrorInvalidValue;  // rows_n's size
  size_t smem = static_cast<size_t>(p.max_blocks) * (sizeof(float) + 2);
  const StateView& s = p.state;
  if (p.block_scores != nullptr && !p.merge_history)
    return launch_select_as<kStateF32, 0, kMaxPerStep, true>(p, smem, stream);  // no V/D read
  if (p.block_scores != nullptr) {  // merge_history: two sort buffers of a power of two
    if (p.max_blocks > kMaxHybridBlocks) return cudaErrorInvalidValue;
    smem = (smem + 3) / 4 * 4 + static_cast<size_t>(sort_capacity(p.max_blocks)) * 2 * 4;
  }
  // max pooling: 16-byte loads where the rows allow them (fp16, fp8), else 8-byte (16 for fp32)
  // Few CTAs (at most half as many as SMs: one layer's launch for few requests) have the SMs to
  // themselves, or those a top-K beside them leaves (one a row): the wide kernel then. With more
  // CTAs it takes several rounds and is slower (benchmarks/bench_select_one_layer.py,
  // bench_update_overlap.py).
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
