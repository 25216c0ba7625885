#include <algorithm>

#include "plugins.h"

namespace spin_trt {

FieldSpec intField(char const* name, bool required, double def, double lo, double hi, char const* rule) {
  return FieldSpec{name, FieldKind::kInt, required, def, lo, hi, {}, rule};
}

FieldSpec boolField(char const* name, bool def) {
  return FieldSpec{name, FieldKind::kBool, false, def ? 1.0 : 0.0, 0.0, 1.0, {}, "must be 0 or 1"};
}

FieldSpec floatField(char const* name, double def, char const* rule) {
  return FieldSpec{name, FieldKind::kFloat, false, def, 0.0, 1.0, {}, rule};
}

FieldSpec enumField(char const* name, double def, std::vector<char const*> names, char const* rule) {
  double const hi = static_cast<double>(names.size()) - 1.0;
  return FieldSpec{name, FieldKind::kEnum, false, def, 0.0, hi, std::move(names), rule};
}

FieldSpec blockSizeField() {
  return intField("block_size", false, spin::kBlockSize, spin::kBlockSize, spin::kBlockSize,
                  "must be 64: the kernels use 64-slot blocks (one indexer K-cache page)");
}

FieldSpec layerField(bool required) {
  if (required) return intField("layer", true, 0, 0, kInt32Max, "the indexer layer (state layer), >= 0");
  return intField("layer", false, -1, -1, kInt32Max,
                  "the indexer layer >= 0 whose slice of [B, L, m_cap] block_ids to use (-1: unset)");
}

FieldSpec maxContextField() {
  return intField("max_context", true, 0, 1, kInt32Max,
                  "the longest context the engine serves: 1 <= max_context < 2^31");
}

TypeRule stateRule(int32_t pos) {
  switch (pos) {
    case 0: return TypeRule{{DataType::kFLOAT, DataType::kHALF, DataType::kFP8}, -1};
    case 1: return TypeRule{{DataType::kFLOAT, DataType::kHALF, DataType::kFP8}, 0};
    default: return TypeRule{{DataType::kINT64}, -1};
  }
}

void checkStateDims(DimCheck& c, bool concrete) {
  constexpr int32_t V = 0, D = 1, LS = 2, DS = 3;
  c.sameShape(D, V);
  c.same(LS, 0, V, 0, "state slots differ");
  c.same(LS, 1, V, 1, "state layers differ");
  if (c.at(V, 2) >= 0) {
    int64_t const blocks = (c.at(V, 2) + spin::kBlockSize - 1) / spin::kBlockSize;
    std::string const what = "last_seen must be [S, L, ceil(cap / 64)] = [S, L, " + std::to_string(blocks) + "]";
    c.equals(LS, 2, blocks, what.c_str());
  }
  c.same(DS, 0, V, 0, "state slots differ");
  c.same(DS, 1, V, 1, "state layers differ");
  if (concrete) {
    c.within(V, 0, 0, kInt32Max, "V must be [S, L, cap] with S < 2^31");
    c.within(V, 1, 1, kInt32Max, "V must be [S, L, cap] with 1 <= L < 2^31");
    c.within(V, 2, 1, kInt32Max, "V must be [S, L, cap] with 1 <= cap < 2^31");
  }
}

spin::StateView stateView(PluginTensorDesc const* in, void const* const* inputs) {
  spin::StateView s{};
  s.V = const_cast<void*>(inputs[0]);
  s.D = const_cast<void*>(inputs[1]);
  s.last_seen = static_cast<int64_t*>(const_cast<void*>(inputs[2]));
  s.decode_steps = static_cast<int64_t*>(const_cast<void*>(inputs[3]));
  s.type = in[0].type == DataType::kHALF  ? spin::kStateF16
         : in[0].type == DataType::kFP8 ? spin::kStateE4M3
                                        : spin::kStateF32;
  s.cap = in[0].dims.d[2];
  s.block_cap = in[2].dims.d[2];
  s.num_layers = static_cast<int>(in[0].dims.d[1]);
  s.num_slots = static_cast<int>(in[0].dims.d[0]);
  return s;
}

int32_t effectiveMaxContext(int64_t maxContext, int64_t cap) {
  return static_cast<int32_t>(std::max<int64_t>(1, std::min(maxContext, cap)));
}

void checkRows(DimCheck& c, int32_t ctx) {
  c.within(ctx, 1, 1, spin::kMaxNextN, "context_lens must be [B, R] with 1 <= R (next_n) <= 8");
}

void checkBatch(DimCheck& c, int32_t vec, int32_t ctx, char const* what) {
  c.same(vec, 0, ctx, 0, what);
}

void checkGridBatch(DimCheck& c, int32_t ctx, bool concrete) {
  if (concrete) c.within(ctx, 0, 0, spin::kMaxGridYZ, "the batch (context_lens dim 0) must be <= 65535 (CUDA grid y)");
}

void checkSelection(DimCheck& c, int32_t ids, int32_t counts, int64_t layer, int64_t stateLayers) {
  bool const layered = c.rank(ids) == 3;
  if (c.rank(counts) != c.rank(ids) - 1) {
    c.fail(std::string(layered ? "counts must be [B, L] to match block_ids [B, L, m_cap]"
                               : "counts must be [B] to match block_ids [B, m_cap]") +
           ", got " + std::to_string(c.rank(counts)) + " dims");
    return;
  }
  c.same(counts, 0, ids, 0, "batch sizes differ");
  int32_t const last = c.rank(ids) - 1;
  static_assert(spin::kMaxMCap == 33550335, "the message below names kMaxMCap");
  c.within(ids, last, 0, spin::kMaxMCap, "block_ids m_cap (last dim) must be <= 33550335");
  if (!layered) return;
  c.same(counts, 1, ids, 1, "layers differ");
  if (layer < 0) {
    c.fail("block_ids is [B, L, m_cap]: set the field 'layer' to pick the slice");
    return;
  }
  if (c.at(ids, 1) >= 0 && layer >= c.at(ids, 1)) {
    c.fail("field 'layer' = " + std::to_string(layer) + " is outside block_ids' " + std::to_string(c.at(ids, 1)) +
           " layers");
  }
  if (stateLayers >= 0 && c.at(ids, 1) >= 0 && c.at(ids, 1) != stateLayers) {
    c.fail("block_ids has " + std::to_string(c.at(ids, 1)) + " layers, the state has " + std::to_string(stateLayers));
  }
}

SelectionView selectionView(PluginTensorDesc const* in, void const* const* inputs, int32_t ids, int32_t counts,
                            int64_t layer) {
  Dims const& d = in[ids].dims;
  SelectionView v{};
  v.ids = static_cast<int32_t const*>(inputs[ids]);
  v.counts = static_cast<int32_t const*>(inputs[counts]);
  if (d.nbDims == 3) {  // the [:, layer] slice: what the torch binding gets from a strided view
    v.mCap = static_cast<int32_t>(d.d[2]);
    v.idsStride = d.d[1] * d.d[2];
    v.countsStride = d.d[1];
    v.ids += layer * d.d[2];
    v.counts += layer;
  } else {
    v.mCap = static_cast<int32_t>(d.d[1]);
    v.idsStride = d.d[1];
    v.countsStride = 1;
  }
  return v;
}

}  // namespace spin_trt
