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
from ._gemm_fusion import fuse_all_groups


class FuseGemmsMixedConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True


@TransformRegistry.register("fuse_gemms_mixed_children")
class FuseGemmsMixedChildren(BaseTransform):
    config_class = FuseGemmsMixedConfig
    requires = ("load_weights",)
    run_after = ("fuse_gemms",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = fuse_all_groups(gm, mixed=True)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
