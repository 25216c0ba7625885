// spin::update: deferred EMA update of V (per slot) and D (per relative offset) from the
// compact logits of one layer; MTP rows 0..a replayed in order (or row 0 only). V is walked
// per scored slot and D per offset, so every entry has one owner thread and the row order
// holds without atomics. Non-finite scores are not observed.
#include "common.cuh"

namespace spin {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) update_kernel(UpdateParams p) {
  extern __shared__ int compact_of_block[];  // block id -> compact index, -1 if not scored
  // grid (slices, B): slice x takes every gridDim.x-th chunk of scored slots and of offsets
  const int b = blockIdx.y;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const StateView& s = p.state;
  const int slot_id = p.state_slot[b];
  if (slot_id < 0 || slot_id >= s.num_slots) return;  // no state to update
  const int64_t stream = static_cast<int64_t>(slot_id) * s.num_layers + p.layer;
  const int64_t base = stream * s.cap;
  const int64_t width = static_cast<int64_t>(p.m_cap) * kBlockSize;
  const int32_t* ids = p.block_ids + b * p.ids_stride;
  const int count = min(p.counts[b * p.counts_stride], p.m_cap);
  const int rows = p.row0_only ? 1 : min(max(p.accepted[b], 0) + 1, p.rows);
  const float a = p.alpha, one_minus_a = p.one_minus_alpha;
  auto n_of = [&](int r) { return min(max(p.n[b * p.rows + r], 0), p.max_context); };
  auto round_state = [&](float v) {
    return s.half ? __half2float(__float2half_rn(fminf(fmaxf(v, -65504.0f), 65504.0f))) : v;
  };
  auto score = [&](int r, int64_t pos) {
    return p.logits[(static_cast<int64_t>(b) * p.rows + r) * width + pos];
  };

  for (int j = threadIdx.x; j < p.max_blocks; j += kThreads) compact_of_block[j] = -1;
  __syncthreads();
  for (int c = threadIdx.x; c < count; c += kThreads) {
    const int j = ids[c];
    if (j >= 0 && j < p.max_blocks) compact_of_block[j] = c;
  }
  __syncthreads();

  // V: one thread per scored slot, rows in order.
  for (int64_t pos = first; pos < static_cast<int64_t>(count) * kBlockSize; pos += stride) {
    const int j = ids[pos / kBlockSize];
    const int64_t i = static_cast<int64_t>(j) * kBlockSize + pos % kBlockSize;
    if (j < 0 || i >= s.cap) continue;
    float v = load_state(s.V, s.half, base + i);
    bool changed = false;
    for (int r = 0; r < rows; ++r) {
      if (i >= n_of(r)) continue;
      const float z = score(r, pos);
      if (!isfinite(z)) continue;
      v = round_state(ema(a, one_minus_a, v, z));
      changed = true;
    }
    if (changed) store_state(s.V, s.half, base + i, v);
  }

  // D: one thread per offset o; row r observes slot i = q_r - o.
  int qmax = -1;
  for (int r = 0; r < rows; ++r) qmax = max(qmax, p.q[b * p.rows + r]);
  const int64_t olimit = min(static_cast<int64_t>(qmax) + 1, s.cap);
  for (int64_t o = first; o < olimit; o += stride) {
    float d = 0.0f;
    bool loaded = false, changed = false;
    for (int r = 0; r < rows; ++r) {
      const int64_t i = static_cast<int64_t>(p.q[b * p.rows + r]) - o;
      if (i < 0 || i >= n_of(r)) continue;
      const int64_t j = i / kBlockSize;
      if (j >= p.max_blocks) continue;
      const int c = compact_of_block[j];
      if (c < 0) continue;
      const float z = score(r, static_cast<int64_t>(c) * kBlockSize + i % kBlockSize);
      if (!isfinite(z)) continue;
      if (!loaded) { d = load_state(s.D, s.half, base + o); loaded = true; }
      d = round_state(ema(a, one_minus_a, d, z));
      changed = true;
    }
    if (changed) store_state(s.D, s.half, base + o, d);
  }

  if (blockIdx.x != 0) return;
  int64_t* last_seen = s.last_seen + stream * s.block_cap;
  for (int c = threadIdx.x; c < count; c += kThreads) {
    const int j = ids[c];
    if (j >= 0 && j < s.block_cap && j < p.max_blocks) last_seen[j] = p.step[b];
  }
  if (threadIdx.x == 0) s.decode_steps[stream] += 1;
}

}  // namespace

cudaError_t launch_update(const UpdateParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  const size_t smem = static_cast<size_t>(p.max_blocks) * sizeof(int);
  cudaError_t err = cudaFuncSetAttribute(update_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  // enough slices to cover the longest context with a few passes per thread
  const int slices = max(1, min(64, (p.max_context + 4 * kThreads - 1) / (4 * kThreads)));
  update_kernel<<<dim3(slices, p.batch), kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace spin
