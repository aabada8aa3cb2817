"""Export patch ``state_kernels``: HF's state-space and linear-attention kernels become canonical ops.

transformers routes every stateful mixer's inner loop through a few module-level "kernel
functions" (hub kernels with a torch fallback): ``causal_conv1d_fn`` (the short conv of Mamba,
Mamba2, LFM2, Gated DeltaNet, ...), ``mamba2_chunk_scan`` (the SSD scan), ``mamba_selective_scan``
(Mamba1's scan), ``torch_chunk_gated_delta_rule`` (Qwen3-Next, Qwen3.5, OLMo-Hybrid) and
``chunk_kimi_delta_attention`` (Kimi-Linear, Bailing-Hybrid). Their torch fallbacks loop over the
sequence and pad it to whole chunks, which ``torch.export`` cannot trace with a dynamic length
(``shape '[1, 7, -1]' is invalid``) and which a cache could not serve anyway: they hide the state.

For the duration of one export this patch rebinds those names, in every loaded transformers
modelling module that defines them, to wrappers that emit the canonical ops
(``torch_causal_conv1d``, ``torch_ssm``, ``torch_ssm_mamba1``, ``torch_gated_delta_rule``,
``torch_gated_delta_rule_channelwise``). The mixers' own code (projections, splits, gated norms)
is traced as written; the ``insert_cached_*`` transforms then give each op its state cache.

A wrapper only takes the prefill-from-zero case that export sees (no initial state, no final
state requested, the softplus the canonical ops apply); any other call goes to HF's function
unchanged, so an unexpected use exports as before instead of computing something else.
"""

import sys
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .patch_registry import register_export_patch

_ops = torch.ops.autodeploy
_CONV_ACTIVATIONS = (None, "silu", "swish")


def _conv_fn(original: Callable) -> Callable:
    def causal_conv1d_fn(hidden_states: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                         activation: Optional[str] = None, **kwargs: Any) -> Tensor:
        if activation not in _CONV_ACTIVATIONS or kwargs.get("seq_idx") is not None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        # HF's layout is [b, c, s]; the op's is [b, s, c]
        out = _ops.torch_causal_conv1d(hidden_states.transpose(1, 2), weight, bias, activation)
        return out.transpose(1, 2)

    return causal_conv1d_fn


def _time_step_limit(dt_limit: Tuple[float, float]) -> Optional[List[float]]:
    low, high = float(dt_limit[0]), float(dt_limit[1])
    return None if low <= 0.0 and high == float("inf") else [low, high]


def _mamba2_fn(original: Callable) -> Callable:
    def mamba2_chunk_scan(hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, chunk_size: int,
                          D: Optional[Tensor] = None, dt_bias: Optional[Tensor] = None,
                          initial_states: Optional[Tensor] = None, dt_softplus: bool = False,
                          dt_limit: Tuple[float, float] = (0.0, float("inf")), return_final_states: bool = False,
                          **kwargs: Any) -> Tensor:
        if initial_states is not None or return_final_states or not dt_softplus or kwargs.get("seq_idx") is not None:
            return original(hidden_states, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias,
                            initial_states=initial_states, dt_softplus=dt_softplus, dt_limit=dt_limit,
                            return_final_states=return_final_states, **kwargs)
        heads = hidden_states.shape[2]
        D = D if D is not None else A.new_zeros(heads)
        dt_bias = dt_bias if dt_bias is not None else A.new_zeros(heads)
        return _ops.torch_ssm(hidden_states, dt, A, B, C, D, dt_bias, _time_step_limit(dt_limit))

    return mamba2_chunk_scan


def _mamba1_fn(original: Callable) -> Callable:
    def mamba_selective_scan(hidden_states: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                             D: Optional[Tensor] = None, z: Optional[Tensor] = None,
                             delta_bias: Optional[Tensor] = None, delta_softplus: bool = False,
                             return_last_state: bool = False, **kwargs: Any) -> Tensor:
        if return_last_state or not delta_softplus:
            return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                            delta_softplus=delta_softplus, return_last_state=return_last_state, **kwargs)
        channels = hidden_states.shape[1]
        D = D if D is not None else A.new_zeros(channels)
        delta_bias = delta_bias if delta_bias is not None else A.new_zeros(channels)
        # HF's layouts: x, dt, z [b, c, s]; B, C [b, n, s]. The op's: [b, s, c] and [b, s, n].
        y = _ops.torch_ssm_mamba1(hidden_states.transpose(1, 2), dt.transpose(1, 2), A, B.transpose(1, 2),
                                  C.transpose(1, 2), D, delta_bias).transpose(1, 2)
        return y * F.silu(z) if z is not None else y

    return mamba_selective_scan


def _delta_rule_fn(original: Callable, op: Callable) -> Callable:
    def chunk_delta_rule(query: Tensor, key: Tensor, value: Tensor, g: Tensor, beta: Tensor, chunk_size: int = 64,
                         initial_state: Optional[Tensor] = None, output_final_state: bool = False,
                         use_qk_l2norm_in_kernel: bool = False, **kwargs: Any) -> Tuple[Tensor, None]:
        if initial_state is not None or output_final_state or kwargs.get("cu_seqlens") is not None:
            return original(query, key, value, g=g, beta=beta, chunk_size=chunk_size, initial_state=initial_state,
                            output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
        return op(query, key, value, g, beta, None, bool(use_qk_l2norm_in_kernel)), None

    return chunk_delta_rule


# HF function name -> wrapper factory (original -> replacement)
_KERNELS: Dict[str, Callable[[Callable], Callable]] = {
    "causal_conv1d_fn": _conv_fn,
    "mamba2_chunk_scan": _mamba2_fn,
    "mamba_selective_scan": _mamba1_fn,
    "torch_chunk_gated_delta_rule": lambda f: _delta_rule_fn(f, _ops.torch_gated_delta_rule),
    "chunk_kimi_delta_attention": lambda f: _delta_rule_fn(f, _ops.torch_gated_delta_rule_channelwise),
}


def previous_token(x: Tensor) -> Tensor:
    """``x [b, s, c]`` moved down one token (zeros first: ``out[:, t] = x[:, t - 1]``), written as a
    width-2 depthwise ``torch_causal_conv1d`` with taps ``[1, 0]`` (``1 * x_{t-1} + 0 * x_t``, the
    same numbers), so ``insert_cached_causal_conv`` keeps the previous token per sequence: the
    state of RWKV's token shift and of ZAYA's delayed value projection."""
    ones = torch.ones(x.shape[-1], 1, 1, dtype=x.dtype, device=x.device)
    taps = torch.cat([ones, torch.zeros_like(ones)], dim=2)  # [c, 1, 2]: the previous token, not this one
    return _ops.torch_causal_conv1d(x, taps, None, None)


def _modelling_modules() -> List[Any]:
    return [m for name, m in list(sys.modules.items())
            if name.startswith("transformers.models.") and name.rsplit(".", 1)[-1].startswith("modeling_")
            and m is not None]


@register_export_patch(
    "state_kernels",
    "HF's conv / SSM / delta-rule kernel functions (causal_conv1d_fn, mamba2_chunk_scan, mamba_selective_scan, "
    "torch_chunk_gated_delta_rule, chunk_kimi_delta_attention) loop and pad over the sequence: export them as "
    "the canonical state ops the insert_cached_* transforms cache",
)
@contextmanager
def _state_kernels(model: nn.Module) -> Iterator[None]:
    swapped: List[Tuple[Any, str, Callable]] = []
    try:
        for module in _modelling_modules():
            for name, make in _KERNELS.items():
                original = module.__dict__.get(name)
                if callable(original):
                    swapped.append((module, name, original))
                    setattr(module, name, make(original))
        yield
    finally:
        for module, name, original in swapped:
            setattr(module, name, original)
