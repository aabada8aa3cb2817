"""The ``autodeploy`` command: listing, export, and one-line errors with exit code 2."""

import json
import os
import subprocess
import sys

import pytest

from autodeploy.cli import main
from autodeploy.transform.interface import TransformRegistry

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_cli(*args, env=None):
    """The installed console script in a real subprocess."""
    exe = os.path.join(os.path.dirname(sys.executable), "autodeploy")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


def test_transforms_lists_every_registered_transform(capsys):
    assert main(["transforms", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    keys = {r["key"] for r in rows}
    registered = {k for k in TransformRegistry.keys() if not k.startswith("_test")}
    assert registered <= keys
    rope = next(r for r in rows if r["key"] == "match_rope_pattern")
    assert rope["stage"] == "pattern_matcher" and rope["default"] == "on"
    linear = next(r for r in rows if r["key"] == "match_linear_simple")
    assert linear["default"] == "off"
    export = next(r for r in rows if r["key"] == "export_to_gm")
    field = next(f for f in export["fields"] if f["name"] == "attn_implementation")
    assert field["default"] == "autodeploy" and field["description"]


def test_transforms_text_output_shows_fields_and_descriptions(capsys):
    assert main(["transforms", "--key", "load_weights"]) == 0
    out = capsys.readouterr().out
    assert "load_weights  [stage weight_load, default on]" in out
    assert "show_progress" in out and "skip_on_error" in out


def test_models_lists_presets(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "tiny-llama" in out and "demo" in out and "(default)" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["export", "--model", "/no/such/dir"], "model path '/no/such/dir' does not exist"),
        (["export", "--transforms.match_rope_patern.enabled", "false"], "unknown transform 'match_rope_patern'"),
        (["export", "--transforms.match_rope_pattern.enabled", "maybe"], "match_rope_pattern.enabled"),
        (["export", "--max_seq_len", "many"], "max_seq_len"),
        (["transforms", "--key", "nope"], "unknown transform 'nope'"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autodeploy: error:") and message in err
    assert len(err.splitlines()) == 1


@pytest.mark.slow  # ~10 s: a fresh interpreter; the in-process YAML error tests stay default
def test_bad_yaml_file_through_the_real_console_script(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("transforms:\n  xyzzy_plugh: {}\n")
    proc = run_cli("export", "--yaml", str(bad))
    assert proc.returncode == 2
    # the registry is fixed, so is the message: no key is close enough to be suggested
    assert proc.stderr.strip().splitlines() == ["autodeploy: error: unknown transform 'xyzzy_plugh'"]
    debug = run_cli("--debug", "export", "--yaml", str(bad))
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_export_prints_summary_and_writes_artifacts(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", "--model", "tiny-llama", "--out", str(out), "--max_seq_len", "64"]) == 0
    stdout = capsys.readouterr().out
    assert "match_rope_pattern" in stdout and "total" in stdout
    # each skipped row says why
    assert any(line.startswith("recompute_fallback ") and line.endswith("skipped: not needed: the caches serve this model")
               for line in stdout.splitlines())
    assert "autodeploy.sdpa_cached_attention_with_cache" in stdout  # the default pipeline caches attention
    for name in ("graph.dot", "graph.txt", "graph.py", "summary.txt", "config.json"):
        assert (out / name).exists(), name
    assert "cached_attention" in (out / "graph.py").read_text()


@pytest.mark.slow  # ~8 s; test_readme_commands runs `run` (table once, prompt lines, throughput) by default
def test_run_generates_and_reports_throughput(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The for statement\n\nHello\n")
    proc = run_cli("run", "--model", "tiny-llama", "--prompts-file", str(prompts), "--prompt", "x",
                   "--max-tokens", "5", "--max_seq_len", "64")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "load_weights" in out and "insert_cached_attention" in out  # the summary table
    table_rows = [line for line in (out + proc.stderr).splitlines() if line.startswith("load_weights ")]
    assert len(table_rows) == 1, "the transform table is printed once (stdout), not logged again"
    for prompt in ("x", "The for statement", "Hello"):
        assert f"--- prompt: {prompt!r}  [length, 5 tokens]" in out
    assert "prefill" in out and "decode" in out and "tok/s" in out


def test_run_rejects_bad_sampling_flags():
    proc = run_cli("run", "--model", "tiny-llama", "--top-p", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "autodeploy: error: invalid sampling parameter: top_p must be in (0, 1], got 2.0"]
    missing = run_cli("run", "--model", "tiny-llama", "--prompts-file", "/no/such/file")
    assert missing.returncode == 2 and "cannot read prompts file" in missing.stderr


@pytest.mark.parametrize("flags, error", [
    (["--repetition-penalty", "0"], "repetition_penalty must be > 0"),
    (["--max-tokens", "4", "--min-tokens", "5"], "min_tokens (5) must not exceed max_tokens (4)"),
    (["--frequency-penalty", "3"], "frequency_penalty must be in [-2, 2]"), (["--min-p", "-1"], "min_p must be in"),
])
def test_run_rejects_bad_penalty_flags_before_building(capsys, flags, error):
    """(In process: the flags are checked before the model is built.)"""
    assert main(["run", "--model", "tiny-llama", *flags]) == 2
    assert error in capsys.readouterr().err


# ---- transforms: order, descriptions, why a transform is off, export patches ---------------------
def _json_rows(*args):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["transforms", "--json", *args]) == 0
    return json.loads(buf.getvalue())


def test_transforms_are_listed_in_run_order():
    from autodeploy.cli_listing import STAGES_HELP, stage_names
    from autodeploy.config import load_deploy_config
    from autodeploy.transform.interface import Stage
    from autodeploy.transform.optimizer import InferenceOptimizer

    assert stage_names()[:3] == ["factory", "export", "post_export"] and stage_names()[-1] == "compile"
    assert ", ".join(stage_names()) in STAGES_HELP  # the help text names the stages in run order
    rows = _json_rows()
    orders = [Stage(r["stage"]).order for r in rows]
    assert orders == sorted(orders)
    # within a stage, the order the default pipeline runs them in
    ran = [t.get_transform_key() for t in InferenceOptimizer(load_deploy_config().transforms).transforms]
    listed = [r["key"] for r in rows if r["in_default_pipeline"]]
    assert listed == ran


def test_transform_descriptions_are_whole_paragraphs():
    rows = {r["key"]: r for r in _json_rows()}
    assert rows["recompute_fallback"]["summary"] == (
        "check the KV-cached graph, and run the model in recompute mode when a KV cache cannot serve it.")
    for key, row in rows.items():  # the lead "``key`` (stage):" dropped, the sentence kept whole
        assert not row["summary"].startswith(f"``{key}``") and row["summary"].endswith("."), (key, row["summary"])


def test_transforms_say_why_one_is_off(capsys):
    assert main(["transforms", "--stage", "pattern_matcher"]) == 0
    out = capsys.readouterr().out
    assert ("match_linear_simple  [stage pattern_matcher, default off by default (switch on with "
            "--transforms.match_linear_simple.enabled true)]") in out
    assert "[stage export" not in out  # only the stage asked for


def test_export_to_gm_lists_the_export_patches(capsys):
    from autodeploy.export.patch_registry import export_patches

    names = [p.name for p in export_patches()]
    assert {"no_grad", "list_index_constants", "meta_tensor_constants", "state_kernels"} <= set(names)
    assert main(["transforms", "--key", "export_to_gm"]) == 0
    out = capsys.readouterr().out
    assert "export patches (all on; switch one off with --transforms.export_to_gm.patches.<name> false):" in out
    for name in names:
        assert f"      {name}: " in out, name
    row = _json_rows("--key", "export_to_gm")[0]
    assert [p["name"] for p in row["export_patches"]] == names


def test_unknown_stage_is_exit_code_2_with_the_stages_in_run_order(capsys):
    assert main(["transforms", "--stage", "compil"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("autodeploy: error: --stage: unknown stage 'compil' (did you mean: compile?); stages in run "
                   "order: factory, export, post_export, pattern_matcher, sharding, weight_load, post_load_fusion, "
                   "cache_init, visualize, compile")


# ---- version and help ----------------------------------------------------------------------------
def test_version(capsys):
    import autodeploy

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"autodeploy {autodeploy.__version__}"


def _help(*args):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as exc:
        main([*args, "--help"])
    assert exc.value.code == 0
    return " ".join(buf.getvalue().split())  # argparse wraps lines


def test_help_explains_every_flag():
    top = _help()
    assert "--version" in top and "--debug" in top and "--transforms.<key>.<field> VALUE" in top
    listing = _help("transforms")
    assert "--json print JSON" in listing and "stages in run order: factory, export," in listing
    assert "--debug debug logging" in listing
    for command in ("run", "export", "serve"):
        text = _help(command)
        assert "--<setting> VALUE" in text and "--transforms.<key>.<field> VALUE" in text, command
        assert "max_seq_len" in text and "attn_backend" in text and "--debug" in text, command
    for command in ("run", "serve", "bench"):
        assert "--world-size N ranks (tensor parallelism, default 1): this process is rank 0 and starts the others" \
            in _help(command), command


def test_world_size_flags_are_checked_before_any_rank_starts(capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert main(["bench", "--model", "tiny-llama", "--world-size", "2", "--yaml", "x.yaml"]) == 2
    assert "--yaml variants are not measured at --world-size 2" in capsys.readouterr().err
    assert main(["bench", "--model", "tiny-llama", "--world-size", "2", "--engines", "hf-eager"]) == 2
    assert "keep 'autodeploy' in --engines" in capsys.readouterr().err
    assert main(["run", "--model", "tiny-llama", "--world-size", "0"]) == 2
    assert "--world-size: Input should be greater than or equal to 1 (got 0)" in capsys.readouterr().err
    # under a launcher (torchrun), its WORLD_SIZE is the world size; another --world-size is an error
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main(["run", "--model", "tiny-llama", "--world-size", "2"]) == 2
    assert ("--world-size 2 asked for, but the launcher's environment says WORLD_SIZE 3; give the same number to "
            "both" in capsys.readouterr().err)


def test_bench_help_shows_the_defaults():
    text = _help("bench")
    for flag, default in (("--batch-sizes", "1 8 32"), ("--new-tokens", "128"), ("--prefill-lens", "128 512"),
                          ("--rounds", "3"), ("--model", "small"), ("--accuracy-tokens", "32")):
        after = text.split(f" {flag} ", 1)[1]
        assert f"(default: {default})" in after.split(" --", 1)[0], flag


def test_serve_prints_the_table_once(capsys, monkeypatch):
    import autodeploy.serve.server

    monkeypatch.setattr(autodeploy.serve.server, "serve", lambda llm, **kwargs: None)
    assert main(["serve", "--model", "tiny-llama", "--max_seq_len", "64", "--port", "0"]) == 0
    captured = capsys.readouterr()
    rows = [line for line in (captured.out + captured.err).splitlines() if line.startswith("load_weights ")]
    assert len(rows) == 1 and "serving 'tiny-llama'" in captured.out
