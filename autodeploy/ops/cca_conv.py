"""ZAYA's compressed-convolutional-attention (CCA) convolution: two stacked causal convolutions over
the concatenated query/key projections, a depthwise one then a grouped one.

For ``x [b, s, c]`` (channels last) with ``K = (t0 - 1) + (t1 - 1)`` zeros in front of the
sequence::

    y = grouped_conv(depthwise_conv(pad_left(x, K)))     # both "valid" (no padding of their own)

``depthwise``: weight ``[c, 1, t0]`` (every channel its own taps); ``grouped``: weight
``[c, c / groups, t1]`` (each of ``groups`` channel groups -- one per attention head in ZAYA --
mixes its channels). Output ``y [b, s, c]``: token ``t`` sees the inputs ``t - K .. t`` only.
Numerics: ``nn.Conv1d``'s in the input's dtype, as HF runs them.

The cached variant keeps, per state slot, the last ``K`` inputs of the sequence (``conv_state
[num_slots, c, K]``, the model's dtype: raw inputs): a step's new tokens are convolved with that
window in front (zeros for a new sequence, as HF's padding), and the window becomes the last ``K``
inputs seen -- HF's conv cache. The step driver is ``causal_conv.scan_each_sequence``.
"""

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .causal_conv import scan_each_sequence


def _window(dw_weight: Tensor, g_weight: Tensor) -> int:
    return (dw_weight.shape[-1] - 1) + (g_weight.shape[-1] - 1)


def _check(x: Tensor, dw_weight: Tensor, g_weight: Tensor, groups: int) -> None:
    c = x.shape[-1]
    if (x.dim() != 3 or dw_weight.shape[:2] != (c, 1) or groups < 1 or c % groups
            or g_weight.shape[:2] != (c, c // groups)):
        raise ValueError(f"cca conv: x {tuple(x.shape)} must be [b, s, c], the depthwise weight "
                         f"{tuple(dw_weight.shape)} [c, 1, t0] and the grouped weight {tuple(g_weight.shape)} "
                         f"[c, c / groups, t1] with groups={groups} dividing c")


def _scan(x: Tensor, window: Tensor, dw_weight: Tensor, dw_bias: Optional[Tensor], g_weight: Tensor,
          g_bias: Optional[Tensor], groups: int) -> Tuple[Tensor, Tensor]:
    """``x [b, s, c]`` after the previous inputs ``window [b, c, K]`` -> (``[b, s, c]``, the last ``K``
    inputs ``[b, c, K]``)."""
    inputs = torch.cat([window.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [b, c, K + s]
    hidden = F.conv1d(inputs, dw_weight, dw_bias, groups=x.shape[-1])
    out = F.conv1d(hidden, g_weight, g_bias, groups=groups)  # [b, c, s]
    return out.transpose(1, 2), inputs[..., inputs.shape[-1] - window.shape[-1]:]


@torch.library.custom_op("autodeploy::torch_cca_conv", mutates_args=())
def torch_cca_conv(x: Tensor, dw_weight: Tensor, dw_bias: Optional[Tensor], g_weight: Tensor,
                   g_bias: Optional[Tensor], groups: int) -> Tensor:
    """The two causal convolutions over ``x [b, s, c]`` from zeros (see the module docstring)."""
    _check(x, dw_weight, g_weight, groups)
    zeros = x.new_zeros(x.shape[0], x.shape[2], _window(dw_weight, g_weight))
    return _scan(x, zeros, dw_weight, dw_bias, g_weight, g_bias, groups)[0].contiguous()


@torch_cca_conv.register_fake
def _cca_conv_fake(x, dw_weight, dw_bias, g_weight, g_bias, groups):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("autodeploy::torch_cached_cca_conv", mutates_args=("conv_state",))
def torch_cached_cca_conv(
    x: Tensor,
    dw_weight: Tensor,
    dw_bias: Optional[Tensor],
    g_weight: Tensor,
    g_bias: Optional[Tensor],
    batch_info: Tensor,
    seq_len: Tensor,
    cu_seqlen: Tensor,
    slot_idx: Tensor,
    use_initial_state: Tensor,
    conv_state: Tensor,
    groups: int,
) -> Tensor:
    """``torch_cca_conv`` over a flattened step ``x [1, T, c]``, each sequence continuing from its
    slot's window ``conv_state [num_slots, c, K]``."""
    _check(x, dw_weight, g_weight, groups)
    if tuple(conv_state.shape[1:]) != (x.shape[-1], _window(dw_weight, g_weight)):
        raise ValueError(f"cca conv: state cache {tuple(conv_state.shape)} does not fit x {tuple(x.shape)} and "
                         f"kernels {dw_weight.shape[-1]}, {g_weight.shape[-1]}")

    def scan(tokens: Sequence[Tensor], initial: Tensor) -> Tuple[Tensor, Tensor]:
        return _scan(tokens[0], initial, dw_weight, dw_bias, g_weight, g_bias, groups)

    return scan_each_sequence(scan, [x], batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state, conv_state)


@torch_cached_cca_conv.register_fake
def _cached_cca_conv_fake(x, dw_weight, dw_bias, g_weight, g_bias, batch_info, seq_len, cu_seqlen, slot_idx,
                          use_initial_state, conv_state, groups):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
