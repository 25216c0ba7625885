"""SPIN for TensorRT networks: the plugins of libspin_trtllm_plugins.so (plugins/tensorrt/) and a
pass that rewires a DSA network's dense indexer through them.

    import tensorrt as trt
    from spin_trtllm import SpinConfig
    from spin_trtllm.integrations import tensorrt as spin_trt

    spin_trt.load_plugins()                     # the .so, via trt.get_plugin_registry()
    for l in range(num_indexer_layers):         # while building the network
        spin_trt.mark_indexer(network, layer=l, logits=f"layers.{l}.indexer.logits",
                              topk=f"layers.{l}.indexer.topk", q=0, weights=2, kv_cache=1)
    spin_trt.mark_mtp(network, next_n=2, accepted="mtp.accepted")   # with MTP
    report = spin_trt.insert_spin(network, SpinConfig(index_topk=2048), max_context=131072)
    print(report.describe())

Importing this needs no TensorRT; load_plugins/insert_spin (with the default backend) raise a
SpinError saying so when the tensorrt package is missing.
"""

from .fields import (FIELDS, PLUGIN_NAMES, PLUGIN_NAMESPACE, PLUGIN_VERSION, logits_fields,
                     select_fields, topk_fields, update_fields)
from .network_pass import (DONE_OUTPUT, SHARED_INPUTS, IndexerMark, MtpMark, SpinPassReport,
                           clear_marks, insert_spin, mark_by_names, mark_indexer, mark_mtp, marks_of)
from .plugins import LIBRARY, TensorRTBackend, find_plugin_library, import_tensorrt, load_plugins

__all__ = [
    "FIELDS", "PLUGIN_NAMES", "PLUGIN_NAMESPACE", "PLUGIN_VERSION", "select_fields",
    "logits_fields", "topk_fields", "update_fields", "DONE_OUTPUT", "SHARED_INPUTS",
    "IndexerMark", "MtpMark", "SpinPassReport", "clear_marks", "insert_spin", "mark_by_names",
    "mark_indexer", "mark_mtp", "marks_of", "LIBRARY", "TensorRTBackend", "find_plugin_library",
    "import_tensorrt", "load_plugins",
]
