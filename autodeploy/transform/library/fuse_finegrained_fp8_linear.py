"""``fuse_finegrained_fp8_linear`` (post_load_fusion): ``torch_quant_finegrained_fp8_linear`` ->
per-group FP8 activation + float linear.

Before::

    y = autodeploy.torch_quant_finegrained_fp8_linear(x, P.weight, P.bias, P.weight_scale_inv, 128, 128)

After::

    xq = autodeploy.torch_quant_fp8_group_activation(x, 128)   # e4m3 per token per 128 channels
    y = aten.linear(xq, P.weight, P.bias)        # P.weight = e4m3 weight * its tile's scale, decoded once

See ``_quant_backend`` for why decoding once is the CPU backend and what it costs in memory.
"""

import torch
from torch import fx

from ...ops.quant import formats
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_backend import DecodeRule, decode_quantized_linears

RULE = DecodeRule(
    op=torch.ops.autodeploy.torch_quant_finegrained_fp8_linear.default,
    decode=lambda weight, scale_inv, block_n=128, block_k=128: formats.dequantize_fp8_blocks(
        weight, scale_inv, (block_n, block_k)),
    activation=torch.ops.autodeploy.torch_quant_fp8_group_activation.default,
    activation_args=lambda rest: (rest[2] if len(rest) > 2 else 128,),
)


class FuseFinegrainedFP8LinearConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True


@TransformRegistry.register("fuse_finegrained_fp8_linear")
class FuseFinegrainedFP8Linear(BaseTransform):
    config_class = FuseFinegrainedFP8LinearConfig
    run_after = ("fuse_finegrained_fp8_swiglu", "quantize_weights")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = decode_quantized_linears(gm, ctx, RULE)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
