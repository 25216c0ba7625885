"""Loading libspin_native (the CUDA kernels of cpp/, built by build.sh) and checking its ABI."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

from ..limits import NATIVE_ABI

log = logging.getLogger("spin_trtllm")
PACKAGE_DIR = Path(__file__).resolve().parent.parent


def native_abi() -> int:
    try:
        return int(torch.ops.spin_native.abi_version())
    except (AttributeError, RuntimeError):      # built before the version existed
        return 1


def load_native(here: Optional[Path] = None) -> bool:
    """Load the first usable libspin_native*.so in `here` (the package directory)."""
    for lib in sorted((here or PACKAGE_DIR).glob("libspin_native*.so")):
        try:
            torch.ops.load_library(str(lib))
        except (OSError, RuntimeError) as err:
            log.warning("spin_trtllm: cannot load %s (%s)", lib.name, err)
            continue
        abi = native_abi()
        if abi != NATIVE_ABI:
            log.warning("spin_trtllm: %s is stale (kernel ABI %d, these ops need %d); spin ops "
                        "run the reference until ./build.sh rebuilds it", lib.name, abi,
                        NATIVE_ABI)
            return False
        return True
    return False


NATIVE = load_native()
