"""``fuse_gemms`` (post_load_fusion): linears that share an input become one GEMM.

Before (every user of ``x`` is such a linear: q/k/v, or gate/up)::

    q = aten.linear(x, wq); k = aten.linear(x, wk); v = aten.linear(x, wv)

After (weights concatenated once, at load time)::

    qkv = aten.linear(x, cat([wq, wk, wv]))
    q, k, v = aten.split_with_sizes(qkv, [nq, nk, nv], -1)

One larger GEMM instead of several small ones: fewer calls and better GEMM efficiency, the
same arithmetic per output element. Linears with different inputs, dtypes or bias presence
stay apart. Peak memory stays at the model plus the largest group (see ``_gemm_fusion``).
"""

from torch import fx

from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._gemm_fusion import fuse_all_groups


class FuseGemmsConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True  # originals freed as the fused weights appear (net ~0)


@TransformRegistry.register("fuse_gemms")
class FuseGemms(BaseTransform):
    config_class = FuseGemmsConfig
    requires = ("load_weights",)
    run_after = ("match_swiglu_pattern",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = fuse_all_groups(gm, mixed=False)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
