"""Delta-rule linear attention: DeltaNet, Gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo-Hybrid) and
Kimi Delta Attention (Kimi-Linear, Bailing-Hybrid, GLM-5-Next), plus ``torch_l2norm``.

Each head keeps a fast-weight state ``S [dk, dv]`` (zeros at the start of a sequence). For every
token, in fp32::

    S   = S * exp(g)                       # decay; g is a log-decay (<= 0), per head or per key channel
    S   = S + k (beta * (v - S^T k))^T     # delta rule: write only what S does not already recall for k
    o   = S^T (scale * q)                  # read with the query

``g`` absent is plain DeltaNet. ``use_qk_l2norm`` L2-normalises q and k (eps 1e-6) before the
scale, as HF's kernels do with ``use_qk_l2norm_in_kernel=True`` (every model in transformers
5.23 passes True). ``scale`` defaults to ``dk ** -0.5``, the only value HF uses.

Shapes are the ones HF passes to its kernel functions (``torch_chunk_gated_delta_rule`` and
friends), layout ``bsnd``: q/k ``[b, s, hk, dk]``, v ``[b, s, h, dv]``, beta ``[b, s, h]``,
g ``[b, s, h]`` (per head) or ``[b, s, h, dk]`` (per channel, KDA), output ``[b, s, h, dv]`` in
q's dtype. ``h % hk == 0``: like HF, each q/k head serves ``h // hk`` *consecutive* value heads
(``repeat_interleave``, not ``repeat``); the graph never materialises the expansion. What HF does
around the kernel (the short causal conv, the gate's softplus/``A_log`` arithmetic, the sigmoid on
beta, OLMo's ``beta * 2``, the gated RMSNorm on the output) stays outside these ops.

The references are the token-by-token recurrence: readable and exact. HF's chunked form (chunks
of 64 with a triangular solve) is the same math, and the tests hold both to it.

Cached variants run on the flattened-token graph (every token of the step in one row, q/k/v
``[1, T, ...]``) with the metadata ``batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state``
(no ``input_pos``: whether a sequence continues is all a recurrence needs) and a state cache
``[num_slots, h, dk, dv]``, read and updated in place. Keep it fp32 (HF does): it is a running
sum over the whole sequence; the op computes in fp32 whatever its dtype and rounds only to store.
Sequence ``i`` (rows ``cu_seqlen[i]:cu_seqlen[i + 1]``) starts from ``state_cache[slot_idx[i]]``
when ``use_initial_state[i]`` (a later prefill chunk or a decode), else from zeros (a new or
preempted-and-restarted sequence: whatever the slot holds is ignored), and its final state is
written back to that slot. No other slot is read or written. The step driver is
``causal_conv.scan_each_sequence``, shared with the conv and SSM ops.
"""

from typing import List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import native_state
from .causal_conv import scan_each_sequence

# HF's kernels hard-code this eps for the in-kernel q/k normalisation.
QK_L2NORM_EPS = 1e-6


def _l2norm(x: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


@torch.library.custom_op("autodeploy::torch_l2norm", mutates_args=())
def torch_l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """``x / sqrt(sum(x^2, -1) + eps)`` over the last dim, computed in fp32, cast back to x's dtype.

    eps is added to the sum of squares inside the root (FLA's convention), not used as a clamp
    on the norm as in ``F.normalize``. Spelled ``x * rsqrt(...)`` as Qwen3-Next's ``l2norm``, so
    fp32 inputs give its result bit for bit; Kimi's ``x / sqrt(...)`` differs by up to 2 ulps.
    """
    return _l2norm(x.float(), eps).to(x.dtype)


@torch_l2norm.register_fake
def _torch_l2norm_fake(x, eps=1e-6):
    return torch.empty_like(x)


def _check_heads(q: Tensor, k: Tensor, v: Tensor) -> int:
    """Number of value heads; q/k heads must divide it."""
    hk, h = k.shape[-2], v.shape[-2]
    if q.shape[-2] != hk or h % hk != 0:
        raise ValueError(f"delta rule: q/k heads {q.shape[-2]}/{hk} must be equal and divide the {h} value heads")
    return h


def _recurrence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Optional[Tensor],
    beta: Tensor,
    state: Tensor,
    scale: Optional[float],
    use_qk_l2norm: bool,
) -> Tuple[Tensor, Tensor]:
    """The delta rule over ``s`` tokens of ``b`` independent sequences, in fp32.

    q/k ``[b, s, hk, dk]``, v ``[b, s, h, dv]``, beta ``[b, s, h]``, log_decay ``None`` or
    ``[b, s, h, 1 | dk]``, state ``[b, h, dk, dv]`` (the state before the first token).
    Returns (output ``[b, s, h, dv]`` fp32, state after the last token ``[b, h, dk, dv]`` fp32).
    """
    h = _check_heads(q, k, v)
    groups = h // k.shape[-2]
    q, k = (x.float().repeat_interleave(groups, dim=2) if groups > 1 else x.float() for x in (q, k))
    v, beta = v.float(), beta.float()
    if use_qk_l2norm:
        q, k = _l2norm(q, QK_L2NORM_EPS), _l2norm(k, QK_L2NORM_EPS)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    decay = None if log_decay is None else log_decay.float().exp().unsqueeze(-1)  # [b, s, h, 1|dk, 1]
    state = state.float()
    out = v.new_empty(v.shape)
    for t in range(v.shape[1]):
        if decay is not None:
            state = state * decay[:, t]
        k_t = k[:, t].unsqueeze(-2)  # [b, h, 1, dk]
        recalled = k_t @ state  # [b, h, 1, dv]: what the state already returns for k_t
        delta = (v[:, t].unsqueeze(-2) - recalled) * beta[:, t, :, None, None]
        state = state + k_t.transpose(-1, -2) @ delta
        out[:, t] = (q[:, t].unsqueeze(-2) @ state).squeeze(-2)
    return out, state


def _step_in_place(q: Tensor, k: Tensor, v: Tensor, log_decay: Optional[Tensor], beta: Tensor, state: Tensor,
                   scale: Optional[float], use_qk_l2norm: bool) -> Tensor:
    """``_recurrence`` for one token of one sequence (q/k ``[hk, dk]``, v ``[h, dv]``, beta ``[h]``,
    log_decay ``None`` or ``[h, 1 | dk]``), updating its fp32 ``state [h, dk, dv]`` in place
    (``scan_each_sequence``'s CPU decode path); returns the output ``[h, dv]`` fp32."""
    groups = v.shape[-2] // k.shape[-2]
    q, k = (x.float().repeat_interleave(groups, dim=0) if groups > 1 else x.float() for x in (q, k))
    if use_qk_l2norm:
        q, k = _l2norm(q, QK_L2NORM_EPS), _l2norm(k, QK_L2NORM_EPS)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    if log_decay is not None:
        state.mul_(log_decay.float().exp().unsqueeze(-1))
    recalled = k.unsqueeze(-2) @ state  # [h, 1, dv]
    delta = (v.float().unsqueeze(-2) - recalled) * beta.float()[:, None, None]
    state.baddbmm_(k.unsqueeze(-1), delta)
    return (q.unsqueeze(-2) @ state).squeeze(-2)


def _uncached(q, k, v, log_decay, beta, scale, use_qk_l2norm) -> Tensor:
    b, _, h, _ = v.shape
    zeros = v.new_zeros(b, h, k.shape[-1], v.shape[-1], dtype=torch.float32)
    out, _ = _recurrence(q, k, v, log_decay, beta, zeros, scale, use_qk_l2norm)
    return out.to(q.dtype)


def _output_fake(q: Tensor, v: Tensor) -> Tensor:
    return q.new_empty(*v.shape)


@torch.library.custom_op("autodeploy::torch_gated_delta_rule", mutates_args=())
def torch_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
) -> Tensor:
    """Gated DeltaNet: one log-decay per head and token, ``g [b, s, h]``.

    Equals HF's ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule`` with
    ``initial_state=None`` (first return value) and ``scale=None``.
    """
    return _uncached(q, k, v, g.unsqueeze(-1), beta, scale, use_qk_l2norm)


@torch_gated_delta_rule.register_fake
def _gated_fake(q, k, v, g, beta, scale=None, use_qk_l2norm=False):
    return _output_fake(q, v)


@torch.library.custom_op("autodeploy::torch_delta_rule", mutates_args=())
def torch_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
) -> Tensor:
    """DeltaNet: the gated delta rule without decay (``g = 0``)."""
    return _uncached(q, k, v, None, beta, scale, use_qk_l2norm)


@torch_delta_rule.register_fake
def _delta_fake(q, k, v, beta, scale=None, use_qk_l2norm=False):
    return _output_fake(q, v)


@torch.library.custom_op("autodeploy::torch_gated_delta_rule_channelwise", mutates_args=())
def torch_gated_delta_rule_channelwise(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
) -> Tensor:
    """Kimi Delta Attention: one log-decay per key channel, ``g [b, s, h, dk]``: row ``i`` of
    each head's state decays by ``exp(g[..., i])``.

    Equals HF kimi_linear's ``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``
    with ``initial_state=None``. Kimi has ``hk == h``; fewer q/k heads are accepted as above.
    """
    return _uncached(q, k, v, g, beta, scale, use_qk_l2norm)


@torch_gated_delta_rule_channelwise.register_fake
def _channelwise_fake(q, k, v, g, beta, scale=None, use_qk_l2norm=False):
    return _output_fake(q, v)


# ---- cached variants (flattened-token graph) ------------------------------------------------


def _cached(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_decay: Optional[Tensor],
    beta: Tensor,
    batch_info: Tensor,
    seq_len: Tensor,
    cu_seqlen: Tensor,
    slot_idx: Tensor,
    use_initial_state: Tensor,
    state_cache: Tensor,
    scale: Optional[float],
    use_qk_l2norm: bool,
) -> Tensor:
    """The recurrence per sequence through the driver every cached state op shares: prefills one
    at a time, all one-token sequences as one batch (no host reads in a pure decode step)."""
    h, dk, dv = state_cache.shape[1:]
    if v.shape[-2] != h or k.shape[-1] != dk or v.shape[-1] != dv:
        raise ValueError(f"delta rule: state cache {tuple(state_cache.shape)} does not fit k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")

    def scan(tokens: Sequence[Tensor], initial: Tensor) -> Tuple[Tensor, Tensor]:
        v_, q_, k_, beta_, *gate = tokens
        return _recurrence(q_, k_, v_, gate[0] if gate else None, beta_, initial, scale, use_qk_l2norm)

    def step(token: Sequence[Tensor], state: Tensor) -> Tensor:
        v_, q_, k_, beta_, *gate = token
        return _step_in_place(q_, k_, v_, gate[0] if gate else None, beta_, state, scale, use_qk_l2norm)

    def step_all(token: Sequence[Tensor], cu: Tensor, slots: Tensor, carry: Tensor) -> Optional[Tensor]:
        v_, q_, k_, beta_, *gate = token
        return native_state.fast_weight_step(q_, k_, v_, gate[0] if gate else None, beta_, state_cache, cu, slots,
                                             carry, scale, use_qk_l2norm)

    # The driver's output takes the first input's shape and dtype: v's shape in q's dtype, as HF.
    tokens = [v.to(q.dtype), q, k, beta] + ([] if log_decay is None else [log_decay])
    return scan_each_sequence(scan, tokens, batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state,
                              state_cache, step=step if state_cache.dtype == torch.float32 else None, step_all=step_all)


@torch.library.custom_op("autodeploy::torch_cached_gated_delta_rule", mutates_args=("state_cache",))
def torch_cached_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    batch_info: Tensor,
    seq_len: Tensor,
    cu_seqlen: Tensor,
    slot_idx: Tensor,
    use_initial_state: Tensor,
    state_cache: Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
) -> Tensor:
    """``torch_gated_delta_rule`` over a flattened step, each sequence continuing its slot's state."""
    return _cached(q, k, v, g.unsqueeze(-1), beta, batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state,
                   state_cache, scale, use_qk_l2norm)


@torch_cached_gated_delta_rule.register_fake
def _cached_gated_fake(q, k, v, g, beta, batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state, state_cache,
                       scale=None, use_qk_l2norm=False):
    return _output_fake(q, v)


@torch.library.custom_op("autodeploy::torch_cached_delta_rule", mutates_args=("state_cache",))
def torch_cached_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    batch_info: Tensor,
    seq_len: Tensor,
    cu_seqlen: Tensor,
    slot_idx: Tensor,
    use_initial_state: Tensor,
    state_cache: Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
) -> Tensor:
    """``torch_delta_rule`` over a flattened step, each sequence continuing its slot's state."""
    return _cached(q, k, v, None, beta, batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state, state_cache,
                   scale, use_qk_l2norm)


@torch_cached_delta_rule.register_fake
def _cached_delta_fake(q, k, v, beta, batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state, state_cache,
                       scale=None, use_qk_l2norm=False):
    return _output_fake(q, v)


@torch.library.custom_op("autodeploy::torch_cached_gated_delta_rule_channelwise", mutates_args=("state_cache",))
def torch_cached_gated_delta_rule_channelwise(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    batch_info: Tensor,
    seq_len: Tensor,
    cu_seqlen: Tensor,
    slot_idx: Tensor,
    use_initial_state: Tensor,
    state_cache: Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = False,
) -> Tensor:
    """``torch_gated_delta_rule_channelwise`` over a flattened step, each sequence continuing its
    slot's state."""
    return _cached(q, k, v, g, beta, batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state, state_cache,
                   scale, use_qk_l2norm)


@torch_cached_gated_delta_rule_channelwise.register_fake
def _cached_channelwise_fake(q, k, v, g, beta, batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state,
                             state_cache, scale=None, use_qk_l2norm=False):
    return _output_fake(q, v)


__all__: List[str] = [
    "torch_l2norm",
    "torch_gated_delta_rule",
    "torch_delta_rule",
    "torch_gated_delta_rule_channelwise",
    "torch_cached_gated_delta_rule",
    "torch_cached_delta_rule",
    "torch_cached_gated_delta_rule_channelwise",
]
