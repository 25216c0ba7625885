"""The one home of the constants that the kernels, the ops, the config, the integrations and
the CLI share.

Torch- and pydantic-free, so the CLI and the config read it without importing torch (a submodule of
``spin_trtllm.ops`` cannot be: importing the package registers the torch ops). The C++ side
holds the same values in ``cpp/include/spin/spin_kernels.h``; ``tests/test_limits.py`` fails
when the two disagree.
"""

from dataclasses import dataclass

BLOCK_SLOTS = 64          # KV slots per SPIN block = slots per indexer K-cache page
PAGE_SIZES = (32, BLOCK_SLOTS)   # K-cache page sizes: a SPIN block is one or two pages
MAX_NEXT_N = 8            # MTP rows per request (next_n = 1 + draft tokens)
INDEX_HEADS = 64          # indexer heads (DeepSeek-V3.2/V4)
HEAD_DIM = 128            # indexer key/query dimension (fp8 bytes per key)
KEY_BYTES = HEAD_DIM
SLOT_BYTES = KEY_BYTES + 4    # fp8 key + its fp32 scale
# MXFP4 keys (V4 on SM100): HEAD_DIM / 2 bytes of E2M1 pairs (even element in the low nibble),
# then one UE8M0 exponent byte per FP4_BLOCK values; a page keeps all its keys, then all scales
FP4_BLOCK = 32
FP4_SLOT_BYTES = HEAD_DIM // 2 + HEAD_DIM // FP4_BLOCK
SUMMARY_BYTES = 144       # a page's probe summary: 128 fp8 bytes, fp32 scale, padding
GAUSS_SUMMARY_BYTES = 2 * SUMMARY_BYTES   # gauss: the mean row, then the per-dim std row
MAX_SORTED_K = 4096       # remap(ascending=True): one CTA sorts a row
# ops.topk's filter (SPIN_TOPK_FILTER): rows wider than a slice of table slots (m_cap * 64), at
# most TOPK_FILTER_MAX_SLOTS wide, K and rows within their bounds; auto for
# TOPK_FILTER_AUTO_MIN_ROWS to TOPK_FILTER_AUTO_MAX_ROWS rows of at least
# TOPK_FILTER_AUTO_MIN_SLOTS (where it beat one CTA a row on full and on most half-full rows;
# it also wins full 32 x 128K rows, but loses half-full ones more: RESULTS.md, top-K)
TOPK_FILTER_SLICE_SLOTS = 16384
TOPK_FILTER_MAX_SLOTS = 512 * 1024
TOPK_FILTER_MAX_K = 2048
TOPK_FILTER_MAX_ROWS = 2048
TOPK_FILTER_AUTO_MIN_ROWS = 16
TOPK_FILTER_AUTO_MAX_ROWS = 32
TOPK_FILTER_AUTO_MIN_SLOTS = 16 * TOPK_FILTER_SLICE_SLOTS
MAX_HYBRID_BLOCKS = 8192  # select(merge_history=True) sorts a row's blocks in shared memory
MAX_M_CAP = 33550335      # m_cap * 64, plus update's next pass (2^18 slots), fits the kernels' int
MAX_LAUNCH_BATCH = 65535  # requests of one launch: the CUDA grid's y dimension
# DeepGEMM's SM90 paged-logits schedule (get_paged_mqa_logits_metadata) splits a request's
# slots into runs of this many; ops.compact writes that schedule for every layer at once
DEEPGEMM_SPLIT_KV = 256
INT32_MAX = 2**31 - 1     # the kernels' sizes and indices are int32: no tensor dim may pass it

# Enum values as the kernels read them.
POOLING = {"max": 0, "mean": 1, "top4": 2}
EXPLORATION_POLICY = {"random": 0, "staleness": 1, "age": 2}
STATE_DTYPES = ("float32", "float16", "float8_e4m3fn")   # kernel StateType order

# Bounds and defaults of SpinConfig fields, here so that the CLI's parser states them without
# importing pydantic (spin_trtllm/config.py uses these).
# Upper bound of index_topk: 512x V3.2's 2048 and as many slots as a 1M-token context. The
# kernels, the TensorRT plugin fields and the trace format carry K as int32 and size per-row
# top-K buffers by it, so a larger K overflowed (int64 conversion) or allocated without bound.
MAX_INDEX_TOPK = 1 << 20
MAX_BLOCK_SIZE = 1 << 16
DEFAULT_TARGET_SPARSITY = 0.4
DEFAULT_EXPLORATION = 0.05
DEFAULT_EXPLORATION_POLICY = "random"
DEFAULT_SEED = 0
# index_topk defaults of the two TensorRT-LLM DSA algorithms.
TRTLLM_ALGORITHM_TOPK = {"deepseek_v4": 512, "dsa": 2048}
# The Triton bundle's model.py defers to TensorRT-LLM's LLM-API Triton model: where it sits in a
# TensorRT-LLM checkout, and the variable that names it at Triton load.
LLMAPI_MODEL_PATH = "triton_backend/all_models/llmapi/tensorrt_llm/1/model.py"
LLMAPI_MODEL_ENV = "SPIN_TRTLLM_LLMAPI_MODEL"

# spin_native::abi_version of the kernels the ops drive: a library built before an op's
# meaning changed would misread the call.
NATIVE_ABI = 7


@dataclass(frozen=True)
class DemoWorkload:
    """The demo's default work on a device type (each a harness.demo.DemoOptions field)."""
    requests: int
    prompt_tokens: int                  # the longest prompt
    new_tokens: int
    measure_miss: bool


# The GPU's is the workload the report was designed around. The CPU's is smaller so the
# reference ops finish in well under a minute on 2 cores (most of it is the dense prefill
# indexer, quadratic in the prompt); there the shadow dense indexer adds under a tenth, on a
# GPU it would run inside the timed steps.
DEMO_WORKLOADS = {
    "cuda": DemoWorkload(requests=4, prompt_tokens=1600, new_tokens=48, measure_miss=False),
    "cpu": DemoWorkload(requests=4, prompt_tokens=896, new_tokens=32, measure_miss=True)}


# The mask plot's default window: the newest slots of the last steps, about 2 x 1 pixels a
# slot-step on its 10 x 6 inch axes at DPI (the whole of a long trace would be < 1 px a slot)
MASK_SLOTS = 512
MASK_STEPS = 512
