"""Normalisation ops."""

import torch
from torch import Tensor


@torch.library.custom_op("autodeploy::torch_rmsnorm", mutates_args=())
def torch_rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as Llama computes it: normalise in fp32, cast back, then scale by ``weight``.

    Models whose norm scales by ``1 + weight`` (Gemma) are canonicalised with ``weight + 1``
    computed in the graph, so this op keeps one meaning.
    """
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@torch_rmsnorm.register_fake
def _torch_rmsnorm_fake(x, weight, eps):
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))
