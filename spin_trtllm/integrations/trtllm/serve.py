"""`spin-trtllm serve MODEL [--config cfg.yaml]`: trtllm-serve with SPIN enabled."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from ..._inputs import load_yaml_file, one_line, shown
from ...config import SpinConfig
from ...errors import SpinConfigError, SpinError
from ...predictors import TRTLLM_DEFAULT_PREDICTOR
from .bundle import sparse_attention_block
from .config_ext import PREDICTOR, spin_settings_of


def serve_options(config: Optional[str], spin: SpinConfig, algorithm: Optional[str],
                  predictor: Optional[str] = None) -> dict[str, Any]:
    """The LLM-API options trtllm-serve gets: the user's YAML with a `spin:` block in its
    sparse_attention_config (added from the SPIN flags and `predictor` when it has none; a
    `predictor` fills in a block that names none, and one other than the block's is
    refused)."""
    data: dict[str, Any] = {}
    chosen = predictor or TRTLLM_DEFAULT_PREDICTOR
    if config is not None:
        where = f"--config {one_line(config, 300)}"
        data = load_yaml_file(config, where, SpinConfigError) or {}
        if not isinstance(data, dict):
            raise SpinConfigError(f"{where}: expected a mapping of LLM-API options")
    block = data.get("sparse_attention_config")
    if block is None:
        if algorithm is None:
            raise SpinConfigError("no sparse_attention_config in --config: pass --algorithm "
                                  "dsa|deepseek_v4 or add the block")
        block = sparse_attention_block(spin, algorithm, predictor=chosen)
    elif not isinstance(block, dict):
        raise SpinConfigError("sparse_attention_config must be a mapping")
    else:
        block = dict(block)
        if not isinstance(block.get("algorithm", "dsa"), str):
            raise SpinConfigError(f"sparse_attention_config.algorithm must be a string, got "
                                  f"{shown(block['algorithm'])}")
        if algorithm is not None and block.get("algorithm") != algorithm:
            raise SpinConfigError(f"--algorithm {algorithm} conflicts with the config's "
                                  f"{block.get('algorithm')!r}")
        if "spin" not in block:
            block["spin"] = sparse_attention_block(spin, block.get("algorithm", "dsa"),
                                                   block.get("index_topk"), chosen)["spin"]
        elif predictor is not None and isinstance(block["spin"], dict) and \
                PREDICTOR not in block["spin"]:
            block["spin"] = {**block["spin"], PREDICTOR: predictor}   # the block names none
    settings = spin_settings_of(block)       # validate now, not inside a worker process
    if predictor is not None and settings.predictor != predictor:
        raise SpinConfigError(f"--predictor {predictor} conflicts with the --config's "
                              f"sparse_attention_config.spin.predictor {settings.predictor!r}")
    data["sparse_attention_config"] = block
    return data


def run_trtllm_serve(model: str, options: dict[str, Any], extra: Sequence[str]) -> int:
    try:
        import spin_trtllm.trtllm  # noqa: F401  (activates SPIN in this process)
    except ImportError as err:
        raise SpinError(str(err)) from None
    from importlib.metadata import entry_points

    scripts = [ep for ep in entry_points(group="console_scripts") if ep.name == "trtllm-serve"]
    if not scripts:
        raise SpinError("tensorrt_llm is installed but has no trtllm-serve entry point")
    command = scripts[0].load()
    with tempfile.TemporaryDirectory(prefix="spin-trtllm-serve-") as tmp:
        path = Path(tmp) / "llm_api_options.yaml"
        path.write_text(yaml.safe_dump(options, sort_keys=False))
        args = [model, "--extra_llm_api_options", str(path), *extra]
        result = command.main(args=args, prog_name="trtllm-serve", standalone_mode=False)
    return int(result or 0)
