"""fuse_gemms_mixed_children: linears sharing an input that also has other users -> one GEMM + narrows."""

import copy

import pytest
import torch
from torch import nn

from autodeploy.transform.interface import Stage
from helpers import apply_transform, assert_same_outputs, build, count_op, export_gm, family_checkpoint

aten = torch.ops.aten


class LinearsAndRelu(nn.Module):
    def __init__(self, bias=False):
        super().__init__()
        self.a, self.b = nn.Linear(32, 24, bias=bias), nn.Linear(32, 8, bias=bias)

    def forward(self, x):
        h = torch.tanh(x)
        return self.a(h), self.b(h) * 3, torch.relu(h)


class OneLinearAndRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 24)

    def forward(self, x):
        h = torch.tanh(x)
        return self.a(h), torch.relu(h)


class OnlyLinears(LinearsAndRelu):
    def forward(self, x):
        h = torch.tanh(x)
        return self.a(h), self.b(h)


class HeadsFromInputShape(nn.Module):
    """HF style: the head views take their sizes from the projections' input (a graph input here,
    so that input also has ``sym_size`` users besides the linears)."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(32, 32, bias=False), nn.Linear(32, 16, bias=False)

    def forward(self, x):
        shape = (*x.shape[:-1], -1, 8)
        return self.q(x).view(shape), self.k(x).view(shape)


class FlattenedWithRelu(LinearsAndRelu):
    def forward(self, x):
        h = torch.tanh(x)
        a = self.a(h)
        return a.view(a.shape[0], -1), self.b(h), torch.relu(h)


SHAPES = [(torch.randn(2, 5, 32),), (torch.randn(3, 1, 32),)]


def _run(module, key="fuse_gemms_mixed_children"):
    gm = export_gm(module.eval(), torch.randn(2, 5, 32))
    reference = copy.deepcopy(gm)
    gm, record = apply_transform(key, gm)
    return reference, gm, record


@pytest.mark.parametrize("bias", [False, True])
def test_linears_with_relu_user_become_narrow_views(bias):
    reference, gm, record = _run(LinearsAndRelu(bias))
    assert record.num_matches == 1
    assert count_op(gm, aten.linear) == 1
    assert count_op(gm, aten.split_with_sizes) == 0
    narrows = [n for n in gm.graph.nodes if n.target == aten.narrow.default]
    assert [(n.args[1], n.args[2], n.args[3]) for n in narrows] == [(-1, 0, 24), (-1, 24, 8)]
    fused = gm.graph.find_nodes(op="call_function", target=aten.linear.default)[0]
    assert all(n.args[0] is fused for n in narrows)
    relu = gm.graph.find_nodes(op="call_function", target=aten.relu.default)[0]
    assert relu.args[0] is fused.args[0]  # the other user keeps reading the shared input
    names = {n for n, _ in gm.named_parameters()}
    assert not names & {"a.weight", "b.weight", "a.bias", "b.bias"}
    assert str(fused.args[1].target) in names and gm.get_parameter(str(fused.args[1].target)).shape == (32, 32)
    assert sum(p.numel() for p in gm.parameters()) == sum(p.numel() for p in reference.parameters())
    assert_same_outputs(reference, gm, SHAPES)


def test_input_with_shape_users_is_fused_here_not_by_fuse_gemms():
    module = HeadsFromInputShape()
    _, _, plain = _run(copy.deepcopy(module), key="fuse_gemms")
    assert plain.num_matches == 0
    reference, gm, record = _run(module)
    assert record.num_matches == 1
    assert count_op(gm, aten.linear) == 1 and count_op(gm, aten.narrow) == 2
    assert count_op(gm, [aten.view, aten.reshape]) == 2
    assert_same_outputs(reference, gm, SHAPES)


@pytest.mark.parametrize("cls", [OneLinearAndRelu, OnlyLinears], ids=lambda c: c.__name__)
def test_near_misses_left_alone(cls):
    reference, gm, record = _run(cls())
    assert record.num_matches == 0
    assert count_op(gm, aten.narrow) == 0
    assert count_op(gm, aten.linear) == count_op(reference, aten.linear)
    assert {n for n, _ in gm.named_parameters()} == {n for n, _ in reference.named_parameters()}
    assert_same_outputs(reference, gm, SHAPES)


def test_view_merging_feature_dim_still_works():
    reference, gm, record = _run(FlattenedWithRelu())
    assert record.num_matches == 1
    assert count_op(gm, aten.linear) == 1 and count_op(gm, aten.narrow) == 2
    # the view merging the narrowed feature dim into a leading one became a reshape (a copy)
    assert count_op(gm, aten.view) == 0 and count_op(gm, aten.reshape) == 1
    assert_same_outputs(reference, gm, SHAPES)


def test_llama_pipeline_leaves_all_linear_parents_to_fuse_gemms():
    result = build(family_checkpoint("llama"), up_to=Stage.POST_LOAD_FUSION)
    records = {r.key: r for r in result.context.history}
    assert records["fuse_gemms_mixed_children"].status == "ok"
    assert records["fuse_gemms_mixed_children"].num_matches == 0
    assert records["fuse_gemms"].num_matches == 2
    assert count_op(result.graph, aten.narrow) == 0
