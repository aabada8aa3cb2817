"""``quantize_finegrained_fp8_linear_from_config`` (pattern_matcher): block-scaled FP8 linears ->
``torch_quant_finegrained_fp8_linear``.

Applies when ``config.json`` declares ``quant_method: fp8`` (DeepSeek-V3, Qwen3-FP8 and other
"fine-grained FP8" checkpoints): e4m3 weights with one float32 multiplier per
``weight_block_size`` tile (128x128; partial tiles at the edges) and activations quantized per
token per 128 channels at run time (``activation_scheme: dynamic``). Every linear with a
``weight_scale_inv`` is rewritten; the rest (``modules_to_not_convert``) stay float.

Before::

    y = aten.linear(x, P.weight, P.bias)                  # float parameter [N, K]

After::

    y = autodeploy.torch_quant_finegrained_fp8_linear(x, P.weight, P.bias, P.weight_scale_inv, 128, 128)
    # P.weight: float8_e4m3fn [N, K]; P.weight_scale_inv: float32 [ceil(N/128), ceil(K/128)]

Static activation scales (``activation_scheme: static``) are refused: that variant stores
``activation_scale`` tensors this op does not read, and running without them would change the numerics.
"""

from typing import Any, Tuple

import torch
from torch import fx

from ...utils.errors import ModelSourceError
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_from_config import Buffer, CheckpointTensor, LinearFormat, quantize_linears


def _tiles(block: Tuple[int, int]):
    return lambda n, k: (-(-n // block[0]), -(-k // block[1]))


def finegrained_fp8_format(block: Tuple[int, int]) -> LinearFormat:
    return LinearFormat(
        name="fine-grained FP8",
        op=torch.ops.autodeploy.torch_quant_finegrained_fp8_linear.default,
        marker="weight_scale_inv",
        tensors=(
            CheckpointTensor("weight", ("F8_E4M3",), lambda n, k: (n, k), "weight"),
            CheckpointTensor("weight_scale_inv", ("F32", "BF16"), _tiles(block),
                             f"scale per {block[0]}x{block[1]} weight tile"),
        ),
        buffers=(
            Buffer("weight", torch.float8_e4m3fn, lambda n, k: (n, k)),
            Buffer("weight_scale_inv", torch.float32, _tiles(block)),
        ),
        constants=block,
    )


class QuantizeFinegrainedFP8LinearFromConfigConfig(TransformConfig):
    stage: Stage = Stage.PATTERN_MATCHER


@TransformRegistry.register("quantize_finegrained_fp8_linear_from_config")
class QuantizeFinegrainedFP8LinearFromConfig(BaseTransform):
    config_class = QuantizeFinegrainedFP8LinearFromConfigConfig

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        info = getattr(ctx.factory, "quantization", None)
        if info is None or info.transform != "quantize_finegrained_fp8_linear_from_config":
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        count = quantize_linears(gm, ctx, finegrained_fp8_format(declared_block(info)))
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)


def declared_block(info: Any) -> Tuple[int, int]:
    """The checkpoint's ``weight_block_size``, after refusing what the ops cannot run (a static
    activation scheme, a malformed block)."""
    scheme = info.config.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ModelSourceError(
            f"fine-grained FP8 checkpoint declares activation_scheme '{scheme}'; autodeploy runs the dynamic "
            f"scheme (per-token activation scales computed at run time) only"
        )
    block = info.config.get("weight_block_size") or [128, 128]
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelSourceError(f"fine-grained FP8 checkpoint declares weight_block_size {block!r}; expected two "
                               f"positive integers such as [128, 128]")
    return block[0], block[1]
