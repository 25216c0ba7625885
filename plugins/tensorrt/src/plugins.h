// The four SPIN plugins (one .cpp each) and the checks/views they share.
#pragma once

#include "common.h"
#include "spin/spin_kernels.h"

namespace spin_trt {

// Field constructors for the plugin specs.
FieldSpec intField(char const* name, bool required, double def, double lo, double hi, char const* rule);
FieldSpec boolField(char const* name, bool def);
FieldSpec floatField(char const* name, double def, char const* rule);  // [0, 1)
FieldSpec enumField(char const* name, double def, std::vector<char const*> names, char const* rule);
FieldSpec blockSizeField();
FieldSpec layerField(bool required);
FieldSpec maxContextField();

// State inputs at positions 0..3: V, D [S, L, cap] float32/float16/fp8 e4m3 (same dtype), last_seen
// int64 [S, L, ceil(cap / 64)], decode_steps int64 [S, L].
constexpr int32_t kStateInputs = 4;
TypeRule stateRule(int32_t pos);
void checkStateDims(DimCheck& c, bool concrete);
// The state written in place through the input pointers (the pattern of TensorRT-LLM's
// gptAttention KV cache: the plugin mutates buffers that the runtime owns and binds).
spin::StateView stateView(PluginTensorDesc const* in, void const* const* inputs);
// The kernels clamp context lengths to this; like SpinIndexer it never exceeds the state's
// capacity, so a runtime can grow the state (cap) without rebuilding the engine.
int32_t effectiveMaxContext(int64_t maxContext, int64_t cap);

// context_lens [B, R] (1 <= R <= 8); state_slot/query_pos/... checked against it.
void checkRows(DimCheck& c, int32_t ctx);
void checkBatch(DimCheck& c, int32_t vec, int32_t ctx, char const* what);  // vec is [B]
// Every launcher puts the batch on gridDim.y.
void checkGridBatch(DimCheck& c, int32_t ctx, bool concrete);

// block_ids int32 [B, m_cap] or [B, L, m_cap] (then counts [B, L] and the plugin's `layer`
// picks the slice without a copy), counts int32 [B] or [B, L].
void checkSelection(DimCheck& c, int32_t ids, int32_t counts, int64_t layer, int64_t stateLayers);
struct SelectionView {
  int32_t const* ids;
  int32_t const* counts;
  int32_t mCap;
  int64_t idsStride, countsStride;
};
SelectionView selectionView(PluginTensorDesc const* in, void const* const* inputs, int32_t ids,
                            int32_t counts, int64_t layer);

using PluginFactory = SpinPluginBase* (*)(FieldValues, std::string);
PluginSpec const& selectSpec();
PluginSpec const& logitsSpec();
PluginSpec const& topkSpec();
PluginSpec const& updateSpec();
SpinPluginBase* makeSelect(FieldValues fields, std::string name);
SpinPluginBase* makeLogits(FieldValues fields, std::string name);
SpinPluginBase* makeTopK(FieldValues fields, std::string name);
SpinPluginBase* makeUpdate(FieldValues fields, std::string name);

}  // namespace spin_trt
