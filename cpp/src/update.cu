// spin::update: deferred EMA update of V (per slot) and D (per relative offset) from the
// compact logits of one layer, or of several (one per grid z); MTP rows 0..a replayed in order
// (or row 0 only). Non-finite scores are not observed.
// Grid (slices, requests, layers): a request's work is dealt out in chunks over its `slices`
// CTAs of kThreads. One row: each scored slot owns its V and D entries, so one pass over the
// compact positions updates both (a warp takes 32 K consecutive positions, one K-entry state
// vector a lane, or 128 positions one at a time). Several rows: V is walked per scored slot and
// D per offset, so every entry has one owner thread and the row order holds without atomics.
// Without EMAs (ema false: a predictor that reads no history) mark_scored_kernel, one CTA a
// stream, marks the scored blocks' last step and counts the step.
#include "common.cuh"

namespace spin {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxSlices = 64;  // CTAs a request at most (launch_update_as)
// a request's positions stay in int32 one pass (of up to 8 a thread) past m_cap * 64
static_assert(2 * kMaxSlices * kThreads * 8 <= kIndexSlack, "kMaxMCap leaves a pass's slack");

// One-row update on 16-byte vectors (K entries) for interior blocks: all 64 slots below n and
// the state's capacity, the block's D window [q - 64j - 63, q - 64j] inside [0, cap). A warp
// takes 32 K consecutive compact positions; lane h of a block the slots i = 64j + K h .. + K - 1
// (one V vector, K logits). D goes by aligned vectors too: lane h owns the vector A that holds
// offset q - i - K + 1. With skew S = (q + 1) % K, A's first S entries are the next lane's first
// S slots' (their logits come by shuffle). At a block's edges A reaches into the neighbouring
// block's window, so the last lane stores only A's entries S..K-1 and the first lane the S
// entries of the vector above its own, one at a time: two blocks never store the same vector.
// Where the next lane holds block j + 1 (adjacent blocks kept, next to each other in the warp),
// its first S logits are the ones A needs: the last lane stores A whole and the next block's
// first lane leaves it (benchmarks/bench_update_skew.py times every skew).
// Same arithmetic and rounding as the scalar path, so the results are bit for bit the same on
// finite state (all the ops write); an entry whose logit is not finite is stored back unchanged
// within a vector, so a non-finite entry put there from outside would be saturated (NaN to
// the most negative value) where the scalar path leaves it.
template <int kType>
struct RowVectors {
  // entries per vector: 16 bytes of fp32 or fp16, 8 of fp8
  static constexpr int K = kType == kStateF32 ? 4 : 8;
  static constexpr int kGroup = kBlockSize / K;  // lanes per block
  using Vec = StateVec<kType, K>;

  // old unless z is observed (finite): then one EMA step
  __device__ static float step(float a, float one_minus_a, float old, float z) {
    return isfinite(z) ? ema(a, one_minus_a, old, z) : old;
  }

  // The vectors of one lane once its block is known to be interior; S: the D skew.
  template <int S>
  __device__ static void apply(void* V_row, void* D_row, int jb, int q, const float (&z)[K],
                               float a, float one_minus_a) {
    const int h = (threadIdx.x & 31) % kGroup;
    const int i = jb * kBlockSize + K * h;
    const int d_at = (q - i - K + 1 - S) / K;  // A's vector index (q - i - K + 1 - S >= 0)
    // the lane below holds block jb + 1 / the lane above block jb - 1 (a lane's own id at the
    // warp's ends, so never)
    const bool joined_below = S != 0 && __shfl_down_sync(0xffffffffu, jb, 1) == jb + 1;
    const bool joined_above = S != 0 && __shfl_up_sync(0xffffffffu, jb, 1) == jb - 1;
    Vec v_raw, d_raw, up_raw;
    v_raw.load_vec(V_row, i / K);
    d_raw.load_vec(D_row, d_at);
    if (S != 0 && h == 0 && !joined_above) up_raw.load_vec(D_row, d_at + 1);
    float zn[S > 0 ? S : 1];  // the next lane's first S logits
#pragma unroll
    for (int e = 0; e < S; ++e) zn[e] = __shfl_down_sync(0xffffffffu, z[e], 1);
    // fp8 converts two entries at a time up front; fp16 converts each where used (fewer live
    // registers: unpacked, the fp16 path spills more)
    constexpr bool kUnpack = kType == kStateE4M3;
    float v_f[kUnpack ? K : 1], d_f[kUnpack ? K : 1];
    if constexpr (kUnpack) {
      v_raw.unpack(v_f);
      d_raw.unpack(d_f);
    }
    auto v = [&](int e) { if constexpr (kUnpack) return v_f[e]; else return v_raw[e]; };
    auto d = [&](int e) { if constexpr (kUnpack) return d_f[e]; else return d_raw[e]; };
    float nv[K], nd[K];
#pragma unroll
    for (int e = 0; e < K; ++e) {
      nv[e] = step(a, one_minus_a, v(e), z[e]);
      // entry e of A is offset q - i - K + 1 - S + e, slot i + K - 1 + S - e
      const int at = K - 1 + S - e;
      nd[e] = step(a, one_minus_a, d(e), at < K ? z[at < K ? at : 0] : zn[at >= K ? at - K : 0]);
    }
    Vec::store_vec(V_row, i / K, nv);
    if (S == 0 || h != kGroup - 1 || joined_below) {
      Vec::store_vec(D_row, d_at, nd);
    } else {  // entries below S are the next block's
#pragma unroll
      for (int e = S; e < K; ++e)
        if (isfinite(z[K - 1 + S - e])) store_state(D_row, kType, d_at * K + e, nd[e]);
    }
    if (S != 0 && h == 0 && !joined_above) {
      // entries e < S of the vector above: slots i + S - 1 - e
      float up[K];
      up_raw.unpack(up);
#pragma unroll
      for (int e = 0; e < S; ++e) {
        const float zz = z[S > 0 ? S - 1 - e : 0];
        if (isfinite(zz))
          store_state(D_row, kType, (d_at + 1) * K + e, ema(a, one_minus_a, up[e], zz));
      }
    }
  }

  template <int S = 0>
  __device__ static void apply_skew(int skew, void* V_row, void* D_row, int jb, int q,
                                    const float (&z)[K], float a, float one_minus_a) {
    if constexpr (S + 1 < K) {
      if (skew != S) return apply_skew<S + 1>(skew, V_row, D_row, jb, q, z, a, one_minus_a);
    }
    apply<S>(V_row, D_row, jb, q, z, a, one_minus_a);
  }
};

// The step each scored block was last seen at, and the stream's decode-step count: one CTA of
// the stream.
__device__ void mark_scored(const UpdateParams& p, int64_t stream, const int32_t* ids, int count,
                            int b) {
  int64_t* last_seen = p.state.last_seen + stream * p.state.block_cap;
  for (int c = threadIdx.x; c < count; c += kThreads) {
    const int j = ids[c];
    if (j >= 0 && j < p.state.block_cap && j < p.max_blocks) last_seen[j] = p.step[b];
  }
  if (threadIdx.x == 0) p.state.decode_steps[stream] += 1;
}

// kType: the StateType of V/D (a template argument so that no load or store branches on it).
template <int kType>
__global__ void __launch_bounds__(kThreads, 4) update_kernel(UpdateParams p) {
  extern __shared__ int compact_of_block[];  // block id -> compact index, -1 if not scored
  // a select launched beside this kernel (the next layer's) may start now
  pdl_launch_dependents();
  auto leave = [&] { leave_after_previous(p.beside_previous); };
  // grid (slices, B, layers): slice x takes every gridDim.x-th chunk of 4 x kThreads (K x
  // kThreads on the vector path) scored slots and of offsets of request y in layer layer + z
  const int b = blockIdx.y, layer = p.layer + blockIdx.z;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const StateView& s = p.state;
  const int64_t width = static_cast<int64_t>(p.m_cap) * kBlockSize;
  const int32_t* ids = p.block_ids + b * p.ids_stride + blockIdx.z * p.ids_layer_stride;
  const float* logits = p.logits + blockIdx.z * p.logits_layer_stride;
  // independent loads first: each thread makes about one pass, so the chain of dependent
  // loads (state slot, count, block id, state) is what it waits on
  const int slot_id = p.state_slot[b];
  const int count =
      min(p.counts[b * p.counts_stride + blockIdx.z * p.counts_layer_stride], p.m_cap);
  const int accepted = p.accepted[b];
  const int q0 = p.q[b * p.rows];
  // One-row path without vectors (the state rows or the logits not aligned for them): a warp
  // takes 128 consecutive compact positions (2 scored blocks) from chunk0
  // on, lane l the positions l + 32e (e < 4), so V, D and the logits move in whole lines.
  // Block ids and logits are loaded one chunk ahead (the first before the count and the row
  // count are known; unused with several rows): V and D then wait on one load, not on a chain
  // of them. Positions within a request, a pass past them included, fit in 32 bits (kMaxMCap).
  const float* z_row = logits + static_cast<int64_t>(b) * p.rows * p.logits_stride;  // row 0
  const int lane = threadIdx.x & 31;
  const int chunk0 = (static_cast<int>(first) - lane) * 4;
  const int chunk_step = static_cast<int>(stride) * 4;
  int j_ahead[2];
  float z_ahead[4];
  auto prefetch = [&](int chunk) {
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int c = chunk / kBlockSize + h;
      j_ahead[h] = c < p.m_cap ? ids[c] : -1;
    }
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int pos = chunk + lane + 32 * e;
      z_ahead[e] = pos < width ? z_row[pos] : 0.0f;
    }
  };
  // The one-row path on vectors (RowVectors) when the state rows and the logits allow it; a
  // warp's chunk with a block that is not interior goes one position at a time.
  using RV = RowVectors<kType>;
  constexpr int K = RV::K;
  const bool row_vectors =
      state_vectorizable(s, K) && reinterpret_cast<uintptr_t>(z_row) % 16 == 0;
  const int span0 = (static_cast<int>(first) - lane) * K;
  const int span_step = static_cast<int>(stride) * K;
  int jv_ahead = -1;
  float zv_ahead[K];
  auto prefetch_vectors = [&](int chunk) {
    const int c = chunk / kBlockSize + lane / RV::kGroup;
    jv_ahead = c < p.m_cap ? ids[c] : -1;
    const int pos = chunk + K * lane;
#pragma unroll
    for (int e = 0; e < K; e += 4) {
      const float4 z4 = pos < width ? *reinterpret_cast<const float4*>(z_row + pos + e)
                                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      zv_ahead[e] = z4.x; zv_ahead[e + 1] = z4.y; zv_ahead[e + 2] = z4.z; zv_ahead[e + 3] = z4.w;
    }
  };
  if (row_vectors) prefetch_vectors(span0); else prefetch(chunk0);
  if (slot_id < 0 || slot_id >= s.num_slots) return leave();  // no state to update
  const int64_t stream = static_cast<int64_t>(slot_id) * s.num_layers + layer;
  const int64_t base = stream * s.cap;
  // rows 0..accepted, all rows from rows - 1 up (no overflow)
  const int rows = p.row0_only ? 1 : accepted >= p.rows - 1 ? p.rows : max(accepted, 0) + 1;
  const float a = p.alpha, one_minus_a = p.one_minus_alpha;
  auto n_of = [&](int r) { return min(max(p.n[b * p.rows + r], 0), p.max_context); };
  auto round_state = [&](float v) {
    if constexpr (kType == kStateF16)
      return __half2float(__float2half_rn(saturate_state(kType, v)));
    if constexpr (kType == kStateE4M3) return e4m3_to_float(float_to_e4m3(v));
    return v;
  };

  const int64_t scored = static_cast<int64_t>(count) * kBlockSize;

  if (rows == 1) {
    // One row sees offset o only at slot q - o, so each scored slot owns its V and D entries:
    // one pass over the scored slots reads the logits once and needs no block table.
    const int n = n_of(0);
    const int q = q0;
    const int olimit = static_cast<int>(min(min(static_cast<int64_t>(q) + 1, s.cap),
                                            static_cast<int64_t>(INT_MAX)));
    const int vlimit = static_cast<int>(min(static_cast<int64_t>(n), s.cap));
    void* V_row = static_cast<char*>(s.V) + base * state_bytes(kType);
    void* D_row = static_cast<char*>(s.D) + base * state_bytes(kType);
    const int skew = (q + 1) & (K - 1);
    for (int chunk = span0; row_vectors && chunk < scored; chunk += span_step) {
      const int c = chunk / kBlockSize + lane / RV::kGroup;
      const int jb = c < count ? jv_ahead : -1;
      float z[K];
#pragma unroll
      for (int e = 0; e < K; ++e) z[e] = zv_ahead[e];
      if (chunk + span_step < scored) prefetch_vectors(chunk + span_step);
      const bool interior = jb >= 0 && jb < p.max_blocks &&
                            jb * kBlockSize + kBlockSize - 1 < vlimit &&
                            q - jb * kBlockSize - (kBlockSize - 1) >= 0 &&
                            q - jb * kBlockSize < s.cap;
      if (__all_sync(0xffffffffu, interior)) {
        RV::apply_skew(skew, V_row, D_row, jb, q, z, a, one_minus_a);
      } else {
        // the chunk with a block at the context's or the state's edge (every row has one when
        // n % 64 != 0): 4 positions' loads in flight, not one position's chain at a time, which
        // would hold up the whole update (benchmarks/bench_update_skew.py)
#pragma unroll
        for (int e0 = 0; e0 < K; e0 += 4) {
          int at[4];
          float zz[4], vo[4], dv[4];
          bool v_seen[4], d_seen[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const int pos = chunk + lane + 32 * (e0 + u);
            const int jb = pos < scored ? ids[pos / kBlockSize] : -1;
            zz[u] = pos < scored ? z_row[pos] : CUDART_NAN_F;
            const bool block = jb >= 0 && jb < p.max_blocks;
            at[u] = (block ? jb : 0) * kBlockSize + pos % kBlockSize;
            const int o = q - at[u];
            v_seen[u] = block && at[u] < vlimit;
            d_seen[u] = block && at[u] < n && o >= 0 && o < olimit;
          }
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            vo[u] = v_seen[u] ? load_state(V_row, kType, at[u]) : 0.0f;
            dv[u] = d_seen[u] ? load_state(D_row, kType, q - at[u]) : 0.0f;
          }
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            if (!isfinite(zz[u])) continue;
            if (v_seen[u]) store_state(V_row, kType, at[u], ema(a, one_minus_a, vo[u], zz[u]));
            if (d_seen[u])
              store_state(D_row, kType, q - at[u], ema(a, one_minus_a, dv[u], zz[u]));
          }
        }
      }
    }
    for (int chunk = chunk0; !row_vectors && chunk < scored; chunk += chunk_step) {
      int j[2];
      float z[4];
      #pragma unroll
      for (int h = 0; h < 2; ++h) j[h] = j_ahead[h];
      #pragma unroll
      for (int e = 0; e < 4; ++e) z[e] = z_ahead[e];
      if (chunk + chunk_step < scored) prefetch(chunk + chunk_step);
      bool v_seen[4], d_seen[4];
      uint32_t v[4], d[4];
      #pragma unroll
      for (int e = 0; e < 4; ++e) {  // all loads first; D must not wait for the logits
        // j < max_blocks keeps i in 32 bits; a larger j is past n anyway
        const int jb = j[e >> 1];
        const bool block = chunk / kBlockSize + (e >> 1) < count && jb >= 0 && jb < p.max_blocks;
        const int i = (block ? jb : 0) * kBlockSize + lane + 32 * (e & 1);
        const int o = q - i;
        v_seen[e] = block && i < vlimit;
        d_seen[e] = block && i < n && o >= 0 && o < olimit;
        v[e] = v_seen[e] ? load_state_bits(V_row, kType, i) : 0u;
        d[e] = d_seen[e] ? load_state_bits(D_row, kType, o) : 0u;
      }
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        if (!isfinite(z[e])) continue;
        const int i = (v_seen[e] || d_seen[e] ? j[e >> 1] : 0) * kBlockSize + lane + 32 * (e & 1);
        // one EMA step: storing it rounds it once, as round_state would
        if (v_seen[e])
          store_state(V_row, kType, i, ema(a, one_minus_a, state_from_bits(v[e], kType), z[e]));
        if (d_seen[e])
          store_state(D_row, kType, q - i, ema(a, one_minus_a, state_from_bits(d[e], kType), z[e]));
      }
    }
  } else {
    // Several rows: a thread takes 4 consecutive entries (one vector load when the state rows
    // allow it) and issues all its loads before using them (bound by load latency otherwise).
    const bool vec = state_vectorizable(s);
    auto load4 = [&](const void* arr, int64_t i0, int valid, float (&v)[4]) {
      if (vec && valid == 4) {
        StateVec<kType, 4> r;
        r.load(arr, base + i0);
        #pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = r[e];
      } else {
        #pragma unroll
        for (int e = 0; e < 4; ++e) v[e] = e < valid ? load_state(arr, kType, base + i0 + e) : 0.0f;
      }
    };
    auto store_changed = [&](void* arr, int64_t i0, const float (&v)[4], const bool (&changed)[4]) {
      #pragma unroll
      for (int e = 0; e < 4; ++e)
        if (changed[e]) store_state(arr, kType, base + i0 + e, v[e]);
    };
    for (int j = threadIdx.x; j < p.max_blocks; j += kThreads) compact_of_block[j] = -1;
    __syncthreads();
    for (int c = threadIdx.x; c < count; c += kThreads) {
      const int j = ids[c];
      if (j >= 0 && j < p.max_blocks) compact_of_block[j] = c;
    }
    __syncthreads();

    // V: one thread per 4 scored slots (same block), rows in order.
    for (int64_t pos = first * 4; pos < scored; pos += stride * 4) {
      const int j = ids[pos / kBlockSize];
      const int64_t i0 = static_cast<int64_t>(j) * kBlockSize + pos % kBlockSize;
      if (j < 0 || i0 >= s.cap) continue;
      const int valid = static_cast<int>(s.cap - i0 < 4 ? s.cap - i0 : 4);
      float v[4];
      bool changed[4] = {false, false, false, false};
      load4(s.V, i0, valid, v);
      for (int r = 0; r < rows; ++r) {
        const int n = n_of(r);
        const float4 z4 = *reinterpret_cast<const float4*>(
            logits + (static_cast<int64_t>(b) * p.rows + r) * p.logits_stride + pos);
        const float z[4] = {z4.x, z4.y, z4.z, z4.w};
        #pragma unroll
        for (int e = 0; e < 4; ++e)
          if (e < valid && i0 + e < n && isfinite(z[e])) {
            v[e] = round_state(ema(a, one_minus_a, v[e], z[e]));
            changed[e] = true;
          }
      }
      store_changed(s.V, i0, v, changed);
    }

    // D: one thread per 4 offsets o; row r observes slot i = q_r - o.
    int qmax = -1;
    for (int r = 0; r < rows; ++r) qmax = max(qmax, p.q[b * p.rows + r]);
    const int64_t olimit = min(static_cast<int64_t>(qmax) + 1, s.cap);
    // compact position of the slot row r sees at offset o, -1 if it is not scored
    auto seen_at = [&](int r, int64_t o) -> int64_t {
      const int64_t i = static_cast<int64_t>(p.q[b * p.rows + r]) - o;
      if (o >= olimit || i < 0 || i >= n_of(r)) return -1;
      const int64_t j = i / kBlockSize;
      if (j >= p.max_blocks) return -1;
      const int c = compact_of_block[j];
      return c < 0 ? -1 : static_cast<int64_t>(c) * kBlockSize + i % kBlockSize;
    };
    for (int64_t o0 = first * 4; o0 < olimit; o0 += stride * 4) {
      const int valid = static_cast<int>(olimit - o0 < 4 ? olimit - o0 : 4);
      bool any = false;
      for (int r = 0; r < rows; ++r)
        #pragma unroll
        for (int e = 0; e < 4; ++e) any |= seen_at(r, o0 + e) >= 0;
      if (!any) continue;
      float d[4];
      bool changed[4] = {false, false, false, false};
      load4(s.D, o0, valid, d);
      for (int r = 0; r < rows; ++r) {
        float z[4];
        const float* zr = logits + (static_cast<int64_t>(b) * p.rows + r) * p.logits_stride;
        #pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int64_t at = seen_at(r, o0 + e);
          z[e] = at >= 0 ? zr[at] : CUDART_NAN_F;
        }
        #pragma unroll
        for (int e = 0; e < 4; ++e)
          if (isfinite(z[e])) {
            d[e] = round_state(ema(a, one_minus_a, d[e], z[e]));
            changed[e] = true;
          }
      }
      store_changed(s.D, o0, d, changed);
    }
  }

  if (blockIdx.x != 0) return leave();
  mark_scored(p, stream, ids, count, b);
  leave();
}

// ema false: the counters alone, one CTA a stream (grid (1, requests, layers)); the logits and
// V/D are not touched.
__global__ void __launch_bounds__(kThreads) mark_scored_kernel(UpdateParams p) {
  pdl_launch_dependents();
  const int b = blockIdx.y, layer = p.layer + blockIdx.z;
  const int slot_id = p.state_slot[b];
  if (slot_id >= 0 && slot_id < p.state.num_slots) {
    const int32_t* ids = p.block_ids + b * p.ids_stride + blockIdx.z * p.ids_layer_stride;
    const int count =
        min(p.counts[b * p.counts_stride + blockIdx.z * p.counts_layer_stride], p.m_cap);
    mark_scored(p, static_cast<int64_t>(slot_id) * p.state.num_layers + layer, ids, count, b);
  }
  leave_after_previous(p.beside_previous);
}

}  // namespace

// kernel over grid (slices, requests, layers), beside the previous kernel when p allows it
template <typename Kernel>
cudaError_t launch_streams(Kernel kernel, const UpdateParams& p, int slices, size_t smem,
                           cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(slices, p.batch, p.layers);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  allow_beside_previous(cfg, attr, p.beside_previous);
  return cudaLaunchKernelEx(&cfg, kernel, p);
}

template <int kType>
cudaError_t launch_update_as(const UpdateParams& p, size_t smem, cudaStream_t stream) {
  cudaError_t err = allow_dynamic_smem(update_kernel<kType>, smem);
  if (err != cudaSuccess) return err;
  // Enough slices to cover the longest context with a few passes per thread. The one-row path
  // prefetches its next pass, so for it about 1,536 CTAs in all (at least 16 a request) do
  // better: more only queue (benchmarks/bench_update_skew.py). The MTP path, which does not
  // prefetch, keeps up to 64.
  const int cover = (p.max_context + 8 * kThreads - 1) / (8 * kThreads);
  const bool one_row = p.rows == 1 || p.row0_only;
  const int cap = one_row ? max(16, 1536 / p.batch) : kMaxSlices;
  const int slices = max(1, min(min(kMaxSlices, cover), cap));
  return launch_streams(update_kernel<kType>, p, slices, smem, stream);
}

cudaError_t launch_update(const UpdateParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.layers == 0) return cudaSuccess;
  if (p.layers < 0 || p.layers > kMaxGridYZ || p.batch > kMaxGridYZ) return cudaErrorInvalidValue;
  if (!p.ema) return launch_streams(mark_scored_kernel, p, 1, 0, stream);
  const size_t smem = static_cast<size_t>(p.max_blocks) * sizeof(int);
  switch (p.state.type) {
    case kStateF32: return launch_update_as<kStateF32>(p, smem, stream);
    case kStateF16: return launch_update_as<kStateF16>(p, smem, stream);
    case kStateE4M3: return launch_update_as<kStateE4M3>(p, smem, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace spin
