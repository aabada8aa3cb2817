"""``quantize_nvfp4_linear_from_config`` (pattern_matcher): ModelOpt NVFP4 linears -> ``torch_quant_nvfp4_linear``.

Applies when the checkpoint declares ``quant_method: modelopt`` with ``quant_algo: NVFP4``
(group 16). Every linear whose checkpoint has a ``weight_scale_2`` is rewritten; the rest stay
float.

Before::

    y = aten.linear(x, P.weight, P.bias)                  # float parameter [N, K]

After::

    y = autodeploy.torch_quant_nvfp4_linear(x, P.weight, P.bias, P.input_scale, P.weight_scale, P.weight_scale_2)
    # P.weight: uint8 [N, K/2] (two e2m1 codes, element 2i low); P.weight_scale: float8_e4m3fn
    # [N, K/16]; P.weight_scale_2, P.input_scale: float32 scalars

NVFP4 quantizes activations too (W4A4): the op rounds its input to e2m1 per 16 values with an
e4m3 scale relative to ``input_scale``, as the format's GPU kernels do. A linear whose K is not a
multiple of 16 cannot be NVFP4 and is refused with its name.
"""

import torch
from torch import fx

from ...ops.quant.formats import NVFP4_GROUP
from ...utils.errors import ModelSourceError
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_from_config import Buffer, CheckpointTensor, LinearFormat, quantize_linears, skip_kv_cache_scales

_SCALE_DTYPES = ("F32", "BF16", "F16")


def _k_error(n: int, k: int):
    return f"NVFP4 groups {NVFP4_GROUP} inputs and {k} is not a multiple of {NVFP4_GROUP}" if k % NVFP4_GROUP else None


NVFP4_LINEAR = LinearFormat(
    name="ModelOpt NVFP4",
    op=torch.ops.autodeploy.torch_quant_nvfp4_linear.default,
    marker="weight_scale_2",
    tensors=(
        CheckpointTensor("weight", ("U8",), lambda n, k: (n, k // 2), "packed e2m1 weight"),
        CheckpointTensor("weight_scale", ("F8_E4M3",), lambda n, k: (n, k // NVFP4_GROUP), "e4m3 scale per 16 inputs"),
        CheckpointTensor("weight_scale_2", _SCALE_DTYPES, None, "per-tensor weight scale"),
        CheckpointTensor("input_scale", _SCALE_DTYPES, None, "static per-tensor input scale"),
    ),
    buffers=(
        Buffer("weight", torch.uint8, lambda n, k: (n, k // 2)),
        Buffer("input_scale", torch.float32, None),
        Buffer("weight_scale", torch.float8_e4m3fn, lambda n, k: (n, k // NVFP4_GROUP)),
        Buffer("weight_scale_2", torch.float32, None),
    ),
    shape_error=_k_error,
)


class QuantizeNVFP4LinearFromConfigConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER


@TransformRegistry.register("quantize_nvfp4_linear_from_config")
class QuantizeNVFP4LinearFromConfig(BaseTransform):
    config_class = QuantizeNVFP4LinearFromConfigConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        info = getattr(ctx.factory, "quantization", None)
        if info is None or info.transform != "quantize_nvfp4_linear_from_config":
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        group = info.config.get("group_size", NVFP4_GROUP)
        if group != NVFP4_GROUP:
            raise ModelSourceError(f"NVFP4 checkpoint declares group_size {group}; NVFP4 groups {NVFP4_GROUP} values")
        count = quantize_linears(gm, ctx, NVFP4_LINEAR)
        skip_kv_cache_scales(gm, ctx, info)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
