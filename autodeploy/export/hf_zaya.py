"""Export patch ``zaya_cca``: ZAYA's compressed convolutional attention (CCA) projection becomes
canonical state ops.

``ZayaCCAProjection`` makes each attention layer's q/k/v with two kinds of state across tokens:

* q and k come out of two stacked causal convolutions (depthwise, then grouped per head) over the
  concatenated q/k projections, after ``K = (cca_time0 - 1) + (cca_time1 - 1)`` zeros of padding;
  HF keeps the last ``K`` inputs in its cache;
* half of each value head is the *previous* token's ``v_proj_delayed`` projection (``v_proj_delayed``
  of a zero vector for the first token).

HF writes both with an HF cache object and slices that ``torch.export`` only took with a shape check
(``Ne(seq, 2)``), so the model ran in recompute mode. For one export this patch replaces the
forward by the same computation with ``torch_cca_conv`` for the convolutions (whose ``[c, K]`` window
``insert_cached_cca_conv`` keeps) and ``v_proj_delayed(previous_token(x))`` for the delayed values
(``previous_token``: a width-2 ``torch_causal_conv1d``, kept by ``insert_cached_causal_conv``; the
projection of the zero row is HF's first-token value). The residual q/k paths are HF's code.
A call with an HF cache runs HF's forward.
"""

import importlib
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Tuple

import torch
from torch import Tensor, nn

from .patch_registry import register_export_patch, replaced_forwards
from .state_kernels import previous_token

_ops = torch.ops.autodeploy
_ATTRIBUTES = ("q_proj", "k_proj", "v_proj_current", "v_proj_delayed", "conv_qk_depthwise", "conv_qk_grouped",
               "num_key_value_groups", "head_dim")


def is_cca_projection(module: nn.Module) -> bool:
    """ZAYA's CCA projection with the unpadded stride-1 convolutions the op computes."""
    if not (type(module).__name__.endswith("CCAProjection") and all(hasattr(module, a) for a in _ATTRIBUTES)):
        return False
    convs = (module.conv_qk_depthwise, module.conv_qk_grouped)
    return (all(c.padding == (0,) and c.stride == (1,) and c.dilation == (1,) for c in convs)
            and module.conv_qk_depthwise.groups == module.conv_qk_depthwise.in_channels)


def _repeat_kv(cls: type) -> Callable:
    return getattr(importlib.import_module(cls.__module__), "repeat_kv")


def _cca_forward(original: Callable, repeat_kv: Callable) -> Callable:
    def forward(self: nn.Module, hidden_states: Tensor, past_key_values: Any,
                conv_mask: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
        if past_key_values is not None:
            return original(self, hidden_states, past_key_values, conv_mask)
        if conv_mask is not None:
            hidden_states = hidden_states * conv_mask[:, :, None].to(hidden_states.dtype)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        queries, keys = self.q_proj(hidden_states), self.k_proj(hidden_states)
        # the residual paths, as HF: (q + repeated k) / 2, and its mean over each key's query group
        key_residual = repeat_kv(keys.view(*hidden_shape).transpose(1, 2), self.num_key_value_groups).transpose(1, 2)
        query_residual = (queries.view(*hidden_shape) + key_residual) * 0.5
        key_residual = query_residual.view(*input_shape, -1, self.num_key_value_groups, self.head_dim).mean(dim=-2)
        depthwise, grouped = self.conv_qk_depthwise, self.conv_qk_grouped
        qk = _ops.torch_cca_conv(torch.cat([queries, keys], dim=-1), depthwise.weight, depthwise.bias,
                                 grouped.weight, grouped.bias, grouped.groups)
        width = queries.shape[-1]
        query = qk[..., :width].view(*hidden_shape) + query_residual
        key = qk[..., width:].view(*hidden_shape) + key_residual
        delayed = self.v_proj_delayed(previous_token(hidden_states))  # the first token: v_proj_delayed(0)
        value = torch.cat([self.v_proj_current(hidden_states), delayed], dim=-1).view(*hidden_shape)
        return query, key, value

    return forward


@register_export_patch(
    "zaya_cca",
    "ZAYA's CCA projection (stacked causal convs over q/k and a one-token-delayed half of v, kept in HF's cache) "
    "exports as torch_cca_conv and a width-2 torch_causal_conv1d, which the state-cache transforms serve",
)
@contextmanager
def _zaya_cca(model: nn.Module) -> Iterator[None]:
    classes = {type(m) for m in model.modules() if is_cca_projection(m)}
    with replaced_forwards({cls: _cca_forward(cls.forward, _repeat_kv(cls)) for cls in classes}):
        yield
