"""Helpers shared by the test suite (tests/) and nothing else: random FP8 K-cache pages, the
random op problems, comparisons, small traces, an independent exploration-hash oracle, the
dsa-lite schedules and the TensorRT-LLM stand-in's building blocks and dense reference.

The package's runtime code never imports spin_trtllm.testing; these modules may import torch and
any spin_trtllm module. Import the submodule you need (spin_trtllm.testing.pages, .problems,
.compare, .traces, .hash_oracle, .harness, .standin, .triton_pdl): nothing is imported
here.
"""
