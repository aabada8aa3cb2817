"""``fuse_fp8_gemms`` (post_load_fusion): FP8 per-tensor linears that share an input become one GEMM.

Before (every user of ``x`` is such a linear: q/k/v, or gate/up; all with the same input scale)::

    q = autodeploy.torch_quant_fp8_linear(x, Wq, None, s_in, sq)   # W: e4m3 [n, K]; s_in, sq: per tensor
    k = autodeploy.torch_quant_fp8_linear(x, Wk, None, s_in, sk)
    v = autodeploy.torch_quant_fp8_linear(x, Wv, None, s_in, sv)

After (tensors concatenated once, at load time)::

    qkv = autodeploy.torch_quant_fp8_linear(x, cat([Wq, Wk, Wv]), None, s_in, s)
    q, k, v = aten.split_with_sizes(qkv, [nq, nk, nv], -1)
    # s = cat([sq repeated nq times, sk x nk, sv x nv]): float32 [nq + nk + nv], one scale per output row

Why: one larger GEMM instead of several small ones, and the activation quantized once instead of
once per linear. The fusion is exact: the e4m3 codes are concatenated unchanged and each row keeps
its own linear's scale (``weight_scale`` becomes a per-row vector), so the fused graph equals the
unfused one up to float summation order (bit for bit on the CPU test checkpoints). When all the
group's weight scales are equal, ``weight_scale`` stays that 0-d scalar.

TensorRT-LLM instead re-quantizes every weight to the common ``max(s_i)``,
``W_i' = e4m3(W_i * s_i / s)``, rounding all but one weight a second time on a coarser grid. The
previous version of this transform did that; measured on the tiny Llama test checkpoint it moved
a re-rounded weight by up to 2.8% relative RMS (as much as its own FP8 rounding) and the logits by
4.4% relative RMS against the unfused graph, changing greedy tokens at near-ties, for nothing on
the CPU (its backend decodes the weight to float anyway); on Hopper ``_scaled_mm`` takes row-wise
scales natively. Linears whose input scales differ are left alone (they quantize their input
differently), as are groups with mixed bias or different input sizes. The activation-quant +
float-GEMM backend (``fuse_fp8_linear``, which decodes a per-row scale as well) runs after;
``fuse_silu_mul`` (after this in the pipeline) turns a fused gate/up split into ``silu_and_mul``.
"""

from torch import fx

from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_gemm_fusion import FP8, fuse_quant_gemms


class FuseFP8GemmsConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True  # originals freed as the fused tensors appear (net ~0)


@TransformRegistry.register("fuse_fp8_gemms")
class FuseFP8Gemms(BaseTransform):
    config_class = FuseFP8GemmsConfig
    requires = ("load_weights",)
    run_after = ("fuse_gemms", "fuse_gemms_mixed_children", "fuse_swiglu")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = fuse_quant_gemms(gm, FP8)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
