"""``fuse_finegrained_fp8_linear`` (post_load_fusion): ``torch_quant_finegrained_fp8_linear`` ->
per-group FP8 activation + float linear.

Before::

    y = autodeploy.torch_quant_finegrained_fp8_linear(x, P.weight, P.bias, P.weight_scale_inv, 128, 128)

After, ``backend: dequantized`` (``auto`` on CPU, in float32, and where the GPU kernel is
missing)::

    xq = autodeploy.torch_quant_fp8_group_activation(x, 128)   # e4m3 per token per 128 channels
    y = aten.linear(xq, P.weight, P.bias)        # P.weight = e4m3 weight * its tile's scale, decoded once

After, ``backend: scaled_mm`` (``auto`` for a bfloat16/float16 model on a CUDA GPU whose
block-scaled FP8 GEMM passed its trial)::

    y = autodeploy.scaled_mm_fp8_block_linear(x, P.weight, P.bias, P.weight_scale_inv, N)
        # P.weight stays e4m3 (padded to the kernel's alignment once); one FP8 GEMM with
        # 1x128 activation and 128x128 weight scales (ops/quant/fp8_gemm.py)

See ``_quant_backend`` for why decoding once is the CPU backend and what it costs in memory. The
FP8 GEMM writes bfloat16, so a float32 model keeps the decoded weight (exact) under ``auto``.
"""

from typing import Literal

import torch
from pydantic import Field
from torch import fx, nn

from ...ops.quant import formats
from ...ops.quant.fp8_gemm import BLOCK, block_scaled_mm_problem, pad_block_weight
from ...utils.logging import get_logger
from ..graph_utils import get_attr_value, nodes_calling, owner_of
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_backend import DecodeRule, decode_quantized_linears

logger = get_logger(__name__)
CANONICAL = torch.ops.autodeploy.torch_quant_finegrained_fp8_linear.default

RULE = DecodeRule(
    op=CANONICAL,
    decode=lambda weight, scale_inv, block_n=128, block_k=128: formats.dequantize_fp8_blocks(
        weight, scale_inv, (block_n, block_k)),
    activation=torch.ops.autodeploy.torch_quant_fp8_group_activation.default,
    activation_args=lambda rest: (rest[2] if len(rest) > 2 else 128,),
)


class FuseFinegrainedFP8LinearConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True
    backend: Literal["auto", "dequantized", "scaled_mm"] = Field(
        default="auto",
        description="auto: scaled_mm for a bfloat16/float16 model on a CUDA GPU whose block-scaled FP8 GEMM "
        "passes a trial GEMM at build time, else dequantized; dequantized: weight decoded once to the deployment "
        "dtype, activation FP8-rounded per 128 channels, a float GEMM; scaled_mm: the e4m3 weight kept (1 byte "
        "per value) and torch._scaled_mm with block-wise scales on CUDA (bfloat16 output; on CPU the same "
        "numbers from a weight decoded on every call: slow).",
    )


def _replace_tensor(gm: fx.GraphModule, target: str, value: torch.Tensor) -> None:
    """Swap the tensor behind a get_attr target, keeping it a parameter or a buffer."""
    owner, leaf = owner_of(gm, target)
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


def _to_block_scaled_mm(gm: fx.GraphModule) -> int:
    """Retarget every 128x128-tile linear whose weight and scales are its own attributes."""
    count = 0
    for node in list(nodes_calling(gm, CANONICAL)):
        x, weight, bias, scale, *blocks = node.args
        if tuple(blocks or (BLOCK, BLOCK)) != (BLOCK, BLOCK):
            continue  # other tile shapes: the decoded path
        attrs = (weight, scale)
        if any(not isinstance(a, fx.Node) or a.op != "get_attr" or len(a.users) != 1 for a in attrs):
            continue
        w, s = get_attr_value(gm, weight), get_attr_value(gm, scale)
        padded, padded_scale = pad_block_weight(w, s)
        _replace_tensor(gm, str(weight.target), padded)
        _replace_tensor(gm, str(scale.target), padded_scale)
        node.target = torch.ops.autodeploy.scaled_mm_fp8_block_linear.default
        node.args = (x, weight, bias, scale, int(w.shape[0]))
        count += 1
    gm.recompile()
    return count


@TransformRegistry.register("fuse_finegrained_fp8_linear")
class FuseFinegrainedFP8Linear(BaseTransform):
    config_class = FuseFinegrainedFP8LinearConfig
    run_after = ("fuse_finegrained_fp8_swiglu", "quantize_weights")

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = 0
        if nodes_calling(gm, CANONICAL) and self._use_scaled_mm(ctx):
            count = _to_block_scaled_mm(gm)
            logger.info("fine-grained FP8: %d linears run as block-scaled FP8 GEMMs (weights stay e4m3)", count)
        count += decode_quantized_linears(gm, ctx, RULE)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)

    def _use_scaled_mm(self, ctx: PipelineContext) -> bool:
        backend = self.config.backend  # type: ignore[attr-defined]
        device = torch.device(ctx.device)
        if backend == "dequantized" or (backend == "auto" and (device.type != "cuda" or ctx.dtype == torch.float32)):
            return False
        if device.type != "cuda":
            return True  # asked for on CPU: the op's decoded-per-call path (memory over speed)
        problem = block_scaled_mm_problem(str(device))
        if problem is not None:
            (logger.warning if backend == "scaled_mm" else logger.info)(
                "fine-grained FP8 linears keep the decoded weight: %s", problem)
        return problem is None
