"""dsa-lite: a small DeepSeek-V4-shaped decode engine that runs SPIN end to end."""

from .config import DsaLiteConfig, tiny, v4_flash_indexer
from .engine import (Engine, EngineOptions, Request, RequestError, RequestOutput, StepStats,
                     sample)
from .model import Caches, DsaLiteModel, init_weights, load_checkpoint, save_checkpoint

__all__ = ["DsaLiteConfig", "tiny", "v4_flash_indexer", "Engine", "EngineOptions", "Request",
           "RequestError", "RequestOutput", "StepStats", "sample", "Caches", "DsaLiteModel",
           "init_weights", "load_checkpoint", "save_checkpoint"]
