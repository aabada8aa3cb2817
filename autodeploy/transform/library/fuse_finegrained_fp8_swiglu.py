"""``fuse_finegrained_fp8_swiglu`` (post_load_fusion): the gate and up projections of a SwiGLU MLP
in fine-grained (block-scaled) FP8 become one GEMM followed by ``torch_silu_and_mul``.

Before (what a quantized Llama/Qwen3 MLP exports to)::

    g = autodeploy.torch_quant_finegrained_fp8_linear(x, Wg, None, Sg, 128, 128)
    u = autodeploy.torch_quant_finegrained_fp8_linear(x, Wu, None, Su, 128, 128)
    h = aten.mul(aten.silu(g), u)

After (concatenated once, at load time, along the output dim)::

    gu = autodeploy.torch_quant_finegrained_fp8_linear(x, cat([Wg, Wu]), None, cat([Sg, Su]), 128, 128)
    h = autodeploy.torch_silu_and_mul(gu)          # silu(gu[..., :n]) * gu[..., n:]

Why: one GEMM over [gate; up] and one per-token activation quantization instead of two, and the
gated activation in one op. The tile scales are local to their 128x128 tile, so the concatenation
changes no value: the result equals the unfused graph up to summation order. That holds only when
gate's output size is a multiple of ``block_n``: otherwise gate's last partial tile and up's
first rows would share one tile row of ``weight_scale_inv`` with two different scales, so such a
pair is left alone (as are pairs whose gate or up has another user, whose block sizes, input
sizes or bias presence differ). The backend ``fuse_finegrained_fp8_linear`` runs after.
"""

from torch import fx

from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_gemm_fusion import FINEGRAINED_FP8, fuse_quant_swiglus


class FuseFinegrainedFP8SwigluConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True  # originals freed as the fused tensors appear (net ~0)


@TransformRegistry.register("fuse_finegrained_fp8_swiglu")
class FuseFinegrainedFP8Swiglu(BaseTransform):
    config_class = FuseFinegrainedFP8SwigluConfig
    requires = ("load_weights",)
    run_after = ("fuse_gemms", "fuse_gemms_mixed_children", "fuse_swiglu")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = fuse_quant_swiglus(gm, FINEGRAINED_FP8)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
