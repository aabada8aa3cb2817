"""``fuse_gemms_mixed_children`` (post_load_fusion): as ``fuse_gemms`` when the shared input also
has users that are not linears.

Before::

    a = aten.linear(x, wa); b = aten.linear(x, wb); c = aten.relu(x)

After::

    ab = aten.linear(x, cat([wa, wb]))
    a = aten.narrow(ab, -1, 0, na); b = aten.narrow(ab, -1, na, nb); c = aten.relu(x)

The other users keep reading ``x``; the split uses ``narrow`` views (no copies).
"""

from torch import fx

from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._gemm_fusion import fuse_group, linear_groups


class FuseGemmsMixedConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True


@TransformRegistry.register("fuse_gemms_mixed_children")
class FuseGemmsMixedChildren(BaseTransform):
    config_class = FuseGemmsMixedConfig
    requires = ("load_weights",)
    run_after = ("fuse_gemms",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        groups = linear_groups(gm, mixed=True)
        for parent, linears in groups:
            fuse_group(gm, parent, linears, narrow=True)
        return TransformInfo(num_matches=len(groups), is_clean=not groups, has_valid_shapes=not groups)
