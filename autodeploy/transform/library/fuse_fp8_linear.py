"""``fuse_fp8_linear`` (post_load_fusion): ``torch_quant_fp8_linear`` -> an FP8 backend.

Before::

    y = autodeploy.torch_quant_fp8_linear(x, P.weight, P.bias, P.input_scale, P.weight_scale)

After, ``backend: dequantized`` (``auto`` on CPU, for float32 models, and on GPUs without FP8 tensor
cores)::

    xq = autodeploy.torch_quant_fp8_activation(x, P.input_scale)    # e4m3(x / s) * s
    y = aten.linear(xq, P.weight, P.bias)             # P.weight = e4m3 weight * weight_scale, decoded once

After, ``backend: scaled_mm`` (``auto`` for bfloat16/float16 models on CUDA with compute capability
8.9+, K and N multiples of 16)::

    y = autodeploy.scaled_mm_fp8_linear(x, P.weight, P.bias, P.input_scale, P.weight_scale)   # e4m3 weight kept

The reference op decodes its e4m3 weight on every call. ``dequantized`` decodes it once at load
into the deployment dtype (exact in float32) and keeps the static activation quantization, so
outputs equal the reference's up to summation order; see ``_quant_backend`` for why that is the
CPU backend (CPUs have no FP8 GEMM), and the plain linear is then packed by
``select_linear_backend``. ``scaled_mm`` runs the FP8 GEMM itself through ``torch._scaled_mm``
(``ops/quant/fp8_gemm.py``), per-tensor or, after ``fuse_fp8_gemms``, per-row weight scales: the
weight stays one byte per value. On a CPU torch runs it too, exactly but 25-50x slower than the
decoded path (``ops/quant/fp8_gemm.py``): chosen there only when asked, for the memory. On an
H100 (torch 2.11, 2026-11-26) a float32 ModelOpt FP8 Llama built with ``scaled_mm`` gave the
float32 reference's greedy tokens (logits 8.8e-3 off: the FP8 tensor cores' narrower accumulation),
and in bfloat16 the FP8 GEMMs added no error beyond the decoded weights' (``tests/gpu``).
"""

from typing import Literal

import torch
from pydantic import Field
from torch import fx

from ...ops.quant import formats
from ...ops.quant.fp8_gemm import scaled_mm_supported
from ...utils.logging import get_logger
from ..graph_utils import get_attr_value, nodes_calling
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._quant_backend import DecodeRule, decode_quantized_linears, first_tensor_args

logger = get_logger(__name__)
CANONICAL = torch.ops.autodeploy.torch_quant_fp8_linear.default
RULE = DecodeRule(
    op=CANONICAL,
    decode=lambda weight, input_scale, weight_scale: formats.dequantize_fp8(weight, weight_scale),
    activation=torch.ops.autodeploy.torch_quant_fp8_activation.default,
    activation_args=first_tensor_args((0,)),
)


class FuseFP8LinearConfig(TransformConfig):
    stage: Stage = Stage.POST_LOAD_FUSION
    expect_mem_change: bool = True  # the decoded weights are wider than the FP8 ones
    backend: Literal["auto", "dequantized", "scaled_mm"] = Field(
        default="auto",
        description="auto: scaled_mm for bfloat16/float16 models on CUDA GPUs with FP8 tensor cores (compute capability 8.9+) where the "
        "shape allows, else dequantized; dequantized: weight decoded once to the deployment dtype, activation "
        "FP8-rounded, a float GEMM; scaled_mm: the FP8 GEMM (torch._scaled_mm) on the e4m3 weight, which stays "
        "1 byte per value (on CPU: exact but slow).",
    )


def _to_scaled_mm(gm: fx.GraphModule, ctx: PipelineContext, backend: str) -> int:
    """Swap canonical ops for ``scaled_mm_fp8_linear`` (same arguments) where chosen; returns how many."""
    device = torch.device(ctx.device)
    count = 0
    for node in nodes_calling(gm, CANONICAL):
        weight = node.args[1]
        if not isinstance(weight, fx.Node) or weight.op != "get_attr":
            continue
        n, k = get_attr_value(gm, weight).shape
        why_not = scaled_mm_supported(device, n, k)
        if why_not is not None:
            if backend == "scaled_mm":
                logger.info("%s: %s; decoding it once instead", weight.target, why_not)
            continue
        node.target = torch.ops.autodeploy.scaled_mm_fp8_linear.default
        count += 1
    gm.recompile()
    return count


@TransformRegistry.register("fuse_fp8_linear")
class FuseFP8Linear(BaseTransform):
    config_class = FuseFP8LinearConfig
    run_after = ("fuse_fp8_gemms",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        backend = self.config.backend  # type: ignore[attr-defined]
        count = 0
        # auto: FP8 GEMMs for half-precision models on CUDA. A float32 model keeps the decoded weight: the
        # FP8 tensor cores accumulate in less than float32 (1.2e-4 relative per GEMM on an H100), which the
        # FP8 rounding of the next activations amplified to 3.5e-2 in a tiny MoE's logits (H200, 2026-11-26)
        half = ctx.dtype in (torch.bfloat16, torch.float16)
        if backend == "scaled_mm" or (backend == "auto" and half and torch.device(ctx.device).type == "cuda"):
            count = _to_scaled_mm(gm, ctx, backend)
        count += decode_quantized_linears(gm, ctx, RULE)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
