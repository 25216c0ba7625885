"""Stand-in for tensorrt_llm/_torch/attention_backend/sparse (release 1.2)."""
