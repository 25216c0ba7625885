// spin::compact and spin::remap: drive an external paged indexer-logits kernel (DeepGEMM's
// fp8_paged_mqa_logits, as TensorRT-LLM uses it) over SPIN's selected blocks only.
//
// compact: one CTA per request and layer writes the compacted block table (the pages of the
// selected blocks in compact order, 0 elsewhere) and, per MTP row, the number of visible slots in
// compact order. Ids are ascending, so a row's visible slots are a prefix of the compact order
// and (table, lens) given to the external kernel as (block table, context lengths) yield SPIN's
// compact masked logits. Every layer in one launch (grid y), and with a schedule DeepGEMM's
// schedule of each layer's lens (its last CTA writes it), so the step's one launch replaces the
// compact and schedule kernels of each layer's call.
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

// Runs of kDeepGemmSplitKv slots that request b's last MTP row reads (0 past the batch).
__device__ __forceinline__ uint32_t splits_of(const int32_t* lens, int b, int batch, int rows) {
  if (b >= batch) return 0u;
  const int64_t at = static_cast<int64_t>(b) * rows + rows - 1;
  const uint32_t n = static_cast<uint32_t>(__ldcg(lens + at));  // other CTAs wrote it: not L1
  return (n + kDeepGemmSplitKv - 1) / kDeepGemmSplitKv;
}

// DeepGEMM's SM90 paged-logits schedule of one layer's lens [batch, rows] (what
// get_paged_mqa_logits_metadata returns for them; unsigned arithmetic as there): request b is
// splits_of(b) runs for each of its `pairs` row pairs (ceil(rows / 2), 1 for one row), dealt
// out in request order to num_sms SMs, each q = total / num_sms runs and the last r = total %
// num_sms one more. meta[s] = (first request pair, first run) of SM s; meta[num_sms] = (batch *
// pairs, 0), as is every SM's entry when there is no run at all.
__device__ void write_schedule(const int32_t* lens, int batch, int rows, int num_sms,
                               int32_t* meta) {
  __shared__ int warp_sums[kCompactWarps];
  __shared__ uint32_t prefix[kCompactThreads];
  // inclusive prefix of a chunk of kCompactThreads requests' runs; `chunk` their sum (int sums
  // wrap as DeepGEMM's unsigned ones do)
  auto chunk_prefix = [&](int c, uint32_t& chunk) {
    const int v = static_cast<int>(splits_of(lens, c + threadIdx.x, batch, rows));
    int sum;
    const int before = block_exclusive_sum<kCompactThreads>(v, warp_sums, sum);
    chunk = static_cast<uint32_t>(sum);
    return static_cast<uint32_t>(before + v);
  };
  const uint32_t pairs = rows >= 2 ? (rows + 1) / 2 : 1;
  uint32_t runs = 0;
  for (int c = 0; c < batch; c += kCompactThreads) {
    uint32_t chunk;
    chunk_prefix(c, chunk);
    runs += chunk;
    __syncthreads();  // warp_sums is written again
  }
  const uint32_t total = runs * pairs, sms = static_cast<uint32_t>(num_sms);
  const uint32_t q = total / sms, pivot = sms - total % sms;
  // SM s starts at run `seg` of the whole order: in the request whose prefix first passes it
  uint32_t base = 0;
  for (int c = 0; c < batch; c += kCompactThreads) {
    uint32_t chunk;
    prefix[threadIdx.x] = chunk_prefix(c, chunk);
    __syncthreads();
    const int n = min(kCompactThreads, batch - c);
    for (uint32_t s = threadIdx.x; s < sms; s += kCompactThreads) {
      const uint32_t seg = s * q + (s > pivot ? s - pivot : 0u);
      if (seg < base * pairs || seg >= (base + chunk) * pairs) continue;
      int lo = 0, hi = n;
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if ((base + prefix[mid]) * pairs <= seg) lo = mid + 1;
        else hi = mid;
      }
      const uint32_t before = lo ? prefix[lo - 1] : 0u;
      const uint32_t own = prefix[lo] - before, offset = seg - (base + before) * pairs;
      meta[2 * s] = static_cast<int32_t>((c + lo) * pairs + offset / own);
      meta[2 * s + 1] = static_cast<int32_t>(offset % own);
    }
    base += chunk;
    __syncthreads();  // prefix is rewritten next
  }
  for (uint32_t s = threadIdx.x; s <= sms; s += kCompactThreads)
    if (s == sms || total == 0) {
      meta[2 * s] = static_cast<int32_t>(static_cast<uint32_t>(batch) * pairs);
      meta[2 * s + 1] = 0;
    }
}

__global__ void __launch_bounds__(kCompactThreads) compact_kernel(CompactParams p) {
  __shared__ long long partial[kMaxNextN][kCompactWarps];
  __shared__ bool last;
  const int b = blockIdx.x, layer = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int32_t* ids = p.block_ids + b * p.ids_stride + layer * p.ids_layer_stride;
  const int32_t* table = p.block_table + b * p.table_stride;
  const int count =
      max(min(p.counts[b * p.counts_stride + layer * p.counts_layer_stride], p.m_cap), 0);
  const int shift = p.page_slots == kBlockSize ? 0 : 1;  // log2 of pages per block
  const int ppb_mask = (1 << shift) - 1;

  // the table: entry e is page e % ppb of compact block e / ppb
  int32_t* out = p.compact_table + layer * p.compact_layer_stride + b * p.compact_stride;
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
  int32_t* layer_lens = p.compact_lens + static_cast<int64_t>(layer) * p.batch * p.rows;
  if (threadIdx.x < p.rows) {
    long long total = 0;
#pragma unroll
    for (int w = 0; w < kCompactWarps; ++w) total += partial[threadIdx.x][w];
    layer_lens[b * p.rows + threadIdx.x] = static_cast<int32_t>(total);
    if (p.schedule != nullptr) __threadfence();  // before this CTA counts as done
  }
  if (p.schedule == nullptr) return;
  // the layer's last CTA to finish writes its schedule, from every request's lens
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(p.done + layer, 1) == p.batch - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  write_schedule(layer_lens, p.batch, p.rows, p.num_sms,
                 p.schedule + static_cast<int64_t>(layer) * (p.num_sms + 1) * 2);
  if (threadIdx.x == 0) p.done[layer] = 0;  // the next launch counts from zero
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
  if (p.batch == 0)  // no request: every schedule entry is (0, 0)
    return p.schedule == nullptr ? cudaSuccess
                                 : cudaMemsetAsync(p.schedule, 0,
                                                   sizeof(int32_t) * 2 * (p.num_sms + 1) *
                                                       static_cast<size_t>(p.layers),
                                                   stream);
  if (p.rows < 1 || p.rows > kMaxNextN || (p.page_slots != 32 && p.page_slots != kBlockSize) ||
      p.layers < 1 || p.layers > kMaxGridYZ ||
      (p.schedule != nullptr && (p.num_sms < 1 || p.done == nullptr)))
    return cudaErrorInvalidValue;
  compact_kernel<<<dim3(p.batch, p.layers), kCompactThreads, 0, stream>>>(p);
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
