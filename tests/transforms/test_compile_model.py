"""compile_model (compile): torch-simple hands back the module it got; unknown backends are config errors."""

import re

import pytest
import torch
from torch import nn

from autodeploy.config import load_deploy_config
from autodeploy.transform.interface import PipelineContext, Stage
from autodeploy.transform.optimizer import build_transform
from autodeploy.utils.errors import ConfigError
from helpers import export_gm


class _Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.silu(self.lin(x)) * 2


def test_torch_simple_returns_the_same_module_and_output():
    x = torch.randn(3, 8)
    gm = export_gm(_Small(), x)
    with torch.no_grad():
        before = gm(x)
    code_before = gm.code
    ctx = PipelineContext()
    transform = build_transform("compile_model", {"backend": "torch-simple"})
    assert transform.config.stage == Stage.COMPILE
    out = transform(gm, ctx)
    assert out is gm
    assert out.code == code_before
    with torch.no_grad():
        after = out(x)
        other = out(torch.randn(5, 8))  # still dynamic
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    assert other.shape == (5, 8)
    # nothing of autodeploy's to run directly: torch-simple hands the graph back, and says so
    assert ctx.history[-1].key == "compile_model" and ctx.history[-1].status == "skipped"


def test_default_backend_is_auto_and_auto_is_torch_simple_on_cpu():
    from autodeploy.transform.library.compile_model import resolve_backend

    cfg = load_deploy_config()
    assert cfg.compile_backend is None  # the shortcut is unset: the transform's own default rules
    assert build_transform("compile_model", cfg.transforms["compile_model"]).config.backend == "auto"
    assert resolve_backend("auto", "cpu") == "torch-simple"
    assert resolve_backend("auto", "cuda") == "torch-cudagraph" and resolve_backend("auto", "cuda:1") == "torch-cudagraph"
    assert resolve_backend("torch-compile", "cuda") == "torch-compile"


def test_unknown_backend_is_a_config_error():
    # the error names the setting the user wrote (the shortcut), not the transform field behind it
    with pytest.raises(ConfigError, match=r"^compile_backend: .*'nope'") as err:
        load_deploy_config(compile_backend="nope")
    assert "torch-simple" in str(err.value)


def test_unknown_backend_in_transform_config_is_a_config_error():
    with pytest.raises(ConfigError, match=r"transforms\.compile_model\.backend"):
        build_transform("compile_model", {"backend": "inductor-max"})


def test_slow_backends_log_before_and_after_with_the_time(monkeypatch, caplog):
    """torch-compile spends seconds in inductor inside this one transform: a line says so before,
    and one gives the time after (inductor itself is replaced here: the lines are the subject)."""
    import logging

    import autodeploy.transform.library.compile_model as compile_model

    calls = []

    def fake_compile_graph(gm, cache, backend, **kwargs):
        calls.append(backend)
        return gm

    monkeypatch.setattr(compile_model, "compile_graph", fake_compile_graph)
    monkeypatch.setattr(logging.getLogger("autodeploy"), "propagate", True)
    x = torch.randn(3, 8)
    with caplog.at_level(logging.INFO, logger="autodeploy"):
        build_transform("compile_model", {"backend": "torch-compile"})(export_gm(_Small(), x), PipelineContext())
    # by identity: after an in-process CLI run pytest's handlers also sit on the autodeploy logger (each record twice)
    records = {id(r): r for r in caplog.records}.values()
    lines = [r.getMessage() for r in records if r.name.endswith("compile_model")]
    assert calls == ["torch-compile"]
    assert len(lines) == 2 and "torch-compile: inductor compiles" in lines[0]
    assert re.search(r"torch-compile done in \d+\.\d s", lines[1])
