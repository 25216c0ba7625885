import pytest

from spin_trtllm import SpinConfig, SpinConfigError


def test_defaults_match_paper():
    cfg = SpinConfig()
    assert (cfg.block_size, cfg.target_sparsity, cfg.ema_decay, cfg.exploration) == (64, 0.4, 0.5, 0.05)
    assert (cfg.reduction, cfg.pooling, cfg.mtp_mask, cfg.mtp_update) == ("A1", "max", "union", "prefix_valid")
    assert cfg.keep_sink and cfg.keep_newest and cfg.warmup_steps == 1
    assert cfg.index_topk == 512 and cfg.min_blocks == 8


@pytest.mark.parametrize("field,value,rule", [
    ("target_sparsity", 1.0, "less than 1"),
    ("target_sparsity", -0.1, "greater than or equal to 0"),
    ("ema_decay", 1.0, "less than 1"),
    ("exploration", 1.5, "less than 1"),
    ("exploration_policy", "greedy", "random"),
    ("warmup_steps", 0, "greater than or equal to 1"),
    ("block_size", 0, "greater than or equal to 1"),
    ("index_topk", 0, "greater than or equal to 1"),
    ("reduction", "A3", "A0"),
    ("pooling", "median", "max"),
    ("mtp_mask", "all", "union"),
    ("mtp_update", "all", "prefix_valid"),
    ("state_dtype", "bfloat16", "float16"),
    ("seed", -1, "greater than or equal to 0"),
    ("seed", 1 << 32, "less than"),
    ("keep_sink", "yes", "boolean"),
    ("block_size", 64.5, "integer"),
])
def test_invalid_values_name_field_and_rule(field, value, rule):
    with pytest.raises(SpinConfigError) as err:
        SpinConfig(**{field: value})
    msg = str(err.value)
    assert field in msg and rule in msg


def test_unknown_key_rejected():
    with pytest.raises(SpinConfigError, match="target_sparsty: unknown key"):
        SpinConfig.from_dict({"target_sparsty": 0.3})


def test_from_dict_and_spin_block():
    assert SpinConfig.from_dict({"target_sparsity": 0.3}).target_sparsity == 0.3
    assert SpinConfig.from_dict({"spin": {"exploration": 0.0}}).exploration == 0.0
    assert SpinConfig.from_dict(None) == SpinConfig()


def test_trtllm_block(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(
        "max_batch_size: 8\n"
        "sparse_attention_config:\n"
        "  algorithm: deepseek_v4\n"
        "  index_topk: 512\n"
        "  spin: {target_sparsity: 0.3, exploration: 0.1}\n")
    cfg = SpinConfig.from_yaml(path)
    assert (cfg.index_topk, cfg.target_sparsity, cfg.exploration) == (512, 0.3, 0.1)


def test_trtllm_algorithm_default_topk():
    assert SpinConfig.from_trtllm({"algorithm": "dsa"}).index_topk == 2048
    assert SpinConfig.from_trtllm({"algorithm": "deepseek_v4", "spin": {}}).index_topk == 512


def test_trtllm_errors():
    with pytest.raises(SpinConfigError, match="algorithm"):
        SpinConfig.from_trtllm({"algorithm": "rocket", "spin": {}})
    with pytest.raises(SpinConfigError, match="conflicts"):
        SpinConfig.from_trtllm({"algorithm": "dsa", "index_topk": 2048, "spin": {"index_topk": 512}})
    with pytest.raises(SpinConfigError, match="spin.*mapping"):
        SpinConfig.from_trtllm({"algorithm": "dsa", "spin": [1, 2]})
    with pytest.raises(SpinConfigError, match="ema_decay"):
        SpinConfig.from_trtllm({"algorithm": "dsa", "spin": {"ema_decay": 2}})


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("target_sparsity: [unclosed\n")
    with pytest.raises(SpinConfigError, match="not valid YAML"):
        SpinConfig.from_yaml(bad)
    with pytest.raises(SpinConfigError, match="cannot read"):
        SpinConfig.from_yaml(tmp_path / "missing.yaml")
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(SpinConfigError, match="mapping"):
        SpinConfig.from_yaml(scalar)


def test_with_overrides_validates_and_is_frozen():
    cfg = SpinConfig().with_overrides(exploration=0.0, seed=None)
    assert cfg.exploration == 0.0 and cfg.seed == 0
    with pytest.raises(SpinConfigError, match="exploration"):
        SpinConfig().with_overrides(exploration=2.0)
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="frozen"):
        cfg.block_size = 32
