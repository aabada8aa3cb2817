"""match_linear_simple: aten.linear with a parameter weight -> torch_linear_simple (off by
default in the pipeline; enabled here by building it directly)."""

import copy

import torch
import torch.nn.functional as F
from torch import nn

from helpers import apply_transform, assert_same_outputs, count_op, export_gm

ad = torch.ops.autodeploy
aten = torch.ops.aten
KEY = "match_linear_simple"


class Mlp(nn.Module):
    """Two linears with a parameter weight: one with a bias, one without."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class ComputedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 8))
        self.b = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return F.linear(x, self.w * 2), F.linear(x, self.w * 2, self.b)


def _run(module, *args):
    gm = export_gm(module.eval(), *args)
    reference = copy.deepcopy(gm)
    gm, record = apply_transform(KEY, gm)
    return reference, gm, record


def _simple_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == ad.torch_linear_simple.default]


def test_parameter_linears_become_linear_simple():
    module = Mlp().eval()
    reference, gm, record = _run(module, torch.randn(2, 3, 8))
    assert count_op(reference, aten.linear) == 2
    assert record.num_matches == 2
    assert count_op(gm, aten.linear) == 0
    nodes = _simple_nodes(gm)
    assert len(nodes) == 2
    # bias carried over where there is one, None where there is not
    bias_of = {n.args[1].target: (n.args[2].target if n.args[2] is not None else None) for n in nodes}
    assert bias_of == {"up.weight": "up.bias", "down.weight": None}
    inputs = [(torch.randn(2, 3, 8),), (torch.randn(5, 1, 8),)]
    assert_same_outputs(reference, gm, inputs, tol=1e-6)
    with torch.no_grad():
        x = inputs[1][0]
        assert torch.allclose(gm(x), module(x), atol=1e-6)


def test_node_metadata_carries_the_output_shape():
    reference, gm, record = _run(Mlp().eval(), torch.randn(2, 3, 8))
    assert record.num_matches == 2
    nodes = _simple_nodes(gm)
    assert len(nodes) == 2  # the loop below must have something to check
    for node in nodes:
        assert node.meta["val"].shape[-1] == node.args[1].meta["val"].shape[0]
        assert node.meta["val"].dim() == 3


def test_computed_weight_is_left_alone():
    reference, gm, record = _run(ComputedWeight().eval(), torch.randn(2, 3, 8))
    assert count_op(reference, aten.linear) == 2
    assert record.num_matches == 0
    assert count_op(gm, aten.linear) == 2
    assert count_op(gm, ad.torch_linear_simple) == 0
    assert_same_outputs(reference, gm, [(torch.randn(2, 3, 8),), (torch.randn(4, 7, 8),)], tol=1e-6)
