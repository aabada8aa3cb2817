"""Gated MLPs (SwiGLU) and the activation they share."""

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native
from .linear import linear


@torch.library.custom_op("autodeploy::torch_swiglu_mlp", mutates_args=())
def torch_swiglu_mlp(
    x: Tensor,
    gate_weight: Tensor,
    up_weight: Tensor,
    down_weight: Tensor,
    gate_bias: Optional[Tensor] = None,
    up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None,
) -> Tensor:
    """``down(silu(gate(x)) * up(x))``: the Llama-family MLP as one canonical node."""
    gate = linear(x, gate_weight, gate_bias)
    up = linear(x, up_weight, up_bias)
    return linear(F.silu(gate) * up, down_weight, down_bias)


@torch_swiglu_mlp.register_fake
def _swiglu_fake(x, gate_weight, up_weight, down_weight, gate_bias=None, up_bias=None, down_bias=None):
    return x.new_empty(*x.shape[:-1], down_weight.shape[0])


@torch.library.custom_op("autodeploy::torch_fused_swiglu_mlp", mutates_args=())
def torch_fused_swiglu_mlp(
    x: Tensor,
    gate_up_weight: Tensor,
    down_weight: Tensor,
    gate_up_bias: Optional[Tensor] = None,
    down_bias: Optional[Tensor] = None,
) -> Tensor:
    """SwiGLU with gate and up weights stacked (gate rows first): one GEMM for both."""
    gate_up = linear(x, gate_up_weight, gate_up_bias)
    return linear(torch_silu_and_mul_impl(gate_up), down_weight, down_bias)


@torch_fused_swiglu_mlp.register_fake
def _fused_swiglu_fake(x, gate_up_weight, down_weight, gate_up_bias=None, down_bias=None):
    return x.new_empty(*x.shape[:-1], down_weight.shape[0])


def torch_silu_and_mul_impl(x: Tensor) -> Tensor:
    """The activation of both SwiGLU ops. On CPU in float32 autodeploy's kernel does it in one
    pass (``native.silu_and_mul``; torch's two ops and a temporary cost ~2 ms of a batch-32 decode
    step of the small preset); the torch expression is the reference and the fallback."""
    out = native.silu_and_mul(x)
    if out is not None:
        return out
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


@torch.library.custom_op("autodeploy::torch_silu_and_mul", mutates_args=())
def torch_silu_and_mul(x: Tensor) -> Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of width 2d (gate first, then up)."""
    return torch_silu_and_mul_impl(x)


@torch_silu_and_mul.register_fake
def _silu_and_mul_fake(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
