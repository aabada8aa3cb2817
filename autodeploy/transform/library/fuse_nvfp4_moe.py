"""``fuse_nvfp4_moe`` (post_load_fusion): how ModelOpt NVFP4 experts run - decoded once, or kept in NVFP4.

``torch_quant_nvfp4_moe`` (from ``quantize_nvfp4_moe_from_config``) becomes, with ``backend:
decoded``, ``grouped_quant_moe_fused`` over the experts decoded once into the model's dtype
(``e2m1(weight) * weight_scale * weight_scale_2``), each GEMM's input rows quantized W4A4-style
(e2m1 per 16 with e4m3 scales relative to the expert's ``input_scale``, ``act_quant: nvfp4``)::

    y = autodeploy.torch_quant_nvfp4_moe(x, sel, w, [gate weights], .., [gate input_scales], .., ..)
  ->
    y = autodeploy.grouped_quant_moe_fused(x, sel, w, P.moe_gate_up_weight, P.moe_down_weight,
                                           P.moe_gate_up_input_scale, P.moe_down_input_scale, None, None,
                                           act, alpha, limit, "nvfp4", 128, bmm_max_pairs)

``backend: nvfp4`` keeps the per-expert op (~0.56 bytes per weight; active experts decoded each
step); ``auto`` decodes when the decoded experts fit in half the free memory. See ``_quant_moe_fusion``.
"""

from typing import Literal

import torch
from pydantic import Field

from ...ops.quant import formats
from ..interface import TransformRegistry
from ._quant_moe_fusion import QuantMoEFusion, QuantMoEFusionConfig, QuantMoEKind


class FuseNVFP4MoEConfig(QuantMoEFusionConfig):
    backend: Literal["auto", "decoded", "nvfp4"] = Field(
        default="auto",
        description="decoded: NVFP4 experts decoded once into the model dtype, grouped GEMMs with the activations "
        "rounded as NVFP4 (4 bytes per weight in fp32); nvfp4: kept in NVFP4 (~0.56 bytes per weight), each active "
        "expert decoded when it runs; auto: decoded when the decoded experts fit in half the free memory, else nvfp4.",
    )


@TransformRegistry.register("fuse_nvfp4_moe")
class FuseNVFP4MoE(QuantMoEFusion):
    config_class = FuseNVFP4MoEConfig
    kind = QuantMoEKind(
        name="ModelOpt NVFP4", op=torch.ops.autodeploy.torch_quant_nvfp4_moe.default,
        stacked_op=torch.ops.autodeploy.torch_quant_nvfp4_moe_stacked.default,
        buffers=("weight", "input_scale", "weight_scale", "weight_scale_2"), act_quant="nvfp4",
        decode=lambda t, constants: formats.dequantize_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"]),
    )
