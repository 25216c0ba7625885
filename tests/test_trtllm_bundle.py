"""spin-trtllm build / serve: generated files parse and validate; bad input is refused."""

import ast
import json
import re
import sys

import pytest
import yaml

from spin_trtllm import SpinConfig
from spin_trtllm.cli import main
from spin_trtllm.integrations.trtllm.config_ext import spin_config_of, spin_settings_of
from spin_trtllm.integrations.trtllm.serve import serve_options
from spin_trtllm.predictors import TRTLLM_DEFAULT_PREDICTOR

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
text_format = pytest.importorskip("google.protobuf.text_format")


def build(tmp_path, *extra):
    out = tmp_path / "bundle"
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    rc = main(["build", str(model), "-o", str(out), "--sparsity", "0.4", "--seed", "7",
               "--max-batch-size", "16", *extra])
    return rc, out, model


def test_build_writes_a_valid_bundle(tmp_path, capsys):
    rc, out, model = build(tmp_path, "--mtp", "3", "--tp", "8", "--name", "dsv4")
    assert rc == 0
    printed = capsys.readouterr().out.splitlines()
    # the four files, SPIN's memory, then the commands that serve the bundle
    assert printed[4].startswith("SPIN memory on each GPU") and printed[5] == "next:"
    opts = yaml.safe_load((out / "llm_api_options.yaml").read_text())
    block = opts["sparse_attention_config"]
    # K is the checkpoint's unless asked for: TensorRT-LLM keeps an explicit one over it
    assert block["algorithm"] == "deepseek_v4" and "index_topk" not in block
    spin = spin_config_of(block)
    assert spin.target_sparsity == 0.4 and spin.seed == 7 and spin.index_topk == 512
    assert opts["speculative_config"] == {"decoding_type": "MTP", "num_nextn_predict_layers": 3}
    # SPIN follows the overlap scheduler's device-side corrections: it is left on
    assert "disable_overlap_scheduler" not in opts and opts["tensor_parallel_size"] == 8
    repo = out / "triton_model_repo" / "dsv4"
    cfg = text_format.Parse((repo / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
    assert cfg.name == "dsv4" and cfg.backend == "python"
    inputs = {i.name: i for i in cfg.input}
    assert [i.name for i in cfg.input][0] == "text_input"
    assert list(inputs["text_input"].dims) == [-1]        # as upstream's LLM-API model
    assert inputs["return_finish_reason"].optional and inputs["stop"].optional
    assert {o.name for o in cfg.output} == {"text_output", "finish_reason"}
    assert cfg.max_batch_size == 0           # no Triton batch dimension, as upstream ships it
    tree = ast.parse((repo / "1" / "model.py").read_text())
    imported = {n.names[0].name for n in ast.walk(tree) if isinstance(n, ast.Import)} | \
        {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    # tensorrt_llm is imported late, by upstream's model: SPIN hooks that import instead
    assert not {"tensorrt_llm", "spin_trtllm.trtllm"} & imported
    assert "spin_trtllm.integrations.trtllm.deferred" in imported
    my = yaml.safe_load((repo / "1" / "model.yaml").read_text())
    assert my["model"] == str(model.resolve()) and my["backend"] == "pytorch"
    assert my["triton_config"]["max_batch_size"] == 0 and my["max_batch_size"] == 16
    assert my["tensor_parallel_size"] == 8
    assert spin_config_of(my["sparse_attention_config"]) == spin


def test_build_writes_k_when_asked_and_refuses_to_overwrite(tmp_path, capsys):
    rc, out, _ = build(tmp_path, "--algorithm", "dsa", "--index-topk", "1024")
    assert rc == 0
    block = yaml.safe_load((out / "llm_api_options.yaml").read_text())["sparse_attention_config"]
    assert block["index_topk"] == 1024 and "index_topk" not in block["spin"]
    capsys.readouterr()
    rc, _, _ = build(tmp_path, "--algorithm", "dsa")
    assert rc == 2 and "pass --force" in capsys.readouterr().err
    assert build(tmp_path, "--force")[0] == 0


def test_build_on_a_v4_pro_config_keeps_its_k_and_prints_spin_memory(tmp_path, capsys):
    """V4-Pro's checkpoint K is 1024: a YAML that wrote 512 would run the model at 512."""
    model = tmp_path / "v4pro"
    model.mkdir()
    ratios = [4 if i % 2 else 128 for i in range(61)] + [1]        # 30 indexer layers
    (model / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV4ForCausalLM"], "num_hidden_layers": 61,
        "index_topk": 1024, "max_position_embeddings": 1 << 20, "compress_ratios": ratios}))
    rc = main(["build", str(model), "-o", str(tmp_path / "b"), "--sparsity", "0.4",
               "--max-batch-size", "64", "--mtp", "1"])
    assert rc == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("SPIN memory"))
    block = yaml.safe_load((tmp_path / "b" / "llm_api_options.yaml").read_text())[
        "sparse_attention_config"]
    assert "index_topk" not in block
    # the default predictor (the probe) reads no V/D history: an int64 age per 64-slot block,
    # for every layer and request, and no layer keeps its MTP logits
    slots = (1 << 20) // 4
    ages = 30 * 64 * slots * 8 / 64 / 2**30
    mtp_logits = 30 * 64 * 2 * slots * 4 / 2**30     # spin's, kept until acceptance
    got = float(re.search(r"state ([0-9.]+) GiB", line).group(1))
    total = float(re.search(r"GPU: ([0-9.]+) GiB", line).group(1))
    assert abs(got - ages) < 0.01 and "no V/D" in line, line
    assert total < got + mtp_logits * 0.05 and "30 SPIN layers x 64 requests" in line
    rc = main(["build", str(model), "-o", str(tmp_path / "s"), "--sparsity", "0.4",
               "--max-batch-size", "64", "--mtp", "1", "--predictor", "spin"])
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("SPIN memory"))
    # spin: V and D in fp32 per slot besides the ages
    state = 30 * 64 * slots * (2 * 4 + 8 / 64) / 2**30
    got = float(re.search(r"state ([0-9.]+) GiB", line).group(1))
    total = float(re.search(r"GPU: ([0-9.]+) GiB", line).group(1))
    assert rc == 0 and abs(got - state) / state < 0.01 and "float32" in line, line
    assert total >= got + mtp_logits * 0.99 and "MTP logits kept" in line


@pytest.mark.parametrize("argv,msg", [
    (["build", "./no/such/dir", "-o", "x"], "not a directory here and not a hub id"),
    (["build", "org/model", "-o", "{tmp}/o", "--sparsity", "1.5"], "target_sparsity"),
    (["build", "org/model", "-o", "{tmp}/o", "--tp", "0"], "--tp must be >= 1"),
    (["build", "org/model", "-o", "{tmp}/o", "--name", "a b"], "--name"),
    (["build", "org/model", "-o", "{tmp}/o", "--llmapi-model", "/nope.py"], "no such file"),
    (["serve", "org/model", "--algorithm", "dsa"], "needs TensorRT-LLM"),
    (["serve", "org/model"], "pass --algorithm"),
    (["demo", "--bogus"], "unrecognized arguments"),
])
def test_deploy_commands_reject_bad_input(argv, msg, tmp_path, capsys):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    if "tensorrt_llm" in sys.modules:
        pytest.skip("tensorrt_llm is installed")
    try:
        rc = main(argv)
    except SystemExit as exit_:             # argparse errors exit from inside main
        rc = exit_.code
    assert rc == 2
    err = capsys.readouterr().err
    assert msg in err and "Traceback" not in err


def test_serve_options_merge_the_spin_block(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("max_batch_size: 8\nsparse_attention_config:\n  algorithm: dsa\n"
                   "  index_topk: 1024\n")
    opts = serve_options(str(cfg), SpinConfig(target_sparsity=0.3), None)
    assert opts["max_batch_size"] == 8
    spin = spin_config_of(opts["sparse_attention_config"])
    assert spin.index_topk == 1024 and spin.target_sparsity == 0.3
    cfg.write_text("sparse_attention_config:\n  algorithm: dsa\n  index_topk: 1024\n"
                   "  spin:\n    index_topk: 64\n")
    with pytest.raises(Exception, match="conflicts"):
        serve_options(str(cfg), SpinConfig(), None)
    cfg.write_text("- not a mapping\n")
    with pytest.raises(Exception, match="expected a mapping"):
        serve_options(str(cfg), SpinConfig(), None)


@pytest.mark.parametrize("predictor,row", [("probe", 144), ("hybrid", 144), ("gauss", 288)])
def test_the_memory_line_counts_each_predictors_summary_rows(tmp_path, predictor, row):
    """The summary tables' bytes per page: one 144-byte row (the mean key), gauss two (the mean
    and the std), against 64 or 32 slots of 132 B."""
    from spin_trtllm.integrations.trtllm.bundle import BundleOptions, memory_report
    model = tmp_path / "model"
    model.mkdir()
    line = memory_report(SpinConfig(), BundleOptions(model=str(model), predictor=predictor))
    assert f"predictor {predictor}: summary tables of {row} B per indexer K-cache page" in line
    for slots in (64, 32):
        assert f"{row / (slots * 132):.1%} of the indexer K cache with {slots}-slot pages" in line
    assert "summary tables" not in memory_report(SpinConfig(), BundleOptions(model=str(model),
                                                                           predictor="spin"))


def test_the_memory_line_keeps_mtp_logits_for_history_predictors_only(tmp_path):
    """With MTP, spin and the hybrid keep every layer's logits until acceptance (their EMAs
    read them); the probe and gauss keep none, so their step buffers are smaller."""
    from spin_trtllm.integrations.trtllm.bundle import BundleOptions, memory_report
    model = tmp_path / "model"
    model.mkdir()
    step_gib = {}
    for predictor in ("spin", "hybrid", "probe", "gauss"):
        line = memory_report(SpinConfig(), BundleOptions(model=str(model), predictor=predictor,
                                                         mtp_depth=1, max_batch_size=8))
        history = predictor in ("spin", "hybrid")
        assert ("MTP logits kept until acceptance" in line) == history
        value, unit = re.search(r"step buffers ([0-9.]+) (GiB|MiB)", line).groups()
        step_gib[predictor] = float(value) / (1 if unit == "GiB" else 1024)
    assert step_gib["probe"] == step_gib["gauss"] < step_gib["hybrid"]
    assert step_gib["probe"] < step_gib["spin"] / 4


def test_small_memory_reads_in_mib_not_as_zero():
    """One request of a small model holds about a MiB: printed as such, not as 0.00 GiB."""
    from spin_trtllm.integrations.trtllm.bundle import _gib
    assert _gib(3 * 2**30 // 2) == "1.50 GiB" and _gib(2**30 // 100 + 1) == "0.01 GiB"
    assert _gib(1_153_434) == "1.1 MiB" and _gib(0) == "0.0 MiB"


def test_build_and_serve_write_the_predictor(tmp_path, capsys):
    rc, out, _ = build(tmp_path, "--predictor", "probe")
    assert rc == 0
    printed = capsys.readouterr().out
    assert "predictor probe: summary tables of 144 B per indexer K-cache page" in printed
    # a page's summary against the page's keys: 64 or 32 slots of 132 B
    for slots in (64, 32):
        share = 144 / (slots * 132)
        assert f"{share:.1%} of the indexer K cache with {slots}-slot pages" in printed
    block = yaml.safe_load((out / "llm_api_options.yaml").read_text())["sparse_attention_config"]
    assert block["spin"]["predictor"] == "probe"
    assert spin_settings_of(block).predictor == "probe"
    (tmp_path / "history").mkdir()
    rc, out, _ = build(tmp_path / "history", "--predictor", "spin")
    printed = capsys.readouterr().out
    assert rc == 0 and "summary tables" not in printed
    block = yaml.safe_load((out / "llm_api_options.yaml").read_text())["sparse_attention_config"]
    assert block["spin"]["predictor"] == "spin"
    # no --predictor: the default, written out, so the bundle keeps it if the default changes
    (tmp_path / "plain").mkdir()
    rc, out, _ = build(tmp_path / "plain")
    assert rc == 0 and f"predictor {TRTLLM_DEFAULT_PREDICTOR}: summary tables" in \
        capsys.readouterr().out
    block = yaml.safe_load((out / "llm_api_options.yaml").read_text())["sparse_attention_config"]
    assert block["spin"]["predictor"] == TRTLLM_DEFAULT_PREDICTOR

    opts = serve_options(None, SpinConfig(), "dsa", "hybrid")
    assert spin_settings_of(opts["sparse_attention_config"]).predictor == "hybrid"
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("sparse_attention_config:\n  algorithm: dsa\n  spin: {predictor: probe}\n")
    assert spin_settings_of(serve_options(str(cfg), SpinConfig(), None)[
        "sparse_attention_config"]).predictor == "probe"
    with pytest.raises(Exception, match="--predictor hybrid conflicts with the --config's "
                                        "sparse_attention_config.spin.predictor 'probe'"):
        serve_options(str(cfg), SpinConfig(), None, "hybrid")
    cfg.write_text("sparse_attention_config:\n  algorithm: dsa\n")
    assert spin_settings_of(serve_options(str(cfg), SpinConfig(), None, "hybrid")[
        "sparse_attention_config"]).predictor == "hybrid"
    assert spin_settings_of(serve_options(str(cfg), SpinConfig(), None)[
        "sparse_attention_config"]).predictor == TRTLLM_DEFAULT_PREDICTOR
    # --predictor fills in a spin: block that names none (and conflicts only with one it names)
    cfg.write_text("sparse_attention_config:\n  algorithm: dsa\n  spin: {target_sparsity: 0.4}\n")
    block = serve_options(str(cfg), SpinConfig(), None, "spin")["sparse_attention_config"]
    assert spin_settings_of(block).predictor == "spin"
    assert spin_settings_of(block).config.target_sparsity == 0.4
    # a spin: block that names no predictor runs the default
    assert spin_settings_of({"algorithm": "deepseek_v4", "spin": {}}).predictor == \
        TRTLLM_DEFAULT_PREDICTOR


def test_the_example_bundle_is_what_build_writes(tmp_path):
    """examples/trtllm/bundle is generated; it must not drift from the generator."""
    from pathlib import Path

    from spin_trtllm.integrations.trtllm.bundle import find_llmapi_model
    if find_llmapi_model():
        pytest.skip("a TensorRT-LLM checkout is installed: model.py would point at it")
    example = Path(__file__).parent.parent / "examples" / "trtllm" / "bundle"
    out = tmp_path / "b"
    assert main(["build", "deepseek-ai/DeepSeek-V4-Flash", "-o", str(out), "--sparsity", "0.4",
                 "--tp", "8", "--max-batch-size", "64"]) == 0
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(example) for p in example.rglob("*") if p.is_file())
    for rel in files:
        assert (out / rel).read_text() == (example / rel).read_text(), rel


HOOK_SCRIPT = """
import sys
import spin_trtllm.integrations.trtllm.deferred as d
d.PATCH = "spin_marker"
assert d.activate_on_import() is False
assert "spin_marker" not in sys.modules          # nothing runs before tensorrt_llm is imported
import tensorrt_llm
import spin_marker
assert spin_marker.saw_trtllm and not any(isinstance(f, d._Hook) for f in sys.meta_path)
assert d.activate_on_import() is True           # already imported: at once
print("ok")
"""


@pytest.mark.slow
def test_activation_waits_for_the_tensorrt_llm_import(tmp_path):
    """The Triton bundle's model.py must not import tensorrt_llm itself (upstream imports it
    after MPI and CUDA_VISIBLE_DEVICES are settled); the hook patches right after that import."""
    import subprocess
    (tmp_path / "tensorrt_llm").mkdir()
    (tmp_path / "tensorrt_llm" / "__init__.py").write_text("__version__ = '0'\n")
    (tmp_path / "spin_marker.py").write_text(
        "import sys\nsaw_trtllm = hasattr(sys.modules.get('tensorrt_llm'), '__version__')\n")
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    res = subprocess.run([sys.executable, "-c", HOOK_SCRIPT], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
