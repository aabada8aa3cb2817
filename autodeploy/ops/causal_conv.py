"""Depthwise causal 1-D convolution: ``torch_causal_conv1d`` and its cached variant.

This is the short convolution in front of Mamba/Mamba2's scan (with ``silu``) and LFM2's
short-conv block (no activation). Every channel is convolved with its own ``k`` taps over the
current and the ``k - 1`` previous tokens; the sequence is left-padded with zeros, so token
``t`` never sees tokens after it.

Layout: the op takes and returns ``[b, s, c]`` (channels last, like ``bsnd``), while HF's code
transposes to ``[b, c, s]`` for ``nn.Conv1d`` and back. In ``[b, s, c]`` the op's neighbours (the
in-projection and its split, the SSM, the flattened ``[1, T, ...]`` rows of the cached graph)
need no transposes around it, and a fused kernel is free to pick its own memory layout; the
transposes live inside the reference only.

Numerics follow HF's ``causal_conv1d_fn``: the input is cast to the weight's dtype, conv and
activation run there, and the result is cast back to the input's dtype.

The cached op keeps, per state slot, the last ``k - 1`` inputs of the sequence
(``conv_state [num_slots, c, k - 1]``, channels first like HF's conv cache, but one column
shorter: HF keeps ``k`` and drops the oldest when it convolves). A step's new tokens are
convolved with the stored window in front, and the window is replaced by the last ``k - 1``
inputs seen. The state is stored in ``conv_state``'s dtype; the model's dtype is the natural
choice (these are raw inputs, no accumulation happens in them).

``scan_each_sequence`` is the step driver every cached state op shares (this conv, the SSMs in
``ssm.py``, the delta rules, linear attention, ...): given the op's math as "outputs and final
state from an initial state", it runs prefill sequences one by one and all one-token sequences in
one batch, and reads/writes the state slots; on CPU an op's C kernel (``step_all``) or its
one-token math (``step``) runs the one-token sequences in place on their slots instead.
"""

from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import native_state
from .host_reads import host_lists

# (per-token inputs [b, s, ...], initial state [b, *state_shape]) -> (outputs [b, s, ...], final state)
ScanFn = Callable[[Sequence[Tensor], Tensor], Tuple[Tensor, Tensor]]
# (one token's inputs [...], its sequence's state [*state_shape], updated in place) -> its output [...]
StepFn = Callable[[Sequence[Tensor], Tensor], Tensor]
# (the step's per-token inputs [T, ...], the sequences' row offsets [n + 1], slots [n], carry flags [n])
# -> the outputs [T, ...], each sequence's state updated in place in its slot; None (nothing written)
# when it cannot take these inputs
StepAllFn = Callable[[Sequence[Tensor], Tensor, Tensor, Tensor], Optional[Tensor]]

# When the CPU decode without a C kernel (``step_all``: none built, or inputs it declines) runs
# one-token sequences one by one in place rather than as one gathered batch
# (``benchmarks/bench_state_step.py``, batch sizes 1, 8, 32, on a 2-core Xeon): in place wins for up
# to a few sequences whatever the state (1.5-4x at one), and at any batch for states of a few hundred
# KiB (a Mamba2-130m layer's 768 KiB: 2.8x at 32); for small states (a conv window, a 64 KiB SSM) the
# batch's one pass over all of them wins from about 8 sequences, where the per-sequence ops' overhead
# adds up.
IN_PLACE_ANY_STATE = 2  # sequences
IN_PLACE_MIN_BYTES = 256 * 1024  # state bytes per sequence

_ACTIVATIONS = {None: lambda t: t, "silu": F.silu, "swish": F.silu}


def _activation(name: Optional[str]):
    if name not in _ACTIVATIONS:
        raise ValueError(f"causal_conv1d: unsupported activation {name!r} (use 'silu' or None)")
    return _ACTIVATIONS[name]


def _conv_scan(x: Tensor, window: Tensor, weight: Tensor, bias: Optional[Tensor],
               activation: Optional[str]) -> Tuple[Tensor, Tensor]:
    """``x [b, s, c]`` after the previous inputs ``window [b, c, k - 1]`` -> (outputs ``[b, s, c]``
    in the weight's dtype, the last ``k - 1`` inputs ``[b, c, k - 1]``)."""
    c, k = weight.shape[0], weight.shape[-1]
    taps = weight.reshape(c, 1, k)  # nn.Conv1d's depthwise [c, 1, k]; [c, k] is accepted too
    inputs = torch.cat([window.to(taps.dtype), x.transpose(1, 2).to(taps.dtype)], dim=-1)  # [b, c, k - 1 + s]
    out = _activation(activation)(F.conv1d(inputs, taps, bias, groups=c))  # valid conv: [b, c, s]
    return out.transpose(1, 2), inputs[..., inputs.shape[-1] - (k - 1):]


@torch.library.custom_op("autodeploy::torch_causal_conv1d", mutates_args=())
def torch_causal_conv1d(
    x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, activation: Optional[str] = None
) -> Tensor:
    """Depthwise causal conv of ``x [b, s, c]`` with ``weight [c, 1, k]`` (or ``[c, k]``) -> ``[b, s, c]``.

    ``activation`` is ``'silu'`` (Mamba, Mamba2 and hybrids) or ``None`` (LFM2).
    """
    zeros = x.new_zeros(x.shape[0], x.shape[2], weight.shape[-1] - 1)  # left padding
    return _conv_scan(x, zeros, weight, bias, activation)[0].to(x.dtype).contiguous()


@torch_causal_conv1d.register_fake
def _torch_causal_conv1d_fake(x, weight, bias=None, activation=None):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def scan_each_sequence(
    scan: ScanFn,
    tokens: Sequence[Tensor],
    batch_info: Tensor,
    seq_len: Tensor,
    cu_seqlen: Tensor,
    slot_idx: Tensor,
    use_initial_state: Tensor,
    state_cache: Tensor,
    step: Optional[StepFn] = None,
    step_all: Optional[StepAllFn] = None,
    step_all_prefills: bool = True,
) -> Tensor:
    """Runs ``scan`` over a flattened step and updates ``state_cache [num_slots, *state_shape]``.

    ``tokens`` are the op's per-token inputs, each ``[1, T, ...]``; the first one's shape and dtype
    are the output's. Sequence i continues from ``state_cache[slot_idx[i]]`` when
    ``use_initial_state[i]``, else from zeros, and its final state is written back there; no other
    slot is touched. Prefill sequences run one at a time; the one-token sequences after them
    (decodes, or a whole step with one token per sequence) run as one batch of length-1 rows,
    without host reads when every sequence has one token (decode steps stay CUDA-graph capturable).
    On CPU, where host reads cost nothing, an op that gives ``step`` (its math for one token, updating
    a state in place) has its one-token sequences run one by one on their own slots instead: no
    gathered copy of the states, no scatter back, no fresh state tensors per step (the gather and
    the scatter alone cost as much as the recurrence for a Mamba2 layer's state at batch 1), when
    there are few of them or their states are large (``IN_PLACE_ANY_STATE``, ``IN_PLACE_MIN_BYTES``).
    ``step_all`` (a C kernel's wrapper, ``native_state.py``) does the whole step, prefills and decodes,
    in place in one call, and is tried first on CPU; with ``step_all_prefills`` False it takes only
    the one-token sequences, and prefills go through ``scan`` (an op whose chunked reference beats
    its token-by-token kernel on long prompts).
    """
    num_seqs = seq_len.shape[0]
    on_cpu = state_cache.device.type == "cpu"
    if step_all is not None and on_cpu and (step_all_prefills or tokens[0].shape[1] == num_seqs):
        y = step_all([t[0] for t in tokens], cu_seqlen[:num_seqs + 1], slot_idx[:num_seqs],
                     use_initial_state[:num_seqs])
        if y is not None:
            return y.to(tokens[0].dtype).view(tokens[0].shape)
    out = tokens[0].new_zeros(tokens[0].shape)
    num_prefill, first_single = 0, 0
    if out.shape[1] != num_seqs:  # not one new token per sequence: some prefill rows (host reads)
        info, starts, lengths, slots, carries = host_lists(batch_info, cu_seqlen, seq_len, slot_idx, use_initial_state)
        num_prefill, first_single = info[:2]
        prefills = zip(starts[:num_prefill], lengths[:num_prefill], slots[:num_prefill], carries[:num_prefill])
    else:
        prefills = ()
    for start, n, slot, carry in prefills:
        rows = slice(start, start + n)
        initial = state_cache[slot:slot + 1] if carry else torch.zeros_like(state_cache[slot:slot + 1])
        y, final = scan([t[:, rows] for t in tokens], initial)
        out[:, rows] = y.to(out.dtype)
        state_cache[slot].copy_(final[0])
    if num_seqs > num_prefill:
        _one_token_rows(scan, step, step_all if on_cpu and not step_all_prefills else None, tokens, out, first_single,
                        slot_idx[num_prefill:num_seqs], use_initial_state[num_prefill:num_seqs], state_cache)
    return out


def _one_token_rows(scan: ScanFn, step: Optional[StepFn], step_all: Optional[StepAllFn], tokens: Sequence[Tensor],
                    out: Tensor, first: int, slots: Tensor, carry: Tensor, state_cache: Tensor) -> None:
    """``scan_each_sequence``'s one-token sequences, rows ``first ..`` of ``out``: through ``step_all``
    when given and it takes them; else on CPU one by one in place (``step``) when there are few or
    their states are large; else as one batch gathered from the cache and scattered back."""
    n = slots.shape[0]
    rows = slice(first, first + n)
    if step_all is not None:
        y = step_all([t[0, rows] for t in tokens], torch.arange(n + 1, dtype=torch.int32), slots, carry)
        if y is not None:
            out[0, rows] = y.to(out.dtype)
            return
    state_bytes = state_cache[0].numel() * state_cache.element_size()
    if step is not None and state_cache.device.type == "cpu" and (
            n <= IN_PLACE_ANY_STATE or state_bytes >= IN_PLACE_MIN_BYTES):
        for row, slot, keep in zip(range(first, first + n), *host_lists(slots, carry)):
            state = state_cache[slot]
            if not keep:
                state.zero_()
            out[0, row] = step([t[0, row] for t in tokens], state).to(out.dtype)
        return
    slots_t = slots.long()
    keep_t = carry.to(torch.bool).reshape(-1, *([1] * (state_cache.dim() - 1)))
    initial = state_cache.index_select(0, slots_t).masked_fill_(~keep_t, 0)
    y, final = scan([t[0, rows].unsqueeze(1) for t in tokens], initial)  # row i = sequence i, 1 token
    out[0, rows] = y[:, 0].to(out.dtype)
    state_cache.index_copy_(0, slots_t, final.to(state_cache.dtype))


@torch.library.custom_op("autodeploy::torch_cached_causal_conv1d", mutates_args=("conv_state",))
def torch_cached_causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    batch_info: Tensor,
    seq_len: Tensor,
    cu_seqlen: Tensor,
    slot_idx: Tensor,
    use_initial_state: Tensor,
    conv_state: Tensor,
    activation: Optional[str] = None,
) -> Tensor:
    """``torch_causal_conv1d`` over a flattened step ``x [1, T, c]``, continuing from and updating
    each sequence's window ``conv_state[slot_idx[i]]`` (``[num_slots, c, k - 1]``).

    ``use_initial_state[i] == False`` starts sequence i from zeros (a fresh prompt, or a
    preempted one that restarts), whatever its slot holds.
    """
    def scan(inputs: Sequence[Tensor], window: Tensor) -> Tuple[Tensor, Tensor]:
        return _conv_scan(inputs[0], window, weight, bias, activation)

    def step(inputs: Sequence[Tensor], window: Tensor) -> Tensor:
        return _conv_step(inputs[0], window, weight, bias, activation)

    def step_all(inputs: Sequence[Tensor], cu: Tensor, slots: Tensor, carry: Tensor) -> Optional[Tensor]:
        return native_state.conv_step(inputs[0], conv_state, weight, bias, activation, cu, slots, carry)

    return scan_each_sequence(scan, [x], batch_info, seq_len, cu_seqlen, slot_idx, use_initial_state, conv_state,
                              step=step, step_all=step_all)


def _conv_step(x: Tensor, window: Tensor, weight: Tensor, bias: Optional[Tensor], activation: Optional[str]) -> Tensor:
    """One token ``x [c]`` after ``window [c, k - 1]``: its output ``[c]`` (the weight's dtype, as
    ``_conv_scan``'s), and the window shifted by it in place."""
    c, k = weight.shape[0], weight.shape[-1]
    taps = weight.reshape(c, k)
    out = (window.to(taps.dtype) * taps[:, :-1]).sum(-1) + x.to(taps.dtype) * taps[:, -1]
    if bias is not None:
        out = out + bias
    if k > 1:
        window.copy_(torch.cat([window[:, 1:], x[:, None].to(window.dtype)], dim=1))
    return _activation(activation)(out)


@torch_cached_causal_conv1d.register_fake
def _torch_cached_causal_conv1d_fake(x, weight, bias, batch_info, seq_len, cu_seqlen, slot_idx,
                                     use_initial_state, conv_state, activation=None):
    return x.new_empty(x.shape)


__all__: List[str] = ["torch_causal_conv1d", "torch_cached_causal_conv1d", "scan_each_sequence"]
