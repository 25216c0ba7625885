"""Upstream: tensorrt_llm/_torch/pyexecutor/cuda_graph_runner.py (the constant, in every stored
version).
Stand-in for tensorrt_llm/_torch/pyexecutor/cuda_graph_runner.py: the padding request id.

Upstream pads a generation batch up to a captured batch size with dummy generation requests
that all carry CUDA_GRAPH_DUMMY_REQUEST_ID (the kv cache manager creates it through
add_dummy_requests). UNVERIFIED here: the dummy request's kv length and block offsets; the
stand-in gives it `1 + max_draft_tokens` tokens on one page (`padding_dummy_request`).
"""
CUDA_GRAPH_DUMMY_REQUEST_ID = (1 << 64) - 1


def padding_dummy_request(kv_cache_manager, max_draft_tokens: int = 0) -> int:
    """Stand-in helper: make sure the padding request exists; returns its id."""
    if not kv_cache_manager.has_request(CUDA_GRAPH_DUMMY_REQUEST_ID):
        kv_cache_manager.add_dummy_requests([CUDA_GRAPH_DUMMY_REQUEST_ID],
                                            token_nums=[1 + max_draft_tokens], is_gen=True)
    return CUDA_GRAPH_DUMMY_REQUEST_ID
