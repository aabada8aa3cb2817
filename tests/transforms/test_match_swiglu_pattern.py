"""match_swiglu_pattern: the gated-SiLU MLP (HF LlamaMLP) -> autodeploy.torch_swiglu_mlp."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from autodeploy.transform.interface import Stage
from helpers import apply_transform, assert_same_outputs, build, count_op, export_gm, family_checkpoint

ad = torch.ops.autodeploy
aten = torch.ops.aten


def llama_mlp(bias=False, act="silu"):
    return LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=64, mlp_bias=bias, hidden_act=act))


class GateUpDifferentInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(32, 64, bias=False)
        self.up = nn.Linear(32, 64, bias=False)
        self.down = nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(torch.tanh(x)))


class UpFirst(GateUpDifferentInputs):
    def forward(self, x):
        return self.down(self.up(x) * F.silu(self.gate(x)))


SHAPES = [(torch.randn(2, 5, 32),), (torch.randn(3, 1, 32),)]


def _run(module):
    gm = export_gm(module.eval(), torch.randn(2, 5, 32))
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("match_swiglu_pattern", gm)
    return reference, gm, record


@pytest.mark.parametrize("bias", [False, True])
def test_llama_mlp_becomes_swiglu(bias):
    module = llama_mlp(bias)
    reference, gm, record = _run(module)
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_swiglu_mlp) == 1
    assert count_op(gm, [aten.linear, aten.silu, aten.mul]) == 0
    node = gm.graph.find_nodes(op="call_function", target=ad.torch_swiglu_mlp.default)[0]
    targets = [str(a.target) if isinstance(a, torch.fx.Node) else a for a in node.args[1:]]
    expected = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    if bias:
        expected += ["gate_proj.bias", "up_proj.bias", "down_proj.bias"]
    assert targets[: len(expected)] == expected
    assert all(t is None for t in targets[len(expected):])
    assert_same_outputs(reference, gm, SHAPES)


def test_up_times_silu_gate_order_also_matches():
    reference, gm, record = _run(UpFirst())
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_swiglu_mlp) == 1
    assert count_op(gm, [aten.linear, aten.silu, aten.mul]) == 0
    node = gm.graph.find_nodes(op="call_function", target=ad.torch_swiglu_mlp.default)[0]
    assert [str(a.target) for a in node.args[1:4]] == ["gate.weight", "up.weight", "down.weight"]
    assert_same_outputs(reference, gm, SHAPES)


@pytest.mark.parametrize(
    "make", [lambda: llama_mlp(act="gelu"), lambda: llama_mlp(bias=True, act="gelu"), GateUpDifferentInputs],
    ids=["geglu", "geglu_bias", "gate_up_different_inputs"],
)
def test_near_misses_left_alone(make):
    reference, gm, record = _run(make())
    assert record.num_matches == 0
    assert count_op(gm, ad.torch_swiglu_mlp) == 0
    assert count_op(gm, aten.linear) == 3
    assert_same_outputs(reference, gm, SHAPES)


def test_llama_pipeline_matches_one_swiglu_per_layer():
    result = build(family_checkpoint("llama"), up_to=Stage.PATTERN_MATCHER)
    record = next(r for r in result.context.history if r.key == "match_swiglu_pattern")
    assert record.status == "ok" and record.num_matches == 2
    assert count_op(result.graph, ad.torch_swiglu_mlp) == 2
    assert count_op(result.graph, aten.silu) == 0
