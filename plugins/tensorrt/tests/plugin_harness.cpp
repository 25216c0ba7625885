// plugin_harness: drives libspin_trtllm_plugins.so the way TensorRT does, with no libnvinfer:
// the library is dlopen'ed and its getCreators/setLoggerFinder called; the few TensorRT
// objects a plugin is handed (IExprBuilder, IDimensionExpr, IErrorRecorder,
// IPluginResourceContext, ILogger) are small fakes here.
//   plugin_harness check LIB             creators, fields, dtypes, shapes, formats, serialization
//                                        round trips, clone, and the errors (no GPU needed)
//   plugin_harness fields LIB            one line per creator: NAME VERSION field:TYPE ...
//   plugin_harness run LIB CASE [--dry]  run the calls of CASE/case.txt on the GPU (the format is
//                                        written by spin_trtllm/integrations/tensorrt/harness.py);
//                                        --dry stops before enqueue (no GPU needed)
// Exit: 0 ok, 1 a check or call failed, 2 usage, 3 run without a CUDA device.
#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace {

// ---- fakes of what TensorRT hands a plugin -------------------------------------------------------
class Logger final : public ILogger {
 public:
  void log(Severity severity, char const* msg) noexcept override {
    mMessages.emplace_back(severity, msg ? msg : "");
    if (mEcho && severity <= Severity::kWARNING) std::fprintf(stderr, "[plugin] %s\n", msg);
  }
  size_t mark() const { return mMessages.size(); }
  // every error logged since mark, one per line
  std::string errorsSince(size_t mark) const {
    std::string out;
    for (size_t i = mark; i < mMessages.size(); ++i)
      if (mMessages[i].first <= Severity::kERROR) out += mMessages[i].second + "\n";
    return out;
  }
  bool mEcho{false};

 private:
  std::vector<std::pair<Severity, std::string>> mMessages;
};

class Finder final : public ILoggerFinder {
 public:
  explicit Finder(ILogger* logger) : mLogger(logger) {}
  ILogger* findLogger() override { return mLogger; }

 private:
  ILogger* mLogger;
};

class Recorder final : public IErrorRecorder {
 public:
  int32_t getNbErrors() const noexcept override { return static_cast<int32_t>(mErrors.size()); }
  ErrorCode getErrorCode(int32_t i) const noexcept override { return mErrors.at(i).first; }
  ErrorDesc getErrorDesc(int32_t i) const noexcept override { return mErrors.at(i).second.c_str(); }
  bool hasOverflowed() const noexcept override { return false; }
  void clear() noexcept override { mErrors.clear(); }
  bool reportError(ErrorCode code, ErrorDesc desc) noexcept override {
    mErrors.emplace_back(code, desc ? desc : "");
    return true;
  }
  RefCount incRefCount() noexcept override { return ++mRefs; }
  RefCount decRefCount() noexcept override { return --mRefs; }

 private:
  std::vector<std::pair<ErrorCode, std::string>> mErrors;
  RefCount mRefs{0};
};

class ResourceContext final : public IPluginResourceContext {
 public:
  explicit ResourceContext(IErrorRecorder* recorder) : mRecorder(recorder) {}
  IGpuAllocator* getGpuAllocator() const noexcept override { return nullptr; }
  IErrorRecorder* getErrorRecorder() const noexcept override { return mRecorder; }

 private:
  IErrorRecorder* mRecorder;
};

// A dimension expression: a constant, or a symbol / formula kept as text so that output shapes
// built from symbolic input extents can be compared as strings.
class Expr final : public IDimensionExpr, public apiv::VDimensionExpr {
 public:
  explicit Expr(int64_t v) : mConst(true), mValue(v), mText(std::to_string(v)) { mImpl = this; }
  explicit Expr(std::string text) : mConst(false), mValue(0), mText(std::move(text)) { mImpl = this; }
  ~Expr() noexcept override = default;
  bool isConstant() const override { return mConst; }
  int64_t getConstantValue() const override { return mConst ? mValue : std::numeric_limits<int64_t>::min(); }
  bool isSizeTensor() const override { return false; }
  std::string const& text() const { return mText; }
  int64_t value() const { return mValue; }

 private:
  bool mConst;
  int64_t mValue;
  std::string mText;
};

class ExprBuilder final : public IExprBuilder, public apiv::VExprBuilder {
 public:
  ExprBuilder() { mImpl = this; }
  ~ExprBuilder() noexcept override = default;
  IDimensionExpr const* constant(int64_t v) override { return keep(new Expr(v)); }
  IDimensionExpr const* operation(DimensionOperation op, IDimensionExpr const& first,
                                  IDimensionExpr const& second) override {
    auto const& a = static_cast<Expr const&>(first);
    auto const& b = static_cast<Expr const&>(second);
    char const* sym = nullptr;
    int64_t v = 0;
    int64_t const x = a.value(), y = b.value();
    switch (op) {
      case DimensionOperation::kSUM: sym = "+"; v = x + y; break;
      case DimensionOperation::kPROD: sym = "*"; v = x * y; break;
      case DimensionOperation::kMAX: sym = " max "; v = x > y ? x : y; break;
      case DimensionOperation::kMIN: sym = " min "; v = x < y ? x : y; break;
      case DimensionOperation::kSUB: sym = "-"; v = x - y; break;
      case DimensionOperation::kEQUAL: sym = "=="; v = x == y; break;
      case DimensionOperation::kLESS: sym = "<"; v = x < y; break;
      case DimensionOperation::kFLOOR_DIV: sym = "/"; v = y ? x / y : 0; break;
      case DimensionOperation::kCEIL_DIV: sym = "/^"; v = y ? (x + y - 1) / y : 0; break;
    }
    if (sym == nullptr) return nullptr;
    if (a.isConstant() && b.isConstant()) return keep(new Expr(v));
    return keep(new Expr("(" + a.text() + sym + b.text() + ")"));
  }
  IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&, IDimensionExpr const&) override {
    return nullptr;
  }
  IDimensionExpr const* symbol(std::string const& s) {
    char* end = nullptr;
    long long const v = std::strtoll(s.c_str(), &end, 10);
    if (!s.empty() && *end == '\0') return keep(new Expr(static_cast<int64_t>(v)));
    return keep(new Expr(s));
  }
  static std::string text(IDimensionExpr const* e) { return e ? static_cast<Expr const*>(e)->text() : "null"; }

 private:
  IDimensionExpr const* keep(Expr* e) {
    mPool.emplace_back(e);
    return e;
  }
  std::vector<std::unique_ptr<Expr>> mPool;
};

// ---- the library ---------------------------------------------------------------------------------
using GetCreatorsFn = IPluginCreatorInterface* const* (*)(int32_t&);
using SetLoggerFinderFn = void (*)(ILoggerFinder*);

Logger gLogger;
Finder gFinder(&gLogger);
std::map<std::string, IPluginCreatorV3One*> gCreators;
std::vector<std::string> gCreatorOrder;

bool loadLibrary(char const* path) {
  void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!handle) {
    std::fprintf(stderr, "plugin_harness: cannot load %s: %s\n", path, dlerror());
    return false;
  }
  auto getCreators = reinterpret_cast<GetCreatorsFn>(dlsym(handle, "getCreators"));
  auto setFinder = reinterpret_cast<SetLoggerFinderFn>(dlsym(handle, "setLoggerFinder"));
  if (!getCreators || !setFinder) {
    std::fprintf(stderr, "plugin_harness: %s does not export getCreators and setLoggerFinder\n", path);
    return false;
  }
  setFinder(&gFinder);
  int32_t n = 0;
  IPluginCreatorInterface* const* creators = getCreators(n);
  for (int32_t i = 0; i < n; ++i) {
    if (std::strcmp(creators[i]->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") != 0) continue;
    auto* c = static_cast<IPluginCreatorV3One*>(creators[i]);
    gCreators[c->getPluginName()] = c;
    gCreatorOrder.push_back(c->getPluginName());
  }
  return true;
}

IPluginCreatorV3One* creator(std::string const& name) {
  auto it = gCreators.find(name);
  return it == gCreators.end() ? nullptr : it->second;
}

size_t fieldTypeSize(PluginFieldType t) {
  switch (t) {
    case PluginFieldType::kINT64:
    case PluginFieldType::kFLOAT64: return 8;
    case PluginFieldType::kINT32:
    case PluginFieldType::kFLOAT32: return 4;
    case PluginFieldType::kINT16:
    case PluginFieldType::kFLOAT16:
    case PluginFieldType::kBF16: return 2;
    default: return 1;
  }
}

char const* fieldTypeName(PluginFieldType t) {
  switch (t) {
    case PluginFieldType::kINT64: return "INT64";
    case PluginFieldType::kFLOAT64: return "FLOAT64";
    case PluginFieldType::kINT32: return "INT32";
    case PluginFieldType::kFLOAT32: return "FLOAT32";
    case PluginFieldType::kCHAR: return "CHAR";
    default: return "OTHER";
  }
}

// Plugin fields with owned storage; the PluginField array is rebuilt by fc(), so copies stay valid.
class Fields {
 public:
  Fields& i32(char const* n, int32_t v) { return raw(n, PluginFieldType::kINT32, &v, 4, 1); }
  Fields& i64(char const* n, int64_t v) { return raw(n, PluginFieldType::kINT64, &v, 8, 1); }
  Fields& f32(char const* n, float v) { return raw(n, PluginFieldType::kFLOAT32, &v, 4, 1); }
  Fields& f64(char const* n, double v) { return raw(n, PluginFieldType::kFLOAT64, &v, 8, 1); }
  Fields& str(char const* n, std::string const& v) {
    return raw(n, PluginFieldType::kCHAR, v.c_str(), v.size() + 1, static_cast<int32_t>(v.size() + 1));
  }
  Fields& raw(char const* n, PluginFieldType t, void const* data, size_t bytes, int32_t length) {
    auto const* p = static_cast<unsigned char const*>(data);
    mEntries.push_back(Entry{n, t, std::vector<unsigned char>(p, p + bytes), length});
    return *this;
  }
  Fields& drop(char const* n) {
    for (size_t i = mEntries.size(); i-- > 0;)
      if (mEntries[i].name == n) mEntries.erase(mEntries.begin() + static_cast<long>(i));
    return *this;
  }
  PluginFieldCollection const* fc() {
    mFields.clear();
    for (auto const& e : mEntries) mFields.emplace_back(e.name.c_str(), e.data.data(), e.type, e.length);
    mCollection.nbFields = static_cast<int32_t>(mFields.size());
    mCollection.fields = mFields.data();
    return &mCollection;
  }

 private:
  struct Entry {
    std::string name;
    PluginFieldType type;
    std::vector<unsigned char> data;
    int32_t length;
  };
  std::vector<Entry> mEntries;
  std::vector<PluginField> mFields;
  PluginFieldCollection mCollection{};
};

struct FieldValue {
  std::string name;
  PluginFieldType type;
  int32_t length;
  std::vector<unsigned char> bytes;
  bool operator==(FieldValue const& o) const {
    return name == o.name && type == o.type && length == o.length && bytes == o.bytes;
  }
  double number() const {
    switch (type) {
      case PluginFieldType::kINT64: { int64_t v; std::memcpy(&v, bytes.data(), 8); return static_cast<double>(v); }
      case PluginFieldType::kFLOAT64: { double v; std::memcpy(&v, bytes.data(), 8); return v; }
      case PluginFieldType::kINT32: { int32_t v; std::memcpy(&v, bytes.data(), 4); return v; }
      case PluginFieldType::kFLOAT32: { float v; std::memcpy(&v, bytes.data(), 4); return v; }
      default: return std::nan("");
    }
  }
};

std::vector<FieldValue> snapshot(PluginFieldCollection const* fc) {
  std::vector<FieldValue> out;
  if (!fc) return out;
  for (int32_t i = 0; i < fc->nbFields; ++i) {
    PluginField const& f = fc->fields[i];
    auto const* p = static_cast<unsigned char const*>(f.data);
    size_t const n = fieldTypeSize(f.type) * static_cast<size_t>(f.length);
    out.push_back({f.name, f.type, f.length, p ? std::vector<unsigned char>(p, p + n) : std::vector<unsigned char>{}});
  }
  return out;
}

double valueOf(std::vector<FieldValue> const& fields, char const* name) {
  for (auto const& f : fields)
    if (f.name == name) return f.number();
  return std::nan("");
}

// ---- tensor descriptions -------------------------------------------------------------------------
Dims dims(std::vector<int64_t> const& d) {
  Dims out{};
  out.nbDims = static_cast<int32_t>(d.size());
  for (size_t i = 0; i < d.size(); ++i) out.d[i] = d[i];
  return out;
}

PluginTensorDesc desc(DataType t, std::vector<int64_t> const& d) {
  PluginTensorDesc x{};
  x.dims = dims(d);
  x.type = t;
  x.format = TensorFormat::kLINEAR;
  x.scale = -1.0F;
  return x;
}

DynamicPluginTensorDesc dyn(PluginTensorDesc const& d) {
  DynamicPluginTensorDesc x{};
  x.desc = d;
  x.min = x.max = x.opt = d.dims;
  return x;
}

std::string dimsText(Dims const& d) {
  std::string s = "[";
  for (int32_t i = 0; i < d.nbDims; ++i) s += (i ? ", " : "") + std::to_string(d.d[i]);
  return s + "]";
}

struct Io {
  std::vector<PluginTensorDesc> in, out;
};

constexpr DataType kF32 = DataType::kFLOAT, kF16 = DataType::kHALF, kI32 = DataType::kINT32,
                   kI64 = DataType::kINT64, kFP8 = DataType::kFP8, kI8 = DataType::kINT8;

Io selectIo(int64_t S, int64_t L, int64_t cap, int64_t B, int64_t R, int64_t M, DataType vt = kF32) {
  int64_t const nb = (cap + 63) / 64;
  return Io{{desc(vt, {S, L, cap}), desc(vt, {S, L, cap}), desc(kI64, {S, L, nb}), desc(kI64, {S, L}),
             desc(kI32, {B}), desc(kI32, {B, R}), desc(kI32, {B, R}), desc(kI64, {B}), desc(kI64, {B})},
            {desc(kI32, {B, L, M}), desc(kI32, {B, L})}};
}

Io logitsIo(int64_t B, int64_t R, int64_t L, int64_t M, int64_t P, bool layered) {
  Io io{{desc(kFP8, {B * R, 64, 128}), desc(kI8, {P, 64, 1, 132}), desc(kF32, {B * R, 64}), desc(kI32, {B, R}),
         desc(kI32, {B, 7})},
        {desc(kF32, {B * R, M * 64})}};
  io.in.push_back(layered ? desc(kI32, {B, L, M}) : desc(kI32, {B, M}));
  io.in.push_back(layered ? desc(kI32, {B, L}) : desc(kI32, {B}));
  return io;
}

Io topkIo(int64_t B, int64_t R, int64_t L, int64_t M, int64_t K, bool layered) {
  Io io{{desc(kF32, {B * R, M * 64})}, {desc(kI32, {B * R, K})}};
  io.in.push_back(layered ? desc(kI32, {B, L, M}) : desc(kI32, {B, M}));
  io.in.push_back(layered ? desc(kI32, {B, L}) : desc(kI32, {B}));
  return io;
}

Io updateIo(int64_t S, int64_t L, int64_t cap, int64_t B, int64_t R, int64_t M, bool layered, int tokens = 0,
            DataType vt = kF32) {
  int64_t const nb = (cap + 63) / 64;
  Io io{{desc(vt, {S, L, cap}), desc(vt, {S, L, cap}), desc(kI64, {S, L, nb}), desc(kI64, {S, L}), desc(kI32, {B}),
         desc(kF32, {B * R, M * 64})},
        {desc(kI32, {1})}};
  io.in.push_back(layered ? desc(kI32, {B, L, M}) : desc(kI32, {B, M}));
  io.in.push_back(layered ? desc(kI32, {B, L}) : desc(kI32, {B}));
  for (auto const& d : {desc(kI32, {B, R}), desc(kI32, {B, R}), desc(kI32, {B}), desc(kI64, {B})}) io.in.push_back(d);
  for (int t = 0; t < tokens; ++t) io.in.push_back(desc(kI32, {1}));
  return io;
}

// ---- a plugin created through its creator --------------------------------------------------------
struct Plugin {
  std::unique_ptr<IPluginV3> p;
  IPluginV3OneCore* core{nullptr};
  IPluginV3OneBuild* build{nullptr};
  IPluginV3OneRuntime* runtime{nullptr};
  explicit operator bool() const { return p && core && build && runtime; }
};

Plugin wrap(IPluginV3* raw) {
  Plugin out;
  out.p.reset(raw);
  if (!raw) return out;
  out.core = static_cast<IPluginV3OneCore*>(raw->getCapabilityInterface(PluginCapabilityType::kCORE));
  out.build = static_cast<IPluginV3OneBuild*>(raw->getCapabilityInterface(PluginCapabilityType::kBUILD));
  out.runtime = static_cast<IPluginV3OneRuntime*>(raw->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
  return out;
}

Plugin create(std::string const& type, Fields& f, TensorRTPhase phase = TensorRTPhase::kBUILD,
              char const* name = "harness") {
  IPluginCreatorV3One* c = creator(type);
  return wrap(c ? c->createPlugin(name, f.fc(), phase) : nullptr);
}

Fields selectFields() {
  Fields f;
  f.f64("target_sparsity", 0.5).f32("exploration", 0.1F).str("policy", "staleness").i32("pooling", 2);
  f.i32("index_topk", 128).i32("warmup_steps", 2).i32("keep_sink", 1).i32("keep_newest", 0);
  f.i32("mtp_union", 1).i64("seed", 4000000000LL).i32("max_context", 1000).i32("m_cap", 16).i32("block_size", 64);
  return f;
}
Fields logitsFields(int64_t layer = 1) {
  Fields f;
  f.i32("layer", static_cast<int32_t>(layer));
  return f;
}
Fields topkFields(int64_t layer = 1) {
  Fields f;
  f.i32("index_topk", 128).i32("layer", static_cast<int32_t>(layer));
  return f;
}
Fields updateFields(int64_t layer = 1) {
  Fields f;
  f.i32("layer", static_cast<int32_t>(layer)).f32("ema_decay", 0.9F).i32("row0_only", 0).i32("max_context", 1000);
  return f;
}

// ---- check mode ----------------------------------------------------------------------------------
int gChecks = 0, gFailures = 0, gGroupFailures = 0;

void expectImpl(bool ok, int line, char const* cond, char const* fmt, ...) {
  ++gChecks;
  if (ok) return;
  ++gFailures;
  ++gGroupFailures;
  std::printf("  FAIL line %d: %s", line, cond);
  if (fmt && *fmt) {
    std::printf(": ");
    va_list ap;
    va_start(ap, fmt);
    std::vprintf(fmt, ap);
    va_end(ap);
  }
  std::printf("\n");
}
#define EXPECT(cond, ...) expectImpl(static_cast<bool>(cond), __LINE__, #cond, "" __VA_ARGS__)

bool contains(std::string const& hay, std::string const& needle) { return hay.find(needle) != std::string::npos; }

void group(char const* name, void (*fn)()) {
  gGroupFailures = 0;
  fn();
  std::printf("%s %s\n", gGroupFailures ? "FAIL" : "ok", name);
}

std::vector<DataType> types(std::vector<PluginTensorDesc> const& v) {
  std::vector<DataType> t;
  for (auto const& d : v) t.push_back(d.type);
  return t;
}

// Calls getOutputDataTypes; returns the status and the errors logged.
int32_t outputTypes(Plugin& p, std::vector<DataType> const& in, std::vector<DataType>& out, std::string& errors) {
  size_t const m = gLogger.mark();
  out.assign(static_cast<size_t>(p.build->getNbOutputs()), DataType::kBOOL);
  int32_t const rc = p.build->getOutputDataTypes(out.data(), static_cast<int32_t>(out.size()), in.data(),
                                                 static_cast<int32_t>(in.size()));
  errors = gLogger.errorsSince(m);
  return rc;
}

// getOutputShapes over symbolic input extents ("B", "L", "64", ...): output extents as text.
int32_t outputShapes(Plugin& p, std::vector<std::vector<std::string>> const& in, std::vector<std::string>& out,
                     std::string& errors) {
  ExprBuilder b;
  std::vector<DimsExprs> ins(in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    ins[i].nbDims = static_cast<int32_t>(in[i].size());
    for (size_t a = 0; a < in[i].size(); ++a) ins[i].d[a] = b.symbol(in[i][a]);
  }
  std::vector<DimsExprs> outs(static_cast<size_t>(p.build->getNbOutputs()));
  size_t const m = gLogger.mark();
  int32_t const rc = p.build->getOutputShapes(ins.data(), static_cast<int32_t>(ins.size()), nullptr, 0, outs.data(),
                                              static_cast<int32_t>(outs.size()), b);
  errors = gLogger.errorsSince(m);
  out.clear();
  if (rc == 0) {
    for (auto const& o : outs) {
      std::string s;
      for (int32_t a = 0; a < o.nbDims; ++a) s += (a ? "," : "") + ExprBuilder::text(o.d[a]);
      out.push_back(s);
    }
  }
  return rc;
}

int32_t configure(Plugin& p, Io const& io, std::string& errors) {
  std::vector<DynamicPluginTensorDesc> in, out;
  for (auto const& d : io.in) in.push_back(dyn(d));
  for (auto const& d : io.out) out.push_back(dyn(d));
  size_t const m = gLogger.mark();
  int32_t const rc = p.build->configurePlugin(in.data(), static_cast<int32_t>(in.size()), out.data(),
                                              static_cast<int32_t>(out.size()));
  errors = gLogger.errorsSince(m);
  return rc;
}

int32_t shapeChange(Plugin& p, Io const& io, std::string& errors) {
  size_t const m = gLogger.mark();
  int32_t const rc = p.runtime->onShapeChange(io.in.data(), static_cast<int32_t>(io.in.size()), io.out.data(),
                                              static_cast<int32_t>(io.out.size()));
  errors = gLogger.errorsSince(m);
  return rc;
}

// supportsFormatCombination for every position of io; returns the first refused position or -1.
int32_t refusedPosition(Plugin& p, Io const& io) {
  std::vector<DynamicPluginTensorDesc> all;
  for (auto const& d : io.in) all.push_back(dyn(d));
  for (auto const& d : io.out) all.push_back(dyn(d));
  for (int32_t pos = 0; pos < static_cast<int32_t>(all.size()); ++pos)
    if (!p.build->supportsFormatCombination(pos, all.data(), static_cast<int32_t>(io.in.size()),
                                            static_cast<int32_t>(io.out.size())))
      return pos;
  return -1;
}

bool formatOk(Plugin& p, Io io, int32_t pos, DataType t, TensorFormat f = TensorFormat::kLINEAR) {
  int32_t const nbIn = static_cast<int32_t>(io.in.size());
  PluginTensorDesc& d = pos < nbIn ? io.in[pos] : io.out[pos - nbIn];
  d.type = t;
  d.format = f;
  std::vector<DynamicPluginTensorDesc> all;
  for (auto const& x : io.in) all.push_back(dyn(x));
  for (auto const& x : io.out) all.push_back(dyn(x));
  return p.build->supportsFormatCombination(pos, all.data(), nbIn, static_cast<int32_t>(io.out.size()));
}

void checkCreators() {
  EXPECT(gCreators.size() == 4, "got %zu creators", gCreators.size());
  std::map<std::string, std::vector<std::string>> const expected = {
      {"SpinSelect",
       {"block_size", "target_sparsity", "exploration", "policy", "pooling", "index_topk", "warmup_steps", "keep_sink",
        "keep_newest", "mtp_union", "seed", "max_context", "m_cap"}},
      {"SpinIndexerLogits", {"block_size", "layer"}},
      {"SpinTopK", {"block_size", "index_topk", "layer"}},
      {"SpinUpdate", {"block_size", "layer", "ema_decay", "row0_only", "max_context"}}};
  for (auto const& [name, fields] : expected) {
    IPluginCreatorV3One* c = creator(name);
    EXPECT(c != nullptr, "no creator %s", name.c_str());
    if (!c) continue;
    EXPECT(std::strcmp(c->getPluginVersion(), "1") == 0);
    EXPECT(std::strcmp(c->getPluginNamespace(), "") == 0);
    PluginFieldCollection const* fc = c->getFieldNames();
    std::vector<std::string> got;
    for (int32_t i = 0; fc && i < fc->nbFields; ++i) got.push_back(fc->fields[i].name);
    EXPECT(got == fields, "%s field names differ", name.c_str());
  }
}

void checkCapabilities() {
  struct Case { char const* type; Fields f; int32_t outputs; };
  std::vector<Case> cases;
  cases.push_back({"SpinSelect", selectFields(), 2});
  cases.push_back({"SpinIndexerLogits", logitsFields(), 1});
  cases.push_back({"SpinTopK", topkFields(), 1});
  cases.push_back({"SpinUpdate", updateFields(), 1});
  for (auto& c : cases) {
    Plugin p = create(c.type, c.f);
    EXPECT(static_cast<bool>(p), "%s: createPlugin or a capability failed", c.type);
    if (!p) continue;
    EXPECT(std::strcmp(p.p->getInterfaceInfo().kind, "PLUGIN") == 0);
    EXPECT(std::strcmp(p.core->getInterfaceInfo().kind, "PLUGIN_V3ONE_CORE") == 0);
    EXPECT(std::strcmp(p.build->getInterfaceInfo().kind, "PLUGIN_V3ONE_BUILD") == 0);
    EXPECT(std::strcmp(p.runtime->getInterfaceInfo().kind, "PLUGIN_V3ONE_RUNTIME") == 0);
    EXPECT(std::strcmp(p.core->getPluginName(), c.type) == 0);
    EXPECT(std::strcmp(p.core->getPluginVersion(), "1") == 0);
    EXPECT(p.build->getNbOutputs() == c.outputs, "%s: %d outputs", c.type, p.build->getNbOutputs());
    EXPECT(p.build->getWorkspaceSize(nullptr, 0, nullptr, 0) == 0);
    char const* meta = p.build->getMetadataString();
    EXPECT(meta && contains(meta, c.type) && contains(meta, "block_size=64"), "metadata: %s", meta ? meta : "null");
  }
  Fields f = selectFields();
  Plugin s = create("SpinSelect", f);
  if (s) {
    std::string const meta = s.build->getMetadataString();
    EXPECT(contains(meta, "target_sparsity=0.5") && contains(meta, "exploration=0.1 ") &&
               contains(meta, "policy=staleness") && contains(meta, "pooling=top4") && contains(meta, "seed=4000000000"),
           "%s", meta.c_str());
  }
}

void checkDataTypes() {
  std::vector<DataType> out;
  std::string err;
  Fields fs = selectFields();
  Plugin s = create("SpinSelect", fs);
  Io io = selectIo(5, 2, 300, 3, 2, 16);
  EXPECT(outputTypes(s, types(io.in), out, err) == 0 && out == std::vector<DataType>({kI32, kI32}), "%s", err.c_str());
  io = selectIo(5, 2, 300, 3, 2, 16, kF16);
  EXPECT(outputTypes(s, types(io.in), out, err) == 0, "fp16 state: %s", err.c_str());
  auto t = types(selectIo(5, 2, 300, 3, 2, 16).in);
  t[1] = kF16;
  EXPECT(outputTypes(s, t, out, err) != 0 && contains(err, "D must have the dtype of V (float32), got float16"), "%s",
         err.c_str());
  t = types(selectIo(5, 2, 300, 3, 2, 16).in);
  t[0] = t[1] = kI32;
  EXPECT(outputTypes(s, t, out, err) != 0 && contains(err, "V must be float32/float16/fp8, got int32"), "%s", err.c_str());
  t = types(selectIo(5, 2, 300, 3, 2, 16).in);
  t[7] = kI32;
  EXPECT(outputTypes(s, t, out, err) != 0 && contains(err, "request_id must be int64, got int32"), "%s", err.c_str());
  t.pop_back();
  EXPECT(outputTypes(s, t, out, err) != 0 && contains(err, "takes 9 inputs"), "%s", err.c_str());
  t = types(selectIo(5, 2, 300, 3, 2, 16).in);
  DataType one{};
  size_t const m = gLogger.mark();
  EXPECT(s.build->getOutputDataTypes(&one, 1, t.data(), static_cast<int32_t>(t.size())) != 0 &&
         contains(gLogger.errorsSince(m), "has 2 outputs, TensorRT asked for 1"));

  Fields fl = logitsFields();
  Plugin l = create("SpinIndexerLogits", fl);
  auto lt = types(logitsIo(3, 2, 2, 5, 9, true).in);
  EXPECT(outputTypes(l, lt, out, err) == 0 && out == std::vector<DataType>({kF32}), "%s", err.c_str());
  lt[0] = kI8;
  lt[1] = kFP8;
  EXPECT(outputTypes(l, lt, out, err) == 0, "int8 q and fp8 cache are byte views: %s", err.c_str());
  lt[0] = kF32;
  EXPECT(outputTypes(l, lt, out, err) != 0 && contains(err, "q must be fp8/int8/uint8, got float32"), "%s", err.c_str());
  lt = types(logitsIo(3, 2, 2, 5, 9, true).in);
  lt[2] = kF16;
  EXPECT(outputTypes(l, lt, out, err) != 0 && contains(err, "weights must be float32"), "%s", err.c_str());

  Fields ft = topkFields();
  Plugin k = create("SpinTopK", ft);
  auto kt = types(topkIo(3, 2, 2, 5, 128, true).in);
  EXPECT(outputTypes(k, kt, out, err) == 0 && out == std::vector<DataType>({kI32}), "%s", err.c_str());
  kt[1] = kI64;
  EXPECT(outputTypes(k, kt, out, err) != 0 && contains(err, "block_ids must be int32, got int64"), "%s", err.c_str());

  Fields fu = updateFields();
  Plugin u = create("SpinUpdate", fu);
  auto ut = types(updateIo(5, 2, 300, 3, 2, 16, true, 2).in);
  ut[12] = kF32;  // ordering tokens may be of any dtype
  EXPECT(outputTypes(u, ut, out, err) == 0 && out == std::vector<DataType>({kI32}), "%s", err.c_str());
  ut[13] = DataType::kINT4;  // but whole bytes
  EXPECT(outputTypes(u, ut, out, err) != 0 && contains(err, "ordering token 1 must be"), "%s", err.c_str());
  ut[13] = kI32;
  ut[10] = kI64;
  EXPECT(outputTypes(u, ut, out, err) != 0 && contains(err, "accepted must be int32, got int64"), "%s", err.c_str());
  ut.resize(11);
  EXPECT(outputTypes(u, ut, out, err) != 0 && contains(err, "takes 12+ inputs"), "%s", err.c_str());
}

void checkShapes() {
  std::vector<std::string> out;
  std::string err;
  Fields fs = selectFields();
  Plugin s = create("SpinSelect", fs);
  std::vector<std::vector<std::string>> sel = {{"S", "L", "cap"}, {"S", "L", "cap"}, {"S", "L", "nb"}, {"S", "L"},
                                               {"B"},           {"B", "R"},        {"B", "R"},       {"B"},
                                               {"B"}};
  EXPECT(outputShapes(s, sel, out, err) == 0 && out == std::vector<std::string>({"B,L,16", "B,L"}), "%s%s",
         out.empty() ? "" : out[0].c_str(), err.c_str());
  auto bad = sel;
  bad[0] = {"S", "L"};
  EXPECT(outputShapes(s, bad, out, err) != 0 && contains(err, "V must have 3 dims, got 2"), "%s", err.c_str());
  bad = sel;
  bad[0] = {"4", "2", "300"};
  bad[2] = {"4", "2", "4"};  // ceil(300 / 64) = 5
  EXPECT(outputShapes(s, bad, out, err) != 0 && contains(err, "last_seen must be [S, L, ceil(cap / 64)] = [S, L, 5]"),
         "%s", err.c_str());
  bad = sel;
  bad[5] = {"B", "9"};
  EXPECT(outputShapes(s, bad, out, err) != 0 && contains(err, "1 <= R (next_n) <= 8"), "%s", err.c_str());

  Fields fl = logitsFields();
  Plugin l = create("SpinIndexerLogits", fl);
  std::vector<std::vector<std::string>> lg = {{"BR", "64", "128"}, {"P", "64", "1", "132"}, {"BR", "64"}, {"B", "R"},
                                              {"B", "T"},          {"B", "L", "M"},          {"B", "L"}};
  EXPECT(outputShapes(l, lg, out, err) == 0 && out == std::vector<std::string>({"BR,(M*64)"}), "%s%s",
         out.empty() ? "" : out[0].c_str(), err.c_str());
  lg[5] = {"B", "L", "5"};
  EXPECT(outputShapes(l, lg, out, err) == 0 && out == std::vector<std::string>({"BR,320"}), "%s",
         out.empty() ? err.c_str() : out[0].c_str());
  lg[5] = {"B", "5"};
  lg[6] = {"B"};
  EXPECT(outputShapes(l, lg, out, err) == 0 && out == std::vector<std::string>({"BR,320"}), "2-D ids: %s", err.c_str());
  bad = lg;
  bad[0] = {"BR", "32", "128"};
  EXPECT(outputShapes(l, bad, out, err) != 0 && contains(err, "q must be [B*R, 64, 128]"), "%s", err.c_str());
  bad = lg;
  bad[1] = {"P", "64", "128"};
  EXPECT(outputShapes(l, bad, out, err) != 0 && contains(err, "kv_cache must be pages of 64 x 132 bytes"), "%s",
         err.c_str());
  bad = lg;
  bad[6] = {"B", "L"};
  EXPECT(outputShapes(l, bad, out, err) != 0 && contains(err, "counts must be [B] to match block_ids [B, m_cap]"), "%s",
         err.c_str());
  bad = lg;
  bad[0] = {"6", "64", "128"};
  bad[3] = {"2", "2"};
  EXPECT(outputShapes(l, bad, out, err) != 0 && contains(err, "q has 6 rows, expected B*R = 4"), "%s", err.c_str());

  Fields ft = topkFields();
  Plugin k = create("SpinTopK", ft);
  EXPECT(outputShapes(k, {{"BR", "(M*64)"}, {"B", "L", "M"}, {"B", "L"}}, out, err) == 0 &&
             out == std::vector<std::string>({"BR,128"}),
         "%s", err.c_str());
  EXPECT(outputShapes(k, {{"BR", "320"}, {"B", "L", "4"}, {"B", "L"}}, out, err) != 0 &&
             contains(err, "logits must be [B*R, m_cap*64] = [B*R, 256]"),
         "%s", err.c_str());

  Fields fu = updateFields();
  Plugin u = create("SpinUpdate", fu);
  std::vector<std::vector<std::string>> up = {{"S", "L", "cap"}, {"S", "L", "cap"}, {"S", "L", "nb"}, {"S", "L"},
                                              {"B"},             {"BR", "(M*64)"},  {"B", "L", "M"},  {"B", "L"},
                                              {"B", "R"},        {"B", "R"},        {"B"},            {"B"},
                                              {"1"}};
  EXPECT(outputShapes(u, up, out, err) == 0 && out == std::vector<std::string>({"1"}), "%s", err.c_str());
  bad = up;
  bad[0] = bad[1] = {"S", "1", "cap"};
  bad[2] = {"S", "1", "nb"};
  bad[3] = {"S", "1"};
  EXPECT(outputShapes(u, bad, out, err) != 0 && contains(err, "field 'layer' = 1 is outside the state's 1 layers"),
         "%s", err.c_str());
}

void checkFormats() {
  Fields fs = selectFields();
  Plugin s = create("SpinSelect", fs);
  Io io = selectIo(5, 2, 300, 3, 2, 16);
  EXPECT(refusedPosition(s, io) == -1, "position %d refused", refusedPosition(s, io));
  EXPECT(refusedPosition(s, selectIo(5, 2, 300, 3, 2, 16, kF16)) == -1);
  EXPECT(!formatOk(s, io, 0, kI32));
  EXPECT(!formatOk(s, io, 1, kF16), "D must follow V's dtype");
  EXPECT(!formatOk(s, io, 0, kF32, TensorFormat::kCHW32), "only linear layouts");
  EXPECT(!formatOk(s, io, 2, kI32), "last_seen is int64");
  EXPECT(!formatOk(s, io, 9, kI64), "block_ids output is int32");

  Fields fl = logitsFields();
  Plugin l = create("SpinIndexerLogits", fl);
  Io li = logitsIo(3, 2, 2, 5, 9, true);
  EXPECT(refusedPosition(l, li) == -1);
  EXPECT(formatOk(l, li, 0, kI8) && formatOk(l, li, 0, DataType::kUINT8) && formatOk(l, li, 0, kFP8));
  EXPECT(formatOk(l, li, 1, kFP8) && formatOk(l, li, 1, DataType::kUINT8));
  EXPECT(!formatOk(l, li, 0, kF16) && !formatOk(l, li, 1, kF32) && !formatOk(l, li, 7, kF16));

  Fields ft = topkFields();
  Plugin k = create("SpinTopK", ft);
  Io ki = topkIo(3, 2, 2, 5, 128, false);
  EXPECT(refusedPosition(k, ki) == -1);
  EXPECT(!formatOk(k, ki, 0, kF16) && !formatOk(k, ki, 3, kI64));

  Fields fu = updateFields();
  Plugin u = create("SpinUpdate", fu);
  Io ui = updateIo(5, 2, 300, 3, 2, 16, true, 1, kF16);
  EXPECT(refusedPosition(u, ui) == -1);
  EXPECT(formatOk(u, ui, 12, kF32) && formatOk(u, ui, 12, kI64), "ordering tokens take any dtype");
  EXPECT(!formatOk(u, ui, 13, kF32) && formatOk(u, ui, 13, kI32), "done is int32");
  EXPECT(!formatOk(u, ui, 11, kI32), "step is int64");
}

void checkConfigure() {
  std::string err;
  Fields fs = selectFields();
  Plugin s = create("SpinSelect", fs);
  Io io = selectIo(5, 2, 300, 3, 2, 16);
  EXPECT(configure(s, io, err) == 0, "%s", err.c_str());
  Io wild = io;
  for (auto& d : wild.in) d.dims.d[0] = -1;  // dynamic leading extents match anything
  EXPECT(configure(s, wild, err) == 0, "%s", err.c_str());
  Io bad = io;
  bad.in[4] = desc(kI32, {4});
  EXPECT(configure(s, bad, err) != 0 && contains(err, "batch sizes differ: state_slot is [4], context_lens is [3, 2]"),
         "%s", err.c_str());
  bad = io;
  bad.in[6] = desc(kI32, {3, 1});
  EXPECT(configure(s, bad, err) != 0 && contains(err, "query_pos must have the shape of context_lens [3, 2]"), "%s",
         err.c_str());
  EXPECT(shapeChange(s, io, err) == 0, "%s", err.c_str());
  EXPECT(shapeChange(s, selectIo(5, 2, 300, 0, 2, 16), err) == 0, "an empty batch is valid: %s", err.c_str());
  EXPECT(shapeChange(s, selectIo(5, 2, 300, 70000, 1, 16), err) != 0 && contains(err, "<= 65535"), "%s", err.c_str());

  Fields fl;
  Plugin l = create("SpinIndexerLogits", fl);  // layer unset
  EXPECT(configure(l, logitsIo(3, 2, 2, 5, 9, false), err) == 0, "2-D ids need no layer: %s", err.c_str());
  EXPECT(configure(l, logitsIo(3, 2, 2, 5, 9, true), err) != 0 && contains(err, "set the field 'layer'"), "%s",
         err.c_str());
  Fields fl3 = logitsFields(2);
  Plugin l3 = create("SpinIndexerLogits", fl3);
  EXPECT(configure(l3, logitsIo(3, 2, 2, 5, 9, true), err) != 0 &&
             contains(err, "field 'layer' = 2 is outside block_ids' 2 layers"),
         "%s", err.c_str());
  Fields fl1 = logitsFields(1);
  Plugin l1 = create("SpinIndexerLogits", fl1);
  Io li = logitsIo(3, 2, 2, 5, 9, true);
  EXPECT(shapeChange(l1, li, err) == 0, "%s", err.c_str());
  li.in[1] = desc(kI8, {0, 64, 1, 132});
  EXPECT(shapeChange(l1, li, err) != 0 && contains(err, "at least one page"), "%s", err.c_str());
  li = logitsIo(3, 2, 2, 5, 9, true);
  li.in[1] = desc(kI8, {9, 8448});
  EXPECT(shapeChange(l1, li, err) == 0, "flat pages: %s", err.c_str());

  Fields ft = topkFields();
  Plugin k = create("SpinTopK", ft);
  Io ki = topkIo(3, 2, 2, 5, 128, true);
  EXPECT(shapeChange(k, ki, err) == 0, "%s", err.c_str());
  ki.in[0] = desc(kF32, {7, 320});
  EXPECT(shapeChange(k, ki, err) != 0 && contains(err, "logits has 7 rows: must be B*R with B = 3"), "%s", err.c_str());
  ki.in[0] = desc(kF32, {27, 320});
  EXPECT(shapeChange(k, ki, err) != 0 && contains(err, "1 <= R <= 8"), "%s", err.c_str());
  // no request, yet rows of logits: nothing would write their top-K
  Io kz = topkIo(0, 2, 2, 5, 128, true);
  EXPECT(shapeChange(k, kz, err) == 0, "empty batch: %s", err.c_str());
  kz.in[0] = desc(kF32, {4, 320});
  EXPECT(shapeChange(k, kz, err) != 0 && contains(err, "logits has 4 rows but block_ids holds no request"),
         "%s", err.c_str());

  Fields fu = updateFields();
  Plugin u = create("SpinUpdate", fu);
  Io ui = updateIo(5, 2, 300, 3, 2, 16, true, 3);
  EXPECT(shapeChange(u, ui, err) == 0, "%s", err.c_str());
  EXPECT(shapeChange(u, updateIo(5, 2, 300, 3, 2, 16, false), err) == 0, "2-D ids: %s", err.c_str());
  Io ub = ui;
  ub.in[6] = desc(kI32, {3, 3, 16});
  ub.in[7] = desc(kI32, {3, 3});
  EXPECT(shapeChange(u, ub, err) != 0 && contains(err, "block_ids has 3 layers, the state has 2"), "%s", err.c_str());
  ub = ui;
  ub.in[5] = desc(kF32, {6, 1000});
  EXPECT(shapeChange(u, ub, err) != 0 && contains(err, "logits must be [B*R, m_cap*64] = [B*R, 1024]"), "%s",
         err.c_str());
  ub = ui;
  ub.in[10] = desc(kI32, {2});
  EXPECT(shapeChange(u, ub, err) != 0 && contains(err, "batch sizes differ: accepted is [2]"), "%s", err.c_str());
}

void checkSerialization() {
  struct Case { char const* type; Fields f; };
  std::vector<Case> cases;
  cases.push_back({"SpinSelect", selectFields()});
  cases.push_back({"SpinIndexerLogits", logitsFields()});
  cases.push_back({"SpinTopK", topkFields()});
  cases.push_back({"SpinUpdate", updateFields()});
  for (auto& c : cases) {
    Plugin p = create(c.type, c.f);
    if (!p) {
      EXPECT(false, "%s not created", c.type);
      continue;
    }
    auto const first = snapshot(p.runtime->getFieldsToSerialize());
    IPluginCreatorV3One* cr = creator(c.type);
    EXPECT(first.size() == static_cast<size_t>(cr->getFieldNames()->nbFields), "%s serializes every field", c.type);
    for (auto const& f : first)
      EXPECT(f.length == 1 && (f.type == PluginFieldType::kINT64 || f.type == PluginFieldType::kFLOAT64),
             "%s.%s is %s[%d]", c.type, f.name.c_str(), fieldTypeName(f.type), f.length);
    // the runtime phase re-creates the plugin from exactly these fields
    Fields again;
    for (auto const& f : first) again.raw(f.name.c_str(), f.type, f.bytes.data(), f.bytes.size(), f.length);
    Plugin q = create(c.type, again, TensorRTPhase::kRUNTIME);
    EXPECT(static_cast<bool>(q), "%s not re-created from its fields", c.type);
    if (q) EXPECT(snapshot(q.runtime->getFieldsToSerialize()) == first, "%s round trip differs", c.type);
    Plugin cl = wrap(p.p->clone());
    EXPECT(static_cast<bool>(cl), "%s clone", c.type);
    if (cl) {
      EXPECT(snapshot(cl.runtime->getFieldsToSerialize()) == first, "%s clone differs", c.type);
      EXPECT(cl.p.get() != p.p.get() && cl.runtime != p.runtime);
      Plugin cl2 = wrap(cl.p->clone());
      EXPECT(cl2 && snapshot(cl2.runtime->getFieldsToSerialize()) == first);
    }
    Recorder rec;
    ResourceContext ctx(&rec);
    Plugin att = wrap(p.runtime->attachToContext(&ctx));
    EXPECT(att && snapshot(att.runtime->getFieldsToSerialize()) == first, "%s attachToContext", c.type);
  }
  Fields fs = selectFields();
  Plugin s = create("SpinSelect", fs);
  auto const v = snapshot(s.runtime->getFieldsToSerialize());
  EXPECT(valueOf(v, "exploration") == 0.1, "FLOAT32 0.1f is the decimal 0.1, got %.17g", valueOf(v, "exploration"));
  EXPECT(valueOf(v, "target_sparsity") == 0.5 && valueOf(v, "policy") == 1 && valueOf(v, "pooling") == 2);
  EXPECT(valueOf(v, "seed") == 4000000000.0 && valueOf(v, "keep_newest") == 0 && valueOf(v, "m_cap") == 16);
  Fields fmin;
  fmin.i32("max_context", 64).i32("m_cap", 1);
  Plugin d = create("SpinSelect", fmin);
  auto const dv = d ? snapshot(d.runtime->getFieldsToSerialize()) : std::vector<FieldValue>{};
  EXPECT(valueOf(dv, "target_sparsity") == 0.4 && valueOf(dv, "exploration") == 0.05 && valueOf(dv, "index_topk") == 512 &&
             valueOf(dv, "warmup_steps") == 1 && valueOf(dv, "keep_sink") == 1 && valueOf(dv, "mtp_union") == 1,
         "defaults are SpinConfig's");
  Fields fu;
  fu.i32("layer", 0).i32("max_context", 64);
  Plugin u = create("SpinUpdate", fu);
  auto const uv = u ? snapshot(u.runtime->getFieldsToSerialize()) : std::vector<FieldValue>{};
  EXPECT(valueOf(uv, "ema_decay") == 0.5 && valueOf(uv, "row0_only") == 0);
}

void checkBadFields() {
  struct Case { char const* type; Fields f; char const* needle; };
  std::vector<Case> cases;
  auto sel = [&](std::function<void(Fields&)> edit, char const* needle) {
    Fields f = selectFields();
    edit(f);
    cases.push_back({"SpinSelect", std::move(f), needle});
  };
  sel([](Fields& f) { f.i32("target_sparcity", 1); }, "unknown field 'target_sparcity'");
  sel([](Fields& f) { f.i32("m_cap", 4); }, "field 'm_cap' is given twice");
  sel([](Fields& f) { f.drop("m_cap"); }, "missing field 'm_cap'");
  sel([](Fields& f) { f.drop("max_context"); }, "missing field 'max_context'");
  sel([](Fields& f) { f.drop("target_sparsity").f64("target_sparsity", 1.0); }, "0 <= target_sparsity < 1");
  sel([](Fields& f) { f.drop("exploration").f32("exploration", -0.1F); }, "0 <= exploration < 1");
  sel([](Fields& f) { f.drop("exploration").f64("exploration", std::nan("")); }, "field 'exploration' = nan");
  sel([](Fields& f) { f.drop("policy").i32("policy", 3); }, "field 'policy' = 3");
  sel([](Fields& f) { f.drop("policy").str("policy", "bogus"); }, "field 'policy' = 'bogus'");
  sel([](Fields& f) { f.drop("pooling").str("pooling", "median"); }, "'max', 1/'mean' or 2/'top4'");
  sel([](Fields& f) { f.drop("block_size").i32("block_size", 32); }, "block_size' = 32: must be 64");
  sel([](Fields& f) { f.drop("seed").i64("seed", 4294967296LL); }, "0 <= seed < 2^32");
  sel([](Fields& f) { f.drop("seed").i32("seed", -1); }, "field 'seed' = -1");
  sel([](Fields& f) { f.drop("m_cap").i32("m_cap", 0); }, "field 'm_cap' = 0");
  sel([](Fields& f) { f.drop("m_cap").f32("m_cap", 4.0F); }, "'m_cap' must be an integer");
  sel([](Fields& f) { f.drop("keep_sink").i32("keep_sink", 2); }, "'keep_sink' = 2: must be 0 or 1");
  sel([](Fields& f) { f.drop("index_topk").i32("index_topk", 0); }, "1 <= index_topk <= 2^20");
  sel([](Fields& f) { f.drop("index_topk").i32("index_topk", (1 << 20) + 1); }, "1 <= index_topk <= 2^20");
  sel([](Fields& f) { f.drop("m_cap").str("m_cap", "16"); }, "'m_cap' must be a number, got a string");
  sel([](Fields& f) {
    int32_t two[2] = {1, 2};
    f.drop("m_cap").raw("m_cap", PluginFieldType::kINT32, two, 8, 2);
  }, "'m_cap' must hold one value, got 2");
  Fields ft;
  ft.i32("layer", 0);
  cases.push_back({"SpinTopK", std::move(ft), "missing field 'index_topk'"});
  Fields ftk = topkFields();  // K past 2^20: the kernel's -1 fill would loop past int32
  ftk.drop("index_topk").i32("index_topk", 2147483647);
  cases.push_back({"SpinTopK", std::move(ftk), "1 <= index_topk <= 2^20"});
  Fields fu;
  fu.i32("max_context", 64);
  cases.push_back({"SpinUpdate", std::move(fu), "missing field 'layer'"});
  Fields fu2 = updateFields();
  fu2.drop("ema_decay").f64("ema_decay", 1.0);
  cases.push_back({"SpinUpdate", std::move(fu2), "0 <= ema_decay < 1"});
  Fields fl;
  fl.i32("layer", -2);
  cases.push_back({"SpinIndexerLogits", std::move(fl), "field 'layer' = -2"});
  for (auto& c : cases) {
    size_t const m = gLogger.mark();
    Plugin p = create(c.type, c.f, TensorRTPhase::kBUILD, "bad_layer");
    std::string const err = gLogger.errorsSince(m);
    EXPECT(!p.p, "%s accepted fields that should fail with '%s'", c.type, c.needle);
    EXPECT(contains(err, c.needle) && contains(err, c.type) && contains(err, "'bad_layer'"),
           "expected '%s' in the logged error, got: %s", c.needle, err.c_str());
  }
  Fields fs;
  fs.str("policy", "age").str("pooling", "mean").i32("max_context", 64).i32("m_cap", 1);
  Plugin ok = create("SpinSelect", fs);
  EXPECT(static_cast<bool>(ok), "enum fields by name");
  IPluginCreatorV3One* c = creator("SpinIndexerLogits");
  Plugin dflt = wrap(c ? c->createPlugin("x", nullptr, TensorRTPhase::kBUILD) : nullptr);
  EXPECT(static_cast<bool>(dflt), "a null collection means every default");
}

void checkEnqueueErrors() {
  // No kernel runs here: each call fails its checks before any launch.
  Fields fl = logitsFields();
  Plugin l = create("SpinIndexerLogits", fl);
  Recorder rec;
  ResourceContext ctx(&rec);
  Plugin att = wrap(l.runtime->attachToContext(&ctx));
  if (!att) {
    EXPECT(false, "attachToContext");
    return;
  }
  Io io = logitsIo(3, 2, 2, 5, 9, true);
  auto* fake = reinterpret_cast<void*>(0x100000);
  std::vector<void const*> in(io.in.size(), fake);
  std::vector<void*> out(io.out.size(), fake);
  in[0] = reinterpret_cast<void const*>(0x100001);  // q misaligned
  size_t m = gLogger.mark();
  EXPECT(att.runtime->enqueue(io.in.data(), io.out.data(), in.data(), out.data(), nullptr, nullptr) != 0);
  EXPECT(rec.getNbErrors() == 1 && rec.getErrorCode(0) == ErrorCode::kINVALID_ARGUMENT &&
             contains(rec.getErrorDesc(0), "16-byte aligned"),
         "recorder: %d errors", rec.getNbErrors());
  EXPECT(contains(gLogger.errorsSince(m),
                  "SpinIndexerLogits 'harness': q, kv_cache and weights must start at 16-byte aligned"));
  in[0] = fake;
  in[2] = reinterpret_cast<void const*>(0x100004);  // weights 4 bytes off
  rec.clear();
  EXPECT(att.runtime->enqueue(io.in.data(), io.out.data(), in.data(), out.data(), nullptr, nullptr) != 0);
  EXPECT(rec.getNbErrors() == 1 && contains(rec.getErrorDesc(0), "16-byte aligned"));
  in[2] = nullptr;
  rec.clear();
  EXPECT(att.runtime->enqueue(io.in.data(), io.out.data(), in.data(), out.data(), nullptr, nullptr) != 0);
  EXPECT(rec.getNbErrors() == 1 && contains(rec.getErrorDesc(0), "weights [6, 64] has no device address"));
  in[2] = fake;
  io.in[3] = desc(kI32, {3, 0});
  rec.clear();
  EXPECT(att.runtime->enqueue(io.in.data(), io.out.data(), in.data(), out.data(), nullptr, nullptr) != 0);
  EXPECT(rec.getNbErrors() == 1 && contains(rec.getErrorDesc(0), "1 <= R (next_n) <= 8"));

  Fields fu = updateFields();
  Plugin u = create("SpinUpdate", fu);
  Plugin ua = wrap(u.runtime->attachToContext(&ctx));
  Io ui = updateIo(5, 2, 300, 3, 2, 16, true);
  ui.in[2] = desc(kI64, {5, 2, 4});
  std::vector<void const*> uin(ui.in.size(), fake);
  std::vector<void*> uout(1, fake);
  rec.clear();
  EXPECT(ua.runtime->enqueue(ui.in.data(), ui.out.data(), uin.data(), uout.data(), nullptr, nullptr) != 0);
  EXPECT(rec.getNbErrors() == 1 && contains(rec.getErrorDesc(0), "last_seen must be [S, L, ceil(cap / 64)]"));
  ui.in[2] = desc(kI64, {5, 2, 5});
  uin[5] = reinterpret_cast<void const*>(0x100008);  // logits 8 bytes off
  rec.clear();
  EXPECT(ua.runtime->enqueue(ui.in.data(), ui.out.data(), uin.data(), uout.data(), nullptr, nullptr) != 0);
  EXPECT(rec.getNbErrors() == 1 && contains(rec.getErrorDesc(0), "logits must start at a 16-byte aligned"),
         "recorder: %d errors", rec.getNbErrors());
}

int runChecks() {
  group("creators", checkCreators);
  group("capabilities", checkCapabilities);
  group("output_dtypes", checkDataTypes);
  group("output_shapes", checkShapes);
  group("formats", checkFormats);
  group("configure_and_shape_change", checkConfigure);
  group("serialization_round_trip_and_clone", checkSerialization);
  group("bad_fields", checkBadFields);
  group("enqueue_errors", checkEnqueueErrors);
  std::printf("plugin_harness: %d checks, %d failed\n", gChecks, gFailures);
  return gFailures ? 1 : 0;
}

int printFields() {
  for (auto const& name : gCreatorOrder) {
    IPluginCreatorV3One* c = creator(name);
    std::printf("%s %s", name.c_str(), c->getPluginVersion());
    PluginFieldCollection const* fc = c->getFieldNames();
    for (int32_t i = 0; i < fc->nbFields; ++i)
      std::printf(" %s:%s", fc->fields[i].name, fieldTypeName(fc->fields[i].type));
    std::printf("\n");
  }
  return 0;
}

// ---- run mode ------------------------------------------------------------------------------------
struct Tensor {
  DataType type{DataType::kFLOAT};
  Dims dims{};
  void* dev{nullptr};
  size_t bytes{0};
};

bool parseType(std::string const& s, DataType& t, size_t& size) {
  static std::map<std::string, std::pair<DataType, size_t>> const kTypes = {
      {"f32", {DataType::kFLOAT, 4}}, {"f16", {DataType::kHALF, 2}}, {"bf16", {DataType::kBF16, 2}},
      {"i32", {DataType::kINT32, 4}}, {"i64", {DataType::kINT64, 8}}, {"fp8", {DataType::kFP8, 1}},
      {"i8", {DataType::kINT8, 1}},   {"u8", {DataType::kUINT8, 1}}, {"bool", {DataType::kBOOL, 1}}};
  auto it = kTypes.find(s);
  if (it == kTypes.end()) return false;
  t = it->second.first;
  size = it->second.second;
  return true;
}

size_t elementSize(DataType t) {
  switch (t) {
    case DataType::kFLOAT:
    case DataType::kINT32: return 4;
    case DataType::kHALF:
    case DataType::kBF16: return 2;
    case DataType::kINT64: return 8;
    default: return 1;
  }
}

size_t volume(Dims const& d) {
  size_t v = 1;
  for (int32_t i = 0; i < d.nbDims; ++i) v *= static_cast<size_t>(d.d[i] < 0 ? 0 : d.d[i]);
  return v;
}

class Runner {
 public:
  Runner(std::string dir, bool dry) : mDir(std::move(dir)), mDry(dry) {}
  ~Runner() {
    for (auto& [name, t] : mTensors)
      if (t.dev) cudaFree(t.dev);
  }

  int run() {
    std::ifstream in(mDir + "/case.txt");
    if (!in) return fail("cannot read " + mDir + "/case.txt");
    std::string line;
    int lineNo = 0;
    while (std::getline(in, line)) {
      ++lineNo;
      std::istringstream ss(line);
      std::string cmd;
      if (!(ss >> cmd) || cmd[0] == '#') continue;
      std::vector<std::string> args;
      for (std::string a; ss >> a;) args.push_back(a);
      int rc = 0;
      if (cmd == "tensor") rc = tensor(args);
      else if (cmd == "plugin") rc = beginPlugin(args);
      else if (cmd == "field") rc = field(args);
      else if (cmd == "inputs") mInputs = args;
      else if (cmd == "outputs") mOutputs = args;
      else if (cmd == "end") rc = endPlugin();
      else if (cmd == "save") rc = save(args);
      else rc = fail("unknown directive '" + cmd + "'");
      if (rc) {
        std::fprintf(stderr, "plugin_harness: %s/case.txt line %d: %s\n", mDir.c_str(), lineNo, line.c_str());
        return rc;
      }
    }
    std::printf("run: %d plugin calls%s\n", mCalls, mDry ? " (dry: nothing enqueued)" : "");
    return 0;
  }

 private:
  int fail(std::string const& msg) {
    std::fprintf(stderr, "plugin_harness: %s\n", msg.c_str());
    return 1;
  }

  int cuda(cudaError_t e, char const* what) {
    return e == cudaSuccess ? 0 : fail(std::string(what) + ": " + cudaGetErrorString(e));
  }

  // tensor NAME DTYPE FILE D0 [D1 ...]   (FILE "-": zero-filled)
  int tensor(std::vector<std::string> const& a) {
    if (a.size() < 4) return fail("tensor NAME DTYPE FILE D0 [D1 ...]");
    Tensor t;
    size_t esize = 0;
    if (!parseType(a[1], t.type, esize)) return fail("unknown dtype " + a[1]);
    std::vector<int64_t> d;
    for (size_t i = 3; i < a.size(); ++i) d.push_back(std::stoll(a[i]));
    t.dims = dims(d);
    t.bytes = volume(t.dims) * esize;
    std::vector<char> host(t.bytes, 0);
    if (a[2] != "-") {
      std::ifstream f(mDir + "/" + a[2], std::ios::binary | std::ios::ate);
      if (!f) return fail("cannot read " + a[2]);
      size_t const size = static_cast<size_t>(f.tellg());
      if (size != t.bytes)
        return fail(a[2] + " holds " + std::to_string(size) + " bytes, " + a[0] + " " + dimsText(t.dims) + " " + a[1] +
                    " needs " + std::to_string(t.bytes));
      f.seekg(0);
      f.read(host.data(), static_cast<std::streamsize>(size));
    }
    if (!mDry && t.bytes) {
      if (cuda(cudaMalloc(&t.dev, t.bytes), "cudaMalloc")) return 1;
      if (cuda(cudaMemcpy(t.dev, host.data(), t.bytes, cudaMemcpyHostToDevice), "cudaMemcpy")) return 1;
    }
    if (mTensors.count(a[0])) return fail("tensor " + a[0] + " defined twice");
    mTensors[a[0]] = t;
    return 0;
  }

  int beginPlugin(std::vector<std::string> const& a) {
    if (a.size() != 2) return fail("plugin TYPE NAME");
    mType = a[0];
    mName = a[1];
    mFields = std::make_unique<Fields>();
    mInputs.clear();
    mOutputs.clear();
    return 0;
  }

  // field NAME KIND VALUE   (KIND: i32, i64, f32, f64, s)
  int field(std::vector<std::string> const& a) {
    if (!mFields || a.size() != 3) return fail("field NAME KIND VALUE inside plugin ... end");
    char const* n = a[0].c_str();
    if (a[1] == "i32") mFields->i32(n, static_cast<int32_t>(std::stoll(a[2])));
    else if (a[1] == "i64") mFields->i64(n, std::stoll(a[2]));
    else if (a[1] == "f32") mFields->f32(n, std::strtof(a[2].c_str(), nullptr));
    else if (a[1] == "f64") mFields->f64(n, std::strtod(a[2].c_str(), nullptr));
    else if (a[1] == "s") mFields->str(n, a[2]);
    else return fail("field kind must be i32/i64/f32/f64/s");
    return 0;
  }

  int endPlugin() {
    if (!mFields) return fail("end without plugin");
    IPluginCreatorV3One* c = creator(mType);
    if (!c) return fail("no creator named " + mType);
    size_t const m = gLogger.mark();
    Plugin p = wrap(c->createPlugin(mName.c_str(), mFields->fc(), TensorRTPhase::kBUILD));
    if (!p) return fail(mType + " " + mName + ": createPlugin failed: " + gLogger.errorsSince(m));
    int32_t const nbIn = static_cast<int32_t>(mInputs.size());
    int32_t const nbOut = p.build->getNbOutputs();
    if (static_cast<int32_t>(mOutputs.size()) != nbOut)
      return fail(mType + " has " + std::to_string(nbOut) + " outputs, the case names " + std::to_string(mOutputs.size()));
    std::vector<PluginTensorDesc> inDesc;
    std::vector<void const*> inPtr;
    std::vector<DataType> inTypes;
    for (auto const& n : mInputs) {
      auto it = mTensors.find(n);
      if (it == mTensors.end()) return fail("no tensor named " + n);
      PluginTensorDesc d{};
      d.dims = it->second.dims;
      d.type = it->second.type;
      d.format = TensorFormat::kLINEAR;
      d.scale = -1.0F;
      inDesc.push_back(d);
      inPtr.push_back(it->second.dev);
      inTypes.push_back(d.type);
    }
    // build phase, as the builder calls it
    std::vector<DataType> outTypes(static_cast<size_t>(nbOut));
    if (p.build->getOutputDataTypes(outTypes.data(), nbOut, inTypes.data(), nbIn) != 0)
      return fail(mName + ": getOutputDataTypes: " + gLogger.errorsSince(m));
    ExprBuilder b;
    std::vector<DimsExprs> inExpr(inDesc.size());
    for (size_t i = 0; i < inDesc.size(); ++i) {
      inExpr[i].nbDims = inDesc[i].dims.nbDims;
      for (int32_t a = 0; a < inDesc[i].dims.nbDims; ++a) inExpr[i].d[a] = b.constant(inDesc[i].dims.d[a]);
    }
    std::vector<DimsExprs> outExpr(static_cast<size_t>(nbOut));
    if (p.build->getOutputShapes(inExpr.data(), nbIn, nullptr, 0, outExpr.data(), nbOut, b) != 0)
      return fail(mName + ": getOutputShapes: " + gLogger.errorsSince(m));
    std::vector<PluginTensorDesc> outDesc(static_cast<size_t>(nbOut));
    for (int32_t k = 0; k < nbOut; ++k) {
      outDesc[k].dims.nbDims = outExpr[k].nbDims;
      for (int32_t a = 0; a < outExpr[k].nbDims; ++a) {
        if (!outExpr[k].d[a] || !outExpr[k].d[a]->isConstant()) return fail(mName + ": an output extent is not constant");
        outDesc[k].dims.d[a] = outExpr[k].d[a]->getConstantValue();
      }
      outDesc[k].type = outTypes[k];
      outDesc[k].format = TensorFormat::kLINEAR;
      outDesc[k].scale = -1.0F;
    }
    std::vector<DynamicPluginTensorDesc> all, dynIn, dynOut;
    for (auto const& d : inDesc) dynIn.push_back(dyn(d));
    for (auto const& d : outDesc) dynOut.push_back(dyn(d));
    all = dynIn;
    all.insert(all.end(), dynOut.begin(), dynOut.end());
    for (int32_t pos = 0; pos < nbIn + nbOut; ++pos)
      if (!p.build->supportsFormatCombination(pos, all.data(), nbIn, nbOut))
        return fail(mName + ": supportsFormatCombination refused position " + std::to_string(pos));
    if (p.build->configurePlugin(dynIn.data(), nbIn, dynOut.data(), nbOut) != 0)
      return fail(mName + ": configurePlugin: " + gLogger.errorsSince(m));
    size_t const workspace = p.build->getWorkspaceSize(dynIn.data(), nbIn, dynOut.data(), nbOut);
    // the engine keeps the fields; the runtime re-creates the plugin from them
    Fields kept;
    for (auto const& f : snapshot(p.runtime->getFieldsToSerialize()))
      kept.raw(f.name.c_str(), f.type, f.bytes.data(), f.bytes.size(), f.length);
    Plugin rt = wrap(c->createPlugin(mName.c_str(), kept.fc(), TensorRTPhase::kRUNTIME));
    if (!rt) return fail(mName + ": re-creating from the serialized fields failed: " + gLogger.errorsSince(m));
    Recorder rec;
    ResourceContext ctx(&rec);
    Plugin att = wrap(rt.runtime->attachToContext(&ctx));
    if (!att) return fail(mName + ": attachToContext failed");
    if (att.runtime->onShapeChange(inDesc.data(), nbIn, outDesc.data(), nbOut) != 0)
      return fail(mName + ": onShapeChange: " + gLogger.errorsSince(m));
    std::printf("%s %s:", mType.c_str(), mName.c_str());
    for (int32_t k = 0; k < nbOut; ++k) std::printf(" %s %s", mOutputs[k].c_str(), dimsText(outDesc[k].dims).c_str());
    std::printf("\n");
    std::vector<void*> outPtr(static_cast<size_t>(nbOut), nullptr);
    for (int32_t k = 0; k < nbOut; ++k) {
      Tensor t;
      t.type = outDesc[k].type;
      t.dims = outDesc[k].dims;
      t.bytes = volume(t.dims) * elementSize(t.type);
      if (!mDry && t.bytes) {
        if (cuda(cudaMalloc(&t.dev, t.bytes), "cudaMalloc")) return 1;
        // a sentinel, so that an output the plugin does not write shows up
        if (cuda(cudaMemset(t.dev, 0x7f, t.bytes), "cudaMemset")) return 1;
      }
      outPtr[k] = t.dev;
      if (mTensors.count(mOutputs[k])) return fail("tensor " + mOutputs[k] + " defined twice");
      mTensors[mOutputs[k]] = t;
    }
    if (!mDry) {
      void* ws = nullptr;
      if (workspace && cuda(cudaMalloc(&ws, workspace), "cudaMalloc workspace")) return 1;
      cudaStream_t stream = nullptr;
      if (cuda(cudaStreamCreate(&stream), "cudaStreamCreate")) return 1;
      int32_t const rc = att.runtime->enqueue(inDesc.data(), outDesc.data(), inPtr.data(), outPtr.data(), ws, stream);
      cudaError_t const sync = cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
      if (ws) cudaFree(ws);
      if (rc != 0) return fail(mName + ": enqueue returned " + std::to_string(rc) + ": " + gLogger.errorsSince(m));
      if (cuda(sync, "cudaStreamSynchronize after enqueue")) return 1;
      if (rec.getNbErrors()) return fail(mName + ": the error recorder got: " + rec.getErrorDesc(0));
    }
    ++mCalls;
    mFields.reset();
    return 0;
  }

  // save NAME FILE
  int save(std::vector<std::string> const& a) {
    if (a.size() != 2) return fail("save NAME FILE");
    auto it = mTensors.find(a[0]);
    if (it == mTensors.end()) return fail("no tensor named " + a[0]);
    if (mDry) return 0;
    std::vector<char> host(it->second.bytes);
    if (it->second.bytes &&
        cuda(cudaMemcpy(host.data(), it->second.dev, it->second.bytes, cudaMemcpyDeviceToHost), "cudaMemcpy"))
      return 1;
    std::ofstream f(mDir + "/" + a[1], std::ios::binary);
    f.write(host.data(), static_cast<std::streamsize>(host.size()));
    return f ? 0 : fail("cannot write " + a[1]);
  }

  std::string mDir;
  bool mDry;
  std::map<std::string, Tensor> mTensors;
  std::string mType, mName;
  std::unique_ptr<Fields> mFields;
  std::vector<std::string> mInputs, mOutputs;
  int mCalls{0};
};

int usage() {
  std::fprintf(stderr,
               "usage: plugin_harness check LIB | fields LIB | run LIB CASE_DIR [--dry]\n"
               "  LIB: libspin_trtllm_plugins.so; CASE_DIR holds case.txt and the tensor files\n");
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) return usage();
  std::string const mode = argv[1];
  gLogger.mEcho = mode == "run";
  if (!loadLibrary(argv[2])) return 1;
  if (mode == "check") return runChecks();
  if (mode == "fields") return printFields();
  if (mode == "run") {
    if (argc < 4) return usage();
    bool const dry = argc > 4 && std::string(argv[4]) == "--dry";
    if (!dry) {
      int n = 0;
      if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
        std::fprintf(stderr, "plugin_harness: no CUDA device (use --dry to stop before enqueue)\n");
        return 3;
      }
    }
    return Runner(argv[3], dry).run();
  }
  return usage();
}
