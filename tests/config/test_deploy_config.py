"""DeployConfig layering (default.yaml < user YAML files in order < settings < dotted
overrides) and its errors."""

import pytest
import torch

from autodeploy.config import load_deploy_config, parse_dotted_overrides
from autodeploy.config.merge import deep_merge
from autodeploy.utils.errors import ConfigError


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_hold_the_whole_pipeline():
    cfg = load_deploy_config()
    assert cfg.model == "demo" and cfg.device == "cpu"
    for key in ("build_model", "export_to_gm", "match_rope_pattern", "load_weights"):
        assert key in cfg.transforms


def test_yaml_files_merge_in_order_then_settings_then_overrides(tmp_path):
    a = write(tmp_path, "a.yaml", "max_seq_len: 100\ntransforms:\n  match_rope_pattern:\n    enabled: false\n")
    b = write(tmp_path, "b.yaml", "max_seq_len: 200\nmax_batch_size: 3\n")
    cfg = load_deploy_config([a, b])
    assert cfg.max_seq_len == 200 and cfg.max_batch_size == 3
    assert cfg.transforms["match_rope_pattern"]["enabled"] is False
    # untouched transforms keep their defaults and their order
    assert list(cfg.transforms)[:2] == ["build_model", "export_to_gm"]
    cfg = load_deploy_config([a, b], max_seq_len=300)
    assert cfg.max_seq_len == 300
    cfg = load_deploy_config([a, b], ["--max_seq_len", "400", "--transforms.match_rope_pattern.enabled=true"], max_seq_len=300)
    assert cfg.max_seq_len == 400 and cfg.transforms["match_rope_pattern"]["enabled"] is True


def test_dotted_overrides_parse_yaml_values():
    assert parse_dotted_overrides(["--a.b", "false", "--c=1.5", "--d", "[1, 2]", "--e-f", "text"]) == {
        "a": {"b": False}, "c": 1.5, "d": [1, 2], "e_f": "text"}
    with pytest.raises(ConfigError, match="needs a value"):
        parse_dotted_overrides(["--a.b"])
    with pytest.raises(ConfigError, match="unexpected argument 'oops'"):
        parse_dotted_overrides(["oops"])


def test_deep_merge_replaces_leaves_and_keeps_mappings():
    assert deep_merge({"a": {"x": 1, "y": 2}, "b": 1}, {"a": {"y": 3}, "c": 4}) == {"a": {"x": 1, "y": 3}, "b": 1, "c": 4}
    assert deep_merge({"a": {"x": 1}}, {"a": None}) == {"a": {"x": 1}}


@pytest.mark.parametrize(
    "text, message",
    [
        ("max_sq_len: 3\n", r"unknown setting 'max_sq_len' \(did you mean: max_seq_len\?\)"),
        ("max_seq_len: lots\n", r"max_seq_len: .*integer.*'lots'"),
        ("max_batch_size: 0\n", r"max_batch_size: .*greater than or equal to 1"),
        ("dtype: float8\n", r"dtype: .*'float32'"),
        ("device: tpu\n", r"device: .*not a device|device type"),
        ("transforms:\n  match_rope_patern: {}\n", r"unknown transform 'match_rope_patern' \(did you mean: match_rope_pattern"),
        ("transforms:\n  match_rope_pattern:\n    enabeld: false\n", r"match_rope_pattern.enabeld: unknown field \(did you mean: enabled"),
        ("transforms:\n  match_rope_pattern:\n    enabled: sometimes\n", r"match_rope_pattern.enabled: .*boolean"),
        ("transforms:\n  match_rope_pattern: 3\n", r"transforms.match_rope_pattern"),
        ("- a\n- b\n", r"must hold a mapping"),
        ("max_seq_len: [1,\n", r"not valid YAML at line 2"),
    ],
)
def test_bad_yaml_gives_a_one_line_error_naming_the_key(tmp_path, text, message):
    path = write(tmp_path, "bad.yaml", text)
    with pytest.raises(ConfigError, match=message) as info:
        load_deploy_config([path])
    assert "\n" not in str(info.value)


def test_missing_yaml_file():
    with pytest.raises(ConfigError, match="'/nonexistent.yaml' does not exist"):
        load_deploy_config(["/nonexistent.yaml"])


def test_dtype_resolution():
    assert load_deploy_config().torch_dtype() == torch.float32
    assert load_deploy_config(dtype="bfloat16").torch_dtype() == torch.bfloat16
    assert load_deploy_config(device="cuda", dtype="auto").torch_dtype(torch.bfloat16) == torch.bfloat16
    assert load_deploy_config(device="cuda", dtype="auto").torch_dtype(torch.float32) == torch.float32
