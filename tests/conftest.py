"""Suite-wide: @pytest.mark.gpu skips without CUDA, SPIN_SHARD=I/N runs one shard of the tests,
and the fixtures several test modules share. Helpers that tests import live in
spin_trtllm.testing (no test module imports another)."""

import importlib
import os
import zlib
from pathlib import Path

import pytest
import torch

from spin_trtllm.testing.standin import SPIN_MODULES, imported_standin
from spin_trtllm.testing.traces import make_trace

STANDIN = Path(__file__).resolve().parent / "trtllm_standin"
# SPIN_TEST_TIMES=FILE; SPIN_TEST_QUEUE=DIR, SPIN_TEST_ORDER=FILE[:FILE...]; SPIN_KERNEL_LOG=FILE
pytest_plugins = ["pytester", "spin_trtllm.testing.times_plugin",
                  "spin_trtllm.testing.queue_plugin", "spin_trtllm.testing.kernel_log"]


def shard_of(spec: str) -> tuple[int, int]:
    """(i, n) of SPIN_SHARD=I/N, 0 <= I < N."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        raise pytest.UsageError(f"SPIN_SHARD={spec!r}: use I/N, e.g. 0/4") from None
    if not 0 <= i < n:
        raise pytest.UsageError(f"SPIN_SHARD={spec!r}: needs 0 <= I < N")
    return i, n


def pytest_collection_modifyitems(config, items):
    """SPIN_SHARD=I/N keeps the tests whose node id hashes to shard I of N (a test's shard does
    not depend on which others are selected; the sanitizer runs split the GPU tests so). Tests
    marked gpu are skipped where no CUDA device is present (the one place that says so: no
    module keeps its own CUDA skipif)."""
    if os.environ.get("SPIN_SHARD"):
        i, n = shard_of(os.environ["SPIN_SHARD"])
        keep = [t for t in items if zlib.crc32(t.nodeid.encode()) % n == i]
        config.hook.pytest_deselected(items=[t for t in items if t not in keep])
        items[:] = keep
    if torch.cuda.is_available():
        return
    # a skipif placed first, so this reason shows before any other condition of the test
    no_gpu = pytest.mark.skipif(True, reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(no_gpu, append=False)


@pytest.fixture
def bars(monkeypatch):
    """The progress bars a test makes (spin_trtllm.testing.bars.RecordingBar), in order."""
    from spin_trtllm.testing.bars import record_bars

    return record_bars(monkeypatch)


@pytest.fixture(params=["fake", "meta"])
def without_data(request):
    """Where ops run on shapes alone: FakeTensorMode (torch.compile's tracing) or meta tensors.
    Only a registered fake impl runs an op on meta tensors (else NotImplementedError)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode() if request.param == "fake" else torch.device("meta")


@pytest.fixture
def small_trace():
    return make_trace()


@pytest.fixture
def require_native():
    """SPIN_REQUIRE_NATIVE=1 (set by the scripts of tests/gpu/): where CUDA is present the
    native library must have loaded, so GPU tests exercise the kernels rather than compare the
    reference with itself. Op test modules use it for every test (pytestmark usefixtures)."""
    from spin_trtllm import ops

    if torch.cuda.is_available() and os.environ.get("SPIN_REQUIRE_NATIVE") == "1":
        assert ops.NATIVE, "the native library did not load"


@pytest.fixture
def spins_own_topk():
    """Tests that hold spin's kernels to the reference bit for bit, ties included. Where
    flashinfer is installed ops.topk may hand rows to its top-K, which breaks ties at the K-th
    value its own way (tests/test_topk_peer.py checks that path)."""
    from spin_trtllm import ops

    ops.set_topk_backend("spin")


@pytest.fixture(autouse=True)
def topk_backend_from_env():
    """The top-K backend a test chose (ops.set_topk_backend) ends with it: the next test reads
    SPIN_TOPK again."""
    yield
    from spin_trtllm.ops import _topk

    _topk.set_topk_backend(None)


@pytest.fixture
def env():
    """A fresh stand-in `tensorrt_llm` (tests/trtllm_standin) with SPIN activated in it;
    (trt, patch module). sys.modules and sys.path are restored after."""
    with imported_standin(STANDIN, purge=SPIN_MODULES) as trt:
        yield trt, importlib.import_module("spin_trtllm.integrations.trtllm.patch")
