"""The native library and the op registrations: a stale library (older kernel ABI) is not
loaded, the ABI of a library without the version op, fake (meta) implementations that trace
without data, and the kernel sources compiling for sm_90a where nvcc exists."""

import subprocess
import sys

import pytest
import torch

from spin_trtllm import ops
from spin_trtllm.ops import _native

# GPU tests must run the kernels (SPIN_REQUIRE_NATIVE=1), and spin's own top-K (bit for bit)
pytestmark = pytest.mark.usefixtures("require_native", "spins_own_topk")


def test_a_stale_native_library_is_not_used(tmp_path, monkeypatch, caplog):
    """A library built before an op changed meaning under the same schema (update's layer -1)
    would misread the call: its ABI version must match, else the reference runs."""
    import logging

    (tmp_path / "libspin_native_old.so").write_bytes(b"")
    monkeypatch.setattr(torch.ops, "load_library", lambda path: None)
    monkeypatch.setattr(_native, "native_abi", lambda: ops.NATIVE_ABI - 1)
    with caplog.at_level(logging.WARNING, logger="spin_trtllm"):
        assert _native.load_native(tmp_path) is False
    assert f"libspin_native_old.so is stale (kernel ABI {ops.NATIVE_ABI - 1}, these ops need " \
           f"{ops.NATIVE_ABI})" in caplog.text
    monkeypatch.setattr(_native, "native_abi", lambda: ops.NATIVE_ABI)
    assert _native.load_native(tmp_path) is True
    assert _native.load_native(tmp_path / "empty") is False          # no library there


def test_native_abi_of_a_library_without_the_version_op():
    if ops.NATIVE:
        assert _native.native_abi() == ops.NATIVE_ABI
    else:
        assert _native.native_abi() == 1      # nothing loaded: spin_native has no abi_version


def test_fake_impls_trace_without_data(without_data):
    with without_data:
        V = torch.empty(2, 3, 128)
        ids = torch.empty(1, 3, 2, dtype=torch.int32)
        torch.ops.spin.select(V, torch.empty_like(V), torch.empty(2, 3, 2, dtype=torch.int64),
                              torch.empty(2, 3, dtype=torch.int64), torch.empty(1, dtype=torch.int32),
                              torch.empty(1, 1, dtype=torch.int32), torch.empty(1, 1, dtype=torch.int32),
                              torch.empty(1, dtype=torch.int64), torch.empty(1, dtype=torch.int64),
                              ids, torch.empty(1, 3, dtype=torch.int32), 0.4, 0.05, 0, 512, 1, True,
                              True, 0, True, 0, 100)


@pytest.mark.slow
def test_kernel_sources_compile_for_sm90a():
    """Where nvcc exists (this machine and CI), every .cu file must compile for sm_90a/sm_90, and
    every binding against the installed torch's headers."""
    res = subprocess.run([sys.executable, "-m", "spin_trtllm._build", "--check"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_binding_check_fails_on_a_binding_that_does_not_compile(tmp_path, monkeypatch, capsys):
    # at::empty without its header: a CUDA build of torch 2.11 did not compile this
    from spin_trtllm import _build
    compiler = _build.nvcc()
    if compiler is None or _build.cuda_include(compiler) is None:
        pytest.skip("needs nvcc and the CUDA headers")
    topk = (_build.PACKAGE / "csrc" / "topk.cpp").read_text()
    assert "#include <ATen/ops/empty.h>" in topk
    bad = tmp_path / "topk.cpp"
    bad.write_text(topk.replace("#include <ATen/ops/empty.h>", "")
                   .replace('#include "binding.h"', f'#include "{_build.PACKAGE}/csrc/binding.h"'))
    monkeypatch.setattr(_build, "BINDINGS", [bad, _build.PACKAGE / "csrc" / "update.cpp"])
    assert _build.check_bindings(compiler) == 1
    out = capsys.readouterr()
    assert "topk.cpp" in out.out and "FAILED" in out.out and "empty" in out.err
