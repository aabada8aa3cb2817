"""``fuse_rmsnorm`` (post_load_fusion): choose the RMSNorm implementation.

Before::

    y = autodeploy.torch_rmsnorm(x, w, eps)                 # reference: several aten kernels
    y, s = autodeploy.torch_fused_add_rmsnorm(x, r, w, eps)

After (``backend: compile``)::

    y = autodeploy.compiled_rmsnorm(x, w, eps)              # one inductor-generated kernel
    y, s = autodeploy.compiled_fused_add_rmsnorm(x, r, w, eps)

Backends: ``torch`` (keep the reference ops) and ``compile`` (CPU and CUDA). Which one is
faster depends on the machine; ``benchmarks/bench_transforms.py`` measures it. A Triton kernel
for CUDA is not implemented yet (no GPU to verify it on).
"""

from typing import Literal

import torch
from pydantic import Field
from torch import fx

from ..graph_utils import is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

ad = torch.ops.autodeploy


class FuseRMSNormConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    backend: Literal["torch", "compile"] = Field(default="torch", description="RMSNorm implementation.")


@TransformRegistry.register("fuse_rmsnorm")
class FuseRMSNorm(BaseTransform):
    config_class = FuseRMSNormConfig
    run_after = ("fuse_add_rms_norm",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        cfg: FuseRMSNormConfig = self.config  # type: ignore[assignment]
        if cfg.backend == "torch":
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True)
        swap = {ad.torch_rmsnorm.default: ad.compiled_rmsnorm.default,
                ad.torch_fused_add_rmsnorm.default: ad.compiled_fused_add_rmsnorm.default}
        count = 0
        for node in gm.graph.nodes:
            if is_op(node, (ad.torch_rmsnorm, ad.torch_fused_add_rmsnorm)):
                node.target = swap[node.target]
                count += 1
        return TransformInfo(num_matches=count, is_clean=True, has_valid_shapes=True)
