"""Decayed linear attention: MiniMax's lightning attention, and any linear attention whose state
decays by one scalar per head and token (RetNet-style retention, "simple GLA").

Each head keeps a state ``S [dk, dv]`` (zeros at the start of a sequence). For every token, in
fp32::

    S = exp(g) * S + k^T v          # g: a log-decay (<= 0), one per head and token
    o = (scale * q) S               # read with the query

No normaliser, no delta correction (that is ``delta_rule``'s family). MiniMax-Text-01 uses a
fixed decay per head (``g = -slope_rate``, the same for every token) and no scale (``scale=1``);
``scale`` ``None`` means ``dk ** -0.5``, as in the delta-rule ops.

Shapes, layout ``bsnd``: q/k ``[b, s, h, dk]``, v ``[b, s, h, dv]``, g ``[b, s, h]``, output
``[b, s, h, dv]`` in q's dtype. What a model does around it (the projections and their
activation, the output norm and gate) stays outside the op.

The op computes in chunks of ``CHUNK`` tokens, exactly the recurrence above rearranged (HF's
MiniMax does the same in blocks of 256). Within a chunk, with ``G_t = g_1 + ... + g_t`` (inclusive)
and ``S_0`` the state before the chunk::

    o_t = exp(G_t) (q_t S_0) + sum_{j <= t} exp(G_t - G_j) (q_t . k_j) v_j
    S_C = exp(G_C) S_0       + sum_{j <= C} exp(G_C - G_j) k_j^T v_j

Every exponent is a difference ``G_t - G_j`` with ``t >= j`` or a ``G_t`` itself, so all are <= 0:
no ratio of exponentials that could overflow. The tests hold it to a float64 token-by-token loop
and to HF's ``MiniMaxLightningAttention`` (its block form and its one-token decode path).

The cached variant runs on the flattened-token graph (q/k/v ``[1, T, ...]``) with the metadata
``batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state`` and a state cache
``[num_slots, h, dk, dv]`` (fp32: a running sum; HF keeps it in the model's dtype), read and
written in place through the step driver every state op shares (``causal_conv.scan_each_sequence``):
sequence ``i`` continues from ``state_cache[slot_idx[i]]`` when ``use_initial_state[i]``, else from
zeros, and its final state is stored back there; no other slot is touched.
"""

from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import native_state
from .causal_conv import scan_each_sequence

# tokens per chunk: the intra-chunk product is [C, C] per head; 64 keeps it in cache at any dk
CHUNK = 64


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor) -> None:
    b, s, h, dk = q.shape
    if k.shape != q.shape or v.shape[:3] != (b, s, h) or g.shape != (b, s, h):
        raise ValueError(f"linear attention: q {tuple(q.shape)} and k {tuple(k.shape)} must be [b, s, h, dk], "
                         f"v {tuple(v.shape)} [b, s, h, dv] and g {tuple(g.shape)} [b, s, h] with the same b, s, h")


def _step_in_place(q: Tensor, k: Tensor, v: Tensor, g: Tensor, state: Tensor, scale: Optional[float]) -> Tensor:
    """``_scan`` of one token of one sequence (q/k ``[h, dk]``, v ``[h, dv]``, g ``[h]``), updating its
    fp32 ``state [h, dk, dv]`` in place (``scan_each_sequence``'s CPU decode path): the state decays by
    ``exp(g)`` and takes ``k^T v``, the output is ``q`` read from it. Returns ``[h, dv]`` fp32."""
    q = q.float() * (q.shape[-1] ** -0.5 if scale is None else scale)
    state.mul_(g.float().exp()[:, None, None]).baddbmm_(k.float()[:, :, None], v.float()[:, None, :])
    return (q[:, None, :] @ state)[:, 0]


def _scan(q: Tensor, k: Tensor, v: Tensor, g: Tensor, state: Tensor,
          scale: Optional[float]) -> Tuple[Tensor, Tensor]:
    """The recurrence over ``s`` tokens of ``b`` sequences from ``state [b, h, dk, dv]``, in fp32.

    Returns (output ``[b, s, h, dv]`` fp32, the state after the last token ``[b, h, dk, dv]`` fp32).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    # [b, h, s, d] so each head's tokens are a matrix
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    q = q * scale
    g = g.float().transpose(1, 2)  # [b, h, s]
    state = state.float()
    outs = []
    for start in range(0, v.shape[2], CHUNK):
        rows = slice(start, start + CHUNK)
        q_c, k_c, v_c = q[:, :, rows], k[:, :, rows], v[:, :, rows]
        cum = g[:, :, rows].cumsum(-1)  # G_t, [b, h, C]
        diff = cum[..., :, None] - cum[..., None, :]  # G_t - G_j, [b, h, C, C]
        causal = torch.ones(diff.shape[-2:], dtype=torch.bool, device=diff.device).tril()
        weights = (q_c @ k_c.transpose(-1, -2)) * diff.masked_fill(~causal, float("-inf")).exp()
        outs.append(weights @ v_c + (q_c * cum.exp()[..., None]) @ state)
        last = cum[..., -1:]  # G_C, [b, h, 1]
        state = state * last.exp()[..., None] + (k_c * (last - cum).exp()[..., None]).transpose(-1, -2) @ v_c
    out = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape)
    return out.transpose(1, 2).contiguous(), state


@torch.library.custom_op("autodeploy::torch_linear_attention", mutates_args=())
def torch_linear_attention(q: Tensor, k: Tensor, v: Tensor, g: Tensor, scale: Optional[float] = None) -> Tensor:
    """Decayed linear attention from a zero state (see the module docstring); ``g [b, s, h]``."""
    _check(q, k, v, g)
    b, _, h, dk = q.shape
    zeros = v.new_zeros(b, h, dk, v.shape[-1], dtype=torch.float32)
    out, _ = _scan(q, k, v, g, zeros, scale)
    return out.to(q.dtype)


@torch_linear_attention.register_fake
def _linear_attention_fake(q, k, v, g, scale=None):
    return q.new_empty(*v.shape)


@torch.library.custom_op("autodeploy::torch_cached_linear_attention", mutates_args=("state_cache",))
def torch_cached_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    batch_info: Tensor,
    seq_len: Tensor,
    cu_seqlen: Tensor,
    slot_idx: Tensor,
    use_initial_state: Tensor,
    state_cache: Tensor,
    scale: Optional[float] = None,
) -> Tensor:
    """``torch_linear_attention`` over a flattened step, each sequence continuing its slot's state
    ``state_cache [num_slots, h, dk, dv]``."""
    _check(q, k, v, g)
    h, dk, dv = state_cache.shape[1:]
    if q.shape[2] != h or q.shape[3] != dk or v.shape[3] != dv:
        raise ValueError(f"linear attention: state cache {tuple(state_cache.shape)} does not fit q "
                         f"{tuple(q.shape)}, v {tuple(v.shape)}")

    def scan(tokens: Sequence[Tensor], initial: Tensor) -> Tuple[Tensor, Tensor]:
        v_, q_, k_, g_ = tokens
        return _scan(q_, k_, v_, g_, initial, scale)

    def step(token: Sequence[Tensor], state: Tensor) -> Tensor:
        v_, q_, k_, g_ = token
        return _step_in_place(q_, k_, v_, g_, state, scale)

    def step_all(token: Sequence[Tensor], cu: Tensor, slots: Tensor, carry: Tensor) -> Optional[Tensor]:
        v_, q_, k_, g_ = token
        return native_state.fast_weight_step(q_, k_, v_, g_, None, state_cache, cu, slots, carry, scale, False)

    # the driver's output takes the first input's shape and dtype: v's shape in q's dtype. Prefills take
    # the chunked scan: at MiniMax's [64, 128, 128] state its GEMMs match or beat the kernel's
    # token-by-token walk from ~128 tokens (benchmarks/RESULTS.md); the kernel wins only short prompts.
    return scan_each_sequence(scan, [v.to(q.dtype), q, k, g], batch_info, seq_len, cu_seqlen, slot_idx,
                              use_initial_state, state_cache, step=step if state_cache.dtype == torch.float32 else None,
                              step_all=step_all, step_all_prefills=False)


@torch_cached_linear_attention.register_fake
def _cached_linear_attention_fake(q, k, v, g, batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state,
                                  state_cache, scale=None):
    return q.new_empty(*v.shape)
