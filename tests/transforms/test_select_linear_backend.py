"""select_linear_backend: backend "blas" -> autodeploy.blas_linear for float32 parameter linears."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autodeploy.transform.interface import Stage
from helpers import apply_transform, assert_same_outputs, build, count_op, export_gm, family_checkpoint, rel_rmse

ad = torch.ops.autodeploy
aten = torch.ops.aten
WARNING = "OMP_WAIT_POLICY=PASSIVE"


class TwoLinears(nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.a = nn.Linear(32, 48, bias=True).to(dtype)
        self.b = nn.Linear(48, 16, bias=False).to(dtype)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class MixedDtypes(nn.Module):
    """An fp32 linear and a bf16 one (with casts around it)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 48)
        self.b = nn.Linear(48, 16).to(torch.bfloat16)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)).to(torch.bfloat16)).float()


class ComputedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 32))

    def forward(self, x):
        return F.linear(x, self.w * 2)


@pytest.fixture
def propagate_autodeploy_logs(monkeypatch):
    monkeypatch.setattr(logging.getLogger("autodeploy"), "propagate", True)


def _run(module, dtype=torch.float32, **cfg):
    gm = export_gm(module.eval(), torch.randn(2, 5, 32, dtype=dtype))
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("select_linear_backend", gm, **cfg)
    return reference, gm, record


def test_blas_swaps_fp32_linears(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    reference, gm, record = _run(TwoLinears(), backend="blas")
    assert record.num_matches == 2
    assert count_op(gm, ad.blas_linear) == 2
    assert count_op(gm, aten.linear) == 0
    with_bias = [n for n in gm.graph.nodes if n.target == ad.blas_linear.default and len(n.args) > 2 and n.args[2] is not None]
    assert len(with_bias) == 1
    for shape in ((2, 5, 32), (3, 1, 32), (7, 32)):
        x = torch.randn(*shape)
        with torch.no_grad():
            ref, out = reference(x), gm(x)
        assert out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert rel_rmse(out, ref) < 1e-5


def test_torch_backend_changes_nothing(monkeypatch, caplog, propagate_autodeploy_logs):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with caplog.at_level(logging.WARNING, logger="autodeploy"):
        reference, gm, record = _run(TwoLinears(), backend="torch")
    assert record.status == "skipped" and record.num_matches == 0
    assert gm.code == reference.code
    assert count_op(gm, aten.linear) == 2 and count_op(gm, ad.blas_linear) == 0
    assert not any(WARNING in r.getMessage() for r in caplog.records)


def test_default_backend_is_torch():
    reference, gm, record = _run(TwoLinears())
    assert record.num_matches == 0
    assert gm.code == reference.code


def test_bf16_weights_left_alone(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    reference, gm, record = _run(TwoLinears(torch.bfloat16), dtype=torch.bfloat16, backend="blas")
    assert record.num_matches == 0
    assert count_op(gm, aten.linear) == 2 and count_op(gm, ad.blas_linear) == 0
    assert gm.code == reference.code
    x = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(gm(x), reference(x))


def test_only_the_fp32_linear_of_a_mixed_model(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    reference, gm, record = _run(MixedDtypes(), backend="blas")
    assert record.num_matches == 1
    assert count_op(gm, ad.blas_linear) == 1 and count_op(gm, aten.linear) == 1
    blas = gm.graph.find_nodes(op="call_function", target=ad.blas_linear.default)[0]
    assert str(blas.args[1].target) == "a.weight"
    assert_same_outputs(reference, gm, [(torch.randn(2, 5, 32),), (torch.randn(1, 3, 32),)], tol=1e-2)


def test_computed_weight_left_alone(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    reference, gm, record = _run(ComputedWeight(), backend="blas")
    assert record.num_matches == 0
    assert count_op(gm, aten.linear) == 1


@pytest.mark.parametrize("policy,warns", [(None, True), ("ACTIVE", True), ("PASSIVE", False), ("passive", False)])
def test_warns_without_passive_wait_policy(monkeypatch, caplog, propagate_autodeploy_logs, policy, warns):
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    with caplog.at_level(logging.WARNING, logger="autodeploy"):
        _, gm, record = _run(TwoLinears(), backend="blas")
    assert record.num_matches == 2
    hits = [r for r in caplog.records if WARNING in r.getMessage()]
    assert len(hits) == (1 if warns else 0)
    assert all(r.levelno == logging.WARNING and r.name.startswith("autodeploy") for r in hits)


def test_llama_pipeline_with_blas(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    result = build(family_checkpoint("llama"), up_to=Stage.POST_LOAD_FUSION,
                   overrides={"select_linear_backend": {"backend": "blas"}})
    record = next(r for r in result.context.history if r.key == "select_linear_backend")
    # per layer the fused qkv and o_proj (the MLP is one fused swiglu op), plus lm_head
    assert record.status == "ok" and record.num_matches == 5
    gm = result.graph
    assert count_op(gm, ad.blas_linear) == 5 and count_op(gm, aten.linear) == 0
    reference = copy.deepcopy(gm)
    for node in reference.graph.find_nodes(op="call_function", target=ad.blas_linear.default):
        node.target = aten.linear.default
    reference.recompile()
    for b, s in ((1, 6), (3, 2)):
        ids = torch.randint(0, 512, (b, s))
        pos = torch.arange(s).expand(b, s)
        with torch.no_grad():
            out, ref = gm(ids, pos), reference(ids, pos)
        assert rel_rmse(out, ref) < 1e-5
