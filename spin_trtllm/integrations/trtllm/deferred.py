"""Activate SPIN the moment TensorRT-LLM is imported, not before.

TensorRT-LLM's Triton LLM-API model imports tensorrt_llm only once MPI variables and
CUDA_VISIBLE_DEVICES are settled; importing it earlier (as `import spin_trtllm.trtllm` at
module load would) pins the wrong devices. `activate_on_import()` installs a one-shot import
hook instead: when `tensorrt_llm` finishes loading, wherever that happens, SPIN's patch runs.
Framework-free: no tensorrt_llm import here.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading

TARGET = "tensorrt_llm"
PATCH = "spin_trtllm.trtllm"
_LOCK = threading.Lock()


class _ThenActivate(importlib.abc.Loader):
    """Runs the real loader, then the patch."""

    def __init__(self, inner: importlib.abc.Loader):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        importlib.import_module(PATCH)


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        _remove()                                    # one shot; find the real spec below
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _ThenActivate(spec.loader)
        return spec


def _remove() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Hook)]


def activate_on_import() -> bool:
    """Patch TensorRT-LLM when it is imported; at once if it already is. Returns True when the
    patch ran now, False when it waits for the import."""
    with _LOCK:
        if TARGET in sys.modules:
            importlib.import_module(PATCH)
            return True
        if not any(isinstance(f, _Hook) for f in sys.meta_path):
            sys.meta_path.insert(0, _Hook())
        return False
