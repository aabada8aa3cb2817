"""How HF MoE experts whose checkpoint stores each expert separately are exported: stacked (the
module's own [E, ...] parameters, filled by the loader) in an unsharded build of plain weights,
one parameter per checkpoint tensor when asked; quantized experts stacked too, unless their
checkpoint tensors differ from expert to expert."""

import os
import shutil

import torch
from safetensors.torch import load_file, save_file

import quant_expert_checkpoints as qe
from autodeploy.transform.interface import Stage
from autodeploy.transform.library._quant_from_config import GRAPH_LOAD_HOOKS
from helpers import MOE_LAYERS, build, count_op, moe_family_checkpoint

ad = torch.ops.autodeploy


def _expert_params(gm: torch.fx.GraphModule) -> list:
    return [n for n, _ in gm.named_parameters() if ".experts." in n]


def test_plain_per_expert_checkpoint_exports_stacked():
    """Mixtral's checkpoint has experts.<e>.w1/w2/w3 per expert; the graph has two stacked
    parameters per MoE layer (three per expert exported per expert: 4 experts x 3 x 2 layers)."""
    ckpt = moe_family_checkpoint("mixtral")
    layers = MOE_LAYERS["mixtral"]
    stacked = build(ckpt, up_to=Stage.PATTERN_MATCHER).graph_module
    assert count_op(stacked, ad.torch_moe_fused) == layers and count_op(stacked, ad.torch_moe) == 0
    assert sorted(_expert_params(stacked)) == sorted(
        f"model.layers.{i}.mlp.experts.{p}" for i in range(layers) for p in ("gate_up_proj", "down_proj")
    )
    result = build(ckpt, up_to=Stage.PATTERN_MATCHER, overrides={"export_to_gm": {"experts_layout": "per_expert"}})
    per_expert = result.graph_module
    assert count_op(per_expert, ad.torch_moe) == layers and count_op(per_expert, ad.torch_moe_fused) == 0
    assert len(_expert_params(per_expert)) == 4 * 3 * layers
    assert set(_expert_params(per_expert)) <= set(result.factory.checkpoint_index().weight_map)


def test_quantized_experts_export_stacked():
    """An FP8 checkpoint stores the same scales beside every expert's weight: the experts are
    exported stacked too, and ``quantize_fp8_moe_from_config`` replaces the float stacks by one
    [E, ...] buffer per tensor kind and projection, each loaded from the experts' tensors in order."""
    ckpt = qe.quantized_checkpoint("qwen3_moe", "fp8")
    layers, experts = qe.MOE_LAYERS["qwen3_moe"], qe.NUM_EXPERTS["qwen3_moe"]
    exported = build(ckpt, up_to=Stage.EXPORT).graph_module
    assert count_op(exported, ad.torch_moe_fused) == layers and count_op(exported, ad.torch_moe) == 0
    gm = build(ckpt, up_to=Stage.PATTERN_MATCHER).graph_module
    assert count_op(gm, ad.torch_moe_fused) == count_op(gm, ad.torch_quant_fp8_moe) == 0
    assert count_op(gm, ad.torch_quant_fp8_moe_stacked) == layers
    expert_tensors = {n: t for n, t in [*gm.named_parameters(), *gm.named_buffers()] if ".mlp.experts." in n}
    assert sorted(expert_tensors) == sorted(
        f"model.layers.{i}.mlp.experts.{p}_{kind}" for i in qe.MOE_LAYER_IDS["qwen3_moe"]
        for p in ("gate", "up", "down") for kind in ("weight", "input_scale", "weight_scale"))
    assert all(t.shape[0] == experts for t in expert_tensors.values())
    hook = next(h for h in gm.meta[GRAPH_LOAD_HOOKS] if getattr(h, "name", "") == "model.layers.1.mlp.experts.up_weight")
    assert hook.keys == tuple(f"model.layers.1.mlp.experts.{e}.up_proj.weight" for e in range(experts))


def test_experts_that_differ_in_their_tensors_stay_per_expert(tmp_path):
    """Near miss: one expert of layer 0 lacks its input scale, so that layer's experts are not
    alike and are exported one by one (where the quantizer names the missing tensor); layer 1
    still stacks."""
    src = qe.quantized_checkpoint("qwen3_moe", "fp8")
    dst = tmp_path / "one-scale-missing"
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    sd = load_file(path)
    del sd["model.layers.0.mlp.experts.2.up_proj.input_scale"]
    save_file(sd, path, metadata={"format": "pt"})
    gm = build(str(dst), up_to=Stage.EXPORT).graph_module
    assert count_op(gm, ad.torch_moe) == 1 and count_op(gm, ad.torch_moe_fused) == 1
    per_expert = next(n for n in gm.graph.nodes if n.target == ad.torch_moe.default)
    assert str(per_expert.args[3][0].target) == "model.layers.0.mlp.experts.0.gate_proj.weight"
