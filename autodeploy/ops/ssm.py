"""Selective state-space scans (Mamba2 and Mamba1) and their cached variants.

Importing this module also registers the causal conv ops (``causal_conv.py``), the other half of
a Mamba mixer.

``torch_ssm`` is the Mamba2 / SSD scan used by Mamba2, Bamba, Falcon-H1, Nemotron-H and
Zamba2. Per head h (one scalar ``A[h] < 0``) and token t, with the state ``S [head_dim, state]``::

    dt_t = clamp(softplus(dt_t + dt_bias), *time_step_limit)
    S_t  = exp(dt_t * A) * S_{t-1} + dt_t * x_t (outer) B_t
    y_t  = S_t @ C_t + D * x_t

``B``/``C`` have ``groups`` heads that are shared by ``heads // groups`` consecutive heads
(HF's ``repeat_interleave``). ``dt`` enters raw (the in-projection's slice): the op adds
``dt_bias``, applies softplus and clamps, as HF's ``mamba2_chunk_scan(dt_softplus=True)`` does, so
the weights stay op inputs and a fused kernel can do the discretisation. ``time_step_limit``
is HF's ``(min, max)``; ``None`` means no clamp (HF's default ``(0, inf)`` is the same thing).
What the op leaves to the graph: the conv before it, and the gated RMSNorm
(``norm(y * silu(z))``) and out-projection after it.

``torch_ssm_mamba1`` is Mamba1's scan (``MambaMixer``): ``A [channels, state]`` (one decay per
channel and state entry), ``B``/``C [b, s, state]`` shared by all channels, ``D [channels]``,
``dt`` raw with ``dt_bias`` (``dt_proj.bias``) added before softplus and no clamp. Its gate
``y * silu(z)`` stays outside the op.

Numerics: everything runs in fp32 and the output is cast to ``x``'s dtype. The reference for
Mamba2 is the chunked form (SSD): within a chunk, tokens mix like causal attention with
decay-weighted ``C @ B^T`` scores; between chunks the state is carried explicitly. This equals
the recurrence above (the tests check it against a per-token loop) and is what HF computes, at a
cost linear in the length. Mamba1's state has a decay per channel and state entry, so its
reference is the per-token recurrence (HF's slow path).

Cached variants work on the flattened step (``x [1, T, ...]``, see
``causal_conv.scan_each_sequence``) with the metadata ``batch_info, seq_len, cu_seqlen,
slot_idx, use_initial_state`` (no ``input_pos``: whether a sequence continues is all a
state-space op needs to know) and the state in ``ssm_state [num_slots, heads, head_dim, state]``
(Mamba2) or ``[num_slots, channels, state]`` (Mamba1). The state is the running sum of the
whole sequence, so it should be fp32 (HF's torch path keeps it in fp32 as well): bf16 loses the
small contributions of later tokens. The op computes in fp32 whatever the cache dtype and rounds
only when it stores.

Where these ops knowingly differ from HF's torch code (transformers 5.23): HF's one-token decode
(``mamba2_selective_state_update``) skips the ``time_step_limit`` clamp its prefill applies, so
with a limit that bites (Nemotron-H and Zamba2 use ``(time_step_min, inf)``) HF's decode and
prefill disagree; the ops clamp every token, so a cached run equals the uncached one. HF's
Mamba2 scan returns fp32 to the gated norm, the op returns ``x``'s dtype. HF's Mamba1 torch
path drops the cached SSM state in a multi-token chunk after the first (its scan takes no initial
state); the cached Mamba1 op continues it.
"""

from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native_state
from .causal_conv import scan_each_sequence

CHUNK_SIZE = 128  # tokens per SSD chunk; the result does not depend on it beyond rounding


def _mamba2_dt(dt: Tensor, dt_bias: Tensor, time_step_limit: Optional[Sequence[float]]) -> Tensor:
    """Raw ``dt [..., heads]`` -> the step size the scan uses, fp32."""
    dt = F.softplus(dt.float() + dt_bias.float())
    if time_step_limit is not None:
        dt = dt.clamp(time_step_limit[0], time_step_limit[1])
    return dt


def _segment_sum(a: Tensor) -> Tensor:
    """``a [..., l]`` -> ``[..., l, l]`` with ``out[..., i, j] = a[j+1] + ... + a[i]`` for ``i >= j``
    (0 on the diagonal) and ``-inf`` above it. Summed per segment rather than as a difference
    of cumulative sums, which cancels catastrophically once the sums grow large."""
    l = a.shape[-1]
    terms = a[..., :, None].expand(*a.shape, l)  # terms[..., k, j] = a[k]
    below = torch.tril(torch.ones(l, l, dtype=torch.bool, device=a.device), diagonal=-1)  # k > j
    sums = terms.masked_fill(~below, 0).cumsum(dim=-2)  # sums[..., i, j] = sum of a[k] for j < k <= i
    causal = torch.tril(torch.ones(l, l, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~causal, float("-inf"))


def _mamba2_step_in_place(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, D: Tensor, state: Tensor) -> Tensor:
    """One token of one sequence (``x [heads, head_dim]``, discretised ``dt [heads]``, ``B``/``C
    [groups, n]``) from its fp32 ``state [heads, head_dim, n]``, updated in place: the recurrence of
    the module docstring without a fresh state tensor (``scan_each_sequence``'s CPU decode path)."""
    heads, head_dim = x.shape
    groups, n = B.shape
    x = x.float()
    state.mul_(torch.exp(dt * A.float())[:, None, None])
    grouped = state.view(groups, heads // groups, head_dim, n)
    grouped.addcmul_((x * dt[:, None]).view(groups, heads // groups, head_dim, 1), B.float().view(groups, 1, 1, n))
    y = (grouped @ C.float().view(groups, 1, n, 1)).view(heads, head_dim)
    return y + x * D.float()[:, None]


def _mamba2_step(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                 state: Tensor) -> Tuple[Tensor, Tensor]:
    """``_mamba2_scan`` of one token per row (``x [b, 1, heads, head_dim]``, fp32 inputs): the
    recurrence of the module docstring, each head reading its group's ``B``/``C`` through a view
    (``[b, groups, heads / groups, ...]``) instead of a copy."""
    b, _, heads, head_dim = x.shape
    groups, n = B.shape[2], B.shape[3]
    step = dt[:, 0]  # [b, heads]
    decay = torch.exp(step * A)[:, :, None, None]  # [b, heads, 1, 1]
    grouped = (b, groups, heads // groups)
    xdt = (x[:, 0] * step[..., None]).view(*grouped, head_dim, 1)
    state = state * decay + (xdt * B[:, 0, :, None, None, :]).view(b, heads, head_dim, n)  # + dt x (outer) B
    y = (state.view(*grouped, head_dim, n) @ C[:, 0, :, None, :, None]).view(b, heads, head_dim)
    return (y + x[:, 0] * D.float()[:, None])[:, None], state


def _mamba2_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                 state: Tensor) -> Tuple[Tensor, Tensor]:
    """SSD scan from ``state [b, heads, head_dim, n]``; ``dt [b, s, heads]`` already discretised.

    Returns (``y [b, s, heads, head_dim]``, final state ``[b, heads, head_dim, n]``), both fp32.
    """
    heads, groups = x.shape[2], B.shape[2]
    x, A, state = x.float(), A.float(), state.float()
    if x.shape[1] == 1:  # one token a row (decode): the recurrence itself, without the chunk's machinery
        return _mamba2_step(x, dt, A, B.float(), C.float(), D, state)
    B = B.float().repeat_interleave(heads // groups, dim=2)  # [b, s, heads, n]
    C = C.float().repeat_interleave(heads // groups, dim=2)
    y = torch.empty_like(x)
    for start in range(0, x.shape[1], CHUNK_SIZE):
        rows = slice(start, start + CHUNK_SIZE)
        Bc, Cc = B[:, rows], C[:, rows]
        xdt = x[:, rows] * dt[:, rows, :, None]  # each token's input, scaled by its step
        log_decay = (dt[:, rows] * A).transpose(1, 2)  # [b, heads, l]: log of each token's decay
        seg = _segment_sum(log_decay)  # [b, heads, l(i), l(j)]: log decay from token j to token i
        # within the chunk: causal attention-like mixing with scores C_i . B_j * decay(j -> i)
        scores = torch.einsum("bihn,bjhn->bhij", Cc, Bc) * seg.exp()
        y_chunk = torch.einsum("bhij,bjhp->bihp", scores, xdt)
        # the state carried into the chunk, decayed to each token and read out with C
        decay_in = log_decay.cumsum(dim=-1).exp()  # [b, heads, l]
        y_chunk += torch.einsum("bihn,bhpn->bihp", Cc, state) * decay_in.transpose(1, 2)[..., None]
        y[:, rows] = y_chunk
        # the state after the chunk: the old one decayed over all of it, plus each token's input
        # decayed from the token to the chunk's end
        to_end = seg[:, :, -1, :].exp()  # [b, heads, l]
        state = state * decay_in[:, :, -1, None, None]
        state += torch.einsum("bjhn,bhj,bjhp->bhpn", Bc, to_end, xdt)
    return y + x * D.float()[:, None], state


def _check_mamba2(x: Tensor, B: Tensor) -> None:
    if x.shape[2] % B.shape[2] != 0:
        raise ValueError(f"torch_ssm: {x.shape[2]} heads are not a multiple of {B.shape[2]} groups")


@torch.library.custom_op("autodeploy::torch_ssm", mutates_args=())
def torch_ssm(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    time_step_limit: Optional[List[float]] = None,
) -> Tensor:
    """Mamba2 scan from a zero state: ``x [b, s, heads, head_dim]``, raw ``dt [b, s, heads]``,
    ``A [heads]`` (negative: ``-exp(A_log)``), ``B``/``C [b, s, groups, n]``, ``D``/``dt_bias [heads]``
    -> ``y [b, s, heads, head_dim]`` in ``x``'s dtype (``D`` skip included)."""
    _check_mamba2(x, B)
    zeros = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[3], dtype=torch.float32)
    dt = _mamba2_dt(dt, dt_bias, time_step_limit)
    return _mamba2_scan(x, dt, A, B, C, D, zeros)[0].to(x.dtype)


@torch_ssm.register_fake
def _torch_ssm_fake(x, dt, A, B, C, D, dt_bias, time_step_limit=None):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("autodeploy::torch_cached_ssm", mutates_args=("ssm_state",))
def torch_cached_ssm(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    batch_info: Tensor,
    seq_len: Tensor,
    cu_seqlen: Tensor,
    slot_idx: Tensor,
    use_initial_state: Tensor,
    ssm_state: Tensor,
    time_step_limit: Optional[List[float]] = None,
) -> Tensor:
    """``torch_ssm`` over a flattened step (``x [1, T, heads, head_dim]`` etc.), continuing from
    and updating ``ssm_state[slot_idx[i]]`` (``[num_slots, heads, head_dim, n]``, fp32 advised).

    ``use_initial_state[i] == False`` starts sequence i from zeros.
    """
    _check_mamba2(x, B)
    dt = _mamba2_dt(dt, dt_bias, time_step_limit)

    def scan(tokens: Sequence[Tensor], state: Tensor) -> Tuple[Tensor, Tensor]:
        x_, dt_, B_, C_ = tokens
        return _mamba2_scan(x_, dt_, A, B_, C_, D, state)

    def step(token: Sequence[Tensor], state: Tensor) -> Tensor:
        return _mamba2_step_in_place(*token, A, D, state)

    def step_all(tokens: Sequence[Tensor], cu: Tensor, slots: Tensor, carry: Tensor) -> Optional[Tensor]:
        return native_state.mamba2_step(*tokens, A, D, ssm_state, cu, slots, carry)

    return scan_each_sequence(scan, [x, dt, B, C], batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state,
                              ssm_state, step=step if ssm_state.dtype == torch.float32 else None, step_all=step_all)


@torch_cached_ssm.register_fake
def _torch_cached_ssm_fake(x, dt, A, B, C, D, dt_bias, batch_info, seq_len, cu_seqlen, slot_idx,
                           use_initial_state, ssm_state, time_step_limit=None):
    return x.new_empty(x.shape)


def _mamba1_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
                 state: Tensor) -> Tuple[Tensor, Tensor]:
    """Per-token recurrence from ``state [b, c, n]``; ``dt [b, s, c]`` already discretised.

    Returns (``y [b, s, c]``, final state ``[b, c, n]``), both fp32.
    """
    x, A, B, C, h = x.float(), A.float(), B.float(), C.float(), state.float()
    y = torch.empty_like(x)
    for t in range(x.shape[1]):
        h = torch.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * x[:, t])[..., None] * B[:, t, None, :]
        y[:, t] = torch.einsum("bcn,bn->bc", h, C[:, t])
    return y + x * D.float(), h


def _mamba1_step_in_place(x: Tensor, dt: Tensor, B: Tensor, C: Tensor, A: Tensor, D: Tensor, state: Tensor) -> Tensor:
    """``_mamba1_scan`` of one token of one sequence (``x``/discretised ``dt [c]``, ``B``/``C [n]``),
    updating its fp32 ``state [c, n]`` in place (``scan_each_sequence``'s CPU decode path)."""
    x = x.float()
    state.mul_(torch.exp(dt[:, None] * A.float())).addcmul_((dt * x)[:, None], B.float()[None, :])
    return state @ C.float() + x * D.float()


@torch.library.custom_op("autodeploy::torch_ssm_mamba1", mutates_args=())
def torch_ssm_mamba1(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor) -> Tensor:
    """Mamba1 scan from a zero state: ``x [b, s, c]``, raw ``dt [b, s, c]`` (``dt_proj`` without its
    bias), ``A [c, n]`` (negative: ``-exp(A_log)``), ``B``/``C [b, s, n]``, ``D``/``dt_bias [c]``
    -> ``y [b, s, c]`` in ``x``'s dtype (``D`` skip included, gate not applied)."""
    zeros = x.new_zeros(x.shape[0], x.shape[2], A.shape[1], dtype=torch.float32)
    dt = F.softplus(dt.float() + dt_bias.float())
    return _mamba1_scan(x, dt, A, B, C, D, zeros)[0].to(x.dtype)


@torch_ssm_mamba1.register_fake
def _torch_ssm_mamba1_fake(x, dt, A, B, C, D, dt_bias):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("autodeploy::torch_cached_ssm_mamba1", mutates_args=("ssm_state",))
def torch_cached_ssm_mamba1(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor,
    dt_bias: Tensor,
    batch_info: Tensor,
    seq_len: Tensor,
    cu_seqlen: Tensor,
    slot_idx: Tensor,
    use_initial_state: Tensor,
    ssm_state: Tensor,
) -> Tensor:
    """``torch_ssm_mamba1`` over a flattened step (``x [1, T, c]`` etc.), continuing from and
    updating ``ssm_state[slot_idx[i]]`` (``[num_slots, c, n]``, fp32 advised); metadata as
    ``torch_cached_ssm``."""
    dt = F.softplus(dt.float() + dt_bias.float())

    def scan(tokens: Sequence[Tensor], state: Tensor) -> Tuple[Tensor, Tensor]:
        x_, dt_, B_, C_ = tokens
        return _mamba1_scan(x_, dt_, A, B_, C_, D, state)

    def step(token: Sequence[Tensor], state: Tensor) -> Tensor:
        return _mamba1_step_in_place(*token, A, D, state)

    def step_all(tokens: Sequence[Tensor], cu: Tensor, slots: Tensor, carry: Tensor) -> Optional[Tensor]:
        return native_state.mamba_step(*tokens, A, D, ssm_state, cu, slots, carry)

    return scan_each_sequence(scan, [x, dt, B, C], batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state,
                              ssm_state, step=step if ssm_state.dtype == torch.float32 else None, step_all=step_all)


@torch_cached_ssm_mamba1.register_fake
def _torch_cached_ssm_mamba1_fake(x, dt, A, B, C, D, dt_bias, batch_info, seq_len, cu_seqlen, slot_idx,
                                  use_initial_state, ssm_state):
    return x.new_empty(x.shape)


__all__: List[str] = ["torch_ssm", "torch_cached_ssm", "torch_ssm_mamba1", "torch_cached_ssm_mamba1"]
