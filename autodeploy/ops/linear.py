"""Linear."""

from typing import Optional

import torch
from torch import Tensor


@torch.library.custom_op("autodeploy::torch_linear_simple", mutates_args=())
def torch_linear_simple(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ weight.T + bias`` behind an op boundary.

    Export IR already spells a plain linear as ``aten.linear``; this op exists for passes that
    want every linear as one opaque node (sharding, quantisation) whatever form the model used.
    """
    return torch.nn.functional.linear(x, weight, bias)


@torch_linear_simple.register_fake
def _torch_linear_simple_fake(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
