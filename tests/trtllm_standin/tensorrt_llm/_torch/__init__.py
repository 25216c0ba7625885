"""Stand-in for tensorrt_llm/_torch/ (the PyTorch backend): only the DSA / DeepSeek-V4 path."""
