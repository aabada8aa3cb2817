"""``fuse_rmsnorm_quant_nvfp4`` (post_load_fusion): an RMSNorm emits the NVFP4 input of the linears it feeds.

Before (a ModelOpt NVFP4 Llama layer after ``fuse_nvfp4_linear``, ``fuse_add_rms_norm`` and
``fuse_rmsnorm``)::

    y, s = autodeploy.native_fused_add_rmsnorm(h, r, P.norm_w, eps)
    yg = autodeploy.torch_quant_nvfp4_activation(y, P.gate_proj.input_scale)   # equal scales:
    yu = autodeploy.torch_quant_nvfp4_activation(y, P.up_proj.input_scale)     # the same values twice
    g = aten.linear(yg, ...); u = aten.linear(yu, ...)

After::

    y4, s = autodeploy.native_fused_add_rmsnorm_quant_nvfp4(h, r, P.norm_w, eps, P.gate_proj.input_scale)
    g = aten.linear(y4, ...); u = aten.linear(y4, ...)

The same rule as ``fuse_rmsnorm_quant_fp8`` (whose module holds the shared matching code and
describes the norm forms handled): every user of the normed output must be an NVFP4 activation
quantization with an equal ``input_scale`` value, else the norm is left alone. NVFP4's scales
are per 16 values of a row relative to the calibrated ``input_scale``, so one quantization of
the normed tensor is exactly what each linear computed on its own.

Why: on a GPU (Blackwell) the norm kernel writes e2m1 values and e4m3 block scales directly. On
the CPU the duplicate quantizations go, and NVFP4's emulated rounding is the dearest
elementwise pass of the layer: measured on the ``small`` preset's shapes (hidden 768; 2-core AMD
EPYC, one thread, native norms, interleaved rounds, medians), a norm feeding q/k/v took
626 -> 222 us at one row, 827 -> 292 us at 8 rows and 1503 -> 505 us at 32; one feeding gate/up
432 -> 219 us at one row: ~7 ms of a batch-1 decode step of the 12-layer model.
"""

import torch
from torch import fx

from ...ops.quant import fused  # noqa: F401  (registers the fused ops)
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_norm_fusion import fuse_norm_quant

ad = torch.ops.autodeploy

PLAIN_NVFP4 = {ad.torch_rmsnorm.default: ad.torch_rmsnorm_quant_nvfp4.default,
               ad.native_rmsnorm.default: ad.native_rmsnorm_quant_nvfp4.default}
ADD_NVFP4 = {ad.torch_fused_add_rmsnorm.default: ad.torch_fused_add_rmsnorm_quant_nvfp4.default,
             ad.native_fused_add_rmsnorm.default: ad.native_fused_add_rmsnorm_quant_nvfp4.default}


class FuseRMSNormQuantNVFP4Config(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION


@TransformRegistry.register("fuse_rmsnorm_quant_nvfp4")
class FuseRMSNormQuantNVFP4(BaseTransform):
    config_class = FuseRMSNormQuantNVFP4Config
    run_after = ("fuse_nvfp4_linear", "fuse_add_rms_norm", "fuse_rmsnorm")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = fuse_norm_quant(gm, ad.torch_quant_nvfp4_activation, PLAIN_NVFP4, ADD_NVFP4, self._key)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=count == 0)
