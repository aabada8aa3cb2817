"""``fuse_fp8_linear`` (post_load_fusion): ``torch_quant_fp8_linear`` -> FP8 activation + float linear.

Before::

    y = autodeploy.torch_quant_fp8_linear(x, P.weight, P.bias, P.input_scale, P.weight_scale)

After::

    xq = autodeploy.torch_quant_fp8_activation(x, P.input_scale)    # e4m3(x / s) * s
    y = aten.linear(xq, P.weight, P.bias)             # P.weight = e4m3 weight * weight_scale, decoded once

The reference op decodes its e4m3 weight on every call; this decodes it once at load into the
deployment dtype (exact in float32) and keeps the static activation quantization, so outputs
equal the reference's up to summation order. See ``_quant_backend`` for why this is the CPU
backend; the plain linear is then packed by ``select_linear_backend``.
"""

import torch
from torch import fx

from ...ops.quant import formats
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_backend import DecodeRule, decode_quantized_linears, first_tensor_args

RULE = DecodeRule(
    op=torch.ops.autodeploy.torch_quant_fp8_linear.default,
    decode=lambda weight, input_scale, weight_scale: formats.dequantize_fp8(weight, weight_scale),
    activation=torch.ops.autodeploy.torch_quant_fp8_activation.default,
    activation_args=first_tensor_args((0,)),
)


class FuseFP8LinearConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True  # the decoded weights are wider than the FP8 ones


@TransformRegistry.register("fuse_fp8_linear")
class FuseFP8Linear(BaseTransform):
    config_class = FuseFP8LinearConfig
    run_after = ("fuse_fp8_gemms",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = decode_quantized_linears(gm, ctx, RULE)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
