"""Activation quantization as its own op: what a quantized linear does to its input.

The ``fuse_*_linear`` transforms split a canonical quantized linear into *this op* followed by a
plain float linear over the weight decoded once at load. The activation keeps the format's
numerics (the values the narrow GEMM of a GPU would see), and the GEMM becomes an ordinary one
that the float backends (oneDNN packing, ``fuse_gemms``) already make fast. Each op returns the
quantized-then-dequantized activation in the input's dtype.
"""

import torch
from torch import Tensor

from . import formats


@torch.library.custom_op("autodeploy::torch_quant_fp8_activation", mutates_args=())
def torch_quant_fp8_activation(x: Tensor, input_scale: Tensor) -> Tensor:
    """FP8 e4m3 with a static per-tensor scale (ModelOpt FP8)."""
    return formats.fake_quant_fp8_static(x, input_scale.float()).to(x.dtype)


@torch_quant_fp8_activation.register_fake
def _fp8_activation_fake(x, input_scale):
    return torch.empty_like(x)


@torch.library.custom_op("autodeploy::torch_quant_fp8_group_activation", mutates_args=())
def torch_quant_fp8_group_activation(x: Tensor, group_size: int = 128) -> Tensor:
    """FP8 e4m3 per token per ``group_size`` channels, scales from the values (fine-grained FP8)."""
    return formats.fake_quant_fp8_groups(x, group_size).to(x.dtype)


@torch_quant_fp8_group_activation.register_fake
def _fp8_group_activation_fake(x, group_size=128):
    return torch.empty_like(x)


@torch.library.custom_op("autodeploy::torch_quant_nvfp4_activation", mutates_args=())
def torch_quant_nvfp4_activation(x: Tensor, input_scale: Tensor) -> Tensor:
    """NVFP4 (e2m1 per 16 values, e4m3 block scales relative to ``input_scale``)."""
    return formats.fake_quant_nvfp4(x, input_scale.float()).to(x.dtype)


@torch_quant_nvfp4_activation.register_fake
def _nvfp4_activation_fake(x, input_scale):
    return torch.empty_like(x)
