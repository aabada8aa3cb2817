"""``quantize_nvfp4_moe_from_config`` (pattern_matcher): ModelOpt NVFP4 experts -> ``torch_quant_nvfp4_moe``
(or ``torch_quant_nvfp4_moe_stacked``).

Applies with ``quantize_nvfp4_linear_from_config`` (``quant_method: modelopt``, ``quant_algo:
NVFP4``). ModelOpt stores every routed expert's projections as NVFP4 linears
(``...mlp.experts.<e>.gate_proj.weight`` uint8 [I, H/2], ``weight_scale`` e4m3 [I, H/16],
``weight_scale_2`` and the expert's own ``input_scale``), so a MoE layer whose expert weights
have a ``weight_scale_2`` becomes the per-expert NVFP4 MoE op; the others stay float.

Before::

    y = autodeploy.torch_moe(x, sel, w, [E.0.gate_proj.weight, ..], [E.0.up_proj.weight, ..],
                             [E.0.down_proj.weight, ..], [], [], [], "silu", 1.0, 0.0)

After::

    y = autodeploy.torch_quant_nvfp4_moe(x, sel, w, [gate weights], [up ..], [down ..],
                                         [gate input_scales], .., [gate weight_scales], ..,
                                         [gate weight_scale_2s], .., "silu", 1.0, 0.0)

Each expert tensor is checked against the safetensors headers as a linear's would be (present,
dtype, shape; inputs a multiple of 16) before anything loads. ``fuse_nvfp4_moe`` then chooses how
the experts run.

Exported stacked (the default ``experts_layout``; ``E`` the experts module)::

    y = autodeploy.torch_moe_fused(x, sel, w, E.gate_up_proj, E.down_proj, None, None, "silu", 1.0, 0.0)
  ->
    y = autodeploy.torch_quant_nvfp4_moe_stacked(x, sel, w, E.gate_weight, E.up_weight, E.down_weight,
        E.gate_input_scale, .., E.gate_weight_scale, .., E.gate_weight_scale_2, .., "silu", 1.0, 0.0)
        # one [num_experts, ...] buffer per list above, loaded from the experts' tensors in order
"""

import torch
from torch import fx

from ...ops.quant.formats import NVFP4_GROUP
from ...utils.errors import ModelSourceError
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_from_config import quantize_moe_experts
from .quantize_nvfp4_linear_from_config import NVFP4_LINEAR


class QuantizeNVFP4MoEFromConfigConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER


@TransformRegistry.register("quantize_nvfp4_moe_from_config")
class QuantizeNVFP4MoEFromConfig(BaseTransform):
    config_class = QuantizeNVFP4MoEFromConfigConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        info = getattr(ctx.factory, "quantization", None)
        if info is None or info.transform != "quantize_nvfp4_linear_from_config":
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        group = info.config.get("group_size", NVFP4_GROUP)
        if group != NVFP4_GROUP:
            raise ModelSourceError(f"NVFP4 checkpoint declares group_size {group}; NVFP4 groups {NVFP4_GROUP} values")
        count = quantize_moe_experts(gm, ctx, NVFP4_LINEAR, torch.ops.autodeploy.torch_quant_nvfp4_moe.default,
                                     torch.ops.autodeploy.torch_quant_nvfp4_moe_stacked.default)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
