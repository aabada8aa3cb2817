"""``quantize_finegrained_fp8_moe_from_config`` (pattern_matcher): fine-grained FP8 experts ->
``torch_quant_finegrained_fp8_moe`` (or ``torch_quant_finegrained_fp8_moe_stacked``).

Applies with ``quantize_finegrained_fp8_linear_from_config`` (``quant_method: fp8``, DeepSeek-V3
and Qwen3-MoE-FP8). Those checkpoints store every routed expert's projections as fine-grained FP8
linears (``...mlp.experts.<e>.gate_proj.weight`` e4m3 with ``weight_scale_inv``, one scale per
``weight_block_size`` tile), so a MoE layer whose expert weights have a ``weight_scale_inv``
becomes the per-expert op; the others (and the router) stay float.

Before::

    y = autodeploy.torch_moe(x, sel, w, [E.0.gate_proj.weight, ..], [E.0.up_proj.weight, ..],
                             [E.0.down_proj.weight, ..], [], [], [], "silu", 1.0, 0.0)

After::

    y = autodeploy.torch_quant_finegrained_fp8_moe(x, sel, w, [gate weights], [up ..], [down ..],
                                                   [gate weight_scale_invs], [up ..], [down ..], 128, 128,
                                                   "silu", 1.0, 0.0)
        # weights float8_e4m3fn [I, H] / [H, I]; weight_scale_inv float32 [ceil(I/128), ceil(H/128)], ...

Each expert tensor is checked against the safetensors headers as a linear's would be (present,
dtype, tile count) before anything loads; a static activation scheme or a malformed block size is
refused as for the linears. ``fuse_finegrained_fp8_moe`` then chooses how the experts run.

Exported stacked (the default ``experts_layout``; ``E`` the experts module)::

    y = autodeploy.torch_moe_fused(x, sel, w, E.gate_up_proj, E.down_proj, None, None, "silu", 1.0, 0.0)
  ->
    y = autodeploy.torch_quant_finegrained_fp8_moe_stacked(x, sel, w, E.gate_weight, E.up_weight, E.down_weight,
        E.gate_weight_scale_inv, .., 128, 128, "silu", 1.0, 0.0)
        # one [num_experts, ...] buffer per list above, loaded from the experts' tensors in order
"""

import torch
from torch import fx

from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_from_config import quantize_moe_experts
from .quantize_finegrained_fp8_linear_from_config import declared_block, finegrained_fp8_format


class QuantizeFinegrainedFP8MoEFromConfigConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER


@TransformRegistry.register("quantize_finegrained_fp8_moe_from_config")
class QuantizeFinegrainedFP8MoEFromConfig(BaseTransform):
    config_class = QuantizeFinegrainedFP8MoEFromConfigConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        info = getattr(ctx.factory, "quantization", None)
        if info is None or info.transform != "quantize_finegrained_fp8_linear_from_config":
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        fmt = finegrained_fp8_format(declared_block(info))
        count = quantize_moe_experts(gm, ctx, fmt, torch.ops.autodeploy.torch_quant_finegrained_fp8_moe.default,
                                     torch.ops.autodeploy.torch_quant_finegrained_fp8_moe_stacked.default)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
