"""dsa-lite engine: in-flight batching, MTP draft/verify, multi-turn, CUDA graphs, SPIN state.

  options     EngineOptions (the choices an Engine is built with, checked once), resolve_device
  requests    Request, RequestOutput, RequestError and the checks a request passes
  sampling    sample, teacher forcing, draft verification
  graphs      GraphCache, the CUDA-graph capture cache of the decode step
  tracing     StepStats, indexer timing, the shadow indexer's misses, SPIN traces
  scheduler   Engine: admission, prefill, the decode step, turns
"""

from .graphs import GraphCache
from .options import EngineOptions, resolve_device
from .requests import Prompt, Request, RequestError, RequestOutput
from .sampling import sample
from .scheduler import Engine
from .tracing import StepStats

__all__ = ["Engine", "EngineOptions", "GraphCache", "Prompt", "Request", "RequestError",
           "RequestOutput", "StepStats", "resolve_device", "sample"]
