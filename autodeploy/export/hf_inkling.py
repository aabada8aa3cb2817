"""How Inkling's attention reaches the IR as ``torch_attention`` with a relative position bias.

Inkling (``inkling_text``) adds to each attention score a bias chosen by the key's distance
back from its query and conditioned on the query: ``r_proj(x)`` per head, times a bank of
bias-by-distance profiles (``rel_logits_proj.proj``, ``[d_rel, R]``), gives each query ``R``
values, one for each distance ``0 .. R-1`` (zero beyond). HF materialises that as a dense
``[b, heads, q, kv]`` ``position_bias`` from ``arange`` positions offset by its own cache, and
its full-attention layers also scale the queries and the bias by ``tau = 1 + alpha *
log(max(1, (position + 1) / n_floor))``. Exported as is, the dense bias is an explicit mask
built for one whole sequence: the model ran in recompute mode.

The ``inkling_relative_attention`` export patch, on the ``autodeploy`` attention route only,
replaces the attention's forward for one export by the same computation that hands the
per-query table ``[b, s, heads, R]`` to ``torch_attention`` as ``rel_logits`` (the op and its
cached forms read it at each key's distance: ``autodeploy.ops.attention.relative_bias``), and
takes the positions for ``tau`` from the model's ``position_ids`` (HF's ``arange`` would restart
at 0 in every cached step; the text model's forward is wrapped to hand them down, as HF does not
pass them to its layers). The short convolutions on the keys and values stay HF's modules (the
state-kernel patch makes them ``torch_causal_conv1d``, with their state cache). On the eager/sdpa
routes, and whenever a cache is passed, HF's forward runs.
"""

from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional

import torch
from torch import nn

from .patch_registry import register_export_patch, replaced_forwards

_MASKING_IMPLS = ("eager", "sdpa")
# the position_ids of the text model's forward being traced (innermost last)
_POSITIONS: List[torch.Tensor] = []
_PARTS = ("q_proj", "k_proj", "v_proj", "r_proj", "o_proj", "k_sconv", "v_sconv", "q_norm", "k_norm",
          "rel_logits_proj")


def is_inkling_attention(module: nn.Module) -> bool:
    return (all(isinstance(getattr(module, n, None), nn.Module) for n in _PARTS)
            and isinstance(getattr(getattr(module, "rel_logits_proj", None), "proj", None), torch.Tensor)
            and isinstance(getattr(module, "is_sliding", None), bool) and hasattr(module, "sliding_window"))


def log_scaling(config, positions: torch.Tensor) -> Optional[torch.Tensor]:
    """``tau [b, s]`` (float32) of Inkling's full-attention layers at these positions, or None when
    the config turns it off. HF's formula and order of operations."""
    n_floor = getattr(config, "log_scaling_n_floor", None)
    if n_floor is None:
        return None
    effective = (positions + 1).float()
    return 1.0 + config.log_scaling_alpha * torch.log((effective / n_floor).clamp(min=1.0))


def _attention_forward(original: Callable) -> Callable:
    def forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor],
                conv_mask: Optional[torch.Tensor] = None, past_key_values=None, **kwargs):
        if (getattr(self.config, "_attn_implementation", None) in _MASKING_IMPLS or past_key_values is not None
                or not _POSITIONS):
            return original(self, hidden_states, attention_mask, conv_mask=conv_mask,
                            past_key_values=past_key_values, **kwargs)
        batch, seq = hidden_states.shape[:-1]
        shape = (batch, seq, -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states).view(shape))  # bsnd
        k = self.k_norm(self.k_sconv(self.k_proj(hidden_states), past_key_values=None, conv_mask=conv_mask).view(shape))
        v = self.v_sconv(self.v_proj(hidden_states), past_key_values=None, conv_mask=conv_mask).view(shape)
        rel = self.r_proj(hidden_states).view(batch, seq, self.num_heads, -1) @ self.rel_logits_proj.proj
        tau = None if self.is_sliding else log_scaling(self.config, _POSITIONS[-1])
        if tau is not None:
            tau = tau.expand(batch, seq)[:, :, None, None]
            q = (q.float() * tau).to(q.dtype)
            rel = (rel.float() * tau).to(rel.dtype)
        out = torch.ops.autodeploy.torch_attention(q, k, v, None, 0.0, True, self.scaling, None, self.sliding_window,
                                                   None, rel_logits=rel)
        return self.o_proj(out.reshape(batch, seq, -1)), None

    return forward


def _model_forward(original: Callable) -> Callable:
    def forward(self: nn.Module, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, **kwargs):
        if position_ids is None:
            reference = input_ids if input_ids is not None else inputs_embeds
            position_ids = torch.arange(reference.shape[1], device=reference.device)[None]
        _POSITIONS.append(position_ids)
        try:
            return original(self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=past_key_values, inputs_embeds=inputs_embeds, **kwargs)
        finally:
            _POSITIONS.pop()

    return forward


@register_export_patch(
    "inkling_relative_attention",
    "Inkling's query-conditioned relative position bias exports as torch_attention's rel_logits (a per-query "
    "[heads, distance] table) with positions from position_ids, instead of a dense mask built from arange",
)
@contextmanager
def _inkling_relative_attention(model: nn.Module) -> Iterator[None]:
    attention = {type(m) for m in model.modules() if is_inkling_attention(m)}
    owners = {type(m) for m in model.modules()
              if isinstance(getattr(m, "layers", None), nn.ModuleList)
              and any(type(getattr(layer, "self_attn", None)) in attention for layer in m.layers)}
    if not attention or not owners:
        yield
        return
    forwards = {cls: _attention_forward(cls.forward) for cls in attention}
    forwards.update({cls: _model_forward(cls.forward) for cls in owners})
    with replaced_forwards(forwards):
        yield
