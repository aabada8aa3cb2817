"""fuse_silu_mul: silu(first half) * second half of a fused gate/up GEMM -> torch_silu_and_mul."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autodeploy.transform.interface import Stage
from helpers import apply_transform, assert_matches_hf, assert_same_outputs, build, count_op, export_gm, family_checkpoint

ad = torch.ops.autodeploy
aten = torch.ops.aten
SHAPES = [(torch.randn(2, 5, 32),), (torch.randn(3, 1, 32),)]


class GateUp(nn.Module):
    """Phi-3 style fused gate_up projection; ``mode`` picks how the halves are taken."""

    def __init__(self, mode, width=64):
        super().__init__()
        self.mode = mode
        self.w_gate_up = nn.Parameter(torch.randn(width, 32) * 0.2)
        self.w_down = nn.Parameter(torch.randn(32, 32) * 0.2)

    def forward(self, x):
        gu = F.linear(x, self.w_gate_up)
        if self.mode == "chunk":
            g, u = gu.chunk(2, -1)
        elif self.mode == "narrow":
            g, u = gu.narrow(-1, 0, 32), gu.narrow(-1, 32, 32)
        elif self.mode == "slice":
            g, u = gu[..., :32], gu[..., 32:]
        elif self.mode == "split":
            g, u = gu.split(32, dim=-1)
        elif self.mode == "gate_second":
            g, u = gu.chunk(2, -1)
            return F.linear(F.silu(u) * g, self.w_down)
        elif self.mode == "uneven_split":  # width 72: [32, 32, 8]
            g, u, _ = gu.split([32, 32, 8], dim=-1)
        elif self.mode == "uneven_slices":  # width 66, halves would be 33
            g, u = gu[..., :32], gu[..., 33:65]
        else:
            raise ValueError(self.mode)
        return F.linear(F.silu(g) * u, self.w_down)


def _run(module):
    gm = export_gm(module.eval(), torch.randn(2, 5, 32))
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_silu_mul", gm)
    return reference, gm, record


@pytest.mark.parametrize("mode", ["chunk", "narrow", "slice", "split"])
def test_halves_of_fused_gate_up(mode):
    reference, gm, record = _run(GateUp(mode))
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_silu_and_mul) == 1
    assert count_op(gm, [aten.silu, aten.mul, aten.chunk, aten.split, aten.split_with_sizes, aten.narrow, aten.slice]) == 0
    node = gm.graph.find_nodes(op="call_function", target=ad.torch_silu_and_mul.default)[0]
    src = node.args[0]
    assert src.target == aten.linear.default and str(src.args[1].target) == "w_gate_up"
    assert_same_outputs(reference, gm, SHAPES)


@pytest.mark.parametrize(
    "mode,width", [("gate_second", 64), ("uneven_split", 72), ("uneven_slices", 66)], ids=lambda v: str(v)
)
def test_near_misses_left_alone(mode, width):
    reference, gm, record = _run(GateUp(mode, width))
    assert record.num_matches == 0
    assert count_op(gm, ad.torch_silu_and_mul) == 0
    assert count_op(gm, aten.silu) == 1 and count_op(gm, aten.mul) == 1
    assert_same_outputs(reference, gm, SHAPES)


def _record(result, key):
    return next(r for r in result.context.history if r.key == key)


def test_llama_without_swiglu_matching_fuses_after_fuse_gemms():
    result = build(family_checkpoint("llama"), up_to=Stage.POST_LOAD_FUSION,
                   overrides={"match_swiglu_pattern": {"enabled": False}})
    assert _record(result, "fuse_gemms").num_matches == 4
    record = _record(result, "fuse_silu_mul")
    assert record.status == "ok" and record.num_matches == 2
    assert count_op(result.graph, ad.torch_silu_and_mul) == 2
    assert count_op(result.graph, [aten.silu, aten.mul]) == 0
    assert_matches_hf(result.graph, family_checkpoint("llama"))


def test_phi3_fused_gate_up():
    result = build(family_checkpoint("phi3"), up_to=Stage.POST_LOAD_FUSION)
    record = _record(result, "fuse_silu_mul")
    assert record.status == "ok" and record.num_matches == 2
    assert count_op(result.graph, ad.torch_silu_and_mul) == 2
    assert count_op(result.graph, aten.silu) == 0
    assert_matches_hf(result.graph, family_checkpoint("phi3"))
