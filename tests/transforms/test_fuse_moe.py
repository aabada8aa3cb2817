"""fuse_moe: torch_moe (per-expert parameters) and torch_moe_fused (stacked parameters, or layout
ops on them) -> grouped_moe_fused over stacked parameters made once, originals freed."""

import copy
import os
import shutil

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from autodeploy.export.exporter import export_causal_lm
from autodeploy.transform.cleanups import cleanup_for_matching
from autodeploy.transform.interface import Stage
from helpers import (MOE_LAYERS, apply_transform, assert_matches_hf, assert_same_outputs, build, count_op, export_gm,
                     export_moe_block, moe_block, moe_config, moe_family_checkpoint, rel_rmse)

ad = torch.ops.autodeploy
aten = torch.ops.aten
H = 64
SHAPES = [(torch.randn(2, 5, H),), (torch.randn(3, 1, H),)]


def _numel(gm):
    return sum(p.numel() for p in gm.parameters())


def _tiny_mixtral_graph():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config("mixtral"), dtype=torch.float32).eval()
    gm = export_causal_lm(model, max_batch_size=4, max_seq_len=32)
    cleanup_for_matching(gm)
    return gm


def _lm_inputs():
    return [(torch.randint(0, 512, (b, s)), torch.arange(s).expand(b, s)) for b, s in ((2, 7), (3, 1))]


def test_per_expert_weights_are_stacked_once():
    gm = _tiny_mixtral_graph()
    assert count_op(gm, ad.torch_moe) == 2
    reference = copy.deepcopy(gm)
    ref_params = dict(reference.named_parameters())
    gm, record = apply_transform("fuse_moe", gm)
    assert record.num_matches == 2
    assert count_op(gm, ad.grouped_moe_fused) == 2
    assert count_op(gm, [ad.torch_moe, ad.torch_moe_fused]) == 0
    names = {n for n, _ in gm.named_parameters()}
    assert not [n for n in names if ".experts." in n and n.endswith(".weight")], "per-expert weights not freed"
    for layer, node in enumerate(gm.graph.find_nodes(op="call_function", target=ad.grouped_moe_fused.default)):
        prefix = f"model.layers.{layer}.block_sparse_moe.experts"
        gate_up, down = (gm.get_parameter(str(n.target)) for n in node.args[3:5])
        assert str(node.args[3].target) == f"{prefix}.moe_gate_up_weight"
        assert gate_up.shape == (4, 2 * 128, H) and down.shape == (4, H, 128)
        expect = torch.stack([torch.cat([ref_params[f"{prefix}.{e}.w1.weight"], ref_params[f"{prefix}.{e}.w3.weight"]])
                              for e in range(4)])
        torch.testing.assert_close(gate_up, expect, rtol=0, atol=0)
        torch.testing.assert_close(down, torch.stack([ref_params[f"{prefix}.{e}.w2.weight"] for e in range(4)]),
                                   rtol=0, atol=0)
        assert node.args[5] is None and node.args[6] is None and node.args[7] == "silu"
    assert _numel(gm) == _numel(reference)
    assert_same_outputs(reference, gm, _lm_inputs())


def test_gpt_oss_layout_is_folded_into_new_parameters():
    """GPT-OSS's transposed, interleaved gate/up (+bias) and transposed down: the view/cat ops on
    the parameters become parameters; the HF-layout originals are freed, the plain bias is kept."""
    module = moe_block("gpt_oss")
    gm = export_moe_block(module, "autodeploy")
    assert count_op(gm, aten.transpose) == 2 and count_op(gm, aten.cat) == 2
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_moe", gm)
    assert record.num_matches == 1
    assert count_op(gm, ad.grouped_moe_fused) == 1
    assert count_op(gm, [aten.transpose, aten.cat, aten.slice]) == 0
    names = {n for n, _ in gm.named_parameters()}
    assert names == {"router.weight", "router.bias", "experts.down_proj_bias", "experts.moe_gate_up_weight",
                     "experts.moe_down_weight", "experts.moe_gate_up_bias"}
    node = gm.graph.find_nodes(op="call_function", target=ad.grouped_moe_fused.default)[0]
    assert node.args[7] == "swiglu_oai" and node.args[9] == pytest.approx(7.0)
    assert gm.get_parameter("experts.moe_gate_up_weight").shape == (4, 128, H)
    assert gm.get_parameter("experts.moe_gate_up_weight").is_contiguous()
    assert _numel(gm) == _numel(reference)
    assert_same_outputs(reference, gm, SHAPES)
    assert_same_outputs(module, gm, SHAPES)


def test_stacked_parameters_are_taken_as_they_are():
    module = moe_block("qwen3_moe")
    gm = export_moe_block(module, "autodeploy")
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_moe", gm, bmm_max_pairs=3)
    assert record.num_matches == 1
    assert count_op(gm, ad.grouped_moe_fused) == 1 and count_op(gm, [ad.torch_moe, ad.torch_moe_fused]) == 0
    node = gm.graph.find_nodes(op="call_function", target=ad.grouped_moe_fused.default)[0]
    assert [str(n.target) for n in node.args[3:5]] == ["experts.gate_up_proj", "experts.down_proj"]
    assert node.args[-1] == 3
    assert {n for n, _ in gm.named_parameters()} == {n for n, _ in reference.named_parameters()}
    assert_same_outputs(reference, gm, SHAPES)  # 10 and 3 tokens: above and at the bmm threshold


def test_torch_backend_keeps_the_reference_op():
    gm = export_moe_block(moe_block("mixtral"), "autodeploy")
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_moe", gm, backend="torch")
    assert record.num_matches == 1
    assert count_op(gm, ad.torch_moe_fused) == 1 and count_op(gm, ad.grouped_moe_fused) == 0
    assert_same_outputs(reference, gm, SHAPES)


class InputDependentExperts(nn.Module):
    """MoE ops whose expert weights depend on the input: no parameter to stack or fold."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, 4, bias=False)
        self.g = nn.ParameterList([nn.Parameter(torch.randn(32, H) * 0.2) for _ in range(4)])
        self.u = nn.ParameterList([nn.Parameter(torch.randn(32, H) * 0.2) for _ in range(4)])
        self.d = nn.ParameterList([nn.Parameter(torch.randn(H, 32) * 0.2) for _ in range(4)])
        self.gate_up = nn.Parameter(torch.randn(4, 64, H) * 0.2)
        self.down = nn.Parameter(torch.randn(4, H, 32) * 0.2)

    def forward(self, x):
        x = x.reshape(-1, H)
        weights, index = torch.topk(self.router(x).softmax(-1), 2, dim=-1)
        scale = x.abs().mean()
        gates = [self.g[0] * scale] + list(self.g)[1:]
        a = ad.torch_moe(x, index, weights, gates, list(self.u), list(self.d), [], [], [])
        b = ad.torch_moe_fused(x, index, weights, self.gate_up * scale, self.down)
        return a + b


def test_input_dependent_weights_left_alone():
    gm = export_gm(InputDependentExperts().eval(), torch.randn(2, 5, H))
    reference = copy.deepcopy(gm)
    gm, record = apply_transform("fuse_moe", gm)
    assert record.num_matches == 0
    assert count_op(gm, ad.torch_moe) == 1 and count_op(gm, ad.torch_moe_fused) == 1
    assert count_op(gm, ad.grouped_moe_fused) == 0
    assert {n for n, _ in gm.named_parameters()} == {n for n, _ in reference.named_parameters()}
    assert_same_outputs(reference, gm, SHAPES)


@pytest.mark.parametrize("family,layout", [("mixtral", "auto"), ("mixtral", "per_expert"),
                                           pytest.param("gpt_oss", "auto", marks=pytest.mark.slow)])
def test_pipeline_fuses_every_moe_layer(family, layout):
    """Mixtral's checkpoint stores each expert: by default the export keeps the module's stacked
    parameters (the loader stacks the checkpoint's tensors) and fuse_moe reads them as they are;
    exported per expert, fuse_moe stacks them into new parameters. GPT-OSS's stacked, transposed,
    interleaved layout is folded into new parameters."""
    # select_moe_backend off: this checks fuse_moe's own result (test_select_moe_backend.py the packing)
    result = build(moe_family_checkpoint(family), up_to=Stage.POST_LOAD_FUSION,
                   overrides={"select_moe_backend": {"backend": "torch"},
                              "export_to_gm": {"experts_layout": layout}})
    record = next(r for r in result.context.history if r.key == "fuse_moe")
    assert record.status == "ok" and record.num_matches == MOE_LAYERS[family]
    gm = result.graph
    assert count_op(gm, ad.grouped_moe_fused) == MOE_LAYERS[family]
    assert count_op(gm, [ad.torch_moe, ad.torch_moe_fused]) == 0
    params = dict(gm.named_parameters())
    assert not [n for n in params if ".experts.0." in n]
    read_as_exported = [n for n in params if n.endswith("experts.gate_up_proj")]
    assert len(read_as_exported) == (MOE_LAYERS[family] if (family, layout) == ("mixtral", "auto") else 0)
    assert all(not p.is_meta for p in params.values())
    assert_matches_hf(gm, moe_family_checkpoint(family))


def test_stacked_checkpoint_is_loaded_as_stacked(tmp_path):
    """A checkpoint saved in transformers' own stacked layout (save_original_format=False): the
    export keeps the stacked parameters (the checkpoint's names), fuse_moe uses them as they are."""
    source = moe_family_checkpoint("mixtral")
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path, save_original_format=False)
    for name in os.listdir(source):
        if name.startswith("tokenizer") or name == "generation_config.json":
            shutil.copy(os.path.join(source, name), tmp_path / name)
    result = build(str(tmp_path), up_to=Stage.POST_LOAD_FUSION, max_seq_len=64, max_batch_size=4,
                   overrides={"select_moe_backend": {"backend": "torch"}})
    gm = result.graph
    nodes = gm.graph.find_nodes(op="call_function", target=ad.grouped_moe_fused.default)
    assert len(nodes) == 2
    assert [str(n.target) for n in nodes[0].args[3:5]] == ["model.layers.0.mlp.experts.gate_up_proj",
                                                            "model.layers.0.mlp.experts.down_proj"]
    ids = torch.randint(0, 512, (2, 9))
    pos = torch.arange(9).expand(2, 9)
    with torch.no_grad():
        ref = hf(input_ids=ids, position_ids=pos).logits
        out = gm(ids, pos)
    assert rel_rmse(out, ref) < 1e-5
