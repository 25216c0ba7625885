// Launch API of the SPIN decode kernels: raw pointers, sizes and a stream; no torch/TensorRT.
// The specification of every kernel is spin_trtllm/reference/; the op contracts are in
// spin_trtllm/ops/ (one module per op). All kernels are graph-capturable (no host sync, no allocation).
#pragma once
#include <cstdint>
#include <cuda_runtime.h>

namespace spin {

// ---- shared constants -------------------------------------------------------------------------
// The one C++ home of the numbers that the kernels, the torch bindings and the TensorRT plugins
// share with Python (its name in brackets; spin_trtllm/limits.py unless said). One
// `constexpr int kName = <literal>;` a line, so that tests/test_limits.py can parse them.
constexpr int kBlockSize = 64;          // slots per block = per K-cache page [BLOCK_SLOTS]
constexpr int kHeads = 64;              // indexer heads, DeepSeek-V3.2/V4 [INDEX_HEADS]
constexpr int kHeadDim = 128;           // fp8 bytes per key row [HEAD_DIM]
constexpr int kSlotBytes = 132;         // key row + fp32 scale [SLOT_BYTES]
constexpr int kSummaryBytes = 144;      // summary row, 16-byte aligned [SUMMARY_BYTES]
constexpr int kFp4Block = 32;           // MXFP4 key values per UE8M0 exponent [FP4_BLOCK]
// MXFP4 key: E2M1 pairs, then a UE8M0 exponent per kFp4Block values [FP4_SLOT_BYTES]
constexpr int kFp4SlotBytes = kHeadDim / 2 + kHeadDim / kFp4Block;
constexpr int kGaussSummaryBytes = 2 * kSummaryBytes;  // mean row, std row [GAUSS_SUMMARY_BYTES]
constexpr int kMaxNextN = 8;            // MTP rows per request supported [MAX_NEXT_N]
constexpr int kMaxSortedK = 4096;       // remap(ascending): k one CTA sorts [MAX_SORTED_K]
constexpr int kMaxHybridBlocks = 8192;  // merge_history rank sort [MAX_HYBRID_BLOCKS]
constexpr int kTopKLoadStep = 4 * 128;  // positions a top-K warp loads in one step (topk.cu)
// Positions past m_cap * 64 that int32 index arithmetic may reach: update's next pass over a
// request (64 slices x 256 threads x 8 positions) and the offsets inside it.
constexpr int kIndexSlack = 2 * 64 * 256 * 8;
constexpr int kMaxMCap = (2147483647 - kIndexSlack) / kBlockSize;  // [MAX_M_CAP]
constexpr int kMaxGridYZ = 65535;       // grid y/z: launch batch, update layers [MAX_LAUNCH_BATCH]
// DeepGEMM's SM90 paged-logits schedule splits a request's slots into runs of this many
// (compact.cu writes that schedule) [DEEPGEMM_SPLIT_KV]
constexpr int kDeepGemmSplitKv = 256;
constexpr int kMaxIndexTopK = 1 << 20;  // K: topk's -1 fill loops to it in int32 [MAX_INDEX_TOPK]
// The top-K's filter (topk.cu): a row ranked through it is more than one pass CTA's slice of
// table slots (m_cap * 64) wide, at most kFilterMaxSlots (its bitmap: 64 KB of shared memory),
// K at most kFilterMaxK, at most kFilterMaxRows rows (a workspace of 96 MB at most); auto:
// kFilterAutoMinRows to kFilterAutoMaxRows rows of tables of at least 16 slices [TOPK_FILTER_*]
constexpr int kFilterSliceSlots = 16384;  // [TOPK_FILTER_SLICE_SLOTS]
constexpr int kFilterMaxSlots = 512 * 1024;  // [TOPK_FILTER_MAX_SLOTS]
constexpr int kFilterMaxK = 2048;          // [TOPK_FILTER_MAX_K]
constexpr int kFilterMaxRows = 2048;       // [TOPK_FILTER_MAX_ROWS]
constexpr int kFilterAutoMinRows = 16;     // [TOPK_FILTER_AUTO_MIN_ROWS]
constexpr int kFilterAutoMaxRows = 32;     // [TOPK_FILTER_AUTO_MAX_ROWS]
constexpr int kFilterAutoMinSlots = 16 * kFilterSliceSlots;  // [TOPK_FILTER_AUTO_MIN_SLOTS]
constexpr float kE4M3Max = 448.0f;      // largest finite fp8 e4m3 [reference.FP8_MAX]
// Enum values as the kernels read them (enumerators in value order, one a line).
// select's pooling of a block's slot scores [POOLING]
enum Pooling : int {
  kPoolMax = 0,
  kPoolMean = 1,
  kPoolTop4 = 2,
};
// select's exploration policy [EXPLORATION_POLICY]
enum ExplorePolicy : int {
  kExploreRandom = 0,
  kExploreStaleness = 1,
  kExploreAge = 2,
};
// V/D storage, StateView::type [STATE_DTYPES]: fp32, fp16, or fp8 e4m3 (OCP "fn": no
// infinities, saturating at +-448)
enum StateType : int {
  kStateF32 = 0,
  kStateF16 = 1,
  kStateE4M3 = 2,
};

static_assert(kSlotBytes == kHeadDim + 4, "a slot is the key row and its fp32 scale");
static_assert(kSummaryBytes >= kHeadDim + 4 && kSummaryBytes % 16 == 0,
              "a summary row holds a key row and its scale, 16-byte aligned");
static_assert(kIndexSlack >= kTopKLoadStep,
              "m_cap * kBlockSize fits int32 with a top-K load step past it");

// State tensors are [num_state_slots, num_layers, cap]; request b uses slot state_slot[b].
struct StateView {
  void* V;                 // entries of `type`
  void* D;                 // entries of `type`, indexed by relative offset q - i
  int64_t* last_seen;      // [.., block_cap] step each block was last scored
  int64_t* decode_steps;   // [num_state_slots, num_layers]
  int type;                // kStateF32, kStateF16 or kStateE4M3
  int64_t cap;             // V/D entries per (slot, layer)
  int64_t block_cap;       // last_seen entries per (slot, layer)
  int num_layers;
  int num_slots;           // state slots; a request whose slot is outside is skipped
};

struct SelectParams {
  StateView state;
  const int32_t* state_slot;   // [B]
  const int32_t* n;            // [B, R] visible slots of each MTP row
  const int32_t* q;            // [B, R] query position of each row (slot coordinates)
  const int64_t* request_id;   // [B] RNG counter
  const int64_t* step;         // [B] RNG counter and age clock
  int batch, rows;
  double rho, gamma;
  int index_topk, warmup_steps;
  bool keep_sink, keep_newest, mtp_union;
  int pooling, policy;
  uint32_t seed;
  int32_t* block_ids;          // [B, L, m_cap] ascending, -1 padded
  int32_t* counts;             // [B, L] union size (may exceed m_cap: first m_cap ids kept)
  int m_cap;
  int max_context;             // context lengths are clamped to this
  int max_blocks;              // ceil(max_context / 64); sizes shared memory
  // optional: rank blocks by these scores [B, R, scores_width] (strides in floats) instead of
  // V/D, for layer `layer` alone (its slice of block_ids/counts)
  const float* block_scores = nullptr;
  int64_t scores_stride_b = 0, scores_stride_r = 0;
  int scores_width = 0;
  int layer = -1;              // >= 0: that layer alone (block_scores need one); -1: every layer
  // with block_scores: rank by max(rank share of block_scores, rank share of the V/D
  // prediction) (the hybrid predictor; needs max_blocks <= kMaxHybridBlocks: shared memory for
  // the rank sort)
  bool merge_history = false;
  // Its inputs were complete before the kernel launched just before this one began, and that
  // kernel reads and writes none of its outputs (the previous layer's launch_topk): select may
  // run beside it (programmatic dependent launch, sm_90+) and completes only after it.
  bool beside_previous = false;
};
cudaError_t launch_select(const SelectParams& p, cudaStream_t stream);

struct LogitsParams {
  const uint8_t* q;            // fp8 e4m3 [B*R, 64, 128]
  const uint8_t* kv_cache;     // [num_pages, 64 * 132]: 64 fp8 rows, then 64 fp32 scales
  const float* weights;        // [B*R, 64]
  const int32_t* context_lens; // [B, R]
  const int32_t* block_table;  // [B, table_stride], max_pages valid columns
  const int32_t* block_ids;    // [B, ids_stride] (m_cap used)
  const int32_t* counts;       // [B] with counts_stride
  int batch, rows, m_cap, max_pages;
  int64_t num_pages, table_stride, ids_stride, counts_stride;
  float* out;                  // [B*R, m_cap * 64]
};
cudaError_t launch_indexer_logits(const LogitsParams& p, cudaStream_t stream);

// Block summaries: summaries[pages[i]] = the mean of page pages[i]'s first fill[i] keys,
// re-quantized (reference.summarize_pages; with_std: then their per-dimension std,
// reference.summarize_pages_gauss); pages outside [0, num_pages) are skipped.
// With context_lens set, the pages come from the step's lengths instead
// (reference.newest_pages): for request b = i / 2 and n = clamp(context_lens[b, rows - 1], 0,
// max_len), listing i is page column (max(n - rows, 0) / page_slots) + i % 2 of block_table
// row b with fill n - column * page_slots (at most page_slots), skipped where that fill is not
// positive or the column is past max_pages; count = 2 * batch.
struct SummarizeParams {
  const uint8_t* kv_cache;     // [num_pages, page_slots * slot_bytes]
  const int32_t* pages = nullptr;  // [count]
  const int32_t* fill = nullptr;   // [count]
  int count;
  const int32_t* context_lens = nullptr;  // [batch, rows]: the step's newest pages instead
  const int32_t* block_table = nullptr;   // [batch, table_stride], max_pages valid columns
  int rows = 1, max_pages = 0, max_len = 0;
  int64_t table_stride = 0;
  int64_t num_pages;
  uint8_t* summaries;          // [num_pages, row_bytes]
  int page_slots = 64;         // slots per page: 64 or 32
  int slot_bytes = kSlotBytes; // kSlotBytes (FP8 keys) or kFp4SlotBytes (MXFP4 keys)
  int row_bytes = kSummaryBytes;
  bool with_std = false;       // gauss rows (kGaussSummaryBytes): the std row after the mean row
};
cudaError_t launch_summarize(const SummarizeParams& p, cudaStream_t stream);

// The probe: out[b*R + r, j] = sum_h w_h ReLU(q_h . summary(block_table[b, j])) for page
// columns j with a visible slot (page_slots * j < context_lens[b, r]) and a page inside the
// summaries, else -inf.
struct ProbeParams {
  const uint8_t* q;            // fp8 e4m3 [B*R, 64, 128]
  const uint8_t* summaries;    // [num_pages, summary_bytes]
  const float* weights;        // [B*R, 64]
  const int32_t* context_lens; // [B, R]
  const int32_t* block_table;  // [B, table_stride], max_pages valid columns
  int batch, rows, num_blocks, max_pages;
  int64_t num_pages, table_stride;
  float* out;                  // [B*R, num_blocks]
  int page_slots = 64;         // slots per page: 64 or 32
  int summary_bytes = kSummaryBytes;  // bytes per summaries row (gauss: kGaussSummaryBytes)
};
cudaError_t launch_probe(const ProbeParams& p, cudaStream_t stream);
// gauss: out[b*R + r, j] = sum_h w_h E[relu(X_h)], X_h ~ N(q_h . m, sum_d q_hd^2 s_d^2) with m, s
// the mean and std rows of page block_table[b, j]'s gauss summary (reference.gauss_scores);
// the columns and -inf as the probe's.
cudaError_t launch_gauss(const ProbeParams& p, cudaStream_t stream);

struct TopKParams {
  const float* logits;         // [B*R, >= m_cap * 64], rows logits_stride apart (m_cap*64 read)
  const int32_t* block_ids;    // [B, ids_stride]
  const int32_t* counts;       // [B] with counts_stride
  int batch, rows, m_cap, k;
  int64_t ids_stride, counts_stride;
  int64_t logits_stride;       // floats between rows: a multiple of 4 (16-byte rows), >= m_cap*64
  int32_t* out;                // [B*R, k] request-local slot ids, ascending, -1 padded
  // [B*R] compact length of each row, or null: positions past it take no part (a dense kernel
  // on a compacted table leaves them unspecified)
  const int32_t* row_lens = nullptr;
  // Many long rows may be ranked through a filter (a histogram pass and a filter pass over all
  // SMs, then one CTA a row over the few entries left), through a device workspace of
  // topk_workspace_bytes (0: these shapes never filter), which nothing else may write until
  // the top-K's kernels complete. The torch binding frees it at return: the caching allocator
  // hands it out again only to work ordered after them on the stream, so a kernel launched
  // beside them (which may start earlier) must write only memory allocated before the call.
  // filter: 0 never, 1 wherever the shapes allow, -1 for many long rows.
  int filter = 0;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};
size_t topk_workspace_bytes(const TopKParams& p);
cudaError_t launch_topk(const TopKParams& p, cudaStream_t stream);

struct UpdateParams {
  StateView state;
  int layer;
  const int32_t* state_slot;   // [B]
  const float* logits;         // [B*R, >= m_cap * 64] compact scores of this layer, rows
                               // logits_stride apart (m_cap*64 read)
  const int32_t* block_ids;    // [B, ids_stride]
  const int32_t* counts;       // [B] with counts_stride
  const int32_t* n;            // [B, R]
  const int32_t* q;            // [B, R]
  const int32_t* accepted;     // [B] accepted drafts: rows 0..a replay in order
  const int64_t* step;         // [B]
  int batch, rows, m_cap;
  int64_t ids_stride, counts_stride;
  int64_t logits_stride;       // floats between rows: a multiple of 4 (16-byte rows), >= m_cap*64
  float alpha, one_minus_alpha;  // float(a) and float(1 - a) with 1 - a taken in double
  bool row0_only;
  int max_context;             // context lengths are clamped to this
  int max_blocks;              // ceil(max_context / 64)
  // layers > 1: layers layer .. layer + layers - 1 in one launch, layer l's logits, block ids
  // and counts these strides (elements) after layer `layer`'s (MTP's deferred updates of every
  // layer: one launch instead of one per layer)
  int layers = 1;
  int64_t logits_layer_stride = 0, ids_layer_stride = 0, counts_layer_stride = 0;
  // The inputs (logits, block ids, counts, state) were complete before the kernel launched just
  // before this one began, and that kernel writes none of them and reads none of the update's
  // outputs (launch_topk on the same logits, or the next layer's select launched beside it):
  // the update may then run beside it (programmatic dependent launch, sm_90+), and completes
  // only after it, so that what follows in the stream still sees that kernel's results.
  bool beside_previous = false;
  // false: last_seen and decode_steps only; V, D and the logits untouched (a predictor that
  // ranks without the V/D history: probe, gauss)
  bool ema = true;
};
cudaError_t launch_update(const UpdateParams& p, cudaStream_t stream);

// Compacted block table for an external paged indexer-logits kernel (DeepGEMM's
// fp8_paged_mqa_logits): entry k*ppb + p = block_table[b, ids[k]*ppb + p] (ppb = 64 /
// page_slots pages per SPIN block) for the used k < min(count, m_cap) with ids[k] >= 0 and that
// column < max_pages, else 0 (also columns >= m_cap*ppb); lens[b, j] = sum over used k of
// clamp(context_lens[b, j] - ids[k]*64, 0, 64). One CTA per request and layer (grid y: layers,
// each layer's ids, counts, table and lens at its layer stride; lens of layer l at
// compact_lens + l * batch * rows).
// With schedule, each layer's last CTA also writes DeepGEMM's SM90 paged-logits schedule of
// that layer's lens (what get_paged_mqa_logits_metadata returns for them): so one launch
// prepares every layer's DeepGEMM call, where a call per layer would launch two kernels.
struct CompactParams {
  // a layer's rows; layer l's at + l * its layer stride (lens: + l * batch * rows)
  const int32_t* block_ids;    // [B, ids_stride] ascending, -1 padded (m_cap used)
  const int32_t* counts;       // [B] with counts_stride
  const int32_t* context_lens; // [B, R], every layer's
  const int32_t* block_table;  // [B, table_stride], max_pages valid columns, every layer's
  int batch, rows, m_cap, max_pages, page_slots;  // page_slots 64 or 32
  int64_t ids_stride, counts_stride, table_stride;
  int32_t* compact_table;      // [B, compact_stride], width columns written
  int64_t compact_stride;
  int width;                   // T >= m_cap * ppb
  int32_t* compact_lens;       // [B, R]
  int layers = 1;
  int64_t ids_layer_stride = 0, counts_layer_stride = 0, compact_layer_stride = 0;
  int32_t* schedule = nullptr; // [layers, num_sms + 1, 2] or null
  int num_sms = 0;
  int32_t* done = nullptr;     // [layers] CTAs finished: zero on entry, left zero (with schedule)
};
cudaError_t launch_compact(const CompactParams& p, cudaStream_t stream);

// Compact positions (top-K over compact logits, -1 padded) -> request-local slot ids:
// ids[pos / 64] * 64 + pos % 64 for 0 <= pos < min(count, m_cap) * 64 with ids[pos / 64] >= 0
// and, when values (aligned with the positions) or scores (the rows the positions index) are
// given, a finite value; else -1. Row r belongs to request r / next_n.
// ascending: each row's ids sorted ascending, -1 last (spin::topk's output contract from a
// peer's unordered top-K; k <= kMaxSortedK, one CTA per row); otherwise the order is kept.
// out may be positions (in place).
struct RemapParams {
  const int32_t* positions;    // [B*R, positions_stride], k used
  const float* values;         // [B*R, values_stride] or null
  const int32_t* block_ids;    // [B, ids_stride]
  const int32_t* counts;       // [B] with counts_stride
  int batch, rows, m_cap, k;
  int64_t positions_stride, values_stride, ids_stride, counts_stride;
  bool ascending;
  int32_t* out;                // [B*R, k]
  const float* scores = nullptr;  // [B*R, scores_stride >= m_cap * 64] or null
  int64_t scores_stride = 0;
};
cudaError_t launch_remap(const RemapParams& p, cudaStream_t stream);

}  // namespace spin
