"""fuse_swiglu: torch_swiglu_mlp on parameter weights -> torch_fused_swiglu_mlp with cat([gate, up])."""

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from autodeploy.transform.interface import Stage
from helpers import apply_transform, assert_matches_hf, assert_same_outputs, build, count_op, export_gm, family_checkpoint

ad = torch.ops.autodeploy
H, I = 32, 64
SHAPES = [(torch.randn(2, 5, H),), (torch.randn(3, 1, H),)]


def llama_mlp(bias=False):
    return LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=I, mlp_bias=bias))


class ComputedGate(nn.Module):
    """A swiglu whose gate weight is computed in the graph, not a parameter."""

    def __init__(self):
        super().__init__()
        self.wg, self.wu = nn.Parameter(torch.randn(I, H)), nn.Parameter(torch.randn(I, H))
        self.wd = nn.Parameter(torch.randn(H, I))

    def forward(self, x):
        return ad.torch_swiglu_mlp(x, self.wg * 0.5, self.wu, self.wd)


class GateBiasOnly(ComputedGate):
    def __init__(self):
        super().__init__()
        self.gb = nn.Parameter(torch.randn(I))

    def forward(self, x):
        return ad.torch_swiglu_mlp(x, self.wg, self.wu, self.wd, self.gb)


class SharedMLP(nn.Module):
    """One MLP (one set of weights) applied twice."""

    def __init__(self):
        super().__init__()
        self.mlp = llama_mlp()

    def forward(self, x):
        return self.mlp(torch.tanh(self.mlp(x)))


def _swiglu_gm(module):
    gm = export_gm(module.eval(), torch.randn(2, 5, H))
    gm, record = apply_transform("match_swiglu_pattern", gm)
    return gm, record


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_gets_concatenated_gate_up(bias):
    gm, matched = _swiglu_gm(llama_mlp(bias))
    assert matched.num_matches == 1
    reference = copy.deepcopy(gm)
    ref_params = dict(reference.named_parameters())
    gm, record = apply_transform("fuse_swiglu", gm)
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_fused_swiglu_mlp) == 1
    assert count_op(gm, ad.torch_swiglu_mlp) == 0
    node = gm.graph.find_nodes(op="call_function", target=ad.torch_fused_swiglu_mlp.default)[0]
    w = gm.get_parameter(str(node.args[1].target))
    assert w.shape == (2 * I, H)
    torch.testing.assert_close(w, torch.cat([ref_params["gate_proj.weight"], ref_params["up_proj.weight"]]), rtol=0, atol=0)
    assert str(node.args[2].target) == "down_proj.weight"
    names = {n for n, _ in gm.named_parameters()}
    assert not names & {"gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias"}
    if bias:
        b = gm.get_parameter(str(node.args[3].target))
        torch.testing.assert_close(b, torch.cat([ref_params["gate_proj.bias"], ref_params["up_proj.bias"]]), rtol=0, atol=0)
        assert str(node.args[4].target) == "down_proj.bias"
        assert len(names) == 4
    else:
        assert node.args[3] is None and node.args[4] is None
        assert len(names) == 2
    assert sum(p.numel() for p in gm.parameters()) == sum(p.numel() for p in reference.parameters())
    assert_same_outputs(reference, gm, SHAPES)


@pytest.mark.parametrize("cls", [ComputedGate, GateBiasOnly], ids=lambda c: c.__name__)
def test_near_misses_left_alone(cls):
    gm = export_gm(cls().eval(), torch.randn(2, 5, H))
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_swiglu", gm)
    assert record.num_matches == 0
    assert count_op(gm, ad.torch_swiglu_mlp) == 1
    assert count_op(gm, ad.torch_fused_swiglu_mlp) == 0
    assert {n for n, _ in gm.named_parameters()} == {n for n, _ in reference.named_parameters()}
    assert_same_outputs(reference, gm, SHAPES, tol=1e-4)


def test_shared_mlp_applied_twice():
    """Both applications fuse and read one concatenated gate/up weight (no copy per use)."""
    gm, matched = _swiglu_gm(SharedMLP())
    assert matched.num_matches == 2
    reference = copy.deepcopy(gm)
    ref_params = dict(reference.named_parameters())
    gm, record = apply_transform("fuse_swiglu", gm)
    assert record.num_matches == 2
    assert count_op(gm, ad.torch_fused_swiglu_mlp) == 2 and count_op(gm, ad.torch_swiglu_mlp) == 0
    nodes = gm.graph.find_nodes(op="call_function", target=ad.torch_fused_swiglu_mlp.default)
    assert {str(n.args[1].target) for n in nodes} == {"mlp.fused_gate_proj_up_proj"}
    assert {n for n, _ in gm.named_parameters()} == {"mlp.fused_gate_proj_up_proj", "mlp.down_proj.weight"}
    torch.testing.assert_close(gm.get_parameter("mlp.fused_gate_proj_up_proj"),
                               torch.cat([ref_params["mlp.gate_proj.weight"], ref_params["mlp.up_proj.weight"]]),
                               rtol=0, atol=0)
    assert sum(p.numel() for p in gm.parameters()) == sum(p.numel() for p in reference.parameters())
    assert_same_outputs(reference, gm, SHAPES)


def test_llama_pipeline_fuses_both_layers():
    result = build(family_checkpoint("llama"), up_to=Stage.POST_LOAD_FUSION)
    record = next(r for r in result.context.history if r.key == "fuse_swiglu")
    assert record.status == "ok" and record.num_matches == 2
    assert count_op(result.graph, ad.torch_fused_swiglu_mlp) == 2
    assert count_op(result.graph, ad.torch_swiglu_mlp) == 0
    params = {**dict(result.graph.named_parameters()), **dict(result.graph.named_buffers())}  # packed weights are buffers
    for layer in range(2):
        assert params[f"model.layers.{layer}.mlp.fused_gate_proj_up_proj"].shape == (2 * 128, 64)
    assert not [n for n in params if "gate_proj.weight" in n or "up_proj.weight" in n]
    assert_matches_hf(result.graph, family_checkpoint("llama"))
