"""The one home of the constants that the kernels, the ops and the integrations share.

Torch-free, so the CLI and the config read it without importing torch (a submodule of
``spin_trtllm.ops`` cannot be: importing the package registers the torch ops). The C++ side
holds the same values in ``cpp/include/spin/spin_kernels.h``; ``tests/test_limits.py`` fails
when the two disagree.
"""

BLOCK_SLOTS = 64          # KV slots per SPIN block = slots per indexer K-cache page
PAGE_SIZES = (32, BLOCK_SLOTS)   # K-cache page sizes: a SPIN block is one or two pages
MAX_NEXT_N = 8            # MTP rows per request (next_n = 1 + draft tokens)
INDEX_HEADS = 64          # indexer heads (DeepSeek-V3.2/V4)
HEAD_DIM = 128            # indexer key/query dimension (fp8 bytes per key)
KEY_BYTES = HEAD_DIM
SLOT_BYTES = KEY_BYTES + 4    # fp8 key + its fp32 scale
SUMMARY_BYTES = 144       # a page's probe summary: 128 fp8 bytes, fp32 scale, padding
MAX_SORTED_K = 4096       # remap(ascending=True): one CTA sorts a row
MAX_HYBRID_BLOCKS = 8192  # select(merge_history=True) sorts a row's blocks in shared memory
MAX_M_CAP = 33554431      # m_cap * 64 must fit the kernels' int row width

# Enum values as the kernels read them.
POOLING = {"max": 0, "mean": 1, "top4": 2}
EXPLORATION_POLICY = {"random": 0, "staleness": 1, "age": 2}
STATE_DTYPES = ("float32", "float16", "float8_e4m3fn")   # kernel StateType order

# spin_native::abi_version of the kernels the ops drive: a library built before an op's
# meaning changed would misread the call.
NATIVE_ABI = 4
