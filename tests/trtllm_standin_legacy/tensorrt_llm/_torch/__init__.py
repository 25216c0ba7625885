"""Stand-in for tensorrt_llm/_torch (release 1.2)."""
