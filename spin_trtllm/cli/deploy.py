"""spin-trtllm build and serve: TensorRT-LLM deployment."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from ..config import SpinConfig
from ..errors import SpinError
from .._inputs import one_line
from ._common import _load_config


def _spin_for_deploy(args: argparse.Namespace) -> SpinConfig:
    cfg = _load_config(args)
    if args.sparsity is not None:
        cfg = cfg.with_overrides(target_sparsity=args.sparsity)
    return cfg


def cmd_build(args: argparse.Namespace) -> int:
    import re

    from ..integrations.trtllm.bundle import (BundleOptions, memory_report, model_folder_warning,
                                            write_bundle)

    model = args.model
    if Path(model).exists():
        if not Path(model).is_dir():
            raise SpinError(f"model {model}: not a folder (give the checkpoint folder or a "
                            f"hub id org/name)")
        model = str(Path(model).resolve())
    elif not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        raise SpinError(f"model {args.model!r}: not a directory here and not a hub id (org/name)")
    warning = model_folder_warning(args.model)
    if warning:
        print(f"spin-trtllm: warning: {one_line(warning)}", file=sys.stderr)
    opts = BundleOptions(model=model, algorithm=args.algorithm, index_topk=args.index_topk,
                         tensor_parallel_size=args.tp or 1, max_batch_size=args.max_batch_size,
                         max_seq_len=args.max_seq_len, mtp_depth=args.mtp, name=args.name,
                         llmapi_model=args.llmapi_model)
    spin = _spin_for_deploy(args)
    for path in write_bundle(spin, opts, args.output, force=args.force):
        print(path)
    print(memory_report(spin, opts))
    return 0


def cmd_serve(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from ..integrations.trtllm.serve import run_trtllm_serve, serve_options

    options = serve_options(args.config_yaml, _spin_for_deploy(args), args.algorithm)
    return run_trtllm_serve(args.model, options, extra)
