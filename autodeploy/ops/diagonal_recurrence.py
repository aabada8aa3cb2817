"""Diagonal linear recurrence: the scan of RecurrentGemma's RG-LRU (Griffin / Hawk).

Each channel keeps one number ``h`` (zero at the start of a sequence). For every token, in fp32::

    h = a * h + x            # a, x: [b, s, w]; a in [0, 1] per token and channel

and the output is ``h`` at every token, in x's dtype. What the model computes around it (the
input and recurrence gates, ``a = exp(-8 * gate * softplus(param))``, the ``sqrt(1 - a^2)`` input
normalisation, the reset of ``a`` at position 0) is per-token element-wise arithmetic and stays
in the graph; only the scan over the sequence is the op. This is HF's ``_rnn_scan`` (fp32
accumulation, the output rounded to the input's dtype at every token).

The references are the token loop itself: prefill over ``s`` tokens costs ``s`` element-wise
steps on ``[b, w]``, a decode step one. On CPU the cached variant runs a C kernel instead
(``native_state.diagonal_recurrence_step``: the same loop per channel block, fused multiply-adds).

The cached variant runs on the flattened-token graph (x/a ``[1, T, w]``) with the metadata
``batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state`` and a state cache
``[num_slots, w]`` (fp32, as HF keeps ``recurrent_states``), read and written in place through
``causal_conv.scan_each_sequence``: sequence ``i`` continues from ``state_cache[slot_idx[i]]``
when ``use_initial_state[i]``, else from zeros, and its final state is stored back there.
"""

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import native_state
from .causal_conv import scan_each_sequence


def _check(x: Tensor, a: Tensor) -> None:
    if x.dim() != 3 or a.shape != x.shape:
        raise ValueError(f"diagonal recurrence: x {tuple(x.shape)} and a {tuple(a.shape)} must both be [b, s, w]")


def _scan(x: Tensor, a: Tensor, state: Tensor) -> Tuple[Tensor, Tensor]:
    """``h = a h + x`` over the ``s`` tokens of ``b`` sequences from ``state [b, w]``.

    Returns (output ``[b, s, w]`` in x's dtype, the fp32 state after the last token ``[b, w]``)."""
    h = state.float()
    a = a.float()
    out = torch.empty_like(x)
    for t in range(x.shape[1]):
        h = a[:, t] * h + x[:, t].float()
        out[:, t] = h.to(x.dtype)
    return out, h


@torch.library.custom_op("autodeploy::torch_diagonal_recurrence", mutates_args=())
def torch_diagonal_recurrence(x: Tensor, a: Tensor) -> Tensor:
    """``h_t = a_t * h_{t-1} + x_t`` from ``h = 0``, every ``h_t`` returned; x/a ``[b, s, w]``."""
    _check(x, a)
    return _scan(x, a, x.new_zeros(x.shape[0], x.shape[2], dtype=torch.float32))[0]


@torch_diagonal_recurrence.register_fake
def _diagonal_recurrence_fake(x, a):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("autodeploy::torch_cached_diagonal_recurrence", mutates_args=("state_cache",))
def torch_cached_diagonal_recurrence(
    x: Tensor,
    a: Tensor,
    batch_info: Tensor,
    seq_len: Tensor,
    cu_seqlen: Tensor,
    slot_idx: Tensor,
    use_initial_state: Tensor,
    state_cache: Tensor,
) -> Tensor:
    """``torch_diagonal_recurrence`` over a flattened step, each sequence continuing its slot's
    state ``state_cache [num_slots, w]``."""
    _check(x, a)
    if state_cache.dim() != 2 or state_cache.shape[1] != x.shape[2]:
        raise ValueError(f"diagonal recurrence: state cache {tuple(state_cache.shape)} does not fit x "
                         f"{tuple(x.shape)}")

    def scan(tokens: Sequence[Tensor], initial: Tensor) -> Tuple[Tensor, Tensor]:
        return _scan(tokens[0], tokens[1], initial)

    def step_all(tokens: Sequence[Tensor], cu: Tensor, slots: Tensor, carry: Tensor) -> Optional[Tensor]:
        return native_state.diagonal_recurrence_step(tokens[0], tokens[1], state_cache, cu, slots, carry)

    return scan_each_sequence(scan, [x, a], batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state,
                              state_cache, step_all=step_all)


@torch_cached_diagonal_recurrence.register_fake
def _cached_diagonal_recurrence_fake(x, a, batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state,
                                     state_cache):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
