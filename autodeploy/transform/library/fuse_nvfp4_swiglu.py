"""``fuse_nvfp4_swiglu`` (post_load_fusion): the gate and up projections of a SwiGLU MLP in NVFP4
become one GEMM followed by ``torch_silu_and_mul``.

Before::

    g = autodeploy.torch_quant_nvfp4_linear(x, Wg, None, s_in, Bg, gg)
    u = autodeploy.torch_quant_nvfp4_linear(x, Wu, None, s_in, Bu, gu)
    h = aten.mul(aten.silu(g), u)

After (concatenated once, at load time)::

    gate_up = autodeploy.torch_quant_nvfp4_linear(x, cat([Wg, Wu]), None, s_in, cat([Bg, Bu]), s)
    h = autodeploy.torch_silu_and_mul(gate_up)
    # s = cat([gg repeated n times, gu x n]): float32 [2n] (the scalar when gg == gu)

Why: one GEMM over [gate; up] and one W4A4 activation quantization instead of two, and the gated
activation in one op. NVFP4 rows are independent (scales per 16 values along K), so the codes and
block scales concatenate unchanged; what one op needs is one ``input_scale`` (pairs whose input
scales differ are left alone), and ``weight_scale_2`` becomes a per-row vector, so the result is
the unfused graph's up to summation order (the rule is ``fuse_fp4_gemms``'; rescaling the other
projection's block scales to the larger ``weight_scale_2`` and rounding them again, as
TensorRT-LLM does and the previous version did, moved the tiny Llama test checkpoint's logits by
8.9% relative RMS). Pairs whose gate or up has another user are left alone. Runs before
``fuse_fp4_gemms`` (which would otherwise take gate/up as a plain group) and before the backend
``fuse_nvfp4_linear``.
"""

from torch import fx

from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_gemm_fusion import NVFP4, fuse_quant_swiglus


class FuseNVFP4SwigluConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True  # originals freed as the fused tensors appear (net ~0)


@TransformRegistry.register("fuse_nvfp4_swiglu")
class FuseNVFP4Swiglu(BaseTransform):
    config_class = FuseNVFP4SwigluConfig
    requires = ("load_weights",)
    run_after = ("fuse_gemms", "fuse_gemms_mixed_children", "fuse_swiglu")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = fuse_quant_swiglus(gm, NVFP4)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
