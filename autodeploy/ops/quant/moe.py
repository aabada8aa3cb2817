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

Per-expert quantized experts (ModelOpt FP8 and NVFP4, fine-grained FP8: Qwen3-MoE, DeepSeek-V3)
are ``torch_moe`` whose every expert projection is the format's quantized linear
(``autodeploy.ops.quant.linear``): the checkpoint's own per-expert tensors, one list per tensor
kind and projection, in the order of that linear's arguments::

    torch_quant_fp8_moe(x, sel, w, gate_w[], up_w[], down_w[], gate_input_scale[], up_..., down_...,
                        gate_weight_scale[], up_..., down_...)
    torch_quant_finegrained_fp8_moe(x, sel, w, gate_w[], up_w[], down_w[], gate_weight_scale_inv[], up_...,
                                    down_..., block_n, block_k)
    torch_quant_nvfp4_moe(x, sel, w, gate_w[], up_w[], down_w[], gate_input_scale[], ..., gate_weight_scale[],
                          ..., gate_weight_scale_2[], ...)

Each has a ``_stacked`` form (``torch_quant_fp8_moe_stacked``, ...) with the same arguments where
every list is one tensor stacked along a leading expert dim (``[E, I, H]`` gate weights, ``[E]``
input scales, ``[E, I/128, H/128]`` tile scales, ...): the same numerics, and what the export
emits by default (three tensors per kind and layer instead of 3 x E, see ``export.hf_moe``).
Gate and up stay apart (not one ``[E, 2I, H]``) so a tile of block scales never straddles them.

They are the references: each expert that received tokens runs its three quantized linears
(weights decoded, its input rows quantized as the format does: with *that expert's* calibrated
``input_scale`` for the static formats, per token and 128 channels for fine-grained FP8) and
experts no token chose are never decoded. ``grouped_quant_moe_fused`` is their fast form on
weights decoded once (``fuse_fp8_moe`` / ``fuse_finegrained_fp8_moe`` / ``fuse_nvfp4_moe``).
"""

from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..moe import expert_activation, grouped_moe, per_expert_reference, stacked_experts_reference
from . import formats
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


# ---- per-expert quantized experts -----------------------------------------------------------

GATE, UP, DOWN = 0, 1, 2
PROJECTIONS = ("gate", "up", "down")
# A quantized expert projection: (its input rows, projection index, expert index) -> output rows.
ExpertLinear = Callable[[Tensor, int, int], Tensor]


# One tensor kind of one projection over the experts: a per-expert list, or one tensor stacked
# along a leading expert dim (the ``_stacked`` ops); ``t[e]`` is expert e's in both.
Experts = Union[Sequence[Tensor], Tensor]


def _check_lists(op: str, lists: Sequence[Experts]) -> int:
    """Every per-expert list (or stacked tensor's dim 0) has one entry per expert; returns the
    expert count."""
    num_experts = len(lists[0])
    if num_experts == 0 or any(len(lst) != num_experts for lst in lists):
        raise ValueError(f"{op}: every per-expert list needs one tensor per expert; got lengths "
                         f"{[len(lst) for lst in lists]}")
    return num_experts


def _quantized_experts(x: Tensor, selected_experts: Tensor, routing_weights: Tensor, num_experts: int,
                       linear: ExpertLinear, act: str, alpha: float, limit: float) -> Tensor:
    """``torch_moe``'s loop with each projection a quantized linear."""

    def expert(e: int, rows: Tensor) -> Tensor:
        h = expert_activation(linear(rows, GATE, e), linear(rows, UP, e), act, alpha, limit)
        return linear(h, DOWN, e)

    return per_expert_reference(x, selected_experts, routing_weights, num_experts, expert)


def _gemm(rows: Tensor, seen: Tensor, weight: Tensor) -> Tensor:
    """The quantized linears' GEMM: float32 on the rows as the format lets the weight see them."""
    return F.linear(seen.float(), weight).to(rows.dtype)


def _fp8_experts(op: str, x: Tensor, selected_experts: Tensor, routing_weights: Tensor, weights: Sequence[Experts],
                 inputs: Sequence[Experts], scales: Sequence[Experts], act: str, alpha: float, limit: float) -> Tensor:
    n = _check_lists(op, [*weights, *inputs, *scales])

    def linear(rows: Tensor, p: int, e: int) -> Tensor:
        seen = formats.fake_quant_fp8_static(rows, inputs[p][e].float())
        return _gemm(rows, seen, formats.dequantize_fp8(weights[p][e], scales[p][e]))

    return _quantized_experts(x, selected_experts, routing_weights, n, linear, act, alpha, limit)


@torch.library.custom_op("autodeploy::torch_quant_fp8_moe", mutates_args=())
def torch_quant_fp8_moe(
    x: Tensor, selected_experts: Tensor, routing_weights: Tensor,
    gate_weights: List[Tensor], up_weights: List[Tensor], down_weights: List[Tensor],
    gate_input_scales: List[Tensor], up_input_scales: List[Tensor], down_input_scales: List[Tensor],
    gate_weight_scales: List[Tensor], up_weight_scales: List[Tensor], down_weight_scales: List[Tensor],
    act: str = "silu", alpha: float = 1.0, limit: float = 0.0,
) -> Tensor:
    """ModelOpt FP8 experts: each projection ``torch_quant_fp8_linear`` (e4m3 weight, per-tensor
    weight scale, the expert's own static input scale)."""
    return _fp8_experts("torch_quant_fp8_moe", x, selected_experts, routing_weights,
                        (gate_weights, up_weights, down_weights), (gate_input_scales, up_input_scales, down_input_scales),
                        (gate_weight_scales, up_weight_scales, down_weight_scales), act, alpha, limit)


@torch.library.custom_op("autodeploy::torch_quant_fp8_moe_stacked", mutates_args=())
def torch_quant_fp8_moe_stacked(
    x: Tensor, selected_experts: Tensor, routing_weights: Tensor,
    gate_weights: Tensor, up_weights: Tensor, down_weights: Tensor,
    gate_input_scales: Tensor, up_input_scales: Tensor, down_input_scales: Tensor,
    gate_weight_scales: Tensor, up_weight_scales: Tensor, down_weight_scales: Tensor,
    act: str = "silu", alpha: float = 1.0, limit: float = 0.0,
) -> Tensor:
    """``torch_quant_fp8_moe`` with each list stacked along a leading expert dim."""
    return _fp8_experts("torch_quant_fp8_moe_stacked", x, selected_experts, routing_weights,
                        (gate_weights, up_weights, down_weights), (gate_input_scales, up_input_scales, down_input_scales),
                        (gate_weight_scales, up_weight_scales, down_weight_scales), act, alpha, limit)


def _finegrained_fp8_experts(op: str, x: Tensor, selected_experts: Tensor, routing_weights: Tensor,
                             weights: Sequence[Experts], scales: Sequence[Experts], block_n: int, block_k: int,
                             act: str, alpha: float, limit: float) -> Tensor:
    n = _check_lists(op, [*weights, *scales])

    def linear(rows: Tensor, p: int, e: int) -> Tensor:
        w = formats.dequantize_fp8_blocks(weights[p][e], scales[p][e], (block_n, block_k))
        return _gemm(rows, formats.fake_quant_fp8_groups(rows, block_k), w)

    return _quantized_experts(x, selected_experts, routing_weights, n, linear, act, alpha, limit)


@torch.library.custom_op("autodeploy::torch_quant_finegrained_fp8_moe", mutates_args=())
def torch_quant_finegrained_fp8_moe(
    x: Tensor, selected_experts: Tensor, routing_weights: Tensor,
    gate_weights: List[Tensor], up_weights: List[Tensor], down_weights: List[Tensor],
    gate_weight_scale_invs: List[Tensor], up_weight_scale_invs: List[Tensor], down_weight_scale_invs: List[Tensor],
    block_n: int = 128, block_k: int = 128, act: str = "silu", alpha: float = 1.0, limit: float = 0.0,
) -> Tensor:
    """Fine-grained FP8 experts (DeepSeek-V3, Qwen3-MoE-FP8): each projection
    ``torch_quant_finegrained_fp8_linear`` (a scale per ``block_n x block_k`` tile, activations
    quantized per token per ``block_k`` channels at run time)."""
    return _finegrained_fp8_experts(
        "torch_quant_finegrained_fp8_moe", x, selected_experts, routing_weights, (gate_weights, up_weights, down_weights),
        (gate_weight_scale_invs, up_weight_scale_invs, down_weight_scale_invs), block_n, block_k, act, alpha, limit)


@torch.library.custom_op("autodeploy::torch_quant_finegrained_fp8_moe_stacked", mutates_args=())
def torch_quant_finegrained_fp8_moe_stacked(
    x: Tensor, selected_experts: Tensor, routing_weights: Tensor,
    gate_weights: Tensor, up_weights: Tensor, down_weights: Tensor,
    gate_weight_scale_invs: Tensor, up_weight_scale_invs: Tensor, down_weight_scale_invs: Tensor,
    block_n: int = 128, block_k: int = 128, act: str = "silu", alpha: float = 1.0, limit: float = 0.0,
) -> Tensor:
    """``torch_quant_finegrained_fp8_moe`` with each list stacked along a leading expert dim."""
    return _finegrained_fp8_experts(
        "torch_quant_finegrained_fp8_moe_stacked", x, selected_experts, routing_weights,
        (gate_weights, up_weights, down_weights), (gate_weight_scale_invs, up_weight_scale_invs, down_weight_scale_invs),
        block_n, block_k, act, alpha, limit)


def _nvfp4_experts(op: str, x: Tensor, selected_experts: Tensor, routing_weights: Tensor, weights: Sequence[Experts],
                   inputs: Sequence[Experts], scales: Sequence[Experts], scales_2: Sequence[Experts], act: str,
                   alpha: float, limit: float) -> Tensor:
    n = _check_lists(op, [*weights, *inputs, *scales, *scales_2])

    def linear(rows: Tensor, p: int, e: int) -> Tensor:
        seen = formats.fake_quant_nvfp4(rows, inputs[p][e].float())
        return _gemm(rows, seen, formats.dequantize_nvfp4(weights[p][e], scales[p][e], scales_2[p][e]))

    return _quantized_experts(x, selected_experts, routing_weights, n, linear, act, alpha, limit)


@torch.library.custom_op("autodeploy::torch_quant_nvfp4_moe", mutates_args=())
def torch_quant_nvfp4_moe(
    x: Tensor, selected_experts: Tensor, routing_weights: Tensor,
    gate_weights: List[Tensor], up_weights: List[Tensor], down_weights: List[Tensor],
    gate_input_scales: List[Tensor], up_input_scales: List[Tensor], down_input_scales: List[Tensor],
    gate_weight_scales: List[Tensor], up_weight_scales: List[Tensor], down_weight_scales: List[Tensor],
    gate_weight_scale_2s: List[Tensor], up_weight_scale_2s: List[Tensor], down_weight_scale_2s: List[Tensor],
    act: str = "silu", alpha: float = 1.0, limit: float = 0.0,
) -> Tensor:
    """ModelOpt NVFP4 experts: each projection ``torch_quant_nvfp4_linear`` (e2m1 weights, e4m3
    scale per 16, per-tensor scale; W4A4 against the expert's own ``input_scale``)."""
    return _nvfp4_experts(
        "torch_quant_nvfp4_moe", x, selected_experts, routing_weights, (gate_weights, up_weights, down_weights),
        (gate_input_scales, up_input_scales, down_input_scales), (gate_weight_scales, up_weight_scales, down_weight_scales),
        (gate_weight_scale_2s, up_weight_scale_2s, down_weight_scale_2s), act, alpha, limit)


@torch.library.custom_op("autodeploy::torch_quant_nvfp4_moe_stacked", mutates_args=())
def torch_quant_nvfp4_moe_stacked(
    x: Tensor, selected_experts: Tensor, routing_weights: Tensor,
    gate_weights: Tensor, up_weights: Tensor, down_weights: Tensor,
    gate_input_scales: Tensor, up_input_scales: Tensor, down_input_scales: Tensor,
    gate_weight_scales: Tensor, up_weight_scales: Tensor, down_weight_scales: Tensor,
    gate_weight_scale_2s: Tensor, up_weight_scale_2s: Tensor, down_weight_scale_2s: Tensor,
    act: str = "silu", alpha: float = 1.0, limit: float = 0.0,
) -> Tensor:
    """``torch_quant_nvfp4_moe`` with each list stacked along a leading expert dim."""
    return _nvfp4_experts(
        "torch_quant_nvfp4_moe_stacked", x, selected_experts, routing_weights, (gate_weights, up_weights, down_weights),
        (gate_input_scales, up_input_scales, down_input_scales), (gate_weight_scales, up_weight_scales, down_weight_scales),
        (gate_weight_scale_2s, up_weight_scale_2s, down_weight_scale_2s), act, alpha, limit)


for _op in (torch_quant_fp8_moe, torch_quant_fp8_moe_stacked, torch_quant_finegrained_fp8_moe,
            torch_quant_finegrained_fp8_moe_stacked, torch_quant_nvfp4_moe, torch_quant_nvfp4_moe_stacked):
    _op.register_fake(lambda x, *args, **kwargs: torch.empty_like(x))


# ---- decoded experts with the format's activation quantization ------------------------------

ACTIVATION_QUANT = ("fp8", "fp8_group", "nvfp4")


def input_quantizer(act_quant: str, gate_up_input_scale: Optional[Tensor], down_input_scale: Optional[Tensor],
                    group_size: int):
    """The ``grouped_moe`` input quantizer of a format: ``fp8`` (static, the expert's scale),
    ``fp8_group`` (dynamic per token per ``group_size`` channels), ``nvfp4`` (W4A4, the expert's
    scale)."""
    if act_quant not in ACTIVATION_QUANT:
        raise ValueError(f"unknown MoE activation quantization '{act_quant}'; known: {ACTIVATION_QUANT}")
    if act_quant == "fp8_group":
        return lambda rows, expert, gemm: formats.fake_quant_fp8_groups(rows, group_size).to(rows.dtype)
    if gate_up_input_scale is None or down_input_scale is None:
        raise ValueError(f"MoE activation quantization '{act_quant}' needs per-expert input scales")
    fake = formats.fake_quant_fp8_static if act_quant == "fp8" else formats.fake_quant_nvfp4

    def quant(rows: Tensor, expert: Union[int, Tensor], gemm: int) -> Tensor:
        scale = (gate_up_input_scale if gemm == 0 else down_input_scale)[expert].float()
        return fake(rows, scale[:, None] if scale.dim() else scale).to(rows.dtype)

    return quant


@torch.library.custom_op("autodeploy::grouped_quant_moe_fused", mutates_args=())
def grouped_quant_moe_fused(
    x: Tensor, selected_experts: Tensor, routing_weights: Tensor, gate_up_weight: Tensor, down_weight: Tensor,
    gate_up_input_scale: Optional[Tensor], down_input_scale: Optional[Tensor],
    gate_up_bias: Optional[Tensor] = None, down_bias: Optional[Tensor] = None,
    act: str = "silu", alpha: float = 1.0, limit: float = 0.0, act_quant: str = "fp8", group_size: int = 128,
    bmm_max_pairs: int = 0,
) -> Tensor:
    """``grouped_moe_fused`` over quantized experts decoded once (float ``[E, 2I, H]`` gate rows
    then up rows, ``[E, H, I]``), each GEMM's input rows quantized as the format does
    (``act_quant``; see ``input_quantizer``).

    Input scales are per expert (``[E]``): the rows routed to expert ``e`` are quantized with
    ``e``'s calibrated scale, as the per-expert reference does. (Fused GPU MoE kernels take one
    scale per layer, the max over experts - vLLM's per-tensor FP8 MoE collapses the scales so at
    load - because their grouped GEMM quantizes the layer's input once; here the rows are quantized
    per expert anyway, so the checkpoint's own scales cost nothing. On the tests' checkpoints the
    max would move the logits by 5-16% relative RMSE.)
    The gate and up projections of an expert read the same input: their scale is the larger of
    the two (the same value in calibrated checkpoints).
    """
    quant = input_quantizer(act_quant, gate_up_input_scale, down_input_scale, group_size)
    return grouped_moe(x, selected_experts, routing_weights, gate_up_weight, down_weight, gate_up_bias, down_bias,
                       act, alpha, limit, bmm_max_pairs, quant)


@grouped_quant_moe_fused.register_fake
def _grouped_quant_moe_fused_fake(x, *args, **kwargs):
    return torch.empty_like(x)


def quant_moe_ops() -> Tuple:
    """The per-expert quantized MoE ops (``.default`` overloads), their lists one tensor per expert."""
    ad = torch.ops.autodeploy
    return (ad.torch_quant_fp8_moe.default, ad.torch_quant_finegrained_fp8_moe.default,
            ad.torch_quant_nvfp4_moe.default)


def stacked_quant_moe_ops() -> Tuple:
    """Their ``_stacked`` forms (``.default``): each list one ``[E, ...]`` tensor."""
    ad = torch.ops.autodeploy
    return (ad.torch_quant_fp8_moe_stacked.default, ad.torch_quant_finegrained_fp8_moe_stacked.default,
            ad.torch_quant_nvfp4_moe_stacked.default)
