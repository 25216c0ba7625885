// SpinIndexerLogits: spin::launch_indexer_logits, the indexer scores of the selected blocks only.
//   inputs  q, kv_cache, weights, context_lens, block_table, block_ids, counts
//   output  logits float32 [B*R, m_cap*64]
#include <cstdint>

#include "plugins.h"

namespace spin_trt {
namespace {

enum : int32_t { kQ, kKv, kWeights, kContextLens, kBlockTable, kIds, kCounts, kNbIn };

std::vector<char const*> const kNames = {"q", "kv_cache", "weights", "context_lens", "block_table",
                                         "block_ids", "counts", "logits"};

constexpr int64_t kPageBytes = static_cast<int64_t>(spin::kBlockSize) * spin::kSlotBytes;

class LogitsPlugin final : public SpinPluginBase {
 public:
  LogitsPlugin(FieldValues fields, std::string name) : SpinPluginBase(std::move(fields), std::move(name)) {
    mLayer = mFields.getInt("layer");
  }

 protected:
  SpinPluginBase* copy() const override { return new LogitsPlugin(*this); }
  int32_t minInputs() const override { return kNbIn; }
  int32_t maxInputs() const override { return kNbIn; }
  std::vector<char const*> const& ioNames() const override { return kNames; }

  TypeRule ioRule(int32_t pos, int32_t /*nbInputs*/) const override {
    switch (pos) {
      // byte tensors, read as fp8 e4m3 (q) and as pages of fp8 rows + fp32 scales (cache)
      case kQ: return TypeRule{{DataType::kFP8, DataType::kINT8, DataType::kUINT8}, -1};
      case kKv: return TypeRule{{DataType::kINT8, DataType::kUINT8, DataType::kFP8}, -1};
      case kWeights: return TypeRule{{DataType::kFLOAT}, -1};
      case kNbIn: return TypeRule{{DataType::kFLOAT}, -1};  // logits
      default: return TypeRule{{DataType::kINT32}, -1};
    }
  }

  void rankRange(int32_t i, int32_t& lo, int32_t& hi) const override {
    static int32_t const kLo[kNbIn] = {3, 2, 2, 2, 2, 2, 1};
    static int32_t const kHi[kNbIn] = {3, 8, 2, 2, 2, 3, 2};
    lo = kLo[i];
    hi = kHi[i];
  }

  void checkDims(DimCheck& c, int32_t /*nbInputs*/, bool concrete) const override {
    checkRows(c, kContextLens);
    c.equals(kQ, 1, spin::kHeads, "q must be [B*R, 64, 128] (64 heads x 128 fp8 bytes)");
    c.equals(kQ, 2, spin::kHeadDim, "q must be [B*R, 64, 128] (64 heads x 128 fp8 bytes)");
    int64_t const B = c.at(kContextLens, 0), R = c.at(kContextLens, 1), rows = c.at(kQ, 0);
    if (B >= 0 && R >= 0 && rows >= 0 && rows != B * R)
      c.fail("q has " + std::to_string(rows) + " rows, expected B*R = " + std::to_string(B * R) +
             " from context_lens " + dimsText(Dims{2, {B, R}}));
    c.same(kWeights, 0, kQ, 0, "rows differ");
    c.equals(kWeights, 1, spin::kHeads, "weights must be [B*R, 64]");
    int64_t page = 1;
    for (int32_t a = 1; a < c.rank(kKv); ++a) page = (page < 0 || c.at(kKv, a) < 0) ? -1 : page * c.at(kKv, a);
    if (page >= 0 && page != kPageBytes)
      c.fail("kv_cache must be pages of 64 x 132 bytes (e.g. [num_pages, 64, 1, 132]), got " +
             dimsText(c.dims(kKv)) + " (" + std::to_string(page) + " bytes per page)");
    if (concrete) c.within(kKv, 0, 1, kInt32Max, "kv_cache must hold at least one page");
    checkBatch(c, kBlockTable, kContextLens, "batch sizes differ");
    if (concrete) c.within(kBlockTable, 1, 0, kInt32Max, "block_table must have < 2^31 columns");
    checkBatch(c, kIds, kContextLens, "batch sizes differ");
    checkSelection(c, kIds, kCounts, mLayer, -1);
    checkGridBatch(c, kContextLens, concrete);
  }

  bool outputShapes(DimsExprs const* in, int32_t /*nbInputs*/, DimsExprs* out, IExprBuilder& b) override {
    out[0].nbDims = 2;
    out[0].d[0] = in[kQ].d[0];
    out[0].d[1] = prodConst(b, *in[kIds].d[in[kIds].nbDims - 1], spin::kBlockSize);
    return out[0].d[1] != nullptr;
  }

  cudaError_t launch(PluginTensorDesc const* in, int32_t /*nbInputs*/, void const* const* inputs,
                     void* const* outputs, cudaStream_t stream, std::string& err) override {
    spin::LogitsParams p{};
    p.q = static_cast<uint8_t const*>(inputs[kQ]);
    p.kv_cache = static_cast<uint8_t const*>(inputs[kKv]);
    p.weights = static_cast<float const*>(inputs[kWeights]);
    if (!aligned16(p.q) || !aligned16(p.kv_cache) || !aligned16(p.weights)) {
      err = "q, kv_cache and weights must start at 16-byte aligned addresses (the kernel loads 16 B "
            "at a time)";
      return cudaErrorInvalidValue;
    }
    p.context_lens = static_cast<int32_t const*>(inputs[kContextLens]);
    p.block_table = static_cast<int32_t const*>(inputs[kBlockTable]);
    SelectionView const sel = selectionView(in, inputs, kIds, kCounts, mLayer);
    p.block_ids = sel.ids;
    p.counts = sel.counts;
    p.batch = static_cast<int>(in[kContextLens].dims.d[0]);
    p.rows = static_cast<int>(in[kContextLens].dims.d[1]);
    p.m_cap = sel.mCap;
    p.max_pages = static_cast<int>(in[kBlockTable].dims.d[1]);
    p.num_pages = in[kKv].dims.d[0];
    p.table_stride = in[kBlockTable].dims.d[1];
    p.ids_stride = sel.idsStride;
    p.counts_stride = sel.countsStride;
    p.out = static_cast<float*>(outputs[0]);
    return spin::launch_indexer_logits(p, stream);
  }

 private:
  int64_t mLayer{-1};
};

}  // namespace

PluginSpec const& logitsSpec() {
  static PluginSpec const spec{"SpinIndexerLogits", {blockSizeField(), layerField(false)}};
  return spec;
}

SpinPluginBase* makeLogits(FieldValues fields, std::string name) {
  return new LogitsPlugin(std::move(fields), std::move(name));
}

}  // namespace spin_trt
