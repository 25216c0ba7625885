// SpinUpdate: spin::launch_update, the EMA of V/D for one layer, written in place.
//   inputs  V, D, last_seen, decode_steps (mutated), state_slot, logits, block_ids, counts,
//           context_lens, query_pos, accepted, step, then any number of ordering tokens
//           (never read: they only make TensorRT run this after the layers producing them)
//   output  done int32 [1] (written 0): a token to mark as a network output or chain on
#include "plugins.h"

namespace spin_trt {
namespace {

enum : int32_t {
  kV, kD, kLastSeen, kDecodeSteps, kStateSlot, kLogits, kIds, kCounts, kContextLens, kQueryPos, kAccepted, kStep, kNbIn
};

std::vector<char const*> const kNames = {"V",         "D",      "last_seen",    "decode_steps", "state_slot",
                                         "logits",    "block_ids", "counts",    "context_lens", "query_pos",
                                         "accepted",  "step",   "done"};

class UpdatePlugin final : public SpinPluginBase {
 public:
  UpdatePlugin(FieldValues fields, std::string name) : SpinPluginBase(std::move(fields), std::move(name)) {
    mLayer = mFields.getInt("layer");
    mDecay = mFields.get("ema_decay");
    mRow0 = mFields.getInt("row0_only") != 0;
    mMaxContext = mFields.getInt("max_context");
  }

 protected:
  SpinPluginBase* copy() const override { return new UpdatePlugin(*this); }
  int32_t minInputs() const override { return kNbIn; }
  int32_t maxInputs() const override { return -1; }
  std::vector<char const*> const& ioNames() const override { return kNames; }

  TypeRule ioRule(int32_t pos, int32_t nbInputs) const override {
    if (pos < kStateInputs) return stateRule(pos);
    if (pos >= nbInputs) return TypeRule{{DataType::kINT32}, -1};  // done
    if (pos >= kNbIn) {  // ordering tokens: any dtype TensorRT hands over whole bytes of
      return TypeRule{{DataType::kINT32, DataType::kINT64, DataType::kFLOAT, DataType::kHALF, DataType::kBF16,
                       DataType::kINT8, DataType::kUINT8, DataType::kFP8, DataType::kBOOL},
                      -1};
    }
    if (pos == kLogits) return TypeRule{{DataType::kFLOAT}, -1};
    if (pos == kStep) return TypeRule{{DataType::kINT64}, -1};
    return TypeRule{{DataType::kINT32}, -1};
  }

  void rankRange(int32_t i, int32_t& lo, int32_t& hi) const override {
    static int32_t const kLo[kNbIn] = {3, 3, 3, 2, 1, 2, 2, 1, 2, 2, 1, 1};
    static int32_t const kHi[kNbIn] = {3, 3, 3, 2, 1, 2, 3, 2, 2, 2, 1, 1};
    lo = i < kNbIn ? kLo[i] : 0;
    hi = i < kNbIn ? kHi[i] : nvinfer1::Dims::MAX_DIMS;
  }

  void checkDims(DimCheck& c, int32_t /*nbInputs*/, bool concrete) const override {
    checkStateDims(c, concrete);
    if (c.at(kV, 1) >= 0 && mLayer >= c.at(kV, 1))
      c.fail("field 'layer' = " + std::to_string(mLayer) + " is outside the state's " + std::to_string(c.at(kV, 1)) +
             " layers");
    checkRows(c, kContextLens);
    checkBatch(c, kStateSlot, kContextLens, "batch sizes differ");
    c.sameShape(kQueryPos, kContextLens);
    checkBatch(c, kAccepted, kContextLens, "batch sizes differ");
    checkBatch(c, kStep, kContextLens, "batch sizes differ");
    checkBatch(c, kIds, kContextLens, "batch sizes differ");
    checkSelection(c, kIds, kCounts, mLayer, c.at(kV, 1));
    if (!c.ok()) return;
    int64_t const B = c.at(kContextLens, 0), R = c.at(kContextLens, 1), rows = c.at(kLogits, 0);
    if (B >= 0 && R >= 0 && rows >= 0 && rows != B * R)
      c.fail("logits has " + std::to_string(rows) + " rows, expected B*R = " + std::to_string(B * R) +
             " from context_lens " + dimsText(c.dims(kContextLens)));
    int64_t const mCap = c.at(kIds, c.rank(kIds) - 1);
    if (mCap >= 0) {
      std::string const what = "logits must be [B*R, m_cap*64] = [B*R, " + std::to_string(mCap * spin::kBlockSize) +
                               "] for block_ids " + dimsText(c.dims(kIds));
      c.equals(kLogits, 1, mCap * spin::kBlockSize, what.c_str());
    }
    checkGridBatch(c, kContextLens, concrete);
  }

  bool outputShapes(DimsExprs const* /*in*/, int32_t /*nbInputs*/, DimsExprs* out, IExprBuilder& b) override {
    out[0].nbDims = 1;
    out[0].d[0] = b.constant(1);
    return out[0].d[0] != nullptr;
  }

  cudaError_t launch(PluginTensorDesc const* in, int32_t /*nbInputs*/, void const* const* inputs,
                     void* const* outputs, cudaStream_t stream, std::string& err) override {
    spin::UpdateParams p{};
    p.state = stateView(in, inputs);
    p.layer = static_cast<int>(mLayer);
    p.state_slot = static_cast<int32_t const*>(inputs[kStateSlot]);
    p.logits = static_cast<float const*>(inputs[kLogits]);
    if (!aligned16(p.logits)) {
      err = "logits must start at a 16-byte aligned address (the kernel loads 16 B at a time)";
      return cudaErrorInvalidValue;
    }
    SelectionView const sel = selectionView(in, inputs, kIds, kCounts, mLayer);
    p.block_ids = sel.ids;
    p.counts = sel.counts;
    p.n = static_cast<int32_t const*>(inputs[kContextLens]);
    p.q = static_cast<int32_t const*>(inputs[kQueryPos]);
    p.accepted = static_cast<int32_t const*>(inputs[kAccepted]);
    p.step = static_cast<int64_t const*>(inputs[kStep]);
    p.batch = static_cast<int>(in[kContextLens].dims.d[0]);
    p.rows = static_cast<int>(in[kContextLens].dims.d[1]);
    p.m_cap = sel.mCap;
    p.ids_stride = sel.idsStride;
    p.counts_stride = sel.countsStride;
    p.logits_stride = static_cast<int64_t>(sel.mCap) * spin::kBlockSize;  // [B*R, m_cap*64]
    p.alpha = static_cast<float>(mDecay);
    p.one_minus_alpha = static_cast<float>(1.0 - mDecay);  // 1 - a in double, as the torch binding
    p.row0_only = mRow0;
    p.max_context = effectiveMaxContext(mMaxContext, in[kV].dims.d[2]);
    p.max_blocks = (p.max_context + spin::kBlockSize - 1) / spin::kBlockSize;
    cudaError_t const status = spin::launch_update(p, stream);
    if (status != cudaSuccess) return status;
    return cudaMemsetAsync(outputs[0], 0, sizeof(int32_t), stream);
  }

 private:
  int64_t mLayer{};
  double mDecay{};
  bool mRow0{};
  int64_t mMaxContext{};
};

}  // namespace

PluginSpec const& updateSpec() {
  static PluginSpec const spec{
      "SpinUpdate",
      {blockSizeField(), layerField(true), floatField("ema_decay", 0.5, "must satisfy 0 <= ema_decay < 1"),
       boolField("row0_only", false),
       maxContextField()}};
  return spec;
}

SpinPluginBase* makeUpdate(FieldValues fields, std::string name) {
  return new UpdatePlugin(std::move(fields), std::move(name));
}

}  // namespace spin_trt
