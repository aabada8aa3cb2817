"""The README's command-line examples, run as a user runs them (the installed console script, one
subprocess per command) and checked against what the README says they print.

Commands are read from the README's "Command line" section, so the test follows the document:
the `bash` block's commands (a `/path/to/...` placeholder becomes a real checkpoint directory,
`--max-tokens` a small number, `--out` a temporary directory) and the `console` block of bad-input
examples (`$ command` followed by the exact line it prints). The fast commands start together on
first use, two at a time (the machine has 2 cores); the two that only repeat a build the fast ones
already cover are marked slow.
"""

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXE = os.path.join(os.path.dirname(sys.executable), "autodeploy")
DEMO_DIR = os.path.join(REPO, "autodeploy", "models", "demo")
STAGES = ["factory", "export", "post_export", "pattern_matcher", "sharding", "weight_load", "post_load_fusion",
          "cache_init", "visualize", "compile"]


def _section() -> str:
    with open(os.path.join(REPO, "README.md")) as f:
        text = f.read()
    return text.split("\n## Command line\n", 1)[1].split("\n## ", 1)[0]


def _blocks(kind: str) -> List[str]:
    return re.findall(rf"```{kind}\n(.*?)```", _section(), flags=re.S)


def readme_command(prefix: str) -> List[str]:
    """The README command (in the section's bash blocks) starting with ``prefix``, as argv after
    ``autodeploy``, comment dropped and continuation lines joined."""
    for block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith(prefix):
                return shlex.split(line, comments=True)[1:]
    raise AssertionError(f"the README no longer documents '{prefix}'")


def bad_input_examples() -> Dict[str, str]:
    """`$ command` -> the one line the README says it prints."""
    lines = _blocks("console")[0].strip().splitlines()
    examples = {lines[i][2:]: lines[i + 1] for i in range(0, len(lines), 2) if lines[i].startswith("$ ")}
    assert len(examples) * 2 == len(lines), "each example is a '$ command' line and the line it prints"
    return examples


def _replace(argv: List[str], flag: str, value: str) -> List[str]:
    i = argv.index(flag)
    return argv[:i + 1] + [value] + argv[i + 2:]


def _run(argv: List[str]) -> subprocess.CompletedProcess:
    assert argv and argv[0] != "autodeploy"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # two commands at a time share the 2 cores
    return subprocess.run([EXE, *argv], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)


def _fast_commands(out_dir: str) -> Dict[str, List[str]]:
    from autodeploy.models.presets import preset_dir

    run = readme_command("autodeploy run --model /path/to/checkpoint")
    export = readme_command("autodeploy export --model /path/to/hf/checkpoint")
    commands = {
        "run": _replace(_replace(run, "--model", DEMO_DIR), "--max-tokens", "8"),
        "models": readme_command("autodeploy models"),
        "transforms": readme_command("autodeploy transforms  "),
        "transforms_key": readme_command("autodeploy transforms --key export_to_gm"),
        "export": _replace(_replace(export, "--model", preset_dir("tiny-llama")), "--out", out_dir),
        "version": readme_command("autodeploy --version"),
    }
    commands.update({example: shlex.split(example)[1:] for example in bad_input_examples()})
    return commands


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> Dict[str, Future]:
    out_dir = str(tmp_path_factory.mktemp("export_out"))
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {name: pool.submit(_run, argv) for name, argv in _fast_commands(out_dir).items()}
    futures["_out_dir"] = out_dir  # type: ignore[assignment]
    yield futures
    pool.shutdown(wait=True)


def _ok(ran: Dict[str, Future], name: str) -> subprocess.CompletedProcess:
    proc = ran[name].result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "autodeploy: " not in proc.stderr, proc.stderr[-3000:]
    return proc


def _assert_table_once(proc: subprocess.CompletedProcess) -> None:
    rows = [line for line in proc.stdout.splitlines() if line.startswith("load_weights ")]
    assert len(rows) == 1 and "load_weights " not in proc.stderr, "the transform table is shown once, on stdout"
    skipped = [line for line in proc.stdout.splitlines() if " skipped" in line]
    assert skipped and all(" skipped: " in line for line in skipped), "every skipped row says why"


def test_run_with_a_checkpoint_directory_and_sampling_flags(ran):
    proc = _ok(ran, "run")
    _assert_table_once(proc)
    assert re.search(r"^--- prompt: 'Hello'  \[(length, 8|stop, \d+) tokens\]$", proc.stdout, flags=re.M), proc.stdout
    assert re.search(r"^built .* in [\d.]+ s \(KV cache: \d+ pages x 16 tokens\)$", proc.stdout, flags=re.M)
    assert re.search(r"1 prompts in [\d.]+ s: prefill \d+ tokens at \d+ tok/s, decode \d+ tokens at \d+ tok/s",
                     proc.stdout)


def test_models_lists_the_presets(ran):
    from autodeploy.models.presets import DEFAULT_PRESET, PRESETS

    out = _ok(ran, "models").stdout
    for name in PRESETS:
        assert re.search(rf"^{re.escape(name)} +\S", out, flags=re.M), name
    assert re.search(rf"^{DEFAULT_PRESET} .*\(default\)$", out, flags=re.M)


def test_transforms_lists_every_stage_in_run_order(ran):
    out = _ok(ran, "transforms").stdout
    assert out.startswith("Common fields of every transform")
    seen: List[str] = []
    for stage in re.findall(r"^\w+  \[stage (\w+), default ", out, flags=re.M):
        if stage not in seen:
            seen.append(stage)
    assert seen == [s for s in STAGES if s in seen] and {"factory", "export", "compile"} <= set(seen)
    assert "build_model  [stage factory, default on]" in out
    assert "match_linear_simple  [stage pattern_matcher, default off by default" in out


def test_transforms_key_export_to_gm_lists_the_export_patches(ran):
    out = _ok(ran, "transforms_key").stdout
    assert out.startswith("export_to_gm  [stage export, default on]")
    assert "export patches (all on; switch one off with --transforms.export_to_gm.patches.<name> false):" in out
    for patch in ("no_grad", "list_index_constants", "meta_tensor_constants", "state_kernels"):  # named in README
        assert f"\n      {patch}: " in out, patch


def test_export_with_print_graph_and_out(ran):
    proc = _ok(ran, "export")
    _assert_table_once(proc)
    assert "\nops in the transformed graph:\n" in proc.stdout and "def forward(" in proc.stdout
    out_dir = ran["_out_dir"]
    for name in ("graph.dot", "graph.txt", "graph.py", "summary.txt", "config.json"):
        assert os.path.getsize(os.path.join(out_dir, name)) > 0, name  # type: ignore[arg-type]


def test_version(ran):
    import autodeploy

    assert _ok(ran, "version").stdout == f"autodeploy {autodeploy.__version__}\n"


@pytest.mark.parametrize("example", sorted(bad_input_examples()))
def test_bad_input_prints_the_documented_line_and_exits_2(ran, example):
    proc = ran[example].result()
    assert proc.returncode == 2, (proc.stdout[-2000:], proc.stderr[-2000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("autodeploy")]
    assert errors == [bad_input_examples()[example]]
    assert "Traceback" not in proc.stderr and "build_model " not in proc.stdout  # nothing was built


@pytest.mark.slow  # a second build of the demo model; the flagged run above covers the same path
def test_plain_run_generates_for_the_built_in_prompts():
    from autodeploy.cli_build import DEFAULT_PROMPTS

    proc = _run(readme_command("autodeploy run  "))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_table_once(proc)
    for prompt in DEFAULT_PROMPTS:
        assert f"--- prompt: {prompt!r}  [" in proc.stdout


@pytest.mark.slow  # a second tiny-llama build; the export above covers the same path
def test_dotted_override_example(tmp_path):
    argv = readme_command("autodeploy export --model tiny-llama --max_seq_len")
    assert "--transforms.match_rope_pattern.enabled" in argv
    proc = _run(argv + ["--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^match_rope_pattern +pattern_matcher +disabled$", proc.stdout, flags=re.M)
    config = (tmp_path / "config.json").read_text()
    assert '"max_seq_len": 1024' in config and '"attn_implementation": "sdpa"' in config
