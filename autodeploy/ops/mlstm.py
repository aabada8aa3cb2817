"""The mLSTM of xLSTM (``xLSTMForCausalLM``, the xLSTM-7b family): a matrix memory with exponential
input and sigmoid forget gates and a max-stabiliser.

Per head, with ``q~ = q / sqrt(dqk)`` and the state ``C [dqk, dv]``, ``n [dqk]``, ``m`` (all zero
at the start of a sequence, as in HF), for every token in fp32::

    m_t = max(log sigmoid(f_t) + m_{t-1}, i_t)
    C_t = exp(log sigmoid(f_t) + m_{t-1} - m_t) C_{t-1} + exp(i_t - m_t) k_t v_t^T
    n_t = exp(log sigmoid(f_t) + m_{t-1} - m_t) n_{t-1} + exp(i_t - m_t) k_t
    h_t = (q~_t C_t) / (max(|q~_t . n_t|, exp(-m_t)) + eps)

``i``/``f`` are the gates' pre-activations (soft-capped by the model). Shapes, layout ``bsnd``:
q/k ``[b, s, nh, dqk]``, v ``[b, s, nh, dv]``, i/f ``[b, s, nh]``; output ``[b, s, nh, dv]`` in v's
dtype.

Two evaluations of the same recurrence:

* ``torch_mlstm`` (from the zero state) takes the exact *parallel form*: with
  ``F_t = sum_{r<=t} log sigmoid(f_r)``, ``m_t = max(F_t, max_{s<=t} F_t - F_s + i_s)`` and the
  stabilised decays ``D_ts = exp(F_t - F_s + i_s - m_t)`` (``s <= t``), ``q~_t C_t`` is
  ``sum_s D_ts (q~_t . k_s) v_s`` and ``q~_t . n_t`` the same sum without ``v_s``. Nothing in it
  depends on the sequence length, so export keeps it dynamic; it costs a ``[s, s]`` matrix per head.
* ``torch_cached_mlstm`` steps the recurrence token by token from each sequence's stored state,
  ``state_cache [num_slots, nh, dqk + 1, dv + 1]`` in fp32: ``C`` in ``[:, :dqk, :dv]``, ``n`` as the
  extra column ``[:, :dqk, dv]`` and ``m`` in the corner ``[:, dqk, dv]`` (one tensor, so one
  ``StateHandler``). Zeros are HF's initial state, so a new sequence needs nothing special.
  The step driver is ``causal_conv.scan_each_sequence``; on CPU a C kernel
  (``native_state.mlstm_step``) runs the same recurrence, one pass over ``C`` a token.

The tests hold the two to each other and to HF's own mLSTM (through the coverage sweep's model).
"""

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native_state
from .causal_conv import scan_each_sequence


def _check(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor) -> None:
    b, s, nh, _ = q.shape
    if k.shape != q.shape or v.shape[:3] != (b, s, nh) or i.shape != (b, s, nh) or f.shape != (b, s, nh):
        raise ValueError(f"mlstm: q {tuple(q.shape)} and k {tuple(k.shape)} must be [b, s, nh, dqk], v "
                         f"{tuple(v.shape)} [b, s, nh, dv], i {tuple(i.shape)} and f {tuple(f.shape)} [b, s, nh]")


def _parallel(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, eps: float) -> Tensor:
    """The whole sequence from the zero state at once; returns ``[b, s, nh, dv]`` in v's dtype."""
    out_dtype = v.dtype
    dtype = torch.float64 if out_dtype == torch.float64 else torch.float32
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))  # [b, nh, s, d]
    log_f = F.logsigmoid(f.to(dtype).transpose(1, 2)).cumsum(-1)  # F_t: [b, nh, s]
    seq = q.shape[2]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    log_d = log_f[..., :, None] - log_f[..., None, :] + i.to(dtype).transpose(1, 2)[..., None, :]
    log_d = log_d.masked_fill(~causal, float("-inf"))  # [b, nh, t, s]
    stab = torch.maximum(log_f, log_d.amax(dim=-1))  # m_t: [b, nh, s]
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5) * torch.exp(log_d - stab[..., None])
    denominator = torch.maximum(scores.sum(dim=-1, keepdim=True).abs(), torch.exp(-stab)[..., None])
    return ((scores @ v) / (denominator + eps)).transpose(1, 2).to(out_dtype).contiguous()


def _steps(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, state: Tensor,
           eps: float) -> Tuple[Tensor, Tensor]:
    """Token by token from ``state [b, nh, dqk + 1, dv + 1]`` (C, n, m packed); returns (output
    ``[b, s, nh, dv]`` in v's dtype, the fp32 state after the last token)."""
    dqk, dv, out_dtype = q.shape[-1], v.shape[-1], v.dtype
    state = state.float()
    c, n, m = state[..., :dqk, :dv], state[..., :dqk, dv], state[..., dqk, dv]  # [b,nh,dqk,dv], [b,nh,dqk], [b,nh]
    q = q.float() * dqk ** -0.5
    k, v, i, log_f = k.float(), v.float(), i.float(), F.logsigmoid(f.float())
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        m_new = torch.maximum(log_f[:, t] + m, i[:, t])
        forget, write = torch.exp(log_f[:, t] + m - m_new), torch.exp(i[:, t] - m_new)
        k_t = k[:, t] * write[..., None]  # [b, nh, dqk]
        c = forget[..., None, None] * c + k_t[..., :, None] * v[:, t, :, None, :]
        n = forget[..., None] * n + k_t
        m = m_new
        q_t = q[:, t]
        numerator = (q_t[..., None, :] @ c).squeeze(-2)  # [b, nh, dv]
        denominator = torch.maximum((q_t * n).sum(-1).abs(), torch.exp(-m))
        out[:, t] = numerator / (denominator + eps)[..., None]
    packed = torch.zeros_like(state)
    packed[..., :dqk, :dv], packed[..., :dqk, dv], packed[..., dqk, dv] = c, n, m
    return out.to(out_dtype), packed


@torch.library.custom_op("autodeploy::torch_mlstm", mutates_args=())
def torch_mlstm(q: Tensor, k: Tensor, v: Tensor, i: Tensor, f: Tensor, eps: float = 1e-6) -> Tensor:
    """The mLSTM over whole sequences from the zero state (the parallel form)."""
    _check(q, k, v, i, f)
    return _parallel(q, k, v, i, f, eps)


@torch_mlstm.register_fake
def _mlstm_fake(q, k, v, i, f, eps=1e-6):
    return torch.empty_like(v, memory_format=torch.contiguous_format)


@torch.library.custom_op("autodeploy::torch_cached_mlstm", mutates_args=("state_cache",))
def torch_cached_mlstm(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    i: Tensor,
    f: Tensor,
    batch_info: Tensor,
    seq_len: Tensor,
    cu_seqlen: Tensor,
    slot_idx: Tensor,
    use_initial_state: Tensor,
    state_cache: Tensor,
    eps: float = 1e-6,
) -> Tensor:
    """``torch_mlstm`` over a flattened step, each sequence continuing its slot's packed state
    ``state_cache [num_slots, nh, dqk + 1, dv + 1]``."""
    _check(q, k, v, i, f)
    nh, dqk, dv = q.shape[2], q.shape[3], v.shape[3]
    if tuple(state_cache.shape[1:]) != (nh, dqk + 1, dv + 1):
        raise ValueError(f"mlstm: state cache {tuple(state_cache.shape)} does not fit q {tuple(q.shape)}, v "
                         f"{tuple(v.shape)} (wants [slots, nh, dqk + 1, dv + 1])")

    def scan(tokens: Sequence[Tensor], initial: Tensor) -> Tuple[Tensor, Tensor]:
        v_, q_, k_, i_, f_ = tokens
        return _steps(q_, k_, v_, i_, f_, initial, eps)

    def step_all(tokens: Sequence[Tensor], cu: Tensor, slots: Tensor, carry: Tensor) -> Optional[Tensor]:
        v_, q_, k_, i_, f_ = tokens
        return native_state.mlstm_step(q_, k_, v_, i_, f_, state_cache, cu, slots, carry, eps)

    return scan_each_sequence(scan, [v, q, k, i, f], batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state,
                              state_cache, step_all=step_all)


@torch_cached_mlstm.register_fake
def _cached_mlstm_fake(q, k, v, i, f, batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state, state_cache,
                       eps=1e-6):
    return torch.empty_like(v, memory_format=torch.contiguous_format)
