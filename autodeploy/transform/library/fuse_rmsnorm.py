"""``fuse_rmsnorm`` (post_load_fusion): choose the RMSNorm implementation.

Before::

    y = autodeploy.torch_rmsnorm(x, w, eps)                 # reference: several aten kernels
    y, s = autodeploy.torch_fused_add_rmsnorm(x, r, w, eps)

After (``backend: compile``)::

    y = autodeploy.compiled_rmsnorm(x, w, eps)              # one inductor-generated kernel
    y, s = autodeploy.compiled_fused_add_rmsnorm(x, r, w, eps)

After (``backend: native``, the ``auto`` choice on CPU when autodeploy's kernels build)::

    y = autodeploy.native_rmsnorm(x, w, eps)                # one C loop (ops/csrc/rmsnorm_f32.c)
    y, s = autodeploy.native_fused_add_rmsnorm(x, r, w, eps)

Backends: ``torch`` (keep the reference ops), ``compile`` (CPU and CUDA) and ``native`` (CPU,
float32, or bfloat16 rounded where the reference rounds; other inputs run the reference inside
the op). Why native by default on CPU: at decode
sizes the reference's six ops cost their dispatches, not their arithmetic: a fused add+norm
measured 17 -> 6 us at one row of 768 and 28 -> 13 us at 32 rows (two norms per layer). ``auto`` keeps the
reference where native is not available or not for CPU, and under ``torch-compile``, whose
inductor fuses the reference ops itself. A Triton kernel for CUDA is not implemented yet (no
GPU to verify it on).
"""

from typing import Literal

import torch
from pydantic import Field
from torch import fx

from ...ops import native  # noqa: F401  (registers the native_* ops)
from ..graph_utils import is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._native_backend import TORCH_REASON, resolve_native_backend

ad = torch.ops.autodeploy
# backend -> (plain norm, fused add+norm)
_BACKEND_OPS = {"compile": (ad.compiled_rmsnorm, ad.compiled_fused_add_rmsnorm),
                "native": (ad.native_rmsnorm, ad.native_fused_add_rmsnorm)}


class FuseRMSNormConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    backend: Literal["auto", "torch", "compile", "native"] = Field(
        default="auto",
        description="RMSNorm implementation: auto (native on CPU when autodeploy's C kernels build and the graph "
        "is not for torch-compile, else torch), torch (the reference ops), compile (inductor kernels), native "
        "(autodeploy's CPU kernel; float32 or bfloat16 rows, anything else runs the reference).",
    )


@TransformRegistry.register("fuse_rmsnorm")
class FuseRMSNorm(BaseTransform):
    config_class = FuseRMSNormConfig
    run_after = ("fuse_add_rms_norm",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        backend = self._resolve(ctx)
        if backend == "torch":
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True, reason=TORCH_REASON)
        swap = {ad.torch_rmsnorm.default: _BACKEND_OPS[backend][0].default,
                ad.torch_fused_add_rmsnorm.default: _BACKEND_OPS[backend][1].default}
        count = 0
        for node in gm.graph.nodes:
            if is_op(node, (ad.torch_rmsnorm, ad.torch_fused_add_rmsnorm)):
                node.target = swap[node.target]
                count += 1
        return TransformInfo(num_matches=count, is_clean=True, has_valid_shapes=True)

    def _resolve(self, ctx: PipelineContext) -> str:
        return resolve_native_backend(self.config.backend, ctx, "fuse_rmsnorm")  # type: ignore[attr-defined]
