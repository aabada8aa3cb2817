"""``fuse_finegrained_fp8_moe`` (post_load_fusion): how fine-grained FP8 experts run - decoded once, or kept.

``torch_quant_finegrained_fp8_moe`` (from ``quantize_finegrained_fp8_moe_from_config``) becomes,
with ``backend: decoded``, ``grouped_quant_moe_fused`` over the experts decoded once into the
model's dtype (``weight.float()`` times its tile's ``weight_scale_inv``), each GEMM's input rows
quantized to e4m3 per token per ``block_k`` channels at run time (``act_quant: fp8_group``)::

    y = autodeploy.torch_quant_finegrained_fp8_moe(x, sel, w, [gate weights], .., [gate weight_scale_invs], ..,
                                                   block_n, block_k, act, alpha, limit)
  ->
    y = autodeploy.grouped_quant_moe_fused(x, sel, w, P.moe_gate_up_weight, P.moe_down_weight, None, None,
                                           None, None, act, alpha, limit, "fp8_group", block_k, bmm_max_pairs)

Decoding per projection keeps every tile's scale exact however the intermediate size falls on
the 128-row tiles (gate and up are decoded apart, then stacked). ``backend: fp8`` keeps the
per-expert op (~1 byte per weight; active experts decoded each step); ``auto`` decodes when the
decoded experts fit in half the free memory. See ``_quant_moe_fusion``.
"""

from typing import Literal

import torch
from pydantic import Field

from ...ops.quant import formats
from ..interface import TransformRegistry
from ._quant_moe_fusion import QuantMoEFusion, QuantMoEFusionConfig, QuantMoEKind


class FuseFinegrainedFP8MoEConfig(QuantMoEFusionConfig):
    backend: Literal["auto", "decoded", "fp8"] = Field(
        default="auto",
        description="decoded: fine-grained FP8 experts decoded once into the model dtype, grouped GEMMs with the "
        "activations rounded to FP8 per 128 channels (4 bytes per weight in fp32); fp8: kept in FP8 (~1 byte per "
        "weight), each active expert decoded when it runs; auto: decoded when the decoded experts fit in half the "
        "free memory, else fp8.",
    )


@TransformRegistry.register("fuse_finegrained_fp8_moe")
class FuseFinegrainedFP8MoE(QuantMoEFusion):
    config_class = FuseFinegrainedFP8MoEConfig
    kind = QuantMoEKind(
        name="fine-grained FP8", op=torch.ops.autodeploy.torch_quant_finegrained_fp8_moe.default,
        stacked_op=torch.ops.autodeploy.torch_quant_finegrained_fp8_moe_stacked.default,
        buffers=("weight", "weight_scale_inv"), act_quant="fp8_group",
        decode=lambda t, constants: formats.dequantize_fp8_blocks(
            t["weight"], t["weight_scale_inv"], (int(constants[0]), int(constants[1]))),
    )
