"""Integrations: TensorRT-LLM's PyTorch backend (`trtllm`) and TensorRT networks (`tensorrt`)."""
