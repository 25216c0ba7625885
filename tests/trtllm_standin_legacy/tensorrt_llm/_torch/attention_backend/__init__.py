"""Stand-in for tensorrt_llm/_torch/attention_backend (release 1.2)."""
