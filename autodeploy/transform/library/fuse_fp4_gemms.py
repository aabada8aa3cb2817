"""``fuse_fp4_gemms`` (post_load_fusion): NVFP4 linears that share an input become one GEMM.

Before (every user of ``x`` is such a linear; all with the same input scale)::

    q = autodeploy.torch_quant_nvfp4_linear(x, Wq, None, s_in, Bq, gq)   # W: e2m1 codes, B: e4m3 per 16, g: per tensor
    k = autodeploy.torch_quant_nvfp4_linear(x, Wk, None, s_in, Bk, gk)

After (tensors concatenated once, at load time)::

    qk = autodeploy.torch_quant_nvfp4_linear(x, cat([Wq, Wk]), None, s_in, cat([Bq, Bk]), g)
    q, k = aten.split_with_sizes(qk, [nq, nk], -1)
    # g = cat([gq repeated nq times, gk x nk]): float32 [nq + nk], one weight_scale_2 per output row

Why: one GEMM and one activation quantization instead of several. The fusion is exact: the e2m1
codes and the e4m3 block scales are concatenated unchanged and ``weight_scale_2`` becomes a
per-row vector (each linear's scale over its rows), so the fused graph equals the unfused one up
to float summation order (bit for bit on the CPU test checkpoints). When all the group's
``weight_scale_2`` are equal it stays that 0-d scalar.

TensorRT-LLM instead takes the largest ``g`` and rescales the others' block scales,
``B_i' = e4m3(B_i * g_i / g)``, rounding every block scale of those linears a second time. The
previous version of this transform did that; measured on the tiny Llama test checkpoint it moved
a re-rounded weight by up to 2.5% relative RMS and the logits by 13.5% relative RMS against the
unfused graph (W4A4 activation rounding amplifies any weight change on that tiny random model),
for nothing on the CPU, whose backend decodes the weight to float anyway. Linears whose input
scales differ, or with mixed bias, are left alone. ``fuse_nvfp4_swiglu`` runs first (it claims
the gate/up pairs of a SwiGLU); the backend ``fuse_nvfp4_linear`` (which decodes a per-row
``weight_scale_2`` as well) runs after.
"""

from torch import fx

from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_gemm_fusion import NVFP4, fuse_quant_gemms


class FuseFP4GemmsConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True  # originals freed as the fused tensors appear (net ~0)


@TransformRegistry.register("fuse_fp4_gemms")
class FuseFP4Gemms(BaseTransform):
    config_class = FuseFP4GemmsConfig
    requires = ("load_weights",)
    run_after = ("fuse_gemms", "fuse_gemms_mixed_children", "fuse_swiglu", "fuse_nvfp4_swiglu")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = fuse_quant_gemms(gm, NVFP4)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
