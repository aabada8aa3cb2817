"""Export patch ``rg_lru``: RecurrentGemma's recurrent block becomes canonical state ops.

RecurrentGemma (Griffin) alternates sliding-window attention with a recurrent block::

    y = act(linear_y(x))
    u = conv_1d(linear_x(x))          # depthwise nn.Conv1d, padded by k - 1 and cut to the sequence
    u = rg_lru(u, position_ids)       # gates per token, then _rnn_scan: h = a h + x over the sequence
    out = linear_out(u * y)

HF's ``_rnn_scan`` is a Python loop over the tokens with a separate one-token branch, so
``torch.export`` could only trace the model at a static length (recompute mode), and its states
live on the modules (``conv1d_state``, ``recurrent_states``), where no cache of ours can hold them.
For one export this patch:

* replaces the block's forward (the ``use_cache=False`` path export takes) by the same code with
  the convolution as ``torch_causal_conv1d(u, conv_1d.weight, conv_1d.bias)`` (the same causal
  window as the padded ``nn.Conv1d``), which ``insert_cached_causal_conv`` gives a window state;
* replaces ``_rnn_scan`` (no initial state, fp32 accumulation: what export sees) by
  ``torch_diagonal_recurrence(x, a * ~reset)``, which ``insert_cached_diagonal_recurrence`` gives
  a ``[w]`` fp32 state. The gates and the reset at position 0 stay HF's own code.

Calls with a cache (``use_cache=True``, a stored ``recurrent_states``) run HF's code.
"""

from contextlib import ExitStack, contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import Tensor, nn

from .patch_registry import register_export_patch, replaced_attribute

_ops = torch.ops.autodeploy
_BLOCK = ("linear_x", "linear_y", "linear_out", "conv_1d", "rg_lru", "act_fn")
_LRU = ("_rnn_scan", "recurrent_param", "input_gate_weight", "recurrent_gate_weight")


def is_recurrent_block(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RecurrentBlock") and all(hasattr(module, a) for a in _BLOCK)


def is_rg_lru(module: nn.Module) -> bool:
    return type(module).__name__.endswith("Rglru") and all(hasattr(module, a) for a in _LRU)


def _block_forward(original: Callable) -> Callable:
    def forward(self: nn.Module, input_states: Tensor, position_ids: Tensor, attention_mask: Optional[Tensor],
                use_cache: bool = True, **kwargs: Any) -> Tuple[Tensor, None]:
        conv = self.conv_1d
        causal = conv.groups == conv.in_channels == conv.out_channels and conv.padding == (conv.kernel_size[0] - 1,)
        if use_cache or not causal:
            return original(self, input_states, position_ids, attention_mask, use_cache, **kwargs)
        self.conv1d_state = None
        self.rg_lru.recurrent_states = None
        y = self.act_fn(self.linear_y(input_states))
        u = _ops.torch_causal_conv1d(self.linear_x(input_states), conv.weight, conv.bias, None)
        u = self.rg_lru(u, position_ids)
        return self.linear_out(u * y), None

    return forward


def _rnn_scan(original: Callable) -> Callable:
    def rnn_scan(self: nn.Module, hidden_states: Tensor, recurrent_gate: Tensor, reset: Tensor,
                 recurrent_states: Optional[Tensor], acc_dtype: torch.dtype = torch.float32) -> Tuple[Tensor, None]:
        if recurrent_states is not None or acc_dtype != torch.float32:
            return original(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype)
        return _ops.torch_diagonal_recurrence(hidden_states, recurrent_gate * ~reset), None

    return rnn_scan


@register_export_patch(
    "rg_lru",
    "RecurrentGemma's recurrent block (a padded nn.Conv1d and a per-token Python scan, states on the modules) "
    "exports as torch_causal_conv1d and torch_diagonal_recurrence, which the state-cache transforms serve",
)
@contextmanager
def _rg_lru(model: nn.Module) -> Iterator[None]:
    methods: Dict[Tuple[type, str], Callable[[Callable], Callable]] = {}
    for m in model.modules():
        if is_recurrent_block(m) and "forward" in vars(type(m)):
            methods[(type(m), "forward")] = _block_forward
        elif is_rg_lru(m) and "_rnn_scan" in vars(type(m)):
            methods[(type(m), "_rnn_scan")] = _rnn_scan
    with ExitStack() as stack:
        for (cls, name), make in methods.items():
            stack.enter_context(replaced_attribute(cls, name, make(vars(cls)[name])))
        yield
