"""The C kernels of a state op's decode step (``csrc/state_step_f32.c``): every one-token
sequence of a step through the op at once, each state updated in place in its own cache slot.

These are ``scan_each_sequence``'s ``step_all`` on CPU (``causal_conv.py``): the causal conv window,
the Mamba2 and Mamba scans, and the fast-weight states of the delta rules and decayed linear
attention. Each wrapper takes the rows the driver hands over (``[n, ...]``, possibly strided: the
graph's splits of one projection), the state cache, the sequences' slots (int32) and carry flags
(bool: False starts from a zero state whatever the slot holds), and returns the outputs as float32,
or None, having written nothing, when the kernel cannot take the inputs (not float32 on the CPU, a
non-contiguous cache, no library: ``native.load``); the caller then takes its torch path. A slot
outside the cache raises ``IndexError`` before anything is written. The wrappers run once per layer
of a decode step, so they check with the cheap tensor properties.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from .native import loaded


def _slot_rows(slots: Tensor, carry: Tensor, n: int) -> bool:
    """The decoding sequences' cache slots (int32) and carry flags (bool), ``n`` each, contiguous."""
    return (slots.dtype == torch.int32 and carry.dtype == torch.bool and slots.is_cpu and carry.is_cpu
            and slots.shape == (n,) == carry.shape and slots.stride(0) == 1 and carry.stride(0) == 1)


def _rows(t: Tensor, inner: Tuple[int, ...]) -> Optional[Tensor]:
    """``t [n, *inner]`` (float32, CPU; ``inner`` one or two dims) itself when each row is laid out
    contiguously (any row stride: a split of a wider projection is), else a contiguous copy; None
    for another shape, dtype or device."""
    if t.shape[1:] != inner or t.dtype != torch.float32 or not t.is_cpu:
        return None
    if t.stride(-1) != 1 or (len(inner) == 2 and inner[0] > 1 and t.stride(1) != inner[1]):
        return t.contiguous()
    return t


def _vector(t: Tensor, size: int) -> Optional[Tensor]:
    """A float32 CPU vector of ``size`` (its view as one, made contiguous), or None."""
    if t.numel() != size or t.dtype != torch.float32 or not t.is_cpu:
        return None
    return t.reshape(size).contiguous()


def mamba2_step(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, D: Tensor, state: Tensor, slots: Tensor,
                carry: Tensor) -> Optional[Tensor]:
    """One token of each of ``n`` sequences through the Mamba2 recurrence (``ssm.py``), updating
    ``state [num_slots, heads, head_dim, dstate]`` in place at ``slots`` (a zero state where
    ``carry`` is False): ``x [n, heads, head_dim]``, discretised ``dt [n, heads]``, ``B``/``C [n,
    groups, dstate]``, ``A``/``D [heads]`` -> ``y [n, heads, head_dim]`` float32. None, with nothing
    written, when the kernel cannot take these inputs (all float32 on the CPU, a contiguous state).
    Called once per layer of a decode step, so its checks are the cheap tensor properties."""
    lib = loaded()
    if lib is None or x.dim() != 3 or B.dim() != 3 or state.dtype != torch.float32 or not state.is_cpu:
        return None
    n, heads, head_dim = x.shape
    groups, dstate = B.shape[1], B.shape[2]
    if not groups or heads % groups or state.shape[1:] != (heads, head_dim, dstate) or not state.is_contiguous():
        return None
    x, dt = _rows(x, (heads, head_dim)), _rows(dt, (heads,))
    B, C = _rows(B, (groups, dstate)), _rows(C, (groups, dstate))
    A, D = _vector(A, heads), _vector(D, heads)
    if x is None or dt is None or B is None or C is None or A is None or D is None or not _slot_rows(slots, carry, n):
        return None
    y = x.new_empty(n, heads, head_dim)
    rc = lib.ad_mamba2_step_f32(x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), B.data_ptr(), B.stride(0),
                                C.data_ptr(), C.stride(0), A.data_ptr(), D.data_ptr(), state.data_ptr(),
                                state.shape[0], slots.data_ptr(), carry.data_ptr(), y.data_ptr(), n, heads, head_dim,
                                groups, dstate, torch.get_num_threads())
    if rc != 0:
        raise IndexError(f"Mamba2 step: a slot in {slots.tolist()} is outside the state cache's {state.shape[0]} slots")
    return y


def mamba_step(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, D: Tensor, state: Tensor, slots: Tensor,
               carry: Tensor) -> Optional[Tensor]:
    """One token of each of ``n`` sequences through the Mamba (v1) recurrence (``ssm.py``), updating
    ``state [num_slots, c, dstate]`` in place at ``slots`` (a zero state where ``carry`` is False):
    ``x``/discretised ``dt [n, c]``, ``B``/``C [n, dstate]``, ``A [c, dstate]`` (all <= 0), ``D [c]``
    -> ``y [n, c]`` float32. None, with nothing written, when the kernel cannot take these inputs."""
    lib = loaded()
    if lib is None or x.dim() != 2 or B.dim() != 2 or state.dtype != torch.float32 or not state.is_cpu:
        return None
    n, c = x.shape
    dstate = B.shape[1]
    if state.shape[1:] != (c, dstate) or not state.is_contiguous():
        return None
    x, dt, B, C = _rows(x, (c,)), _rows(dt, (c,)), _rows(B, (dstate,)), _rows(C, (dstate,))
    A, D = _vector(A, c * dstate), _vector(D, c)
    if x is None or dt is None or B is None or C is None or A is None or D is None or not _slot_rows(slots, carry, n):
        return None
    y = x.new_empty(n, c)
    rc = lib.ad_mamba_step_f32(x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), B.data_ptr(), B.stride(0),
                               C.data_ptr(), C.stride(0), A.data_ptr(), D.data_ptr(), state.data_ptr(), state.shape[0],
                               slots.data_ptr(), carry.data_ptr(), y.data_ptr(), n, c, dstate, torch.get_num_threads())
    if rc != 0:
        raise IndexError(f"Mamba step: a slot in {slots.tolist()} is outside the state cache's {state.shape[0]} slots")
    return y


_CONV_ACTIVATIONS = {None: 0, "silu": 1, "swish": 1}


def conv_step(x: Tensor, windows: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str],
              slots: Tensor, carry: Tensor) -> Optional[Tensor]:
    """One token ``x [n, c]`` of each of ``n`` sequences through a depthwise causal conv (``weight
    [c, 1, k]`` or ``[c, k]``), shifting ``windows [num_slots, c, k - 1]`` in place at ``slots`` (a
    zero window where ``carry`` is False) -> ``y [n, c]`` float32, activation (None or ``'silu'``)
    applied. None, with nothing written, when the kernel cannot take these inputs."""
    lib = loaded()
    if lib is None or activation not in _CONV_ACTIVATIONS or x.dim() != 2:
        return None
    n, c = x.shape
    k = weight.shape[-1]
    if (windows.shape[1:] != (c, k - 1) or windows.dtype != torch.float32 or not windows.is_cpu
            or not windows.is_contiguous()):
        return None
    x, weight, taken_bias = _rows(x, (c,)), _vector(weight, c * k), None if bias is None else _vector(bias, c)
    if x is None or weight is None or (bias is not None and taken_bias is None) or not _slot_rows(slots, carry, n):
        return None
    bias = taken_bias
    y = x.new_empty(n, c)
    rc = lib.ad_conv_step_f32(x.data_ptr(), x.stride(0), windows.data_ptr(), windows.shape[0], slots.data_ptr(),
                              carry.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                              _CONV_ACTIVATIONS[activation], y.data_ptr(), n, c, k, torch.get_num_threads())
    if rc != 0:
        raise IndexError(f"conv step: a slot in {slots.tolist()} is outside the cache's {windows.shape[0]} windows")
    return y


def fast_weight_step(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor], beta: Optional[Tensor],
                     state: Tensor, slots: Tensor, carry: Tensor, scale: Optional[float], use_qk_l2norm: bool
                     ) -> Optional[Tensor]:
    """One token of each of ``n`` sequences through a fast-weight state ``[num_slots, h, dk, dv]``,
    updated in place at ``slots`` (a zero state where ``carry`` is False): the delta rule
    (``delta_rule.py``; ``beta [n, h]`` given) or decayed linear attention (``linear_attention.py``;
    ``beta`` None). q/k ``[n, hk, dk]``, v ``[n, h, dv]``, ``log_decay`` None, ``[n, h]``, ``[n, h, 1]``
    or ``[n, h, dk]`` -> ``y [n, h, dv]`` float32. None, with nothing written, when the kernel cannot
    take these inputs."""
    lib = loaded()
    if lib is None or q.dim() != 3 or v.dim() != 3 or state.dtype != torch.float32 or not state.is_cpu:
        return None
    n, h, dv = v.shape
    hk, dk = q.shape[1], q.shape[2]
    if (not hk or h % hk or state.shape[1:] != (h, dk, dv) or not state.is_contiguous() or dk > 1024
            or dv > 1024):
        return None
    q, k, v = _rows(q, (hk, dk)), _rows(k, (hk, dk)), _rows(v, (h, dv))
    width = 0
    if log_decay is not None:
        width = log_decay.shape[-1] if log_decay.dim() == 3 else 1
        log_decay = _rows(log_decay.reshape(n, h, width), (h, width)) if width in (1, dk) else None
    taken_beta = None if beta is None else _rows(beta.reshape(n, h), (h,))
    if (q is None or k is None or v is None or (width and log_decay is None)
            or (beta is not None and taken_beta is None) or not _slot_rows(slots, carry, n)):
        return None
    y = v.new_empty(n, h, dv)
    rc = lib.ad_fast_weight_step_f32(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        None if taken_beta is None else taken_beta.data_ptr(), 0 if taken_beta is None else taken_beta.stride(0),
        None if log_decay is None else log_decay.data_ptr(), 0 if log_decay is None else log_decay.stride(0), width,
        state.data_ptr(), state.shape[0], slots.data_ptr(), carry.data_ptr(), y.data_ptr(), n, h, hk, dk, dv,
        dk ** -0.5 if scale is None else scale, int(use_qk_l2norm), torch.get_num_threads())
    if rc != 0:
        raise IndexError(f"fast-weight step: a slot in {slots.tolist()} is outside the state cache's "
                         f"{state.shape[0]} slots")
    return y
