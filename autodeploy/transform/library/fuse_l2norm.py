"""``fuse_l2norm`` (post_load_fusion): choose the implementation of ``torch_l2norm``.

Before::

    y = autodeploy.torch_l2norm(x, eps)         # reference: x * rsqrt(sum(x*x, -1) + eps), five aten ops

After (``backend: native``, the ``auto`` choice on CPU when autodeploy's kernels build)::

    y = autodeploy.native_l2norm(x, eps)        # autodeploy's RMSNorm C loop with weight d^-1/2, eps/d

Backends: ``torch`` (keep the reference op) and ``native`` (CPU, float32; other inputs run the
reference inside the op; see ``ops/l2norm.py``: the same function up to a few fp32 ulps).
``auto`` picks ``native`` on CPU when the kernels are available and the graph is not for
``torch-compile`` (whose inductor fuses the reference itself), else ``torch``.

Measured on this project's 2-core CPU (float32, q/k-shaped ``[b, s, heads, 128]``, both called
as ops, best of 9-15 runs; the machine was shared, so the larger sizes varied up to 2x between
runs, native ahead in every run): one decode token of 16 heads 22 -> 15 us, 8 decode tokens
26 -> 19 us, 64 tokens of 32 heads 79 -> 51 us, 512 tokens of 16 heads 185 -> 128 us. A strided
input (a slice of a fused projection) is copied first and gains little (252 -> 242 us at
64 x 32). Also measured and not offered, against a reference at 30 / 26 / 79 / 215 us in the same
run: ``torch.compile`` of the reference (slower: 263-670 / 55 / 95 / 251 us, its dynamic-shape
guards dominating at decode sizes) and a ``linalg.vector_norm`` expression with an in-place
epilogue (22 / 25 / 64 / 158 us: faster than the reference, slower than native). Timing script:
not in the repository (a loop of ``perf_counter`` over the two ops). A GPU implementation is not
there yet: on CUDA ``auto`` keeps the reference.
"""

from typing import Literal

import torch
from pydantic import Field
from torch import fx

from ...ops import l2norm as _l2norm_ops  # noqa: F401  (registers autodeploy::native_l2norm)
from ...ops import native  # noqa: F401  (registers the native_* ops)
from ..graph_utils import is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._native_backend import TORCH_REASON, resolve_native_backend

ad = torch.ops.autodeploy
_BACKEND_OPS = {"native": ad.native_l2norm}


class FuseL2NormConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    backend: Literal["auto", "torch", "native"] = Field(
        default="auto",
        description="L2-norm implementation: auto (native on CPU when autodeploy's C kernels build and the graph "
        "is not for torch-compile, else torch), torch (the reference op), native (autodeploy's CPU RMSNorm kernel "
        "scaled to an L2 norm; float32 rows, anything else runs the reference).",
    )


@TransformRegistry.register("fuse_l2norm")
class FuseL2Norm(BaseTransform):
    config_class = FuseL2NormConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        backend = self._resolve(ctx)
        if backend == "torch":
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True, reason=TORCH_REASON)
        target = _BACKEND_OPS[backend].default
        count = 0
        for node in gm.graph.nodes:
            if is_op(node, ad.torch_l2norm):
                node.target = target
                count += 1
        return TransformInfo(num_matches=count, is_clean=True, has_valid_shapes=True)

    def _resolve(self, ctx: PipelineContext) -> str:
        return resolve_native_backend(self.config.backend, ctx, "fuse_l2norm")  # type: ignore[attr-defined]
