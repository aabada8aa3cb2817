"""The WKV recurrence of RWKV-4 (``RwkvForCausalLM``): a per-channel weighted average over the past
values with an exponential decay and a bonus for the current token.

For channel ``c`` with decay ``w = -exp(time_decay)`` and bonus ``u = time_first``::

    wkv_t = (sum_{i<t} e^{(t-1-i) w + k_i} v_i + e^{u + k_t} v_t) / (sum_{i<t} e^{(t-1-i) w + k_i} + e^{u + k_t})

kept, as HF does, as a running numerator ``a``, denominator ``b`` and exponent ``p`` (the sums are
``a e^p`` and ``b e^p``; the exponent keeps every ``exp`` argument <= 0)::

    q = max(p, u + k);  wkv = (e^{p-q} a + e^{u+k-q} v) / (e^{p-q} b + e^{u+k-q})
    q = max(p + w, k);  a = e^{p+w-q} a + e^{k-q} v;  b = e^{p+w-q} b + e^{k-q};  p = q

in fp32; the output takes k's dtype. Shapes: k/v ``[b, s, c]``, time_decay/time_first ``[c]``.

The empty state is ``a = b = 0`` with any ``p``: HF starts ``p`` at -1e38, which makes the first
token's output exactly ``v``. A state cache starts a new sequence at zeros, so the scan takes a
zero denominator (which no token leaves: ``b`` gains ``e^{k-q} = 1`` whenever ``k`` sets the new
exponent, and otherwise keeps ``b``) to mean "empty" and sets ``p`` to -1e38 there. Without that,
``p = 0`` with a very negative ``u + k`` would underflow ``e^{u+k-q}`` to 0 and give 0/0.

The cached variant runs on the flattened-token graph with the metadata ``batch_info, seq_len,
cu_seqlen, slot_idx, use_initial_state`` and a state cache ``[num_slots, 3, c]`` (fp32: ``a``,
``b``, ``p``), read and written in place through ``causal_conv.scan_each_sequence``; on CPU by a C
kernel (``native_state.wkv_step``: the same recurrence per channel block, its ``exp`` the kernels'
polynomial, a few ulp from torch's).
"""

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import native_state
from .causal_conv import scan_each_sequence

# HF's initial exponent: -inf in effect, finite so that p + w stays finite
EMPTY_EXPONENT = -1e38


def _check(time_decay: Tensor, time_first: Tensor, k: Tensor, v: Tensor) -> None:
    c = k.shape[-1]
    if k.dim() != 3 or v.shape != k.shape or time_decay.shape != (c,) or time_first.shape != (c,):
        raise ValueError(f"wkv: k {tuple(k.shape)} and v {tuple(v.shape)} must be [b, s, c] and time_decay "
                         f"{tuple(time_decay.shape)}, time_first {tuple(time_first.shape)} [c]")


def _scan(time_decay: Tensor, time_first: Tensor, k: Tensor, v: Tensor, state: Tensor) -> Tuple[Tensor, Tensor]:
    """The recurrence over the ``s`` tokens of ``b`` sequences from ``state [b, 3, c]`` (a, b, p).

    Returns (output ``[b, s, c]`` in k's dtype, the fp32 state after the last token ``[b, 3, c]``)."""
    w, u = -torch.exp(time_decay.float()), time_first.float()
    num, den, exponent = state.float().unbind(1)
    exponent = torch.where(den == 0, torch.full_like(exponent, EMPTY_EXPONENT), exponent)
    out = torch.empty_like(k)
    for t in range(k.shape[1]):
        k_t, v_t = k[:, t].float(), v[:, t].float()
        top = torch.maximum(exponent, u + k_t)
        e1, e2 = torch.exp(exponent - top), torch.exp(u + k_t - top)
        out[:, t] = ((e1 * num + e2 * v_t) / (e1 * den + e2)).to(k.dtype)
        top = torch.maximum(exponent + w, k_t)
        e1, e2 = torch.exp(exponent + w - top), torch.exp(k_t - top)
        num, den, exponent = e1 * num + e2 * v_t, e1 * den + e2, top
    return out, torch.stack([num, den, exponent], dim=1)


@torch.library.custom_op("autodeploy::torch_wkv", mutates_args=())
def torch_wkv(time_decay: Tensor, time_first: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """RWKV-4's WKV from the empty state (see the module docstring); k/v ``[b, s, c]``."""
    _check(time_decay, time_first, k, v)
    return _scan(time_decay, time_first, k, v, k.new_zeros(k.shape[0], 3, k.shape[2], dtype=torch.float32))[0]


@torch_wkv.register_fake
def _wkv_fake(time_decay, time_first, k, v):
    return torch.empty_like(k, memory_format=torch.contiguous_format)


@torch.library.custom_op("autodeploy::torch_cached_wkv", mutates_args=("state_cache",))
def torch_cached_wkv(
    time_decay: Tensor,
    time_first: Tensor,
    k: Tensor,
    v: Tensor,
    batch_info: Tensor,
    seq_len: Tensor,
    cu_seqlen: Tensor,
    slot_idx: Tensor,
    use_initial_state: Tensor,
    state_cache: Tensor,
) -> Tensor:
    """``torch_wkv`` over a flattened step (k/v ``[1, T, c]``), each sequence continuing its slot's
    state ``state_cache [num_slots, 3, c]``."""
    _check(time_decay, time_first, k, v)
    if state_cache.dim() != 3 or tuple(state_cache.shape[1:]) != (3, k.shape[2]):
        raise ValueError(f"wkv: state cache {tuple(state_cache.shape)} does not fit k {tuple(k.shape)}")

    def scan(tokens: Sequence[Tensor], initial: Tensor) -> Tuple[Tensor, Tensor]:
        return _scan(time_decay, time_first, tokens[0], tokens[1], initial)

    def step_all(tokens: Sequence[Tensor], cu: Tensor, slots: Tensor, carry: Tensor) -> Optional[Tensor]:
        return native_state.wkv_step(time_decay, time_first, tokens[0], tokens[1], state_cache, cu, slots, carry)

    return scan_each_sequence(scan, [k, v], batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state, state_cache,
                              step_all=step_all)


@torch_cached_wkv.register_fake
def _cached_wkv_fake(time_decay, time_first, k, v, batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state,
                     state_cache):
    return torch.empty_like(k, memory_format=torch.contiguous_format)
