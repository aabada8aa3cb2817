"""Collectives as canonical ops: ``torch_dist_all_reduce``, ``torch_dist_all_gather``, and
``torch_dist_rmsnorm`` (an RMSNorm over features split across the ranks; ``torch_dist_rmsnorm_pair``
two of them with one all-reduce).

Why ops and not calls into ``torch.distributed`` in the graph: the sharding transforms insert
them into exported graphs, which shape propagation, the fusions (all-reduce + residual add +
RMSNorm) and the compile backends then have to see as one node with known output shapes. A
custom op with a fake kernel is exactly that; ``torch.distributed``'s own functions are not
traceable and mutate in place.

With one rank (no process group, or a group of one) the first two are the identity and the norm a
plain RMSNorm, so a graph that was sharded for one rank, or a test that runs a sharded graph alone,
needs no group. All return a new tensor (a custom op may not return its input).
"""

from typing import Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.process_group import world_size


@torch.library.custom_op("autodeploy::torch_dist_all_reduce", mutates_args=())
def torch_dist_all_reduce(x: Tensor) -> Tensor:
    """The elementwise sum of ``x`` over every rank (row-parallel linears' partial outputs)."""
    out = x.clone()
    if world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


@torch_dist_all_reduce.register_fake
def _all_reduce_fake(x):
    return torch.empty_like(x)


@torch.library.custom_op("autodeploy::torch_dist_all_gather", mutates_args=())
def torch_dist_all_gather(x: Tensor, dim: int = -1) -> Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (column-parallel outputs, a
    vocab-parallel LM head's logits). Every rank must pass the same shape."""
    n = world_size()
    if n == 1:
        return x.clone()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


@torch_dist_all_gather.register_fake
def _all_gather_fake(x, dim=-1):
    shape = list(x.shape)
    shape[dim] *= world_size()
    return x.new_empty(shape)


@torch.library.custom_op("autodeploy::torch_dist_rmsnorm", mutates_args=())
def torch_dist_rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``torch_rmsnorm`` over features split across the ranks (OLMo-2's query/key norms over all
    heads, with the heads split): ``x`` and ``weight`` are this rank's slice, and the mean of
    squares is the ranks' summed squares over ``world_size`` times the local width. Exact also
    where a slice is held by several ranks (key/value heads replicated): every slice is then held
    by equally many ranks, which scales the sum and the width alike."""
    xf = x.float()
    squares = xf.pow(2).sum(-1, keepdim=True)
    n = world_size()
    if n > 1:
        dist.all_reduce(squares, op=dist.ReduceOp.SUM)
    normed = xf * torch.rsqrt(squares / (x.shape[-1] * n) + eps)
    return weight * normed.to(x.dtype)


@torch_dist_rmsnorm.register_fake
def _dist_rmsnorm_fake(x, weight, eps):
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype))


@torch.library.custom_op("autodeploy::torch_dist_rmsnorm_pair", mutates_args=())
def torch_dist_rmsnorm_pair(x: Tensor, x_weight: Tensor, x_eps: float, y: Tensor, y_weight: Tensor,
                            y_eps: float) -> Tuple[Tensor, Tensor]:
    """Two ``torch_dist_rmsnorm`` over values of the same tokens (an attention's query and key
    norms) with one all-reduce: both sums of squares travel together, so a layer pays one small
    collective instead of two (each a loopback round trip on gloo)."""
    xf, yf = x.float(), y.float()
    squares = torch.cat([xf.pow(2).sum(-1, keepdim=True), yf.pow(2).sum(-1, keepdim=True)], dim=-1)
    n = world_size()
    if n > 1:
        dist.all_reduce(squares, op=dist.ReduceOp.SUM)
    x_normed = xf * torch.rsqrt(squares[..., :1] / (x.shape[-1] * n) + x_eps)
    y_normed = yf * torch.rsqrt(squares[..., 1:] / (y.shape[-1] * n) + y_eps)
    return x_weight * x_normed.to(x.dtype), y_weight * y_normed.to(y.dtype)


@torch_dist_rmsnorm_pair.register_fake
def _dist_rmsnorm_pair_fake(x, x_weight, x_eps, y, y_weight, y_eps):
    return (torch.empty_like(x, dtype=torch.promote_types(x.dtype, x_weight.dtype)),
            torch.empty_like(y, dtype=torch.promote_types(y.dtype, y_weight.dtype)))
