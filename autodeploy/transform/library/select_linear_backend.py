"""``select_linear_backend`` (post_load_fusion): choose the GEMM implementation of plain linears.

Before::

    y = aten.linear(x, w, b)

After (``backend: blas``, CPU, float32 weights)::

    y = autodeploy.blas_linear(x, w, b)        # NumPy's OpenBLAS instead of torch's BLAS

Why: on the 2-core AVX2 machines measured here, OpenBLAS runs fp32 matrix-vector products
(decode at batch 1) at about twice the weight bandwidth of torch's BLAS and small batches
5-15% faster. But two thread pools then share the cores: with the default OpenMP wait policy
torch's threads spin while OpenBLAS works and the model got 3.7x *slower*; with
``OMP_WAIT_POLICY=PASSIVE`` set before Python starts, batch-1 decode of the ``small`` preset
went from 47.6 ms (torch backend, default policy) to 38.8 ms (benchmarks/RESULTS.md). So it is
off by default and warns without that setting. Linears whose weight is not a float32
parameter, or graphs on another device, are left alone.
"""

import os
from typing import Literal

import torch
from pydantic import Field
from torch import fx

from ...utils.logging import get_logger
from ..graph_utils import get_attr_value, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

aten = torch.ops.aten
logger = get_logger(__name__)


class SelectLinearBackendConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    backend: Literal["torch", "blas"] = Field(default="torch", description="GEMM implementation for aten.linear.")


@TransformRegistry.register("select_linear_backend")
class SelectLinearBackend(BaseTransform):
    config_class = SelectLinearBackendConfig
    run_after = ("fuse_gemms", "fuse_gemms_mixed_children", "fuse_swiglu")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        cfg: SelectLinearBackendConfig = self.config  # type: ignore[assignment]
        if cfg.backend == "torch" or torch.device(ctx.device).type != "cpu":
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True)
        if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
            logger.warning(
                "linear backend 'blas' without OMP_WAIT_POLICY=PASSIVE in the environment: torch's and "
                "OpenBLAS's threads will contend (measured 3.7x slower); set it before starting Python"
            )
        count = 0
        for node in gm.graph.nodes:
            if not is_op(node, aten.linear) or not isinstance(node.args[1], fx.Node) or node.args[1].op != "get_attr":
                continue
            if get_attr_value(gm, node.args[1]).dtype != torch.float32:
                continue
            node.target = torch.ops.autodeploy.blas_linear.default
            count += 1
        return TransformInfo(num_matches=count, is_clean=True, has_valid_shapes=True)
