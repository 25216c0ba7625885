// Shared pieces of the SPIN TensorRT plugins: logging, plugin fields (parse, validate,
// serialize) and dimension checks (common.cpp), and the IPluginV3 base that the four plugins
// derive from (plugin_base.cpp).
// The plugins are thin adapters: every launch goes to cpp/include/spin/spin_kernels.h.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace spin_trt {

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::ErrorCode;
using nvinfer1::IDimensionExpr;
using nvinfer1::IErrorRecorder;
using nvinfer1::IExprBuilder;
using nvinfer1::ILogger;
using nvinfer1::IPluginCapability;
using nvinfer1::IPluginResourceContext;
using nvinfer1::IPluginV3;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::PluginTensorDesc;

constexpr char const* kPluginVersion = "1";
constexpr char const* kPluginNamespace = "";
constexpr int64_t kInt32Max = 2147483647;

// ---- logging: through TensorRT's logger when the library was handed a finder ----------------------
void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;
void logMessage(ILogger::Severity severity, std::string const& msg) noexcept;

// ---- fields --------------------------------------------------------------------------------------
enum class FieldKind : int32_t { kInt, kBool, kFloat, kEnum };

struct FieldSpec {
  char const* name;
  FieldKind kind;
  bool required;
  double def;                  // default when not required
  double lo, hi;               // ints and enums: [lo, hi]; floats: [lo, hi)
  std::vector<char const*> names;  // kEnum: value i is names[i] (also accepted as a string)
  char const* rule;            // said in the error when the value is out of range
};

struct PluginSpec {
  char const* name;
  std::vector<FieldSpec> fields;
};

// Values of one plugin's fields, in spec order (every value fits a double exactly).
class FieldValues {
 public:
  explicit FieldValues(PluginSpec const* spec);
  // Parses a collection: unknown, duplicate, mistyped, out-of-range or missing fields fail
  // with a message naming the field.
  bool parse(PluginFieldCollection const* fc, std::string& err);
  double get(char const* name) const;
  int64_t getInt(char const* name) const { return static_cast<int64_t>(get(name)); }
  std::string describe() const;
  // INT64 / FLOAT64 fields pointing into this object; valid until the next call.
  PluginFieldCollection const* serialize();
  PluginSpec const* spec() const { return mSpec; }

 private:
  PluginSpec const* mSpec;
  std::vector<double> mValues;
  std::vector<int64_t> mInts;
  std::vector<double> mFloats;
  std::vector<PluginField> mFields;
  PluginFieldCollection mCollection{};
};

// ---- dimension checks ----------------------------------------------------------------------------
std::string dimsText(Dims const& d);
char const* typeName(DataType t);

// Checks over the input dims of one plugin call; a -1 extent (build time) matches anything.
class DimCheck {
 public:
  DimCheck(std::vector<char const*> const& names, Dims const* dims, int32_t nb)
      : mNames(names), mDims(dims), mNb(nb) {}
  bool ok() const { return mErr.empty(); }
  std::string const& error() const { return mErr; }
  int64_t at(int32_t i, int32_t axis) const { return mDims[i].d[axis]; }
  int32_t rank(int32_t i) const { return mDims[i].nbDims; }
  Dims const& dims(int32_t i) const { return mDims[i]; }

  void rankIs(int32_t i, int32_t r);
  void rankIn(int32_t i, int32_t lo, int32_t hi);
  // dims[i][a] == dims[j][b] where both are known
  void same(int32_t i, int32_t a, int32_t j, int32_t b, char const* what);
  void sameShape(int32_t i, int32_t j);
  void equals(int32_t i, int32_t a, int64_t v, char const* what);
  void within(int32_t i, int32_t a, int64_t lo, int64_t hi, char const* what);
  void fail(std::string msg);

 private:
  std::vector<char const*> const& mNames;
  Dims const* mDims;
  int32_t mNb;
  std::string mErr;
};

// ---- the IPluginV3 base --------------------------------------------------------------------------
// Allowed dtypes of one input/output position; sameAs >= 0: must equal that position's dtype.
struct TypeRule {
  std::vector<DataType> allowed;
  int32_t sameAs{-1};
};

class SpinPluginBase : public IPluginV3,
                       public nvinfer1::IPluginV3OneCore,
                       public nvinfer1::IPluginV3OneBuild,
                       public nvinfer1::IPluginV3OneRuntime {
 public:
  SpinPluginBase(FieldValues fields, std::string layerName);
  ~SpinPluginBase() override = default;

  // IPluginV3
  IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
  IPluginV3* clone() noexcept override;

  // IPluginV3OneCore
  char const* getPluginName() const noexcept override;
  char const* getPluginVersion() const noexcept override { return kPluginVersion; }
  char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

  // IPluginV3OneBuild
  int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                          DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
  int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                             int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* shapeInputs,
                          int32_t nbShapeInputs, DimsExprs* outputs, int32_t nbOutputs,
                          IExprBuilder& exprBuilder) noexcept override;
  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  int32_t getNbOutputs() const noexcept override;
  size_t getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                          DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
  char const* getMetadataString() noexcept override;

  // IPluginV3OneRuntime
  int32_t onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out,
                        int32_t nbOutputs) noexcept override;
  int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
                  void const* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override;
  IPluginV3* attachToContext(IPluginResourceContext* context) noexcept override;
  PluginFieldCollection const* getFieldsToSerialize() noexcept override;

 protected:
  virtual SpinPluginBase* copy() const = 0;
  virtual int32_t minInputs() const = 0;
  virtual int32_t maxInputs() const = 0;   // -1: any number of trailing ordering tokens
  virtual std::vector<char const*> const& ioNames() const = 0;   // inputs, then outputs
  virtual TypeRule ioRule(int32_t pos, int32_t nbInputs) const = 0;
  // allowed ranks [lo, hi] of input i; checked before any extent is read
  virtual void rankRange(int32_t i, int32_t& lo, int32_t& hi) const = 0;
  virtual bool outputShapes(DimsExprs const* in, int32_t nbInputs, DimsExprs* out,
                            IExprBuilder& b) = 0;
  // concrete: every extent is known (run time); otherwise -1 extents match anything.
  virtual void checkDims(DimCheck& c, int32_t nbInputs, bool concrete) const = 0;
  virtual cudaError_t launch(PluginTensorDesc const* in, int32_t nbInputs, void const* const* inputs,
                             void* const* outputs, cudaStream_t stream, std::string& err) = 0;

  void fail(ErrorCode code, std::string const& msg) const noexcept;
  bool checkRanks(int32_t const* ranks, int32_t nbInputs, std::string& err) const;
  bool checkAll(Dims const* dims, int32_t nbInputs, bool concrete, std::string& err) const;
  bool checkInputCount(int32_t nbInputs) const;
  bool checkOutputCount(int32_t nbOutputs) const;
  // configurePlugin / onShapeChange: counts, then every input's dims (dimsOf(i)); 0 or -1
  template <typename DimsOf>
  int32_t checkIo(int32_t nbInputs, int32_t nbOutputs, bool concrete, DimsOf dimsOf) const {
    if (!checkInputCount(nbInputs) || !checkOutputCount(nbOutputs)) return -1;
    std::vector<Dims> dims(nbInputs);
    for (int32_t i = 0; i < nbInputs; ++i) dims[i] = dimsOf(i);
    std::string err;
    if (!checkAll(dims.data(), nbInputs, concrete, err)) {
      fail(ErrorCode::kINVALID_ARGUMENT, err);
      return -1;
    }
    return 0;
  }
  std::string ioName(int32_t pos) const;

  FieldValues mFields;
  std::string mLayerName;
  std::string mMetadata;
  IErrorRecorder* mRecorder{nullptr};
};

// Output extents from input extents, as expressions.
// The kernels load 16 bytes at a time from q, kv_cache, weights and logits.
inline bool aligned16(void const* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline IDimensionExpr const* prodConst(IExprBuilder& b, IDimensionExpr const& e, int64_t k) {
  return b.operation(nvinfer1::DimensionOperation::kPROD, e, *b.constant(k));
}

}  // namespace spin_trt
