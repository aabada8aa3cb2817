"""Canonical quantized linears: ``torch_quant_<format>_linear``.

Each op holds its weight in the checkpoint's narrow form and is the *reference*: it decodes the
weight, quantizes the activation the way the format does (FP8 static or dynamic, NVFP4 W4A4;
nothing for the weight-only int4/int8), and runs one float32 GEMM. That makes it slow and
exact about numerics; the ``fuse_*_linear`` transforms swap it for a backend that decodes once at
load (CPU) or runs the narrow GEMM natively (CUDA).

============================================  ==============================================
op (weight arguments)                         dequantized weight W, activation seen by W
============================================  ==============================================
``torch_quant_fp8_linear``                    ``weight.float() * weight_scale``;
(weight e4m3 [N,K], input_scale [],           x -> e4m3(x / input_scale) * input_scale
weight_scale [] or per row [N])
``torch_quant_finegrained_fp8_linear``        ``weight.float() * weight_scale_inv`` per
(weight e4m3 [N,K], weight_scale_inv          block_n x block_k tile; x -> e4m3 per token per
[ceil(N/bn), ceil(K/bk)])                     block_k channels, scale amax/448
``torch_quant_nvfp4_linear``                  ``e2m1(weight) * weight_scale * weight_scale_2``
(weight uint8 [N,K/2], input_scale [],        per 16; x -> e2m1 per 16 with e4m3 scales
weight_scale e4m3 [N,K/16], weight_scale_2    relative to input_scale
[] or per row [N])
``torch_quant_int4_linear``                   ``(q - zeros) * scales`` per group_size of K;
(weight uint8 [N,K/2], scales, zeros [N,K/g]) x unchanged
``torch_quant_int8_linear``                   ``q * scales[:, None]``; x unchanged
(weight int8 [N,K], scales [N])
============================================  ==============================================

A per-row ``weight_scale`` / ``weight_scale_2`` is what ``fuse_fp8_gemms`` / ``fuse_fp4_gemms``
make when linears with different per-tensor scales become one (exact, no re-quantization);
checkpoints store one per tensor. The fake kernels only need the output shape; the weight's N is
its first dim in every format.
"""

from typing import Optional

import torch
from torch import Tensor

from . import formats


def _finish(x: Tensor, x_seen: Tensor, w: Tensor, bias: Optional[Tensor]) -> Tensor:
    out = torch.nn.functional.linear(x_seen.float(), w, None if bias is None else bias.float())
    return out.to(x.dtype)


def _fake(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("autodeploy::torch_quant_fp8_linear", mutates_args=())
def torch_quant_fp8_linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], input_scale: Tensor, weight_scale: Tensor
) -> Tensor:
    """FP8 per-tensor (ModelOpt FP8): static activation scale, one weight scale."""
    w = formats.dequantize_fp8(weight, weight_scale)
    return _finish(x, formats.fake_quant_fp8_static(x, input_scale), w, bias)


@torch_quant_fp8_linear.register_fake
def _fp8_fake(x, weight, bias, input_scale, weight_scale):
    return _fake(x, weight)


@torch.library.custom_op("autodeploy::torch_quant_finegrained_fp8_linear", mutates_args=())
def torch_quant_finegrained_fp8_linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], weight_scale_inv: Tensor, block_n: int = 128,
    block_k: int = 128,
) -> Tensor:
    """Fine-grained FP8 (DeepSeek-V3, Qwen3-FP8): a scale per weight tile, activations quantized
    per token per ``block_k`` channels at run time."""
    w = formats.dequantize_fp8_blocks(weight, weight_scale_inv, (block_n, block_k))
    return _finish(x, formats.fake_quant_fp8_groups(x, block_k), w, bias)


@torch_quant_finegrained_fp8_linear.register_fake
def _finegrained_fp8_fake(x, weight, bias, weight_scale_inv, block_n=128, block_k=128):
    return _fake(x, weight)


@torch.library.custom_op("autodeploy::torch_quant_nvfp4_linear", mutates_args=())
def torch_quant_nvfp4_linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], input_scale: Tensor, weight_scale: Tensor,
    weight_scale_2: Tensor,
) -> Tensor:
    """NVFP4 (ModelOpt): e2m1 weights with an e4m3 scale per 16 and a per-tensor scale; the
    activations quantized the same way (W4A4) against the calibrated ``input_scale``."""
    w = formats.dequantize_nvfp4(weight, weight_scale, weight_scale_2)
    return _finish(x, formats.fake_quant_nvfp4(x, input_scale.float()), w, bias)


@torch_quant_nvfp4_linear.register_fake
def _nvfp4_fake(x, weight, bias, input_scale, weight_scale, weight_scale_2):
    return _fake(x, weight)


@torch.library.custom_op("autodeploy::torch_quant_int4_linear", mutates_args=())
def torch_quant_int4_linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], scales: Tensor, zeros: Tensor, group_size: int
) -> Tensor:
    """Weight-only int4 (GPTQ, AWQ, compressed-tensors, autodeploy's own ``quantize_weights``),
    all converted at load to one layout: nibbles [N, K/2], a scale and zero point per group."""
    w = formats.dequantize_int4(weight, scales, zeros, group_size)
    return _finish(x, x, w, bias)


@torch_quant_int4_linear.register_fake
def _int4_fake(x, weight, bias, scales, zeros, group_size):
    return _fake(x, weight)


@torch.library.custom_op("autodeploy::torch_quant_int8_linear", mutates_args=())
def torch_quant_int8_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], scales: Tensor) -> Tensor:
    """Weight-only int8, symmetric per output channel."""
    return _finish(x, x, formats.dequantize_int8(weight, scales), bias)


@torch_quant_int8_linear.register_fake
def _int8_fake(x, weight, bias, scales):
    return _fake(x, weight)


def quant_linear_ops() -> tuple:
    """Every canonical quantized linear (the ``.default`` overloads graphs hold)."""
    ad = torch.ops.autodeploy
    return (
        ad.torch_quant_fp8_linear.default,
        ad.torch_quant_finegrained_fp8_linear.default,
        ad.torch_quant_nvfp4_linear.default,
        ad.torch_quant_int4_linear.default,
        ad.torch_quant_int8_linear.default,
    )
