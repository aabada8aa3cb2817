"""Export patch ``lightning_attention``: MiniMax's lightning attention becomes ``torch_linear_attention``.

MiniMax-Text-01 / M1 (``MiniMaxLightningAttention``) compute their linear-attention layers in a
Python loop over blocks of 256 tokens whose last block's length follows the sequence length;
``torch.export`` can only trace it by fixing that length (the export then takes sequences of at
least two tokens, never one), and the running ``K^T V`` state lives in HF's cache object, where
no cache of ours can hold it. So the model ran in recompute mode.

For one export this patch replaces the module's forward by the same computation with the
recurrence as one canonical op::

    qkv     = act(qkv_proj(x))                 (padding rows zeroed, as HF does)
    q, k, v = split(qkv.view(b, s, h, 3d))
    o       = autodeploy.torch_linear_attention(q, k, v, g=-slope_rate (per head, every token), scale=1)
    out     = out_proj(sigmoid(output_gate(x)) * norm(o.view(b, s, h d)))

which ``insert_cached_linear_attention`` gives a per-sequence ``[h, d, d]`` state. The module's
own buffers (``slope_rate``) and submodules are used as they are. A call with an HF cache
(``past_key_values``) runs HF's forward: export never passes one.
"""

import sys
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from .patch_registry import register_export_patch, replaced_forwards

_ATTRIBUTES = ("qkv_proj", "output_gate", "out_proj", "norm", "act_fn", "slope_rate", "num_attention_heads",
               "head_dim")


def is_lightning_attention(module: nn.Module) -> bool:
    """MiniMax's lightning attention (or a copy of it under another family's name)."""
    return type(module).__name__.endswith("LightningAttention") and all(hasattr(module, a) for a in _ATTRIBUTES)


def _padding_masker(cls: type) -> Callable[[Tensor, Optional[Tensor]], Tensor]:
    """The modelling module's own ``apply_mask_to_padding_states`` (zeroes padded rows)."""
    masker = getattr(sys.modules[cls.__module__], "apply_mask_to_padding_states", None)
    if masker is None:
        raise RuntimeError(f"{cls.__module__} has no apply_mask_to_padding_states; the lightning_attention "
                           "export patch does not know this version of the model (turn the patch off)")
    return masker


def _lightning_forward(original: Callable, mask_padding: Callable) -> Callable:
    def forward(self: nn.Module, hidden_states: Tensor, position_embeddings: Any = None,
                attention_mask: Optional[Tensor] = None, past_key_values: Any = None, **kwargs: Any):
        if past_key_values is not None:
            return original(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        b, s, _ = hidden_states.shape
        heads, dim = self.num_attention_heads, self.head_dim
        qkv = mask_padding(self.act_fn(self.qkv_proj(hidden_states)), attention_mask)
        q, k, v = torch.split(qkv.reshape(b, s, heads, 3 * dim), dim, dim=3)
        decay = (-self.slope_rate).reshape(1, 1, heads).to(torch.float32).expand(b, s, heads)
        out = torch.ops.autodeploy.torch_linear_attention(q, k, v, decay, 1.0)
        out = self.norm(out.reshape(b, s, heads * dim))
        out = torch.sigmoid(self.output_gate(hidden_states)) * out
        return self.out_proj(out), None

    return forward


@register_export_patch(
    "lightning_attention",
    "MiniMax lightning attention (a Python loop over 256-token blocks, its K^T V state in HF's cache) exports as "
    "torch_linear_attention, which insert_cached_linear_attention gives a per-sequence state",
)
@contextmanager
def _lightning_attention(model: nn.Module) -> Iterator[None]:
    classes = {type(m) for m in model.modules() if is_lightning_attention(m)}
    with replaced_forwards({cls: _lightning_forward(cls.forward, _padding_masker(cls)) for cls in classes}):
        yield
