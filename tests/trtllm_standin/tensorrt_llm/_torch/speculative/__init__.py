"""Stand-in for tensorrt_llm/_torch/speculative/: the one-model MTP worker."""
