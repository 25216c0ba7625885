// Logging, plugin fields (parse, validate, serialize) and dimension checks of the SPIN TensorRT
// plugins (common.h); the IPluginV3 base they derive from is plugin_base.cpp.
#include "common.h"

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace spin_trt {

// ---- logging -------------------------------------------------------------------------------------
namespace {
std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};
}

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept { gLoggerFinder.store(finder); }

void logMessage(ILogger::Severity severity, std::string const& msg) noexcept {
  try {
    nvinfer1::ILoggerFinder* finder = gLoggerFinder.load();
    ILogger* logger = finder ? finder->findLogger() : nullptr;
    if (logger) {
      logger->log(severity, msg.c_str());
    } else if (severity <= ILogger::Severity::kWARNING) {
      // no TensorRT logger (e.g. the library used directly): errors must still be seen
      std::fprintf(stderr, "[spin_trtllm_plugins] %s\n", msg.c_str());
    }
  } catch (...) {
  }
}

// ---- fields --------------------------------------------------------------------------------------
namespace {

std::string numberText(double v) {
  char buf[64];
  if (v == std::floor(v) && std::fabs(v) < 1e17) {
    std::snprintf(buf, sizeof(buf), "%lld", static_cast<long long>(v));
  } else {
    for (int prec = 1; prec <= 17; ++prec) {  // the shortest decimal that reads back as v
      std::snprintf(buf, sizeof(buf), "%.*g", prec, v);
      if (std::strtod(buf, nullptr) == v) break;
    }
  }
  return buf;
}

// A FLOAT32 field means the decimal the caller wrote: take the shortest decimal that
// round-trips through float, so 0.4f gives 0.4 exactly as the torch ops' double does.
double fromFloat32(float f) {
  if (!std::isfinite(f)) return f;
  char buf[64];
  for (int prec = 1; prec <= 9; ++prec) {
    std::snprintf(buf, sizeof(buf), "%.*g", prec, static_cast<double>(f));
    if (std::strtof(buf, nullptr) == f) return std::strtod(buf, nullptr);
  }
  return f;
}

char const* fieldTypeName(PluginFieldType t) {
  switch (t) {
    case PluginFieldType::kFLOAT16: return "FLOAT16";
    case PluginFieldType::kFLOAT32: return "FLOAT32";
    case PluginFieldType::kFLOAT64: return "FLOAT64";
    case PluginFieldType::kINT8: return "INT8";
    case PluginFieldType::kINT16: return "INT16";
    case PluginFieldType::kINT32: return "INT32";
    case PluginFieldType::kINT64: return "INT64";
    case PluginFieldType::kCHAR: return "CHAR";
    case PluginFieldType::kDIMS: return "DIMS";
    case PluginFieldType::kBF16: return "BF16";
    default: return "another type";
  }
}

bool readInt(PluginField const& f, double& v) {
  switch (f.type) {
    case PluginFieldType::kINT8: v = *static_cast<int8_t const*>(f.data); return true;
    case PluginFieldType::kINT16: v = *static_cast<int16_t const*>(f.data); return true;
    case PluginFieldType::kINT32: v = *static_cast<int32_t const*>(f.data); return true;
    case PluginFieldType::kINT64: v = static_cast<double>(*static_cast<int64_t const*>(f.data)); return true;
    default: return false;
  }
}

bool readFloat(PluginField const& f, double& v) {
  switch (f.type) {
    case PluginFieldType::kFLOAT32: v = fromFloat32(*static_cast<float const*>(f.data)); return true;
    case PluginFieldType::kFLOAT64: v = *static_cast<double const*>(f.data); return true;
    default: return readInt(f, v);
  }
}

bool inRange(FieldSpec const& s, double v) {
  if (s.kind == FieldKind::kFloat) return v >= s.lo && v < s.hi;
  return v >= s.lo && v <= s.hi;
}

}  // namespace

FieldValues::FieldValues(PluginSpec const* spec) : mSpec(spec) {
  for (FieldSpec const& f : spec->fields) mValues.push_back(f.def);
}

bool FieldValues::parse(PluginFieldCollection const* fc, std::string& err) {
  auto const& specs = mSpec->fields;
  std::vector<bool> seen(specs.size(), false);
  int32_t const nb = fc ? fc->nbFields : 0;
  if (nb < 0 || (nb > 0 && fc->fields == nullptr)) {
    err = "the field collection is malformed (nbFields " + std::to_string(nb) + ")";
    return false;
  }
  for (int32_t k = 0; k < nb; ++k) {
    PluginField const& f = fc->fields[k];
    if (f.name == nullptr) {
      err = "field #" + std::to_string(k) + " has no name";
      return false;
    }
    size_t idx = specs.size();
    for (size_t i = 0; i < specs.size(); ++i)
      if (std::strcmp(specs[i].name, f.name) == 0) idx = i;
    if (idx == specs.size()) {
      err = std::string("unknown field '") + f.name + "' (fields:";
      for (FieldSpec const& s : specs) err += std::string(" ") + s.name;
      err += ")";
      return false;
    }
    FieldSpec const& s = specs[idx];
    if (seen[idx]) {
      err = std::string("field '") + s.name + "' is given twice";
      return false;
    }
    if (f.data == nullptr || f.length < 1) {
      err = std::string("field '") + s.name + "' has no value";
      return false;
    }
    double v = 0.0;
    if (f.type == PluginFieldType::kCHAR) {
      if (s.kind != FieldKind::kEnum) {
        err = std::string("field '") + s.name + "' must be a number, got a string";
        return false;
      }
      std::string text(static_cast<char const*>(f.data), static_cast<size_t>(f.length));
      text = text.substr(0, text.find('\0'));
      size_t i = 0;
      while (i < s.names.size() && text != s.names[i]) ++i;
      if (i == s.names.size()) {
        err = std::string("field '") + s.name + "' = '" + text + "': " + s.rule;
        return false;
      }
      v = static_cast<double>(i);
    } else {
      if (f.length != 1) {
        err = std::string("field '") + s.name + "' must hold one value, got " +
              std::to_string(f.length);
        return false;
      }
      bool const isFloat = s.kind == FieldKind::kFloat;
      if (!(isFloat ? readFloat(f, v) : readInt(f, v))) {
        err = std::string("field '") + s.name + "' must be " +
              (isFloat ? "FLOAT64 (or FLOAT32/INT*)" : "an integer (INT8/16/32/64)") + ", got " +
              fieldTypeName(f.type);
        return false;
      }
    }
    if (!inRange(s, v)) {
      err = std::string("field '") + s.name + "' = " + numberText(v) + ": " + s.rule;
      return false;
    }
    mValues[idx] = v;
    seen[idx] = true;
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].required && !seen[i]) {
      err = std::string("missing field '") + specs[i].name + "' (" + specs[i].rule + ")";
      return false;
    }
  }
  return true;
}

double FieldValues::get(char const* name) const {
  for (size_t i = 0; i < mSpec->fields.size(); ++i)
    if (std::strcmp(mSpec->fields[i].name, name) == 0) return mValues[i];
  return 0.0;  // names are compile-time constants of this library
}

std::string FieldValues::describe() const {
  std::string out;
  for (size_t i = 0; i < mSpec->fields.size(); ++i) {
    FieldSpec const& s = mSpec->fields[i];
    if (!out.empty()) out += " ";
    out += std::string(s.name) + "=";
    if (s.kind == FieldKind::kEnum) {
      out += s.names[static_cast<size_t>(mValues[i])];
    } else {
      out += numberText(mValues[i]);
    }
  }
  return out;
}

PluginFieldCollection const* FieldValues::serialize() {
  auto const& specs = mSpec->fields;
  mInts.clear();
  mFloats.clear();
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].kind == FieldKind::kFloat) {
      mFloats.push_back(mValues[i]);
    } else {
      mInts.push_back(static_cast<int64_t>(mValues[i]));
    }
  }
  // pointers into mInts/mFloats: both are complete, so they no longer move
  mFields.clear();
  size_t ni = 0, nf = 0;
  for (FieldSpec const& s : specs) {
    if (s.kind == FieldKind::kFloat) {
      mFields.emplace_back(s.name, &mFloats[nf++], PluginFieldType::kFLOAT64, 1);
    } else {
      mFields.emplace_back(s.name, &mInts[ni++], PluginFieldType::kINT64, 1);
    }
  }
  mCollection.nbFields = static_cast<int32_t>(mFields.size());
  mCollection.fields = mFields.data();
  return &mCollection;
}

// ---- dimension checks ----------------------------------------------------------------------------
std::string dimsText(Dims const& d) {
  std::string s = "[";
  for (int32_t i = 0; i < d.nbDims; ++i) {
    if (i) s += ", ";
    s += d.d[i] < 0 ? std::string("?") : std::to_string(d.d[i]);
  }
  return s + "]";
}

char const* typeName(DataType t) {
  switch (t) {
    case DataType::kFLOAT: return "float32";
    case DataType::kHALF: return "float16";
    case DataType::kINT8: return "int8";
    case DataType::kINT32: return "int32";
    case DataType::kBOOL: return "bool";
    case DataType::kUINT8: return "uint8";
    case DataType::kFP8: return "fp8";
    case DataType::kBF16: return "bfloat16";
    case DataType::kINT64: return "int64";
    default: return "another dtype";
  }
}

void DimCheck::fail(std::string msg) {
  if (mErr.empty()) mErr = std::move(msg);
}

void DimCheck::rankIs(int32_t i, int32_t r) {
  if (mDims[i].nbDims != r)
    fail(std::string(mNames[i]) + " must have " + std::to_string(r) + " dims, got " +
         dimsText(mDims[i]));
}

void DimCheck::rankIn(int32_t i, int32_t lo, int32_t hi) {
  if (mDims[i].nbDims < lo || mDims[i].nbDims > hi)
    fail(std::string(mNames[i]) + " must have " + std::to_string(lo) + ".." + std::to_string(hi) +
         " dims, got " + dimsText(mDims[i]));
}

void DimCheck::same(int32_t i, int32_t a, int32_t j, int32_t b, char const* what) {
  int64_t const x = mDims[i].d[a], y = mDims[j].d[b];
  if (x >= 0 && y >= 0 && x != y)
    fail(std::string(what) + ": " + mNames[i] + " is " + dimsText(mDims[i]) + ", " + mNames[j] +
         " is " + dimsText(mDims[j]));
}

void DimCheck::sameShape(int32_t i, int32_t j) {
  if (mDims[i].nbDims != mDims[j].nbDims) {
    fail(std::string(mNames[i]) + " must have the shape of " + mNames[j] + " " + dimsText(mDims[j]) +
         ", got " + dimsText(mDims[i]));
    return;
  }
  for (int32_t a = 0; a < mDims[i].nbDims; ++a) {
    int64_t const x = mDims[i].d[a], y = mDims[j].d[a];
    if (x >= 0 && y >= 0 && x != y) {
      fail(std::string(mNames[i]) + " must have the shape of " + mNames[j] + " " +
           dimsText(mDims[j]) + ", got " + dimsText(mDims[i]));
      return;
    }
  }
}

void DimCheck::equals(int32_t i, int32_t a, int64_t v, char const* what) {
  int64_t const x = mDims[i].d[a];
  if (x >= 0 && x != v) fail(std::string(what) + ", got " + mNames[i] + " " + dimsText(mDims[i]));
}

void DimCheck::within(int32_t i, int32_t a, int64_t lo, int64_t hi, char const* what) {
  int64_t const x = mDims[i].d[a];
  if (x >= 0 && (x < lo || x > hi)) fail(std::string(what) + ", got " + mNames[i] + " " + dimsText(mDims[i]));
}

}  // namespace spin_trt
