"""Loading libspin_trtllm_plugins.so into TensorRT and creating the SPIN plugins through it.

Everything here needs the `tensorrt` Python package, imported only when a function is called,
so that the network pass (network_pass.py) stays importable and testable without it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ...errors import SpinError
from .fields import FIELDS, PLUGIN_NAMES, PLUGIN_NAMESPACE, PLUGIN_VERSION

LIBRARY = "libspin_trtllm_plugins.so"
_ROOT = Path(__file__).resolve().parents[3]
_LOADED: dict[str, Any] = {}


def import_tensorrt():
    """The tensorrt module, or a SpinError that says how to get it."""
    try:
        import tensorrt
    except ImportError as err:
        raise SpinError(f"this needs the TensorRT Python package (pip install tensorrt, matching the "
                        f"TensorRT the engine runs on); import failed: {err}") from None
    return tensorrt


def library_candidates() -> list[Path]:
    """Where find_plugin_library looks, in order."""
    out = []
    if os.environ.get("SPIN_TRT_PLUGIN_LIB"):
        out.append(Path(os.environ["SPIN_TRT_PLUGIN_LIB"]))
    if os.environ.get("SPIN_TRT_PLUGIN_DIR"):
        out.append(Path(os.environ["SPIN_TRT_PLUGIN_DIR"]) / LIBRARY)
    out += [_ROOT / "build" / "tensorrt" / LIBRARY, Path(__file__).resolve().parents[2] / LIBRARY]
    return out


def find_plugin_library() -> Path:
    """The plugin library: $SPIN_TRT_PLUGIN_LIB, $SPIN_TRT_PLUGIN_DIR, build/tensorrt/ (what
    plugins/tensorrt/build.sh writes), or next to the spin_trtllm package."""
    candidates = library_candidates()
    for path in candidates:
        if path.is_file():
            return path
    raise SpinError(f"{LIBRARY} not found (looked at {', '.join(str(p) for p in candidates)}); "
                    f"build it with plugins/tensorrt/build.sh (needs nvcc and TensorRT headers) or "
                    f"set SPIN_TRT_PLUGIN_LIB")


def load_plugins(path: str | os.PathLike | None = None, registry=None):
    """Register the SPIN plugins with TensorRT's plugin registry (IPluginRegistry::loadLibrary,
    the same as trtexec --dynamicPlugins). Loading twice returns the first handle."""
    trt = import_tensorrt()
    lib = Path(path) if path is not None else find_plugin_library()
    if not lib.is_file():
        raise SpinError(f"{lib}: no such plugin library (build it with plugins/tensorrt/build.sh)")
    registry = registry if registry is not None else trt.get_plugin_registry()
    key = str(lib.resolve())
    if key in _LOADED:
        return _LOADED[key]
    handle = registry.load_library(key)
    if handle is None:
        if all(registry.get_creator(n, PLUGIN_VERSION, PLUGIN_NAMESPACE) for n in PLUGIN_NAMES):
            _LOADED[key] = None      # registered already (e.g. by trtexec --dynamicPlugins)
            return None
        raise SpinError(f"TensorRT could not load {lib}; its log says why (a plugin of the same "
                        f"name already registered, or a TensorRT/CUDA version mismatch)")
    missing = [n for n in PLUGIN_NAMES if not registry.get_creator(n, PLUGIN_VERSION, PLUGIN_NAMESPACE)]
    if missing:
        raise SpinError(f"{lib} loaded but does not register {', '.join(missing)}")
    _LOADED[key] = handle
    return handle


class TensorRTBackend:
    """What the network pass needs from TensorRT: dtypes and plugin objects."""

    _DTYPES = ("float32", "float16", "bfloat16", "int8", "uint8", "fp8", "int32", "int64", "bool")

    def __init__(self, registry=None):
        self.trt = import_tensorrt()
        self.registry = registry if registry is not None else self.trt.get_plugin_registry()

    def dtype(self, name: str):
        trt = self.trt
        return {"float32": trt.float32, "float16": trt.float16, "int32": trt.int32,
                "int64": trt.int64, "int8": trt.int8, "uint8": trt.uint8, "fp8": trt.fp8,
                "bfloat16": trt.bfloat16, "bool": trt.bool}[name]

    def dtype_name(self, dtype) -> str:
        for name in self._DTYPES:
            if getattr(self.trt, name, None) == dtype:
                return name
        return str(dtype)

    def make_plugin(self, plugin: str, layer_name: str, fields: dict):
        import numpy as np

        trt = self.trt
        creator = self.registry.get_creator(plugin, PLUGIN_VERSION, PLUGIN_NAMESPACE)
        if creator is None:
            raise SpinError(f"no TensorRT plugin creator {plugin!r}: call "
                            f"spin_trtllm.integrations.tensorrt.load_plugins() first")
        kinds = dict(FIELDS[plugin])
        pf = []
        for name, value in fields.items():
            if kinds.get(name) == "float":
                pf.append(trt.PluginField(name, np.array([value], dtype=np.float64),
                                          trt.PluginFieldType.FLOAT64))
            else:
                pf.append(trt.PluginField(name, np.array([value], dtype=np.int64),
                                          trt.PluginFieldType.INT64))
        plugin_obj = creator.create_plugin(layer_name, trt.PluginFieldCollection(pf),
                                           trt.TensorRTPhase.BUILD)
        if plugin_obj is None:
            raise SpinError(f"{plugin} {layer_name!r}: the creator refused the fields {fields} "
                            f"(the TensorRT log names the field)")
        return plugin_obj
