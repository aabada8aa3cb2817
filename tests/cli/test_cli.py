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
    assert "autodeploy.sdpa_cached_attention_with_cache" in stdout  # the default pipeline caches attention
    for name in ("graph.dot", "graph.txt", "graph.py", "summary.txt", "config.json"):
        assert (out / name).exists(), name
    assert "cached_attention" in (out / "graph.py").read_text()


def test_run_generates_and_reports_throughput(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The for statement\n\nHello\n")
    proc = run_cli("run", "--model", "tiny-llama", "--prompts-file", str(prompts), "--prompt", "x",
                   "--max-tokens", "5", "--max_seq_len", "64")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "load_weights" in out and "insert_cached_attention" in out  # the summary table
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
