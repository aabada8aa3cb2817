"""Fused ops: the op before a quantized linear emits the quantized input that linear would see.

After ``fuse_fp8_linear`` / ``fuse_nvfp4_linear`` every quantized linear starts with its own
activation-quantization op (``activation.py``). Where one producer feeds several linears that
quantize with the same calibrated scale (the input norm feeding q/k/v, the post-attention norm
feeding gate/up), those ops compute the same tensor several times. The ops here compute the
producer and the quantization once (``fuse_rmsnorm_quant_*``, ``fuse_relu2_quant_nvfp4``):

* ``torch_rmsnorm_quant_fp8`` / ``_nvfp4``: ``torch_rmsnorm`` then the format's activation
  quantization;
* ``torch_fused_add_rmsnorm_quant_fp8`` / ``_nvfp4``: ``torch_fused_add_rmsnorm`` whose normed
  output (the first) is quantized; the residual sum (the second) is returned as is;
* ``torch_rmsnorm_quant_fp8_group`` / ``torch_fused_add_rmsnorm_quant_fp8_group``: the same with
  fine-grained FP8's dynamic quantization (per token per ``group_size`` channels, scales from the
  values: ``torch_quant_fp8_group_activation``). Nothing is calibrated, so every linear fed by the
  norm computed this very tensor, and one quantization serves them all;
* ``native_*`` twins of those six: the same values with the norm computed by autodeploy's CPU
  kernel, so a norm that ``fuse_rmsnorm`` moved to the native backend keeps it when fused;
* ``torch_relu2_quant_nvfp4``: squared ReLU (Nemotron's ``relu2``) then NVFP4 quantization.

Every op returns the quantized-then-dequantized value in the producer's dtype, computed by the
very functions the unfused graph runs (``normalization``, ``formats``), so a fused graph equals
the unfused one exactly. On a GPU the norm kernel would write the narrow type directly; that
kernel is not written here (no GPU to verify it on).

Not here: attention emitting FP8 for ``o_proj`` (the catalogue's ``fuse_trtllm_attn_quant_fp8``).
Fused at post_load_fusion it would hide ``torch_attention`` from ``insert_cached_attention``,
which caches that op only; fused into the cached op (compile stage) it would save the CPU one op
dispatch per layer (~9 us at one row on the ``small`` preset: the quantization pass is the same
inside the op or after it). Its worth is an attention kernel writing FP8 from its epilogue on a
GPU, and no attention backend here has one.
"""

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from .. import native
from ..normalization import _fused_add_rmsnorm_fake, torch_rmsnorm_impl
from . import formats


def _fp8(x: Tensor, input_scale: Tensor) -> Tensor:
    """What ``torch_quant_fp8_activation`` returns for ``x``."""
    return formats.fake_quant_fp8_static(x, input_scale.float()).to(x.dtype)


def _nvfp4(x: Tensor, input_scale: Tensor) -> Tensor:
    """What ``torch_quant_nvfp4_activation`` returns for ``x``."""
    return formats.fake_quant_nvfp4(x, input_scale.float()).to(x.dtype)


def _fp8_group(x: Tensor, group_size: int) -> Tensor:
    """What ``torch_quant_fp8_group_activation`` returns for ``x``."""
    return formats.fake_quant_fp8_groups(x, group_size).to(x.dtype)


def _native_norm(x: Tensor, weight: Tensor, eps: float, residual: Optional[Tensor] = None
                 ) -> Tuple[Tensor, Optional[Tensor]]:
    """``(rmsnorm(x [+ residual]), x + residual or None)`` as ``native_rmsnorm`` /
    ``native_fused_add_rmsnorm`` compute it: the C kernel, or the reference where it cannot run."""
    done = native.rmsnorm(x, weight, eps, residual=residual)
    if done is not None and (residual is None or done[1] is not None):
        return done
    summed = x if residual is None else x + residual
    return torch_rmsnorm_impl(summed, weight, eps), (None if residual is None else summed)


def _norm_fake(x: Tensor, weight: Tensor, *_: object) -> Tensor:
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))


def _add_norm_fake(x: Tensor, residual: Tensor, weight: Tensor, eps: float, *_: object) -> Tuple[Tensor, Tensor]:
    return _fused_add_rmsnorm_fake(x, residual, weight, eps)


def _add_then_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, quant: Callable[[Tensor], Tensor]
                   ) -> Tuple[Tensor, Tensor]:
    summed = x + residual
    return quant(torch_rmsnorm_impl(summed, weight, eps)), summed


# ---- RMSNorm + FP8 (static per-tensor scale) -----------------------------------------------------


@torch.library.custom_op("autodeploy::torch_rmsnorm_quant_fp8", mutates_args=())
def torch_rmsnorm_quant_fp8(x: Tensor, weight: Tensor, eps: float, input_scale: Tensor) -> Tensor:
    """``torch_quant_fp8_activation(torch_rmsnorm(x, weight, eps), input_scale)``."""
    return _fp8(torch_rmsnorm_impl(x, weight, eps), input_scale)


@torch.library.custom_op("autodeploy::torch_fused_add_rmsnorm_quant_fp8", mutates_args=())
def torch_fused_add_rmsnorm_quant_fp8(x: Tensor, residual: Tensor, weight: Tensor, eps: float, input_scale: Tensor
                                      ) -> Tuple[Tensor, Tensor]:
    """``torch_fused_add_rmsnorm`` with its normed output FP8-quantized: ``(fp8(rmsnorm(s)), s)``."""
    return _add_then_norm(x, residual, weight, eps, lambda y: _fp8(y, input_scale))


@torch.library.custom_op("autodeploy::native_rmsnorm_quant_fp8", mutates_args=())
def native_rmsnorm_quant_fp8(x: Tensor, weight: Tensor, eps: float, input_scale: Tensor) -> Tensor:
    """``torch_rmsnorm_quant_fp8`` with the norm from autodeploy's CPU kernel."""
    return _fp8(_native_norm(x, weight, eps)[0], input_scale)


@torch.library.custom_op("autodeploy::native_fused_add_rmsnorm_quant_fp8", mutates_args=())
def native_fused_add_rmsnorm_quant_fp8(x: Tensor, residual: Tensor, weight: Tensor, eps: float, input_scale: Tensor
                                       ) -> Tuple[Tensor, Tensor]:
    """``torch_fused_add_rmsnorm_quant_fp8`` with the add and norm from autodeploy's CPU kernel."""
    normed, summed = _native_norm(x, weight, eps, residual)
    return _fp8(normed, input_scale), summed


# ---- RMSNorm + NVFP4 (e2m1 per 16 values, e4m3 block scales relative to input_scale) -------------


@torch.library.custom_op("autodeploy::torch_rmsnorm_quant_nvfp4", mutates_args=())
def torch_rmsnorm_quant_nvfp4(x: Tensor, weight: Tensor, eps: float, input_scale: Tensor) -> Tensor:
    """``torch_quant_nvfp4_activation(torch_rmsnorm(x, weight, eps), input_scale)``."""
    return _nvfp4(torch_rmsnorm_impl(x, weight, eps), input_scale)


@torch.library.custom_op("autodeploy::torch_fused_add_rmsnorm_quant_nvfp4", mutates_args=())
def torch_fused_add_rmsnorm_quant_nvfp4(x: Tensor, residual: Tensor, weight: Tensor, eps: float, input_scale: Tensor
                                        ) -> Tuple[Tensor, Tensor]:
    """``torch_fused_add_rmsnorm`` with its normed output NVFP4-quantized: ``(nvfp4(rmsnorm(s)), s)``."""
    return _add_then_norm(x, residual, weight, eps, lambda y: _nvfp4(y, input_scale))


@torch.library.custom_op("autodeploy::native_rmsnorm_quant_nvfp4", mutates_args=())
def native_rmsnorm_quant_nvfp4(x: Tensor, weight: Tensor, eps: float, input_scale: Tensor) -> Tensor:
    """``torch_rmsnorm_quant_nvfp4`` with the norm from autodeploy's CPU kernel."""
    return _nvfp4(_native_norm(x, weight, eps)[0], input_scale)


@torch.library.custom_op("autodeploy::native_fused_add_rmsnorm_quant_nvfp4", mutates_args=())
def native_fused_add_rmsnorm_quant_nvfp4(x: Tensor, residual: Tensor, weight: Tensor, eps: float, input_scale: Tensor
                                         ) -> Tuple[Tensor, Tensor]:
    """``torch_fused_add_rmsnorm_quant_nvfp4`` with the add and norm from autodeploy's CPU kernel."""
    normed, summed = _native_norm(x, weight, eps, residual)
    return _nvfp4(normed, input_scale), summed


# ---- RMSNorm + per-group FP8 (dynamic: e4m3 per token per group_size channels) -----------------


@torch.library.custom_op("autodeploy::torch_rmsnorm_quant_fp8_group", mutates_args=())
def torch_rmsnorm_quant_fp8_group(x: Tensor, weight: Tensor, eps: float, group_size: int) -> Tensor:
    """``torch_quant_fp8_group_activation(torch_rmsnorm(x, weight, eps), group_size)``."""
    return _fp8_group(torch_rmsnorm_impl(x, weight, eps), group_size)


@torch.library.custom_op("autodeploy::torch_fused_add_rmsnorm_quant_fp8_group", mutates_args=())
def torch_fused_add_rmsnorm_quant_fp8_group(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                                            group_size: int) -> Tuple[Tensor, Tensor]:
    """``torch_fused_add_rmsnorm`` with its normed output quantized per group: ``(fp8g(rmsnorm(s)), s)``."""
    return _add_then_norm(x, residual, weight, eps, lambda y: _fp8_group(y, group_size))


@torch.library.custom_op("autodeploy::native_rmsnorm_quant_fp8_group", mutates_args=())
def native_rmsnorm_quant_fp8_group(x: Tensor, weight: Tensor, eps: float, group_size: int) -> Tensor:
    """``torch_rmsnorm_quant_fp8_group`` with the norm from autodeploy's CPU kernel."""
    return _fp8_group(_native_norm(x, weight, eps)[0], group_size)


@torch.library.custom_op("autodeploy::native_fused_add_rmsnorm_quant_fp8_group", mutates_args=())
def native_fused_add_rmsnorm_quant_fp8_group(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                                             group_size: int) -> Tuple[Tensor, Tensor]:
    """``torch_fused_add_rmsnorm_quant_fp8_group`` with the add and norm from autodeploy's CPU kernel."""
    normed, summed = _native_norm(x, weight, eps, residual)
    return _fp8_group(normed, group_size), summed


for _op in (torch_rmsnorm_quant_fp8, native_rmsnorm_quant_fp8, torch_rmsnorm_quant_nvfp4, native_rmsnorm_quant_nvfp4,
            torch_rmsnorm_quant_fp8_group, native_rmsnorm_quant_fp8_group):
    _op.register_fake(_norm_fake)
for _op in (torch_fused_add_rmsnorm_quant_fp8, native_fused_add_rmsnorm_quant_fp8,
            torch_fused_add_rmsnorm_quant_nvfp4, native_fused_add_rmsnorm_quant_nvfp4,
            torch_fused_add_rmsnorm_quant_fp8_group, native_fused_add_rmsnorm_quant_fp8_group):
    _op.register_fake(_add_norm_fake)


# ---- squared ReLU + NVFP4 ------------------------------------------------------------------------


@torch.library.custom_op("autodeploy::torch_relu2_quant_nvfp4", mutates_args=())
def torch_relu2_quant_nvfp4(x: Tensor, input_scale: Tensor) -> Tensor:
    """``torch_quant_nvfp4_activation(square(relu(x)), input_scale)``: Nemotron's MLP activation
    and the down projection's input quantization in one op."""
    return _nvfp4(torch.square(torch.relu(x)), input_scale)


@torch_relu2_quant_nvfp4.register_fake
def _relu2_quant_nvfp4_fake(x, input_scale):
    return torch.empty_like(x)
