"""The C kernels of a state op's step (``csrc/state_step_f32.c``): every sequence of a step (a
prefill's tokens, a decode's one) through the op at once, each state updated in place in its own
cache slot.

These are ``scan_each_sequence``'s ``step_all`` on CPU (``causal_conv.py``): the causal conv window,
the Mamba2 and Mamba scans, and the fast-weight states of the delta rules and decayed linear
attention. Each wrapper takes the step's per-token rows (``[rows, ...]``, possibly strided: the
graph's splits of one projection), the state cache, the sequences' row offsets ``cu [n + 1]`` and
slots ``[n]`` (int32) and carry flags ``[n]`` (bool: False starts from a zero state whatever the
slot holds), and returns the outputs ``[rows, ...]`` as float32, or None, having written nothing,
when the kernel cannot take the inputs (not on the CPU, a cache not float32 or not contiguous, no
library: ``native.load``); the caller then takes its torch path. Half-precision inputs are read as
float32 (the references compute in float32 too). A slot outside the cache raises
``IndexError`` and offsets that do not fit the rows ``ValueError``, before anything is written.
The wrappers run once per layer of every step, so they check with the cheap tensor properties.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from .native import loaded

# the kernels' return codes other than 0 (nothing was written)
_SLOT, _OFFSETS = -1, -3


def _step_layout(cu: Tensor, slots: Tensor, carry: Tensor) -> bool:
    """The sequences' row offsets ``[n + 1]``, cache slots ``[n]`` (int32) and carry flags ``[n]``
    (bool), contiguous CPU tensors."""
    n = slots.shape[0] if slots.dim() == 1 else -1
    return (slots.dtype == torch.int32 and cu.dtype == torch.int32 and carry.dtype == torch.bool and slots.is_cpu
            and cu.is_cpu and carry.is_cpu and carry.shape == (n,) and cu.shape == (n + 1,)
            and slots.stride(0) == 1 and carry.stride(0) == 1 and cu.stride(0) == 1)


def _cache_fits(state: Tensor, shape: Tuple[int, ...]) -> bool:
    """A float32, contiguous CPU state cache of ``[num_slots, *shape]``."""
    return (state.dtype == torch.float32 and state.is_cpu and tuple(state.shape[1:]) == shape
            and state.is_contiguous())


# Input dtypes the wrappers take: half-precision rows are read as float32 copies, which is what the
# torch references do first (they compute in float32 and round only the output, as the driver does
# with the kernel's float32 output).
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _rows(t: Tensor, inner: Tuple[int, ...]) -> Optional[Tensor]:
    """``t [rows, *inner]`` (CPU; ``inner`` one or two dims) as float32: itself when it is float32
    and each row is laid out contiguously (any row stride: a split of a wider projection is), else a
    contiguous float32 copy; None for another shape, dtype or device."""
    if t.shape[1:] != inner or t.dtype not in _INPUT_DTYPES or not t.is_cpu:
        return None
    if t.dtype != torch.float32:
        return t.float().contiguous()
    if t.stride(-1) != 1 or (len(inner) == 2 and inner[0] > 1 and t.stride(1) != inner[1]):
        return t.contiguous()
    return t


def _vector(t: Tensor, size: int) -> Optional[Tensor]:
    """``t`` (``size`` elements, CPU) as contiguous float32 memory: itself when it already is (the
    kernels read the pointer, whatever the shape: a ``[c, 1, k]`` conv weight is ``[c * k]``), else a
    converted copy; None for another size, dtype or device."""
    if t.numel() != size or not t.is_cpu:
        return None
    if t.dtype == torch.float32 and t.is_contiguous():
        return t
    return t.reshape(size).float().contiguous() if t.dtype in _INPUT_DTYPES else None


def _raise_for(rc: int, what: str, cu: Tensor, slots: Tensor, num_slots: int, rows: int) -> None:
    if rc == _SLOT:
        raise IndexError(f"{what}: a slot in {slots.tolist()} is outside the state cache's {num_slots} slots")
    if rc == _OFFSETS:
        raise ValueError(f"{what}: the row offsets {cu.tolist()} do not fit the step's {rows} rows")
    if rc != 0:
        raise RuntimeError(f"{what}: the kernel returned {rc}")


def mamba2_step(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, D: Tensor, state: Tensor, cu: Tensor,
                slots: Tensor, carry: Tensor) -> Optional[Tensor]:
    """The Mamba2 recurrence (``ssm.py``) over a step's sequences, updating ``state [num_slots,
    heads, head_dim, dstate]`` in place: ``x [rows, heads, head_dim]``, discretised ``dt [rows,
    heads]``, ``B``/``C [rows, groups, dstate]``, ``A``/``D [heads]`` -> ``y [rows, heads, head_dim]``
    float32; None, with nothing written, when the kernel cannot take these inputs."""
    lib = loaded()
    if lib is None or x.dim() != 3 or B.dim() != 3:
        return None
    rows, heads, head_dim = x.shape
    groups, dstate = B.shape[1], B.shape[2]
    if not groups or heads % groups or not _cache_fits(state, (heads, head_dim, dstate)):
        return None
    x, dt = _rows(x, (heads, head_dim)), _rows(dt, (heads,))
    B, C = _rows(B, (groups, dstate)), _rows(C, (groups, dstate))
    A, D = _vector(A, heads), _vector(D, heads)
    if any(t is None for t in (x, dt, B, C, A, D)) or not _step_layout(cu, slots, carry):
        return None
    y = x.new_empty(rows, heads, head_dim)
    rc = lib.ad_mamba2_step_f32(x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), B.data_ptr(), B.stride(0),
                                C.data_ptr(), C.stride(0), A.data_ptr(), D.data_ptr(), state.data_ptr(),
                                state.shape[0], cu.data_ptr(), rows, slots.data_ptr(), carry.data_ptr(), y.data_ptr(),
                                slots.shape[0], heads, head_dim, groups, dstate, torch.get_num_threads())
    _raise_for(rc, "Mamba2 step", cu, slots, state.shape[0], rows)
    return y


def mamba_step(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, D: Tensor, state: Tensor, cu: Tensor,
               slots: Tensor, carry: Tensor) -> Optional[Tensor]:
    """The Mamba (v1) recurrence (``ssm.py``) over a step's sequences, updating ``state [num_slots,
    c, dstate]`` in place: ``x``/discretised ``dt [rows, c]``, ``B``/``C [rows, dstate]``, ``A [c,
    dstate]`` (all <= 0), ``D [c]`` -> ``y [rows, c]`` float32; None, with nothing written, when the
    kernel cannot take these inputs."""
    lib = loaded()
    if lib is None or x.dim() != 2 or B.dim() != 2:
        return None
    rows, c = x.shape
    dstate = B.shape[1]
    if not _cache_fits(state, (c, dstate)):
        return None
    x, dt, B, C = _rows(x, (c,)), _rows(dt, (c,)), _rows(B, (dstate,)), _rows(C, (dstate,))
    A, D = _vector(A, c * dstate), _vector(D, c)
    if any(t is None for t in (x, dt, B, C, A, D)) or not _step_layout(cu, slots, carry):
        return None
    y = x.new_empty(rows, c)
    rc = lib.ad_mamba_step_f32(x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), B.data_ptr(), B.stride(0),
                               C.data_ptr(), C.stride(0), A.data_ptr(), D.data_ptr(), state.data_ptr(), state.shape[0],
                               cu.data_ptr(), rows, slots.data_ptr(), carry.data_ptr(), y.data_ptr(), slots.shape[0],
                               c, dstate, torch.get_num_threads())
    _raise_for(rc, "Mamba step", cu, slots, state.shape[0], rows)
    return y


_CONV_ACTIVATIONS = {None: 0, "silu": 1, "swish": 1}


def conv_step(x: Tensor, windows: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str],
              cu: Tensor, slots: Tensor, carry: Tensor) -> Optional[Tensor]:
    """A depthwise causal conv (``weight [c, 1, k]`` or ``[c, k]``) over a step's sequences ``x
    [rows, c]``, each continuing from and shifting its window in ``windows [num_slots, c, k - 1]``
    in place -> ``y [rows, c]`` float32, activation (None or ``'silu'``) applied; None, with nothing
    written, when the kernel cannot take these inputs."""
    lib = loaded()
    # the conv runs in the weight's dtype (``causal_conv.py``): the kernel's float32 only for float32 taps
    if lib is None or activation not in _CONV_ACTIVATIONS or x.dim() != 2 or weight.dtype != torch.float32:
        return None
    rows, c = x.shape
    k = weight.shape[-1]
    if not _cache_fits(windows, (c, k - 1)):
        return None
    x, weight, taken_bias = _rows(x, (c,)), _vector(weight, c * k), None if bias is None else _vector(bias, c)
    if x is None or weight is None or (bias is not None and taken_bias is None) or not _step_layout(cu, slots, carry):
        return None
    y = x.new_empty(rows, c)
    rc = lib.ad_conv_step_f32(x.data_ptr(), x.stride(0), windows.data_ptr(), windows.shape[0], cu.data_ptr(), rows,
                              slots.data_ptr(), carry.data_ptr(), weight.data_ptr(),
                              None if taken_bias is None else taken_bias.data_ptr(), _CONV_ACTIVATIONS[activation],
                              y.data_ptr(), slots.shape[0], c, k, torch.get_num_threads())
    _raise_for(rc, "conv step", cu, slots, windows.shape[0], rows)
    return y


def fast_weight_step(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor], beta: Optional[Tensor],
                     state: Tensor, cu: Tensor, slots: Tensor, carry: Tensor, scale: Optional[float],
                     use_qk_l2norm: bool) -> Optional[Tensor]:
    """A fast-weight state ``[num_slots, h, dk, dv]`` over a step's sequences, updated in place:
    the delta rule (``delta_rule.py``; ``beta [rows, h]`` given) or decayed linear attention
    (``linear_attention.py``; ``beta`` None). q/k ``[rows, hk, dk]``, v ``[rows, h, dv]``,
    ``log_decay`` None, ``[rows, h]``, ``[rows, h, 1]`` or ``[rows, h, dk]`` -> ``y [rows, h, dv]``
    float32; None, with nothing written, when the kernel cannot take these inputs."""
    lib = loaded()
    if lib is None or q.dim() != 3 or v.dim() != 3:
        return None
    rows, h, dv = v.shape
    hk, dk = q.shape[1], q.shape[2]
    if not hk or h % hk or not _cache_fits(state, (h, dk, dv)) or dk > 1024 or dv > 1024:
        return None
    q, k, v = _rows(q, (hk, dk)), _rows(k, (hk, dk)), _rows(v, (h, dv))
    width = 0
    if log_decay is not None:
        width = log_decay.shape[-1] if log_decay.dim() == 3 else 1
        log_decay = _rows(log_decay.reshape(rows, h, width), (h, width)) if width in (1, dk) else None
    taken_beta = None if beta is None else _rows(beta.reshape(rows, h), (h,))
    if (q is None or k is None or v is None or (width and log_decay is None)
            or (beta is not None and taken_beta is None) or not _step_layout(cu, slots, carry)):
        return None
    y = v.new_empty(rows, h, dv)
    rc = lib.ad_fast_weight_step_f32(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        None if taken_beta is None else taken_beta.data_ptr(), 0 if taken_beta is None else taken_beta.stride(0),
        None if log_decay is None else log_decay.data_ptr(), 0 if log_decay is None else log_decay.stride(0), width,
        state.data_ptr(), state.shape[0], cu.data_ptr(), rows, slots.data_ptr(), carry.data_ptr(), y.data_ptr(),
        slots.shape[0], h, hk, dk, dv, dk ** -0.5 if scale is None else scale, int(use_qk_l2norm),
        torch.get_num_threads())
    _raise_for(rc, "fast-weight step", cu, slots, state.shape[0], rows)
    return y


def diagonal_recurrence_step(x: Tensor, a: Tensor, state: Tensor, cu: Tensor, slots: Tensor,
                             carry: Tensor) -> Optional[Tensor]:
    """RecurrentGemma's RG-LRU scan ``h = a h + x`` (``diagonal_recurrence.py``) over a step's
    sequences, ``x``/``a [rows, w]``, updating ``state [num_slots, w]`` in place -> ``y [rows, w]``
    float32; None, with nothing written, when the kernel cannot take these inputs."""
    lib = loaded()
    if lib is None or x.dim() != 2 or not _cache_fits(state, (x.shape[1],)):
        return None
    rows, w = x.shape
    x, a = _rows(x, (w,)), _rows(a, (w,))
    if x is None or a is None or not _step_layout(cu, slots, carry):
        return None
    y = x.new_empty(rows, w)
    rc = lib.ad_diagonal_recurrence_f32(x.data_ptr(), x.stride(0), a.data_ptr(), a.stride(0), state.data_ptr(),
                                        state.shape[0], cu.data_ptr(), rows, slots.data_ptr(), carry.data_ptr(),
                                        y.data_ptr(), slots.shape[0], w, torch.get_num_threads())
    _raise_for(rc, "diagonal recurrence step", cu, slots, state.shape[0], rows)
    return y


def wkv_step(time_decay: Tensor, time_first: Tensor, k: Tensor, v: Tensor, state: Tensor, cu: Tensor,
             slots: Tensor, carry: Tensor) -> Optional[Tensor]:
    """RWKV-4's WKV (``wkv.py``) over a step's sequences, ``k``/``v [rows, c]``, updating ``state
    [num_slots, 3, c]`` (numerator, denominator, exponent) in place -> ``y [rows, c]`` float32;
    None, with nothing written, when the kernel cannot take these inputs."""
    lib = loaded()
    if lib is None or k.dim() != 2 or not _cache_fits(state, (3, k.shape[1])):
        return None
    rows, c = k.shape
    k, v = _rows(k, (c,)), _rows(v, (c,))
    time_decay, time_first = _vector(time_decay, c), _vector(time_first, c)
    if k is None or v is None or time_decay is None or time_first is None or not _step_layout(cu, slots, carry):
        return None
    y = k.new_empty(rows, c)
    rc = lib.ad_wkv_f32(time_decay.data_ptr(), time_first.data_ptr(), k.data_ptr(), k.stride(0), v.data_ptr(),
                        v.stride(0), state.data_ptr(), state.shape[0], cu.data_ptr(), rows, slots.data_ptr(),
                        carry.data_ptr(), y.data_ptr(), slots.shape[0], c, torch.get_num_threads())
    _raise_for(rc, "WKV step", cu, slots, state.shape[0], rows)
    return y


def mlstm_step(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, state: Tensor, cu: Tensor, slots: Tensor,
               carry: Tensor, eps: float) -> Optional[Tensor]:
    """xLSTM's mLSTM (``mlstm.py``) over a step's sequences, q/k ``[rows, nh, dqk]``, v ``[rows, nh,
    dv]``, the gates' pre-activations i/f ``[rows, nh]``, updating the packed ``state [num_slots, nh,
    dqk + 1, dv + 1]`` in place -> ``y [rows, nh, dv]`` float32; None, with nothing written, when the
    kernel cannot take these inputs."""
    lib = loaded()
    if lib is None or q.dim() != 3 or v.dim() != 3:
        return None
    rows, nh, dqk = q.shape
    dv = v.shape[2]
    if not _cache_fits(state, (nh, dqk + 1, dv + 1)):
        return None
    q, k, v = _rows(q, (nh, dqk)), _rows(k, (nh, dqk)), _rows(v, (nh, dv))
    i, f = _rows(i, (nh,)), _rows(f, (nh,))
    if any(t is None for t in (q, k, v, i, f)) or not _step_layout(cu, slots, carry):
        return None
    y = v.new_empty(rows, nh, dv)
    rc = lib.ad_mlstm_f32(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                          i.data_ptr(), i.stride(0), f.data_ptr(), f.stride(0), state.data_ptr(), state.shape[0],
                          cu.data_ptr(), rows, slots.data_ptr(), carry.data_ptr(), y.data_ptr(), slots.shape[0], nh,
                          dqk, dv, eps, torch.get_num_threads())
    _raise_for(rc, "mLSTM step", cu, slots, state.shape[0], rows)
    return y
