"""User-caused errors are ``autodeploy: error: ...`` (one line, exit code 2) and say what to
change; ``autodeploy: internal error`` (exit 1) is kept for bugs.

Each case breaks one thing a user controls: a setting (cache size, model_kwargs, serve flags) or
a file of a real checkpoint on disk (a copy of the tiny-llama preset: config.json, the weights,
the shard index, generation_config.json, pickled weights that torch's safe unpickler refuses).
"""

import os
import pickle
import shutil
import socket
import subprocess
import sys
from typing import Callable, List

import pytest
import torch
from safetensors.torch import load_file

from autodeploy.cli import main
from autodeploy.models.presets import preset_dir

AUTODEPLOY = os.path.join(os.path.dirname(sys.executable), "autodeploy")


class RunsCode:
    """A pickle that runs a shell command when unpickled (what weights_only refuses)."""

    def __reduce__(self):
        return (os.system, ("echo this should never run",))


def _checkpoint(tmp_path, edit: Callable[[str], None]) -> str:
    d = str(tmp_path / "ckpt")
    shutil.copytree(preset_dir("tiny-llama"), d)
    edit(d)
    return d


def _write(d: str, name: str, data) -> None:
    with open(os.path.join(d, name), "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def _to_pickle(d: str, payload, **save_kwargs) -> None:
    """Replace the safetensors weights with ``pytorch_model.bin`` holding ``payload``."""
    os.remove(os.path.join(d, "model.safetensors"))
    torch.save(payload, os.path.join(d, "pytorch_model.bin"), **save_kwargs)


def _truncate(d: str) -> None:
    path = os.path.join(d, "model.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    _write(d, "model.safetensors", data[: len(data) // 2])


CHECKPOINT_CASES = {
    # pickled weights, with --allow-pickle: refused by torch's restricted unpickler
    "pickle_that_runs_code": (lambda d: _to_pickle(d, {"w": RunsCode()}), ["--allow-pickle"],
                              ["refused to load", "pytorch_model.bin", "GLOBAL posix.system", "safetensors"]),
    "pickle_that_runs_code_old_format": (
        lambda d: _to_pickle(d, {"w": RunsCode()}, _use_new_zipfile_serialization=False), ["--allow-pickle"],
        ["refused to load", "GLOBAL posix.system", "safetensors"]),
    "plain_pickle_not_torch": (lambda d: (os.remove(os.path.join(d, "model.safetensors")),
                                          _write(d, "pytorch_model.bin", pickle.dumps({"w": [1.0]}))),
                               ["--allow-pickle"], ["refused to load", "not a torch checkpoint"]),
    "truncated_pickle": (lambda d: (_to_pickle(d, {"w": torch.ones(4)}),
                                    _write(d, "pytorch_model.bin", b"PK\x03\x04" + b"\0" * 40)),
                         ["--allow-pickle"], ["cannot read the pickled weights", "corrupted or incomplete"]),
    "training_checkpoint_pickle": (lambda d: _to_pickle(d, {"state_dict": {"w": torch.ones(2)}, "step": 3}),
                                   ["--allow-pickle"], ["not a state dict of tensors", "'state_dict'", "state_dict()"]),
    # checkpoint files
    "config_not_json": (lambda d: _write(d, "config.json", "{model_type: llama"), [],
                        ["config.json is not valid JSON", "save_pretrained"]),
    "config_a_list": (lambda d: _write(d, "config.json", "[1, 2]"), [], ["config.json holds a JSON list"]),
    "safetensors_garbage": (lambda d: _write(d, "model.safetensors", b"\x10" + b"\0" * 7 + b"{garbage}"), [],
                            ["cannot read the safetensors file", "fetch or copy it again"]),
    "safetensors_truncated": (_truncate, [], ["cannot read the safetensors file", "corrupted or incomplete"]),
    "index_without_weight_map": (lambda d: _write(d, "model.safetensors.index.json", '{"metadata": {}}'), [],
                                 ["has no 'weight_map'", "restore the index"]),
    "index_not_json": (lambda d: _write(d, "model.safetensors.index.json", "{oops"), [],
                       ["cannot read the checkpoint index", "restore it"]),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_broken_checkpoint_is_a_user_error(case, tmp_path, capsys):
    edit, flags, expected = CHECKPOINT_CASES[case]
    d = _checkpoint(tmp_path, edit)
    assert main(["export", "--model", d, "--max_seq_len", "64", *flags]) == 2
    _assert_one_line_error(capsys.readouterr().err, expected)


def test_old_format_pickle_of_tensors_loads(tmp_path, capsys):
    """A state dict saved by torch < 1.6 (not a zip archive) cannot be memory-mapped; it is read
    whole instead of failing."""
    d = _checkpoint(tmp_path, lambda d: _to_pickle(d, load_file(os.path.join(d, "model.safetensors")),
                                                    _use_new_zipfile_serialization=False))
    assert main(["export", "--model", d, "--max_seq_len", "64", "--allow-pickle"]) == 0, capsys.readouterr().err


def test_bad_generation_config_is_a_user_error(tmp_path, capsys):
    d = _checkpoint(tmp_path, lambda d: _write(d, "generation_config.json", "{oops"))
    assert main(["run", "--model", d, "--max_seq_len", "64", "--max-tokens", "2", "--prompt", "hi"]) == 2
    _assert_one_line_error(capsys.readouterr().err, ["generation_config.json is not valid JSON", "remove the file"])


SETTING_CASES = {
    "too_few_cache_pages": (["export", "--model", "tiny-llama", "--transforms.initialize_cache.num_pages", "10"],
                            ["transforms.initialize_cache.num_pages is 10", "max_seq_len=1024", "at least 64",
                             "lower max_seq_len to at most 160"]),
    "model_kwargs_wrong_type": (["export", "--model", "tiny-llama", "--max_seq_len", "64",
                                 "--model_kwargs.num_hidden_layers", "many"],
                                ["model_kwargs.num_hidden_layers", "'many'", "expected int"]),
    "model_kwargs_unknown_activation": (["export", "--model", "tiny-llama", "--max_seq_len", "64",
                                         "--model_kwargs.hidden_act", "nope"],
                                        ["model_kwargs.hidden_act='nope'", "check those values"]),
    "serve_port_out_of_range": (["serve", "--model", "tiny-llama", "--port", "99999"],
                                ["--port 99999 is not a TCP port", "1-65535"]),
    "serve_unknown_host": (["serve", "--model", "tiny-llama", "--host", "no-such-host.invalid"],
                           ["--host 'no-such-host.invalid'", "127.0.0.1"]),
    "serve_negative_shutdown_timeout": (["serve", "--model", "tiny-llama", "--shutdown-timeout", "-1"],
                                        ["--shutdown-timeout -1 is negative"]),
    "serve_zero_request_bytes": (["serve", "--model", "tiny-llama", "--max-request-bytes", "0"],
                                 ["--max-request-bytes 0 must be at least 1"]),
    "serve_zero_choices": (["serve", "--model", "tiny-llama", "--max-choices-per-request", "0"],
                           ["--max-choices-per-request 0 must be at least 1"]),
    "serve_unknown_tool_call_parser": (["serve", "--model", "tiny-llama", "--tool-call-parser", "granite"],
                                       ["--tool-call-parser 'granite'",
                                        "['hermes', 'llama3_json', 'pythonic', 'mistral']"]),
    # checked before the build: minutes of work are not thrown away at the end
    "export_out_unwritable": (["export", "--model", "tiny-llama", "--out", "/proc/no-such-dir/graph"],
                              ["--out /proc/no-such-dir/graph: cannot write there"]),
}


@pytest.mark.parametrize("case", sorted(SETTING_CASES))
def test_bad_setting_is_a_user_error(case, capsys):
    args, expected = SETTING_CASES[case]
    assert main(args) == 2
    _assert_one_line_error(capsys.readouterr().err, expected)


# Caught from the settings alone, before anything is built, naming the flag the user typed (not
# the transform field behind a shortcut) with the allowed values.
PRE_BUILD_CASES = {
    "attn_backend_unknown": (["run", "--attn_backend", "flash"],
                             ["--attn_backend: 'flash' is not an attention backend", "choose one of: sdpa, torch"]),
    "attn_backend_field_unknown": (["export", "--transforms.insert_cached_attention.backend", "flash"],
                                   ["--transforms.insert_cached_attention.backend: 'flash'", "sdpa, torch"]),
    "compile_backend_unknown": (["serve", "--compile_backend", "fast"],
                                ["--compile_backend: Input should be 'auto', 'torch-simple', 'torch-compile'", "got 'fast'"]),
    "cuda_graphs_on_cpu": (["run", "--compile_backend", "torch-cudagraph"],
                           ["--compile_backend: 'torch-cudagraph' captures CUDA graphs and needs device cuda",
                            "the device is cpu", "torch-simple"]),
    "cuda_graphs_on_cpu_as_field": (["export", "--transforms.compile_model.backend=torch-opt"],
                                    ["--transforms.compile_model.backend: 'torch-opt'", "needs device cuda"]),
    "piecewise_without_cuda_graphs": (["export", "--transforms.compile_model.piecewise_enabled", "true"],
                                      ["--transforms.compile_model.piecewise_enabled:",
                                       "torch-cudagraph or torch-opt"]),
    "kv_cache_dtype_unknown": (["run", "--kv-cache-dtype", "fp4"],
                               ["--kv-cache-dtype: Input should be 'auto' or 'fp8'"]),
    "max_batch_size_zero": (["run", "--max_batch_size", "0"], ["--max_batch_size: Input should be greater than"]),
    "chat_template_missing": (["serve", "--chat_template", "no-such.jinja"],
                              ["--chat_template:", "'no-such.jinja' is neither a file nor Jinja template text"]),
}
if not torch.cuda.is_available():
    PRE_BUILD_CASES["cuda_without_gpu"] = (["run", "--device", "cuda"],
                                           ["--device: 'cuda' needs a CUDA GPU", "sees none", "use cpu"])


@pytest.fixture
def nothing_is_built(monkeypatch):
    import autodeploy.llm
    import autodeploy.pipeline

    def build_graph(*args, **kwargs):
        raise AssertionError("the model was built before the settings were checked")

    monkeypatch.setattr(autodeploy.pipeline, "build_graph", build_graph)
    monkeypatch.setattr(autodeploy.llm, "build_graph", build_graph)


@pytest.mark.parametrize("case", sorted(PRE_BUILD_CASES))
def test_bad_setting_fails_before_building_and_names_the_flag(case, capsys, nothing_is_built):
    args, expected = PRE_BUILD_CASES[case]
    assert main(args) == 2
    _assert_one_line_error(capsys.readouterr().err, expected)


def test_the_api_names_the_setting_it_was_given():
    """The same checks run for ``LLM(...)``/``load_deploy_config``, naming the keyword."""
    from autodeploy.config import load_deploy_config
    from autodeploy.utils.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^attn_backend: 'flash' is not an attention backend"):
        load_deploy_config(attn_backend="flash")
    with pytest.raises(ConfigError, match=r"^transforms.compile_model.backend: 'torch-cudagraph' captures CUDA"):
        load_deploy_config(transforms={"compile_model": {"backend": "torch-cudagraph"}})
    # a config for a CUDA machine still loads here: only a build needs the GPU
    assert load_deploy_config(device="cuda", compile_backend="torch-cudagraph").device == "cuda"


def test_max_seq_len_above_the_models_limit_names_both_numbers(capsys):
    """The demo model has 512 positions; an explicit larger value is refused (the API does too)."""
    assert main(["run", "--max_seq_len", "1024", "--prompt", "x", "--max-tokens", "1"]) == 2
    _assert_one_line_error(capsys.readouterr().err, ["--max_seq_len 1024 is larger than the model's limit of 512",
                                                     "at most 512"])


@pytest.mark.parametrize("args", [["--debug", "run", "--attn_backend", "flash"],
                                  ["run", "--attn_backend", "flash", "--debug"],
                                  ["transforms", "--debug", "--stage", "compil"]])
def test_debug_in_either_position_keeps_exit_code_2(args, capsys, nothing_is_built):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "override '--debug'" not in err
    assert err.strip().splitlines()[-1].startswith("autodeploy: error: --")


@pytest.mark.parametrize("flags, expected", [
    (["--batch-sizes", "8", "0"], "argument --batch-sizes: 0 is too small: it must be at least 1"),
    (["--new-tokens", "0"], "argument --new-tokens: 0 is too small"),
    (["--prefill-lens", "x"], "argument --prefill-lens: 'x' is not a whole number"),
    (["--accuracy-prompts", "-1"], "argument --accuracy-prompts: -1 is too small: it must be at least 0"),
])
def test_bench_flags_are_checked_before_measuring(flags, expected, capsys, monkeypatch):
    import autodeploy.bench.runner

    monkeypatch.setattr(autodeploy.bench.runner, "run", lambda cfg: pytest.fail("bench ran"))
    with pytest.raises(SystemExit) as exc:
        main(["bench", *flags])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"autodeploy: error: {expected}"), lines
    assert "max_batch_size" not in lines[0]


def test_bench_device_without_gpu_fails_before_measuring(capsys, monkeypatch, tmp_path):
    import autodeploy.bench.runner

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    monkeypatch.setattr(autodeploy.bench.runner, "run", lambda cfg: pytest.fail("bench ran"))
    assert main(["bench", "--device", "cuda", "--out", str(tmp_path)]) == 2
    _assert_one_line_error(capsys.readouterr().err, ["--device: 'cuda' needs a CUDA GPU"])


def test_serve_on_a_port_in_use_fails_before_building(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", "tiny-llama", "--port", str(port)]) == 2
    captured = capsys.readouterr()
    _assert_one_line_error(captured.err, [f"cannot listen on 127.0.0.1:{port}", "pick another --port"])
    assert "loaded" not in captured.err and "transform" not in captured.out  # nothing was built


@pytest.mark.slow  # ~8 s: a fresh interpreter; the in-process refusal tests stay default
def test_refused_pickle_through_the_console_script(tmp_path):
    d = _checkpoint(tmp_path, lambda d: _to_pickle(d, {"w": RunsCode()}))
    proc = subprocess.run([AUTODEPLOY, "export", "--model", d, "--allow-pickle"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "this should never run" not in proc.stdout
    _assert_one_line_error(proc.stderr, ["refused to load", "GLOBAL posix.system"])


def _assert_one_line_error(stderr: str, expected: List[str]) -> None:
    errors = [line for line in stderr.splitlines() if line.startswith("autodeploy:")]
    assert len(errors) == 1, stderr[-2000:]
    line = errors[0]
    assert line.startswith("autodeploy: error: "), line
    assert "internal error" not in stderr and "Traceback" not in stderr, stderr[-2000:]
    for text in expected:
        assert text in line, f"{text!r} not in {line!r}"
