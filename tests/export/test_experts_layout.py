"""How HF MoE experts whose checkpoint stores each expert separately are exported: stacked (the
module's own [E, ...] parameters, filled by the loader) in an unsharded build of plain weights,
one parameter per checkpoint tensor when asked, and always for quantized experts."""

import torch

import quant_expert_checkpoints as qe
from autodeploy.transform.interface import Stage
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


def test_quantized_experts_stay_per_expert():
    """An FP8 checkpoint stores scales beside each expert's weight: stacking would load the
    quantized weights without them, so the experts are exported one by one even by default and
    become the format's per-expert op."""
    gm = build(qe.quantized_checkpoint("qwen3_moe", "fp8"), up_to=Stage.PATTERN_MATCHER).graph_module
    assert count_op(gm, ad.torch_moe_fused) == 0
    assert count_op(gm, ad.torch_quant_fp8_moe) == qe.MOE_LAYERS["qwen3_moe"]
