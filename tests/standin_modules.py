"""The TensorRT-LLM stand-in's modules loaded on their own (tests/trtllm_standin), for tests
that need one of them without the stand-in package on the path."""

import importlib.util
import sys
from pathlib import Path

STANDIN_DG = Path(__file__).parent / "trtllm_standin" / "tensorrt_llm" / "deep_gemm"


def standin_deep_gemm(name: str = "standin_deep_gemm"):
    """The stand-in's DeepGEMM (DeepGEMM's signatures and page layouts; CPU reference bodies),
    as module `name`."""
    spec = importlib.util.spec_from_file_location(
        name, STANDIN_DG / "__init__.py", submodule_search_locations=[str(STANDIN_DG)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
