// SpinSelect: spin::launch_select over every (request, layer) in one launch.
//   inputs  V, D, last_seen, decode_steps, state_slot, context_lens, query_pos, request_id, step
//   outputs block_ids int32 [B, L, m_cap], counts int32 [B, L]
#include "plugins.h"

static_assert(spin::kMaxMCap == 33550335, "the m_cap field's help names kMaxMCap");

namespace spin_trt {
namespace {

enum : int32_t { kV, kD, kLastSeen, kDecodeSteps, kStateSlot, kContextLens, kQueryPos, kRequestId, kStep, kNbIn };

std::vector<char const*> const kNames = {"V", "D", "last_seen", "decode_steps", "state_slot", "context_lens",
                                         "query_pos", "request_id", "step", "block_ids", "counts"};

class SelectPlugin final : public SpinPluginBase {
 public:
  SelectPlugin(FieldValues fields, std::string name) : SpinPluginBase(std::move(fields), std::move(name)) {
    mRho = mFields.get("target_sparsity");
    mGamma = mFields.get("exploration");
    mPolicy = static_cast<int32_t>(mFields.getInt("policy"));
    mPooling = static_cast<int32_t>(mFields.getInt("pooling"));
    mIndexTopk = static_cast<int32_t>(mFields.getInt("index_topk"));
    mWarmup = static_cast<int32_t>(mFields.getInt("warmup_steps"));
    mKeepSink = mFields.getInt("keep_sink") != 0;
    mKeepNewest = mFields.getInt("keep_newest") != 0;
    mUnion = mFields.getInt("mtp_union") != 0;
    mSeed = static_cast<uint32_t>(mFields.getInt("seed"));
    mMaxContext = mFields.getInt("max_context");
    mMCap = static_cast<int32_t>(mFields.getInt("m_cap"));
  }

 protected:
  SpinPluginBase* copy() const override { return new SelectPlugin(*this); }
  int32_t minInputs() const override { return kNbIn; }
  int32_t maxInputs() const override { return kNbIn; }
  std::vector<char const*> const& ioNames() const override { return kNames; }

  TypeRule ioRule(int32_t pos, int32_t /*nbInputs*/) const override {
    if (pos < kStateInputs) return stateRule(pos);
    if (pos == kRequestId || pos == kStep) return TypeRule{{DataType::kINT64}, -1};
    return TypeRule{{DataType::kINT32}, -1};  // state_slot, context_lens, query_pos, outputs
  }

  void rankRange(int32_t i, int32_t& lo, int32_t& hi) const override {
    static int32_t const kRanks[kNbIn] = {3, 3, 3, 2, 1, 2, 2, 1, 1};
    lo = hi = kRanks[i];
  }

  void checkDims(DimCheck& c, int32_t /*nbInputs*/, bool concrete) const override {
    checkStateDims(c, concrete);
    checkRows(c, kContextLens);
    checkBatch(c, kStateSlot, kContextLens, "batch sizes differ");
    c.sameShape(kQueryPos, kContextLens);
    checkBatch(c, kRequestId, kContextLens, "batch sizes differ");
    checkBatch(c, kStep, kContextLens, "batch sizes differ");
    checkGridBatch(c, kContextLens, concrete);
  }

  bool outputShapes(DimsExprs const* in, int32_t /*nbInputs*/, DimsExprs* out, IExprBuilder& b) override {
    out[0].nbDims = 3;
    out[0].d[0] = in[kContextLens].d[0];
    out[0].d[1] = in[kV].d[1];
    out[0].d[2] = b.constant(mMCap);
    out[1].nbDims = 2;
    out[1].d[0] = in[kContextLens].d[0];
    out[1].d[1] = in[kV].d[1];
    return out[0].d[2] != nullptr;
  }

  cudaError_t launch(PluginTensorDesc const* in, int32_t /*nbInputs*/, void const* const* inputs,
                     void* const* outputs, cudaStream_t stream, std::string& /*err*/) override {
    spin::SelectParams p{};
    p.state = stateView(in, inputs);
    p.state_slot = static_cast<int32_t const*>(inputs[kStateSlot]);
    p.n = static_cast<int32_t const*>(inputs[kContextLens]);
    p.q = static_cast<int32_t const*>(inputs[kQueryPos]);
    p.request_id = static_cast<int64_t const*>(inputs[kRequestId]);
    p.step = static_cast<int64_t const*>(inputs[kStep]);
    p.batch = static_cast<int>(in[kContextLens].dims.d[0]);
    p.rows = static_cast<int>(in[kContextLens].dims.d[1]);
    p.rho = mRho;
    p.gamma = mGamma;
    p.index_topk = mIndexTopk;
    p.warmup_steps = mWarmup;
    p.keep_sink = mKeepSink;
    p.keep_newest = mKeepNewest;
    p.mtp_union = mUnion;
    p.pooling = mPooling;
    p.policy = mPolicy;
    p.seed = mSeed;
    p.block_ids = static_cast<int32_t*>(outputs[0]);
    p.counts = static_cast<int32_t*>(outputs[1]);
    p.m_cap = mMCap;
    p.max_context = effectiveMaxContext(mMaxContext, in[kV].dims.d[2]);
    p.max_blocks = (p.max_context + spin::kBlockSize - 1) / spin::kBlockSize;
    return spin::launch_select(p, stream);
  }

 private:
  double mRho{}, mGamma{};
  int32_t mPolicy{}, mPooling{}, mIndexTopk{}, mWarmup{}, mMCap{};
  bool mKeepSink{}, mKeepNewest{}, mUnion{};
  uint32_t mSeed{};
  int64_t mMaxContext{};
};

}  // namespace

PluginSpec const& selectSpec() {
  static PluginSpec const spec{
      "SpinSelect",
      {blockSizeField(),
       floatField("target_sparsity", 0.4, "must satisfy 0 <= target_sparsity < 1"),
       floatField("exploration", 0.05, "must satisfy 0 <= exploration < 1"),
       enumField("policy", 0, {"random", "staleness", "age"}, "must be 0/'random', 1/'staleness' or 2/'age'"),
       enumField("pooling", 0, {"max", "mean", "top4"}, "must be 0/'max', 1/'mean' or 2/'top4'"),
       intField("index_topk", false, 512, 1, spin::kMaxIndexTopK, "must satisfy 1 <= index_topk <= 2^20"),
       intField("warmup_steps", false, 1, 1, kInt32Max, "must satisfy 1 <= warmup_steps < 2^31"),
       boolField("keep_sink", true),
       boolField("keep_newest", true),
       boolField("mtp_union", true),
       intField("seed", false, 0, 0, 4294967295.0, "must satisfy 0 <= seed < 2^32"),
       maxContextField(),
       intField("m_cap", true, 0, 1, spin::kMaxMCap,
                "block-list width, 1 <= m_cap <= 33550335; ceil(max_context / 64) keeps every block")}};
  return spec;
}

SpinPluginBase* makeSelect(FieldValues fields, std::string name) {
  return new SelectPlugin(std::move(fields), std::move(name));
}

}  // namespace spin_trt
