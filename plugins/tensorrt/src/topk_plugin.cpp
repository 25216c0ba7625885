// SpinTopK: spin::launch_topk, top-K of the compact logits as request-local slot ids.
//   inputs  logits float32 [B*R, m_cap*64], block_ids, counts
//   output  topk int32 [B*R, index_topk], ascending, -1 padded
#include "plugins.h"

namespace spin_trt {
namespace {

enum : int32_t { kLogits, kIds, kCounts, kNbIn };

std::vector<char const*> const kNames = {"logits", "block_ids", "counts", "topk"};

class TopKPlugin final : public SpinPluginBase {
 public:
  TopKPlugin(FieldValues fields, std::string name) : SpinPluginBase(std::move(fields), std::move(name)) {
    mK = static_cast<int32_t>(mFields.getInt("index_topk"));
    mLayer = mFields.getInt("layer");
  }

 protected:
  SpinPluginBase* copy() const override { return new TopKPlugin(*this); }
  int32_t minInputs() const override { return kNbIn; }
  int32_t maxInputs() const override { return kNbIn; }
  std::vector<char const*> const& ioNames() const override { return kNames; }

  TypeRule ioRule(int32_t pos, int32_t /*nbInputs*/) const override {
    if (pos == kLogits) return TypeRule{{DataType::kFLOAT}, -1};
    return TypeRule{{DataType::kINT32}, -1};
  }

  void rankRange(int32_t i, int32_t& lo, int32_t& hi) const override {
    static int32_t const kLo[kNbIn] = {2, 2, 1};
    static int32_t const kHi[kNbIn] = {2, 3, 2};
    lo = kLo[i];
    hi = kHi[i];
  }

  void checkDims(DimCheck& c, int32_t /*nbInputs*/, bool concrete) const override {
    checkSelection(c, kIds, kCounts, mLayer, -1);
    if (!c.ok()) return;
    int64_t const mCap = c.at(kIds, c.rank(kIds) - 1);
    if (mCap >= 0) {
      std::string const what = "logits must be [B*R, m_cap*64] = [B*R, " + std::to_string(mCap * spin::kBlockSize) +
                               "] for block_ids " + dimsText(c.dims(kIds));
      c.equals(kLogits, 1, mCap * spin::kBlockSize, what.c_str());
    }
    // rows per request (next_n) = logits rows / batch
    int64_t const B = c.at(kIds, 0), rows = c.at(kLogits, 0);
    if (B > 0 && rows >= 0 && (rows % B != 0 || rows / B < 1 || rows / B > spin::kMaxNextN))
      c.fail("logits has " + std::to_string(rows) + " rows: must be B*R with B = " + std::to_string(B) +
             " (block_ids dim 0) and 1 <= R <= 8");
    if (B == 0 && rows > 0)  // nothing would be launched: the rows' top-K left unwritten
      c.fail("logits has " + std::to_string(rows) + " rows but block_ids holds no request: must be 0");
    if (concrete) c.within(kLogits, 0, 0, kInt32Max, "logits must have < 2^31 rows (one CTA each)");
  }

  bool outputShapes(DimsExprs const* in, int32_t /*nbInputs*/, DimsExprs* out, IExprBuilder& b) override {
    out[0].nbDims = 2;
    out[0].d[0] = in[kLogits].d[0];
    out[0].d[1] = b.constant(mK);
    return out[0].d[1] != nullptr;
  }

  cudaError_t launch(PluginTensorDesc const* in, int32_t /*nbInputs*/, void const* const* inputs,
                     void* const* outputs, cudaStream_t stream, std::string& err) override {
    spin::TopKParams p{};
    SelectionView const sel = selectionView(in, inputs, kIds, kCounts, mLayer);
    p.logits = static_cast<float const*>(inputs[kLogits]);
    if (!aligned16(p.logits)) {
      err = "logits must start at a 16-byte aligned address (the kernel loads 16 B at a time)";
      return cudaErrorInvalidValue;
    }
    p.block_ids = sel.ids;
    p.counts = sel.counts;
    p.batch = static_cast<int>(in[kIds].dims.d[0]);
    p.rows = p.batch > 0 ? static_cast<int>(in[kLogits].dims.d[0] / p.batch) : 0;
    p.m_cap = sel.mCap;
    p.k = mK;
    p.ids_stride = sel.idsStride;
    p.counts_stride = sel.countsStride;
    p.logits_stride = static_cast<int64_t>(sel.mCap) * spin::kBlockSize;  // [B*R, m_cap*64]
    p.out = static_cast<int32_t*>(outputs[0]);
    return spin::launch_topk(p, stream);
  }

 private:
  int32_t mK{};
  int64_t mLayer{-1};
};

}  // namespace

PluginSpec const& topkSpec() {
  static PluginSpec const spec{
      "SpinTopK",
      {blockSizeField(), intField("index_topk", true, 0, 1, spin::kMaxIndexTopK, "K of the top-K, 1 <= index_topk <= 2^20"),
       layerField(false)}};
  return spec;
}

SpinPluginBase* makeTopK(FieldValues fields, std::string name) {
  return new TopKPlugin(std::move(fields), std::move(name));
}

}  // namespace spin_trt
