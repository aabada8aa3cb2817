"""Normalisation ops."""

from typing import Tuple

import torch
from torch import Tensor

from . import native


def torch_rmsnorm_impl(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@torch.library.custom_op("autodeploy::torch_rmsnorm", mutates_args=())
def torch_rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as Llama computes it: normalise in fp32, cast back, then scale by ``weight``.

    Models whose norm scales by ``1 + weight`` (Gemma) are canonicalised with ``weight + 1``
    computed in the graph, so this op keeps one meaning.
    """
    return torch_rmsnorm_impl(x, weight, eps)


@torch_rmsnorm.register_fake
def _torch_rmsnorm_fake(x, weight, eps):
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("autodeploy::torch_fused_add_rmsnorm", mutates_args=())
def torch_fused_add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    """``s = x + residual``; returns ``(rmsnorm(s), s)``: the residual stream and the next
    layer's normed input from one pass over the hidden state."""
    summed = x + residual
    return torch_rmsnorm_impl(summed, weight, eps), summed


@torch_fused_add_rmsnorm.register_fake
def _fused_add_rmsnorm_fake(x, residual, weight, eps):
    summed = torch.empty(torch.broadcast_shapes(x.shape, residual.shape), dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    return torch.empty_like(summed, dtype=torch.promote_types(summed.dtype, weight.dtype)), summed


# --- native backend (``fuse_rmsnorm`` with backend native/auto on CPU) ---------------------------
# autodeploy's C kernel (ops/native.py, ops/csrc/rmsnorm_f32.c): the same formula in one call
# instead of six dispatched ops. Inputs it cannot take (not float32 CPU rows, or the kernels
# unavailable in this process) run the reference instead, so the op never changes meaning.


@torch.library.custom_op("autodeploy::native_rmsnorm", mutates_args=())
def native_rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``torch_rmsnorm`` through autodeploy's CPU kernel."""
    done = native.rmsnorm(x, weight, eps)
    return done[0] if done is not None else torch_rmsnorm_impl(x, weight, eps)


@native_rmsnorm.register_fake
def _native_rmsnorm_fake(x, weight, eps):
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("autodeploy::native_fused_add_rmsnorm", mutates_args=())
def native_fused_add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    """``torch_fused_add_rmsnorm`` through autodeploy's CPU kernel."""
    done = native.rmsnorm(x, weight, eps, residual=residual)
    if done is not None and done[1] is not None:
        return done[0], done[1]
    return torch_fused_add_rmsnorm(x, residual, weight, eps)


@native_fused_add_rmsnorm.register_fake
def _native_fused_add_rmsnorm_fake(x, residual, weight, eps):
    return _fused_add_rmsnorm_fake(x, residual, weight, eps)
