"""A stand-in for tensorrt_llm with the names spin_trtllm.trtllm patches, written for our tests
from the contracts in shared/REFERENCE.md (no upstream code). Only used by test_trtllm_patch."""
__version__ = "1.2.0"
