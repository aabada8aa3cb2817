"""``fuse_nvfp4_linear`` (post_load_fusion): ``torch_quant_nvfp4_linear`` -> NVFP4 activation + float linear.

Before::

    y = autodeploy.torch_quant_nvfp4_linear(x, P.weight, P.bias, P.input_scale, P.weight_scale, P.weight_scale_2)

After::

    xq = autodeploy.torch_quant_nvfp4_activation(x, P.input_scale)   # e2m1 per 16, e4m3 block scales
    y = aten.linear(xq, P.weight, P.bias)      # P.weight = e2m1 * block scale * weight_scale_2, decoded once

NVFP4 needs a Blackwell GPU for its native GEMM; everywhere else (CPU, Hopper) the weight is
decoded once and the activations keep NVFP4's rounding. See ``_quant_backend``.
"""

import torch
from torch import fx

from ...ops.quant import formats
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_backend import DecodeRule, decode_quantized_linears, first_tensor_args

RULE = DecodeRule(
    op=torch.ops.autodeploy.torch_quant_nvfp4_linear.default,
    decode=lambda weight, input_scale, weight_scale, weight_scale_2: formats.dequantize_nvfp4(
        weight, weight_scale, weight_scale_2),
    activation=torch.ops.autodeploy.torch_quant_nvfp4_activation.default,
    activation_args=first_tensor_args((0,)),
)


class FuseNVFP4LinearConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True


@TransformRegistry.register("fuse_nvfp4_linear")
class FuseNVFP4Linear(BaseTransform):
    config_class = FuseNVFP4LinearConfig
    run_after = ("fuse_fp4_gemms", "fuse_nvfp4_swiglu")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = decode_quantized_linears(gm, ctx, RULE)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
