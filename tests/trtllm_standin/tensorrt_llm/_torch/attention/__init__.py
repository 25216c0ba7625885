"""Stand-in for tensorrt_llm/_torch/attention/."""
