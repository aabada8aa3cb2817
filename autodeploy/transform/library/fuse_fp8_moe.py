"""``fuse_fp8_moe`` (post_load_fusion): how ModelOpt FP8 experts run - decoded once, or kept in FP8.

``torch_quant_fp8_moe`` (from ``quantize_fp8_moe_from_config``) becomes, with ``backend:
decoded``, ``grouped_quant_moe_fused`` over the experts decoded once into the model's dtype
(``weight.float() * weight_scale``), each GEMM's input rows quantized to e4m3 with the expert's
static input scale (``act_quant: fp8``)::

    y = autodeploy.torch_quant_fp8_moe(x, sel, w, [gate weights], .., [gate input_scales], .., [gate weight_scales], ..)
  ->
    y = autodeploy.grouped_quant_moe_fused(x, sel, w, P.moe_gate_up_weight, P.moe_down_weight,
                                           P.moe_gate_up_input_scale, P.moe_down_input_scale, None, None,
                                           act, alpha, limit, "fp8", 128, bmm_max_pairs)

``backend: fp8`` keeps the per-expert op (1 byte per weight; active experts decoded each step);
``auto`` decodes when the decoded experts fit in half the free memory. See ``_quant_moe_fusion``.
"""

from typing import Literal

import torch
from pydantic import Field

from ...ops.quant import formats
from ..interface import TransformRegistry
from ._quant_moe_fusion import QuantMoEFusion, QuantMoEFusionConfig, QuantMoEKind


class FuseFP8MoEConfig(QuantMoEFusionConfig):
    backend: Literal["auto", "decoded", "fp8"] = Field(
        default="auto",
        description="decoded: FP8 experts decoded once into the model dtype, grouped GEMMs with the activations "
        "rounded to FP8 (4 bytes per weight in fp32); fp8: kept in FP8 (1 byte per weight), each active expert "
        "decoded when it runs; auto: decoded when the decoded experts fit in half the free memory, else fp8.",
    )


@TransformRegistry.register("fuse_fp8_moe")
class FuseFP8MoE(QuantMoEFusion):
    config_class = FuseFP8MoEConfig
    kind = QuantMoEKind(
        name="ModelOpt FP8", op=torch.ops.autodeploy.torch_quant_fp8_moe.default,
        buffers=("weight", "input_scale", "weight_scale"), act_quant="fp8",
        decode=lambda t, constants: formats.dequantize_fp8(t["weight"], t["weight_scale"]),
    )
