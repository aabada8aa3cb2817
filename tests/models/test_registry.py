"""The model registry (``autodeploy/models/registry``): every built-in entry is valid, every entry
whose model is a preset builds and generates, and ``--model NAME [--use-registry]`` composes an
entry under the user's own files and flags.

Only tiny presets are built (a few seconds each); hub entries are checked without downloading.
"""

import json
import os
import re
import shlex
from typing import Any, Dict, List

import pytest

import autodeploy.config.registry as registry_mod
from autodeploy.cli import build_parser, main
from autodeploy.cli_build import config_from_args
from autodeploy.config import load_deploy_config
from autodeploy.config.deploy_config import DEFAULT_YAML, SHORTCUTS, DeployConfig
from autodeploy.config.merge import load_yaml_file
from autodeploy.models.presets import PRESETS
from autodeploy.config.registry import (
    CONFIGS_DIR, SUPPORTED_WORLD_SIZE, entry_yaml_files, load_registry, registry_entry,
)
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.utils.errors import ConfigError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENTRIES = load_registry()
PRESET_ENTRIES = [name for name, e in ENTRIES.items() if e.model in PRESETS]
TINY = "tiny-llama-cpu"  # a preset entry the CLI tests run
MULTI_RANK = next(name for name, e in ENTRIES.items() if e.world_size > SUPPORTED_WORLD_SIZE)


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.startswith("autodeploy")]
    assert len(lines) == 1 and lines[0].startswith("autodeploy: error: "), err[-2000:]
    assert "Traceback" not in err
    return lines[0]


def _cli_config(*argv: str) -> DeployConfig:
    """The config a build command would deploy, from its real argument parser."""
    args, extra = build_parser().parse_known_args(["export", *argv])
    return config_from_args(args, extra)


# ---- every built-in entry is valid -------------------------------------------------------------
def test_registry_has_entries_with_unique_names_that_no_preset_or_hub_id_shadows():
    assert TINY in ENTRIES and PRESET_ENTRIES and MULTI_RANK
    for name, entry in ENTRIES.items():
        assert name == entry.name and name not in PRESETS, name  # a preset of the same name would win
        assert "/" not in name and entry.description, name


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_entry_fragments_exist_parse_and_hold_only_real_settings(name):
    entry = ENTRIES[name]
    default_transforms = load_yaml_file(DEFAULT_YAML)["transforms"]
    paths = entry_yaml_files(entry)
    assert [os.path.basename(p) for p in paths] == entry.yaml and all(os.path.isabs(p) for p in paths)
    for path in paths:
        fragment = load_yaml_file(path)  # exists, parses, is a mapping
        assert fragment, f"{path} is empty"
        unknown = set(fragment) - set(DeployConfig.model_fields)
        assert not unknown, f"{name}: {path} sets unknown settings {unknown}"
        assert "model" not in fragment and "world_size" not in fragment, "the entry itself names these"
        for key in fragment.get("transforms") or {}:
            # a key outside default.yaml would be appended at the end of the pipeline, out of order
            assert key in default_transforms, f"{name}: {path}: transform '{key}' is not in default.yaml"
    # composed as the user's --yaml files: unknown keys, fields, values and ordering are errors
    config = load_deploy_config(paths, model=entry.model)
    assert config.model == entry.model
    # composed as the registry layer (its shortcuts become transform fields); one rank to get past
    # the world-size check of multi-rank entries
    via_registry = load_deploy_config(registry=name, world_size=1)
    assert via_registry.model == entry.model
    assert via_registry.transforms == config.transforms
    for setting in SHORTCUTS:
        assert getattr(via_registry, setting) is None  # set as fields, not as shortcuts


def test_fragment_files_are_all_used():
    used = {f for e in ENTRIES.values() for f in e.yaml}
    assert used == set(os.listdir(CONFIGS_DIR)), "a fragment no entry names is untested"


@pytest.mark.parametrize("name", PRESET_ENTRIES)
def test_every_preset_entry_builds_and_generates(name):
    from autodeploy import LLM

    entry = ENTRIES[name]
    assert entry.model.startswith("tiny-"), f"{name}: keep preset entries to the tiny presets (this test builds them)"
    llm = LLM(registry=name)
    composed = load_deploy_config(entry_yaml_files(entry), model=entry.model)
    assert llm.config.model == entry.model and llm.config.transforms == composed.transforms
    num_pages = (composed.transforms.get("initialize_cache") or {}).get("num_pages")
    if num_pages:
        assert llm.build.cache.num_pages == num_pages
    out = llm.generate(["The for statement"], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 2


# ---- precedence: the entry, then the user's files, settings and flags --------------------------
def test_user_yaml_settings_and_overrides_win_over_the_entry(tmp_path):
    base = load_deploy_config(registry=TINY)
    assert base.max_seq_len == 256 and base.transforms["initialize_cache"]["num_pages"] == 128
    user_yaml = tmp_path / "user.yaml"
    user_yaml.write_text("max_seq_len: 64\nmax_batch_size: 2\n")
    config = load_deploy_config([str(user_yaml)], overrides=["--max_batch_size", "4",
                                                             "--transforms.initialize_cache.num_pages", "32"],
                                registry=TINY, page_size=8)
    assert (config.max_seq_len, config.max_batch_size, config.page_size) == (64, 4, 8)
    assert config.transforms["initialize_cache"]["num_pages"] == 32
    assert config.model == ENTRIES[TINY].model and config.device == "cpu"
    assert load_deploy_config(registry=TINY, model="tiny-qwen2").model == "tiny-qwen2"


@pytest.mark.parametrize("user", [
    {"overrides": ["--transforms.compile_model.backend", "torch-simple"]},
    {"compile_backend": "torch-simple"},
])
def test_a_users_shortcut_or_field_overrides_an_entrys_shortcut_without_a_conflict(user):
    name = next(n for n, e in ENTRIES.items() if "torch_compile.yaml" in e.yaml)
    assert load_deploy_config(registry=name).transforms["compile_model"]["backend"] == "torch-compile"
    config = load_deploy_config(registry=name, **user)
    assert config.transforms["compile_model"]["backend"] == "torch-simple"


def test_cli_flags_and_yaml_win_and_the_entry_is_logged(tmp_path, caplog):
    user_yaml = tmp_path / "user.yaml"
    user_yaml.write_text("max_seq_len: 64\n")
    with caplog.at_level("INFO", logger="autodeploy"):
        config = _cli_config("--model", TINY, "--use-registry", "--yaml", str(user_yaml), "--max_batch_size", "2")
    assert (config.model, config.max_seq_len, config.max_batch_size) == ("tiny-llama", 64, 2)
    assert config.transforms["initialize_cache"]["num_pages"] == 128
    logged = [r.getMessage() for r in caplog.records if "registry entry" in r.getMessage()]
    assert logged == [f"registry entry '{TINY}': model tiny-llama, fragments cpu_small_pool.yaml, world_size 1 "
                      "(your --yaml files and settings apply over them)"]


def test_model_name_resolution_order(tmp_path, monkeypatch):
    # an entry name alone resolves to the entry
    assert _cli_config("--model", TINY).model == "tiny-llama"
    # presets and hub ids are untouched
    assert _cli_config("--model", "tiny-qwen2").model == "tiny-qwen2"
    # a local directory of the same name wins over the entry; --use-registry still picks the entry
    monkeypatch.chdir(tmp_path)
    os.mkdir(TINY)
    assert _cli_config("--model", TINY).model == TINY
    assert _cli_config("--model", TINY, "--use-registry").model == "tiny-llama"


# ---- errors -------------------------------------------------------------------------------------
def test_unknown_entry_is_one_error_with_close_names(capsys):
    assert main(["run", "--model", "qwen3-30b", "--use-registry"]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "unknown registry entry 'qwen3-30b' (did you mean: qwen3-30b-a3b-fp8?)" in line
    assert "'autodeploy models' lists" in line
    # without --use-registry a bare name close to an entry says so too
    assert main(["run", "--model", "qwen3-30b"]) == 2
    assert "(did you mean: qwen3-30b-a3b-fp8?)" in _one_error_line(capsys.readouterr().err)
    assert main(["run", "--use-registry"]) == 2
    assert "--use-registry needs --model NAME" in _one_error_line(capsys.readouterr().err)


def test_multi_rank_entry_is_refused_before_anything_is_built(capsys, monkeypatch):
    import autodeploy.models.factory

    monkeypatch.setattr(autodeploy.models.factory, "download_from_hub", lambda *a, **k: pytest.fail("downloaded"))
    n = ENTRIES[MULTI_RANK].world_size
    # run, serve and export start the ranks themselves, so the entry's world size is fine there;
    # this machine has no GPU for its cuda device, which is checked before any rank starts
    for argv in (["run", "--model", MULTI_RANK, "--use-registry"], ["serve", "--model", MULTI_RANK],
                 ["export", "--model", MULTI_RANK, "--use-registry"]):
        assert main(argv) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert "needs a CUDA GPU" in line and "needs 8 ranks" not in line
    # the Python API builds one process's graph: it needs the group around it
    with pytest.raises(ConfigError, match=rf"registry entry '{MULTI_RANK}' needs {n} ranks \(world_size {n}\).*"
                                          rf"deploy it with the CLI, which starts the ranks"):
        load_deploy_config(registry=MULTI_RANK)
    # the user's world_size wins over the entry's, as any setting does
    assert load_deploy_config(registry=MULTI_RANK, world_size=1).world_size == 1


def _fake_registry(tmp_path, monkeypatch, models: str, fragments: Dict[str, str]) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    for name, text in fragments.items():
        (configs / name).write_text(text)
    (tmp_path / "models.yaml").write_text(models)
    monkeypatch.setattr(registry_mod, "REGISTRY_YAML", str(tmp_path / "models.yaml"))
    monkeypatch.setattr(registry_mod, "CONFIGS_DIR", str(configs))


def test_missing_fragment_names_the_entry_and_the_file(tmp_path, monkeypatch):
    _fake_registry(tmp_path, monkeypatch, "models:\n- {name: mine, model: tiny-llama, yaml: [a.yaml, gone.yaml]}\n",
                   {"a.yaml": "max_seq_len: 64\n"})
    with pytest.raises(ConfigError, match=r"registry entry 'mine' names fragment 'gone.yaml', which does not exist"):
        load_deploy_config(registry="mine")


@pytest.mark.parametrize("models, message", [
    ("models:\n- {name: mine, modle: tiny-llama}\n", r"entry 'mine', field 'modle': Extra inputs"),
    ("models:\n- {name: a/b, model: tiny-llama}\n", r"entry 'a/b', field 'name'.*no '/'"),
    ("models:\n- {name: mine, model: tiny-llama, world_size: 0}\n", r"entry 'mine', field 'world_size'"),
    ("models:\n- {name: mine, model: tiny-llama, yaml: [../x.yaml]}\n", r"must be a file name under configs/"),
    ("models:\n- {name: mine, model: tiny-llama}\n- {name: mine, model: tiny-qwen2}\n", r"names entry 'mine' twice"),
])
def test_a_bad_registry_file_names_the_entry_and_field(tmp_path, monkeypatch, models, message):
    _fake_registry(tmp_path, monkeypatch, models, {})
    with pytest.raises(ConfigError, match=message):
        registry_entry("mine")


def test_contradicting_fragments_and_bad_keys_are_errors(tmp_path, monkeypatch):
    _fake_registry(tmp_path, monkeypatch,
                   "models:\n- {name: both, model: tiny-llama, yaml: [a.yaml, b.yaml]}\n"
                   "- {name: typo, model: tiny-llama, yaml: [c.yaml]}\n",
                   {"a.yaml": "compile_backend: torch-compile\n",
                    "b.yaml": "transforms: {compile_model: {backend: torch-simple}}\n",
                    "c.yaml": "transforms: {fuse_mxfp4_moe: {backnd: mxfp4}}\n"})
    with pytest.raises(ConfigError, match=r"registry entry 'both': compile_backend is 'torch-compile' but "
                                          r"transforms.compile_model.backend is 'torch-simple'"):
        load_deploy_config(registry="both")
    with pytest.raises(ConfigError, match="backnd"):
        load_deploy_config(registry="typo")


# ---- the CLI ------------------------------------------------------------------------------------
def test_models_prints_the_presets_and_the_registry_table(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^tiny-llama +2-layer Llama", out, flags=re.M)  # the presets, as before
    table = out.split("\nModel registry", 1)[1]
    assert re.search(r"^name +model +fragments +world_size +description$", table, flags=re.M)
    for name, e in ENTRIES.items():
        row = rf"^{re.escape(name)} +{re.escape(e.model)} +{re.escape(', '.join(e.yaml))} +{e.world_size} +"
        assert re.search(row + re.escape(e.description) + "$", table, flags=re.M), name
    assert main(["models", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {p["name"] for p in data["presets"]} == set(PRESETS)
    assert data["registry"][0] == {"name": TINY, **{k: v for k, v in ENTRIES[TINY].model_dump().items() if k != "name"}}
    assert [r["name"] for r in data["registry"]] == list(ENTRIES)


def _readme_registry_command() -> List[str]:
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read().split("\n## Command line\n", 1)[1].split("\n## ", 1)[0]
    for line in text.splitlines():
        if line.startswith(f"autodeploy run --model {TINY} --use-registry"):
            return shlex.split(line, comments=True)[1:]
    raise AssertionError("the README's command-line section no longer shows --use-registry")


def test_run_with_use_registry_end_to_end(capsys):
    argv = _readme_registry_command()
    assert main([*argv, "--max-tokens", "3", "--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert f"built {ENTRIES[TINY].model} in " in out and "(KV cache: 128 pages x 16 tokens)" in out
    assert "--- prompt: 'Hello'  [length, 3 tokens]" in out


def test_bench_takes_the_entry(capsys, monkeypatch, tmp_path):
    import autodeploy.bench.runner as runner

    seen: List[Any] = []

    def fake_run(cfg):
        seen.append(cfg)
        raise KeyboardInterrupt  # stop before measuring

    monkeypatch.setattr(runner, "run", fake_run)
    assert main(["bench", "--model", TINY, "--out", str(tmp_path)]) == 130
    assert (seen[0].model, seen[0].registry) == ("tiny-llama", TINY)
    built: List[Dict[str, Any]] = []
    monkeypatch.setattr(runner, "AutoDeployEngine", lambda model, **kw: built.append(dict(model=model, **kw)))
    runner._build("autodeploy", seen[0], "unused")
    assert built == [{"model": "tiny-llama", "dtype": "float32", "device": "cpu", "world_size": 1, "registry": TINY}]
    assert main(["bench", "--model", MULTI_RANK, "--use-registry", "--out", str(tmp_path)]) == 2
    assert "needs 8 ranks" in _one_error_line(capsys.readouterr().err)


def test_help_documents_the_flag(capsys):
    for command in ("run", "export", "serve", "bench"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--use-registry" in capsys.readouterr().out, command
