"""``quantize_fp8_linear_from_config`` (pattern_matcher): ModelOpt FP8 linears -> ``torch_quant_fp8_linear``.

Applies when the checkpoint declares ``quant_method: modelopt`` with ``quant_algo: FP8``
(``config.json`` or ``hf_quant_config.json``). Every linear whose checkpoint has a
``weight_scale`` next to its weight is rewritten; the others (``exclude_modules``: lm_head,
routers, ...) stay float.

Before::

    y = aten.linear(x, P.weight, P.bias)                  # float parameter [N, K]

After::

    y = autodeploy.torch_quant_fp8_linear(x, P.weight, P.bias, P.input_scale, P.weight_scale)
    # P.weight: float8_e4m3fn [N, K]; P.input_scale, P.weight_scale: float32 scalars (buffers)

The checkpoint tensors already have the op's form, so they load by name with their dtypes. The
op is the reference (decodes the weight on every call); ``fuse_fp8_linear`` chooses a fast backend.
A checkpoint that also calibrated an FP8 KV cache (``kv_cache_quant_algo``) stores
``k_scale``/``v_scale``: ``insert_cached_attention`` uses them with ``kv_cache_dtype: fp8``, and
otherwise keeps the KV cache in the model's dtype and says so in a warning.
"""

import torch
from torch import fx

from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_from_config import Buffer, CheckpointTensor, LinearFormat, quantize_linears, skip_kv_cache_scales

FP8_LINEAR = LinearFormat(
    name="ModelOpt FP8",
    op=torch.ops.autodeploy.torch_quant_fp8_linear.default,
    marker="weight_scale",
    tensors=(
        CheckpointTensor("weight", ("F8_E4M3",), lambda n, k: (n, k), "weight"),
        CheckpointTensor("weight_scale", ("F32", "BF16", "F16"), None, "per-tensor weight scale"),
        CheckpointTensor("input_scale", ("F32", "BF16", "F16"), None, "static per-tensor input scale"),
    ),
    buffers=(
        Buffer("weight", torch.float8_e4m3fn, lambda n, k: (n, k)),
        Buffer("input_scale", torch.float32, None),
        Buffer("weight_scale", torch.float32, None),
    ),
)


class QuantizeFP8LinearFromConfigConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER


@TransformRegistry.register("quantize_fp8_linear_from_config")
class QuantizeFP8LinearFromConfig(BaseTransform):
    config_class = QuantizeFP8LinearFromConfigConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        info = getattr(ctx.factory, "quantization", None)
        if info is None or info.transform != "quantize_fp8_linear_from_config":
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        count = quantize_linears(gm, ctx, FP8_LINEAR)
        skip_kv_cache_scales(gm, ctx, info)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
