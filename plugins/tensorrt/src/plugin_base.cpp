// SpinPluginBase (common.h): the IPluginV3 parts every SPIN plugin shares, input/output counts,
// dtype and dimension checks at build and run time, error reporting, serialization of the
// fields. A plugin supplies its names, rules, output shapes and launch.
#include "common.h"

#include <string>
#include <vector>
#include <cuda_runtime_api.h>

namespace spin_trt {

// ---- the IPluginV3 base --------------------------------------------------------------------------
SpinPluginBase::SpinPluginBase(FieldValues fields, std::string layerName)
    : mFields(std::move(fields)), mLayerName(std::move(layerName)) {}

IPluginCapability* SpinPluginBase::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept {
  switch (type) {
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
  }
  return nullptr;
}

IPluginV3* SpinPluginBase::clone() noexcept {
  try {
    return copy();
  } catch (std::exception const& e) {
    fail(ErrorCode::kFAILED_ALLOCATION, std::string("clone failed: ") + e.what());
  } catch (...) {
    fail(ErrorCode::kFAILED_ALLOCATION, "clone failed");
  }
  return nullptr;
}

char const* SpinPluginBase::getPluginName() const noexcept { return mFields.spec()->name; }

void SpinPluginBase::fail(ErrorCode code, std::string const& msg) const noexcept {
  try {
    std::string text = getPluginName();
    if (!mLayerName.empty()) text += " '" + mLayerName + "'";
    text += ": " + msg;
    if (mRecorder) mRecorder->reportError(code, text.c_str());
    logMessage(ILogger::Severity::kERROR, text);
  } catch (...) {
  }
}

std::string SpinPluginBase::ioName(int32_t pos) const {
  // inputs only: past the fixed inputs come SpinUpdate's ordering tokens
  if (pos < minInputs()) return ioNames()[pos];
  return "ordering token " + std::to_string(pos - minInputs());
}

bool SpinPluginBase::checkInputCount(int32_t nbInputs) const {
  int32_t const lo = minInputs(), hi = maxInputs();
  if (nbInputs >= lo && (hi < 0 || nbInputs <= hi)) return true;
  std::string msg = "takes " + std::to_string(lo) + (hi < 0 ? "+" : hi == lo ? "" : ".." + std::to_string(hi)) +
                    " inputs (";
  for (int32_t i = 0; i < lo; ++i) msg += (i ? ", " : "") + ioName(i);
  msg += "), got " + std::to_string(nbInputs);
  fail(ErrorCode::kINVALID_ARGUMENT, msg);
  return false;
}

bool SpinPluginBase::checkOutputCount(int32_t nbOutputs) const {
  if (nbOutputs == getNbOutputs()) return true;
  fail(ErrorCode::kINVALID_ARGUMENT,
       "has " + std::to_string(getNbOutputs()) + " outputs, TensorRT asked for " + std::to_string(nbOutputs));
  return false;
}

bool SpinPluginBase::checkRanks(int32_t const* ranks, int32_t nbInputs, std::string& err) const {
  for (int32_t i = 0; i < nbInputs; ++i) {
    int32_t lo = 0, hi = 0;
    rankRange(i, lo, hi);
    if (ranks[i] < lo || ranks[i] > hi) {
      err = ioName(i) + " must have " + std::to_string(lo) + (hi == lo ? "" : ".." + std::to_string(hi)) +
            " dims, got " + std::to_string(ranks[i]);
      return false;
    }
  }
  return true;
}

bool SpinPluginBase::checkAll(Dims const* dims, int32_t nbInputs, bool concrete, std::string& err) const {
  std::vector<int32_t> ranks(nbInputs);
  for (int32_t i = 0; i < nbInputs; ++i) ranks[i] = dims[i].nbDims;
  if (!checkRanks(ranks.data(), nbInputs, err)) return false;
  DimCheck c(ioNames(), dims, nbInputs);
  checkDims(c, nbInputs, concrete);
  err = c.error();
  return c.ok();
}

int32_t SpinPluginBase::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                        DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept {
  try {
    return checkIo(nbInputs, nbOutputs, false, [&](int32_t i) { return in[i].desc.dims; });
  } catch (...) {
    fail(ErrorCode::kINTERNAL_ERROR, "configurePlugin failed");
    return -1;
  }
}

int32_t SpinPluginBase::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                                           int32_t nbInputs) const noexcept {
  try {
    if (!checkInputCount(nbInputs)) return -1;
    if (!checkOutputCount(nbOutputs)) return -1;
    for (int32_t i = 0; i < nbInputs; ++i) {
      TypeRule const rule = ioRule(i, nbInputs);
      bool ok = false;
      for (DataType t : rule.allowed) ok = ok || t == inputTypes[i];
      if (!ok) {
        std::string msg = ioName(i) + " must be ";
        for (size_t k = 0; k < rule.allowed.size(); ++k) msg += (k ? "/" : "") + std::string(typeName(rule.allowed[k]));
        fail(ErrorCode::kINVALID_ARGUMENT, msg + ", got " + typeName(inputTypes[i]));
        return -1;
      }
      if (rule.sameAs >= 0 && inputTypes[rule.sameAs] != inputTypes[i]) {
        fail(ErrorCode::kINVALID_ARGUMENT, ioName(i) + " must have the dtype of " + ioName(rule.sameAs) + " (" +
                                               typeName(inputTypes[rule.sameAs]) + "), got " +
                                               typeName(inputTypes[i]));
        return -1;
      }
    }
    for (int32_t k = 0; k < nbOutputs; ++k) outputTypes[k] = ioRule(nbInputs + k, nbInputs).allowed.front();
    return 0;
  } catch (...) {
    fail(ErrorCode::kINTERNAL_ERROR, "getOutputDataTypes failed");
    return -1;
  }
}

int32_t SpinPluginBase::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                                        int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                                        IExprBuilder& exprBuilder) noexcept {
  try {
    if (!checkInputCount(nbInputs)) return -1;
    if (!checkOutputCount(nbOutputs)) return -1;
    // what is already known (constant extents) is checked now, at network construction
    std::vector<Dims> dims(nbInputs);
    for (int32_t i = 0; i < nbInputs; ++i) {
      dims[i].nbDims = inputs[i].nbDims;
      for (int32_t a = 0; a < inputs[i].nbDims && a < Dims::MAX_DIMS; ++a)
        dims[i].d[a] = inputs[i].d[a]->isConstant() ? inputs[i].d[a]->getConstantValue() : -1;
    }
    std::string err;
    if (!checkAll(dims.data(), nbInputs, false, err)) {
      fail(ErrorCode::kINVALID_ARGUMENT, err);
      return -1;
    }
    if (!outputShapes(inputs, nbInputs, outputs, exprBuilder)) {
      fail(ErrorCode::kINTERNAL_ERROR, "could not build the output shape expressions");
      return -1;
    }
    return 0;
  } catch (...) {
    fail(ErrorCode::kINTERNAL_ERROR, "getOutputShapes failed");
    return -1;
  }
}

bool SpinPluginBase::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                               int32_t nbOutputs) noexcept {
  try {
    int32_t const lo = minInputs(), hi = maxInputs();
    if (nbInputs < lo || (hi >= 0 && nbInputs > hi) || nbOutputs != getNbOutputs()) return false;
    if (pos < 0 || pos >= nbInputs + nbOutputs) return false;
    PluginTensorDesc const& d = inOut[pos].desc;
    if (d.format != nvinfer1::TensorFormat::kLINEAR) return false;
    TypeRule const rule = ioRule(pos, nbInputs);
    bool ok = false;
    for (DataType t : rule.allowed) ok = ok || t == d.type;
    return ok && (rule.sameAs < 0 || inOut[rule.sameAs].desc.type == d.type);
  } catch (...) {
    return false;
  }
}

int32_t SpinPluginBase::getNbOutputs() const noexcept {
  return static_cast<int32_t>(ioNames().size()) - minInputs();
}

size_t SpinPluginBase::getWorkspaceSize(DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
                                        DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept {
  // The launchers allocate nothing and keep no scratch: block lists, logits and state are
  // plugin inputs/outputs, so the workspace is empty by design.
  return 0;
}

char const* SpinPluginBase::getMetadataString() noexcept {
  try {
    mMetadata = std::string(getPluginName()) + " " + mFields.describe();
    return mMetadata.c_str();
  } catch (...) {
    return nullptr;
  }
}

int32_t SpinPluginBase::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* /*out*/,
                                      int32_t nbOutputs) noexcept {
  try {
    return checkIo(nbInputs, nbOutputs, true, [&](int32_t i) { return in[i].dims; });
  } catch (...) {
    fail(ErrorCode::kINTERNAL_ERROR, "onShapeChange failed");
    return -1;
  }
}

namespace {
int64_t volume(Dims const& d) {
  int64_t v = 1;
  for (int32_t i = 0; i < d.nbDims; ++i) v *= d.d[i] < 0 ? 0 : d.d[i];
  return v;
}
}  // namespace

int32_t SpinPluginBase::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
                                void const* const* inputs, void* const* outputs, void* /*workspace*/,
                                cudaStream_t stream) noexcept {
  try {
    // enqueue is not told the input count; trailing inputs past minInputs() are ordering
    // tokens that are never read, so the fixed inputs are all there is to check.
    int32_t const nbInputs = minInputs();
    std::vector<Dims> dims(nbInputs);
    for (int32_t i = 0; i < nbInputs; ++i) dims[i] = inputDesc[i].dims;
    std::string err;
    if (!checkAll(dims.data(), nbInputs, true, err)) {
      fail(ErrorCode::kINVALID_ARGUMENT, err);
      return -1;
    }
    for (int32_t i = 0; i < nbInputs; ++i) {
      if (inputs[i] == nullptr && volume(inputDesc[i].dims) > 0) {
        fail(ErrorCode::kINVALID_ARGUMENT, ioName(i) + " " + dimsText(inputDesc[i].dims) + " has no device address");
        return -1;
      }
    }
    for (int32_t k = 0; k < getNbOutputs(); ++k) {
      if (outputs[k] == nullptr && volume(outputDesc[k].dims) > 0) {
        fail(ErrorCode::kINVALID_ARGUMENT, std::string(ioNames()[nbInputs + k]) + " has no device address");
        return -1;
      }
    }
    cudaError_t const status = launch(inputDesc, nbInputs, inputs, outputs, stream, err);
    if (!err.empty()) {
      fail(ErrorCode::kINVALID_ARGUMENT, err);
      return -1;
    }
    if (status != cudaSuccess) {
      fail(ErrorCode::kFAILED_EXECUTION, std::string("kernel launch failed: ") + cudaGetErrorName(status) + " (" +
                                             cudaGetErrorString(status) + ")");
      return -1;
    }
    return 0;
  } catch (...) {
    fail(ErrorCode::kINTERNAL_ERROR, "enqueue failed");
    return -1;
  }
}

IPluginV3* SpinPluginBase::attachToContext(IPluginResourceContext* context) noexcept {
  try {
    SpinPluginBase* p = copy();
    p->mRecorder = context ? context->getErrorRecorder() : nullptr;
    return p;
  } catch (...) {
    fail(ErrorCode::kFAILED_ALLOCATION, "attachToContext failed");
    return nullptr;
  }
}

PluginFieldCollection const* SpinPluginBase::getFieldsToSerialize() noexcept {
  try {
    return mFields.serialize();
  } catch (...) {
    fail(ErrorCode::kFAILED_ALLOCATION, "getFieldsToSerialize failed");
    return nullptr;
  }
}

}  // namespace spin_trt
