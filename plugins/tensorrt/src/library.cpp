// Plugin creators and the two entry points TensorRT looks up in a plugin library
// (IPluginRegistry::loadLibrary, trtexec --dynamicPlugins): getCreators, setLoggerFinder.
#include "plugins.h"

namespace spin_trt {
namespace {

class Creator final : public nvinfer1::IPluginCreatorV3One {
 public:
  Creator(PluginSpec const& spec, PluginFactory make) : mSpec(spec), mMake(make) {
    for (FieldSpec const& f : spec.fields) {
      PluginFieldType const t = f.kind == FieldKind::kFloat ? PluginFieldType::kFLOAT64 : PluginFieldType::kINT64;
      mFieldNames.emplace_back(f.name, nullptr, t, 1);
    }
    mCollection.nbFields = static_cast<int32_t>(mFieldNames.size());
    mCollection.fields = mFieldNames.data();
  }

  char const* getPluginName() const noexcept override { return mSpec.name; }
  char const* getPluginVersion() const noexcept override { return kPluginVersion; }
  char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }
  PluginFieldCollection const* getFieldNames() noexcept override { return &mCollection; }

  // Both phases take the same fields: at run time they are getFieldsToSerialize()'s.
  IPluginV3* createPlugin(char const* name, PluginFieldCollection const* fc,
                          nvinfer1::TensorRTPhase /*phase*/) noexcept override {
    std::string const layer = name ? name : "";
    try {
      FieldValues values(&mSpec);
      std::string err;
      if (!values.parse(fc, err)) {
        logMessage(ILogger::Severity::kERROR, std::string(mSpec.name) + " '" + layer + "': " + err);
        return nullptr;
      }
      return mMake(std::move(values), layer);
    } catch (std::exception const& e) {
      logMessage(ILogger::Severity::kERROR, std::string(mSpec.name) + " '" + layer + "': " + e.what());
    } catch (...) {
      logMessage(ILogger::Severity::kERROR, std::string(mSpec.name) + " '" + layer + "': createPlugin failed");
    }
    return nullptr;
  }

 private:
  PluginSpec const& mSpec;
  PluginFactory mMake;
  std::vector<PluginField> mFieldNames;
  PluginFieldCollection mCollection{};
};

}  // namespace
}  // namespace spin_trt

#define SPIN_EXPORT __attribute__((visibility("default")))

extern "C" SPIN_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder) { spin_trt::setLoggerFinder(finder); }

extern "C" SPIN_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  using namespace spin_trt;
  static Creator select(selectSpec(), makeSelect);
  static Creator logits(logitsSpec(), makeLogits);
  static Creator topk(topkSpec(), makeTopK);
  static Creator update(updateSpec(), makeUpdate);
  static nvinfer1::IPluginCreatorInterface* const creators[] = {&select, &logits, &topk, &update};
  nbCreators = 4;
  return creators;
}
