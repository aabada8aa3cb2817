"""Quantized mixture-of-experts ops: the experts' weights stay in their checkpoint format.

``torch_quant_mxfp4_moe_fused`` is ``torch_moe_fused`` (``autodeploy.ops.moe``) over MXFP4
experts: the stacked canonical layout (``gate_up`` ``[E, 2I, H]``, gate rows first, then up rows;
``down`` ``[E, H, I]``) stored as OCP MXFP4 blocks ``[E, rows, K/32, 16]`` (element 2i in the low
nibble) and E8M0 scales ``[E, rows, K/32]``. Each expert that receives tokens is decoded when it
runs (exact: every MXFP4 value is representable in bf16/fp32) and its GEMMs run in ``x``'s dtype;
experts no token chose are never decoded. Memory stays at MXFP4's ~0.53 bytes per weight, at
the price of decoding the active experts' weights every step: the memory-safe choice for
models whose decoded experts do not fit (``quantize_mxfp4_moe_from_config`` picks it).
Routing, the activation (``silu`` or GPT-OSS's ``swiglu_oai``) and the weighted sum over ``k``
are ``torch_moe_fused``'s.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from ..moe import stacked_experts_reference
from .formats import MXFP4_GROUP, dequantize_mxfp4


def _check_mxfp4_experts(gate_up_blocks: Tensor, gate_up_scales: Tensor, down_blocks: Tensor,
                         down_scales: Tensor) -> None:
    ok = (gate_up_blocks.dim() == down_blocks.dim() == 4 and gate_up_blocks.shape[:3] == gate_up_scales.shape
          and down_blocks.shape[:3] == down_scales.shape and gate_up_blocks.shape[1] % 2 == 0
          and gate_up_blocks.shape[0] == down_blocks.shape[0]
          and down_blocks.shape[2] * MXFP4_GROUP * 2 == gate_up_blocks.shape[1])
    if not ok:
        raise ValueError(
            f"MXFP4 experts must be gate_up blocks [E, 2I, H/32, 16] with scales [E, 2I, H/32] and down blocks "
            f"[E, H, I/32, 16] with scales [E, H, I/32]; got {tuple(gate_up_blocks.shape)}, "
            f"{tuple(gate_up_scales.shape)}, {tuple(down_blocks.shape)}, {tuple(down_scales.shape)}"
        )


@torch.library.custom_op("autodeploy::torch_quant_mxfp4_moe_fused", mutates_args=())
def torch_quant_mxfp4_moe_fused(
    x: Tensor,
    selected_experts: Tensor,
    routing_weights: Tensor,
    gate_up_blocks: Tensor,
    gate_up_scales: Tensor,
    down_blocks: Tensor,
    down_scales: Tensor,
    gate_up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None,
    act: str = "silu",
    alpha: float = 1.0,
    limit: float = 0.0,
) -> Tensor:
    """``torch_moe_fused`` with MXFP4 expert weights, decoded per active expert (module docstring)."""
    _check_mxfp4_experts(gate_up_blocks, gate_up_scales, down_blocks, down_scales)

    def weights(e: int) -> Tuple[Tensor, Tensor]:
        return (dequantize_mxfp4(gate_up_blocks[e], gate_up_scales[e]).to(x.dtype),
                dequantize_mxfp4(down_blocks[e], down_scales[e]).to(x.dtype))

    return stacked_experts_reference(x, selected_experts, routing_weights, gate_up_blocks.shape[0], weights,
                                     gate_up_bias, down_bias, act, alpha, limit)


@torch_quant_mxfp4_moe_fused.register_fake
def _torch_quant_mxfp4_moe_fused_fake(x, selected_experts, routing_weights, gate_up_blocks, gate_up_scales,
                                      down_blocks, down_scales, gate_up_bias=None, down_bias=None, act="silu",
                                      alpha=1.0, limit=0.0):
    return torch.empty_like(x)
