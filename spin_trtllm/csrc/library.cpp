// The spin_native library: torch bindings of the cpp/ launchers, one op per file (select.cpp,
// indexer_logits.cpp, topk.cpp, update.cpp, compact.cpp, probe.cpp), each defining its schema
// with TORCH_LIBRARY_FRAGMENT and its CUDA kernel with TORCH_LIBRARY_IMPL. The public ops
// (torch.ops.spin.*) are defined in spin_trtllm/ops/ (one module per op), which validates every argument and then
// calls these on CUDA tensors; its _SCHEMAS are these schemas.
#include <torch/library.h>

namespace {

// Raised whenever an op's meaning changes under the same schema; spin_trtllm.ops.NATIVE_ABI must
// match, so that a library built before the change is not used.
constexpr int64_t kAbiVersion = 7;
int64_t spin_abi_version() { return kAbiVersion; }

}  // namespace

TORCH_LIBRARY(spin_native, m) {
  m.def("abi_version", &spin_abi_version);
}
