// spin::compact and spin::remap: drive an external paged indexer-logits kernel (DeepGEMM's
// fp8_paged_mqa_logits, as TensorRT-LLM uses it) over SPIN's selected blocks only.
//
// compact: one CTA per request writes the compacted block table (the pages of the selected
// blocks in compact order, 0 elsewhere) and, per MTP row, the number of visible slots in
// compact order. Ids are ascending, so a row's visible slots are a prefix of the compact order
// and (table, lens) given to the external kernel as (block table, context lengths) yield SPIN's
// compact masked logits.
// remap: compact positions of a top-K over those logits -> request-local slot ids, one thread
// per element (in place allowed); ascending: one CTA per row sorts the row's ids (CUB block
// radix sort), so a peer's unordered top-K (flashinfer's) becomes spin::topk's output in one
// launch.
#include <cub/block/block_radix_sort.cuh>

#include "common.cuh"

namespace spin {
namespace {

constexpr int kCompactThreads = 256;
constexpr int kCompactWarps = kCompactThreads / 32;
constexpr int kRemapThreads = 256;
static_assert(16 * kRemapThreads == kMaxSortedK, "remap_sorted_kernel<16> covers kMaxSortedK");

__global__ void __launch_bounds__(kCompactThreads) compact_kernel(CompactParams p) {
  __shared__ long long partial[kMaxNextN][kCompactWarps];
  const int b = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int32_t* ids = p.block_ids + b * p.ids_stride;
  const int32_t* table = p.block_table + b * p.table_stride;
  const int count = max(min(p.counts[b * p.counts_stride], p.m_cap), 0);
  const int shift = p.page_slots == kBlockSize ? 0 : 1;  // log2 of pages per block
  const int ppb_mask = (1 << shift) - 1;

  // the table: entry e is page e % ppb of compact block e / ppb
  int32_t* out = p.compact_table + b * p.compact_stride;
  for (int e = threadIdx.x; e < p.width; e += kCompactThreads) {
    const int k = e >> shift;
    int32_t page = 0;
    if (k < count) {
      const int j = ids[k];
      const int64_t col = (static_cast<int64_t>(j) << shift) + (e & ppb_mask);
      if (j >= 0 && col < p.max_pages) page = table[col];
    }
    out[e] = page;
  }

  // the lengths: row r sees clamp(n_r - 64 j, 0, 64) slots of block j
  int64_t n[kMaxNextN];
  long long acc[kMaxNextN];
#pragma unroll
  for (int r = 0; r < kMaxNextN; ++r) {
    n[r] = r < p.rows ? p.context_lens[b * p.rows + r] : 0;
    acc[r] = 0;
  }
  for (int k = threadIdx.x; k < count; k += kCompactThreads) {
    const int j = ids[k];
    if (j < 0) continue;
    const int64_t first = static_cast<int64_t>(j) * kBlockSize;
#pragma unroll
    for (int r = 0; r < kMaxNextN; ++r)
      acc[r] += min(max(n[r] - first, static_cast<int64_t>(0)), static_cast<int64_t>(kBlockSize));
  }
#pragma unroll
  for (int r = 0; r < kMaxNextN; ++r) {
    long long v = acc[r];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (lane == 0) partial[r][warp] = v;
  }
  __syncthreads();
  if (threadIdx.x < p.rows) {
    long long total = 0;
#pragma unroll
    for (int w = 0; w < kCompactWarps; ++w) total += partial[threadIdx.x][w];
    p.compact_lens[b * p.rows + threadIdx.x] = static_cast<int32_t>(total);
  }
}

// The slot id of element col of row, or -1 (past the scored blocks, a padded id, a slot id past
// int32, or a non-finite value or score).
__device__ __forceinline__ int32_t remap_slot(const RemapParams& p, int64_t row, int64_t col) {
  const int64_t b = row / p.rows;
  const int pos = p.positions[row * p.positions_stride + col];
  const int count = min(p.counts[b * p.counts_stride], p.m_cap);
  if (pos < 0 || static_cast<int64_t>(pos) >= static_cast<int64_t>(count) * kBlockSize) return -1;
  if (p.values != nullptr && !isfinite(p.values[row * p.values_stride + col])) return -1;
  if (p.scores != nullptr && !isfinite(p.scores[row * p.scores_stride + pos])) return -1;
  const int j = p.block_ids[b * p.ids_stride + pos / kBlockSize];
  return j >= 0 && j <= kMaxSlotBlock ? j * kBlockSize + pos % kBlockSize : -1;
}

__global__ void __launch_bounds__(kRemapThreads) remap_kernel(RemapParams p) {
  const int64_t total = static_cast<int64_t>(p.batch) * p.rows * p.k;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kRemapThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kRemapThreads + threadIdx.x; i < total;
       i += step) {
    const int64_t row = i / p.k;
    p.out[i] = remap_slot(p, row, i - row * p.k);
  }
}

// One CTA per row: the ids as unsigned keys (-1 -> UINT32_MAX sorts last), loaded striped,
// block radix sorted and stored striped. Every read precedes the sort's barriers and every
// write follows them, so out may be positions.
template <int kItems>
__global__ void __launch_bounds__(kRemapThreads) remap_sorted_kernel(RemapParams p) {
  using Sort = cub::BlockRadixSort<uint32_t, kRemapThreads, kItems>;
  __shared__ typename Sort::TempStorage scratch;
  const int64_t row = blockIdx.x;
  uint32_t keys[kItems];
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int col = i * kRemapThreads + threadIdx.x;
    keys[i] = col < p.k ? static_cast<uint32_t>(remap_slot(p, row, col)) : 0xffffffffu;
  }
  Sort(scratch).SortBlockedToStriped(keys);
  int32_t* out = p.out + row * p.k;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int col = i * kRemapThreads + threadIdx.x;
    if (col < p.k) out[col] = static_cast<int32_t>(keys[i]);   // UINT32_MAX is -1 again
  }
}

}  // namespace

cudaError_t launch_compact(const CompactParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  if (p.rows < 1 || p.rows > kMaxNextN || (p.page_slots != 32 && p.page_slots != kBlockSize))
    return cudaErrorInvalidValue;
  compact_kernel<<<p.batch, kCompactThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

cudaError_t launch_remap(const RemapParams& p, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(p.batch) * p.rows;
  const int64_t total = rows * p.k;
  if (total == 0) return cudaSuccess;
  if (p.ascending) {
    if (p.k > kMaxSortedK || rows > 0x7fffffff) return cudaErrorInvalidValue;
    const unsigned grid = static_cast<unsigned>(rows);
    if (p.k <= kRemapThreads) remap_sorted_kernel<1><<<grid, kRemapThreads, 0, stream>>>(p);
    else if (p.k <= 2 * kRemapThreads) remap_sorted_kernel<2><<<grid, kRemapThreads, 0, stream>>>(p);
    else if (p.k <= 4 * kRemapThreads) remap_sorted_kernel<4><<<grid, kRemapThreads, 0, stream>>>(p);
    else if (p.k <= 8 * kRemapThreads) remap_sorted_kernel<8><<<grid, kRemapThreads, 0, stream>>>(p);
    else remap_sorted_kernel<16><<<grid, kRemapThreads, 0, stream>>>(p);
    return cudaGetLastError();
  }
  const int64_t blocks = (total + kRemapThreads - 1) / kRemapThreads;
  remap_kernel<<<static_cast<unsigned>(blocks < (1 << 20) ? blocks : (1 << 20)), kRemapThreads, 0,
                 stream>>>(p);
  return cudaGetLastError();
}

}  // namespace spin
