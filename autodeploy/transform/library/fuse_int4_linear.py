"""``fuse_int4_linear`` (post_load_fusion): ``torch_quant_int4_linear`` -> a fast implementation.

Before::

    y = autodeploy.torch_quant_int4_linear(x, W.q, b, ...)     # the reference: decodes W on every call

After (per weight, ``backend: auto`` measures which is faster on this CPU)::

    y = autodeploy.cpu_int4pack_linear(x, W.packed, ..., b)    # torch's packed CPU kernel
    # or
    y = aten.linear(x, W.weight, b)                           # decoded once (then oneDNN-packed)

The weights come from a INT4 checkpoint (GPTQ / AWQ / compressed-tensors for int4) or from
``quantize_weights``. See ``_weight_only_backend`` for the choice and its precision.
"""

from torch import fx

from ..interface import BaseTransform, PipelineContext, TransformInfo, TransformRegistry
from ._weight_only_backend import INT4, WeightOnlyBackendConfig, select_weight_only_backend


class FuseINT4LinearConfig(WeightOnlyBackendConfig):
    expect_mem_change: bool = True  # packed or decoded weights replace the canonical ones


@TransformRegistry.register("fuse_int4_linear")
class FuseINT4Linear(BaseTransform):
    config_class = FuseINT4LinearConfig
    run_after = ("quantize_weights",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = select_weight_only_backend(gm, ctx, INT4, self.config.backend)  # type: ignore[attr-defined]
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
