"""spin-trtllm build and serve: TensorRT-LLM deployment."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..errors import SpinError
from .._inputs import one_line, printable, shown
from ._common import _load_config

if TYPE_CHECKING:                        # imported by the parser: kept free of pydantic
    from ..config import SpinConfig


def _spin_for_deploy(args: argparse.Namespace) -> "SpinConfig":
    cfg = _load_config(args)
    if args.sparsity is not None:
        cfg = cfg.with_overrides(target_sparsity=args.sparsity)
    return cfg


def cmd_build(args: argparse.Namespace) -> int:
    import re

    from ..integrations.trtllm.bundle import (BundleOptions, bundle_files, memory_report,
                                            model_folder_warning, next_steps, write_files)

    model = args.model
    if model == "":
        raise SpinError("model '': empty (give the checkpoint folder or a hub id org/name)")
    if Path(model).exists():
        if not Path(model).is_dir():
            raise SpinError(f"model {one_line(model, 300)}: not a folder (give the checkpoint "
                            f"folder or a hub id org/name)")
        model = str(Path(model).resolve())
    elif not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        raise SpinError(f"model {shown(args.model, 300)}: not a directory here and not a hub "
                        f"id (org/name)")
    opts = BundleOptions(model=model, algorithm=args.algorithm, index_topk=args.index_topk,
                         tensor_parallel_size=args.tp, max_batch_size=args.max_batch_size,
                         max_seq_len=args.max_seq_len, mtp_depth=args.mtp, name=args.name,
                         llmapi_model=args.llmapi_model, predictor=args.predictor)
    spin = _spin_for_deploy(args)
    inputs = [("--config", args.config), ("--llmapi-model", args.llmapi_model)]
    if Path(model).is_dir():
        inputs += [("MODEL file", p) for p in _model_files(Path(model))]
    files = bundle_files(spin, opts, args.output, args.force, inputs)
    report = memory_report(spin, opts)
    warning = model_folder_warning(args.model)     # only once every check has passed
    if warning:
        print(f"spin-trtllm: warning: {one_line(warning)}", file=sys.stderr)
    for path in write_files(args.output, files):
        print(printable(path))
    print(report)
    steps, missing = next_steps(opts, args.output)
    print("\n".join(printable(line) for line in steps))
    if missing:
        print(f"spin-trtllm: warning: {one_line(missing)}", file=sys.stderr)
    return 0


def _model_files(folder: Path, limit: int = 10_000) -> list[Path]:
    """The model folder's top-level files (config.json, weights): a bundle never replaces them."""
    try:
        return [p for _, p in zip(range(limit), folder.iterdir()) if p.is_file()]
    except OSError:
        return []


def cmd_serve(args: argparse.Namespace, extra: Sequence[str]) -> int:
    from ..integrations.trtllm.serve import run_trtllm_serve, serve_options

    options = serve_options(args.config_yaml, _spin_for_deploy(args), args.algorithm,
                            args.predictor)
    return run_trtllm_serve(args.model, options, extra)
