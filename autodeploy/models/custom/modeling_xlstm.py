"""Lean xLSTM (HF ``xLSTMForCausalLM``, the xLSTM-7b family) that exports with a dynamic sequence.

Why a custom model: HF's mLSTM runs a *chunkwise* scan. It splits the sequence into chunks of
``config.chunk_size`` tokens (``view(b, nh, num_chunks, chunk_size)``), loops over the chunks in
Python and handles the remainder with a per-token loop. ``torch.export`` cannot keep the
sequence dimension symbolic through that reshape, so the exported graph bakes in the chunk count
of the example and is wrong for every other length.

This module computes the same mLSTM as one canonical op, ``torch_mlstm`` (``autodeploy.ops.mlstm``):
over a whole sequence in its exact *parallel form* (one ``[seq, seq]`` decay matrix per head from
cumulative log forget gates, with HF's max-stabiliser and normaliser), which nothing ties to a
chunk size, so the graph takes any batch and sequence length. ``insert_cached_mlstm`` then gives
each layer a per-sequence ``C``/``n``/``m`` state and steps the recurrence token by token, so a
decode step costs the same at any history.

Config options and how they are handled:

- ``weight_mode`` ``single`` / ``fused``: both, with HF's parameter names (``q``, ``k``, ``v``,
  ``ogate_preact``, ``igate_preact``, ``fgate_preact`` / ``qkv_opreact``, ``ifgate_preact``; the
  FFN's ``proj_up_gate`` + ``proj_up`` / ``proj_up_gate_z``);
- ``mode`` (``inference``, ``train``, ``train_with_padding``), ``chunk_size``,
  ``chunkwise_kernel``, ``sequence_kernel``, ``step_kernel``, ``return_last_states``,
  ``max_inference_chunksize``: they only choose *how* HF evaluates the same recurrence (chunks,
  per-token steps, zero padding after the sequence, splitting long inputs), never *what* it
  computes. The parallel form gives that result for every length; HF's ``train`` mode itself
  refuses lengths that are not a multiple of ``chunk_size``;
- ``gate_soft_cap`` / ``output_logit_soft_cap``: ``cap * tanh(x / cap)`` on the input/forget
  gate pre-activations and on the logits (``None``: no cap);
- ``use_bias``, ``norm_eps``, ``eps`` (the mLSTM normaliser's), ``norm_reduction_force_float32``,
  ``qk_dim_factor``, ``v_dim_factor``, ``ffn_proj_factor``, ``ffn_round_up_to_multiple_of``:
  as HF uses them;
- ``autocast_kernel_dtype`` / ``inference_state_dtype``: HF's native kernels (the only ones it
  has without the ``xlstm`` package) ignore the first and keep states in the second (float32);
  the mLSTM here always runs in float32 and casts its output back;
- ``add_out_norm``: HF's ``xLSTMModel`` applies ``out_norm`` whatever it says, and so does this
  model (a checkpoint always holds ``backbone.out_norm.weight``).
"""

import logging
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import register_custom_model

logger = logging.getLogger(__name__)
ad = torch.ops.autodeploy

_MODES = ("inference", "train", "train_with_padding")
_WEIGHT_MODES = ("single", "fused")


def soft_cap(values: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """``cap * tanh(values / cap)``, HF's soft cap (``None``: values unchanged)."""
    if cap is None:
        return values
    return cap * torch.tanh(values / cap)


def round_up(value: float, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (HF's ``round_up_to_next_multiple_of``)."""
    return int(((value + multiple - 1) // multiple) * multiple)


class XLSTMRMSNorm(nn.Module):
    """HF's ``xLSTMRMSNorm`` (always with a weight, a bias with ``use_bias``). With float32
    reductions (the default) it is exactly ``torch_rmsnorm``; without them the reduction runs in
    the input dtype, as HF's does."""

    def __init__(self, num_features: int, eps: float, use_bias: bool = False, force_float32: bool = True):
        super().__init__()
        self.eps = eps
        self.force_float32 = force_float32
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features)) if use_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.force_float32:
            y = ad.torch_rmsnorm(x, self.weight, self.eps)
        else:
            y = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight
        return y if self.bias is None else y + self.bias


class XLSTMMultiHeadLayerNorm(nn.Module):
    """HF's ``xLSTMMultiHeadLayerNorm``: a LayerNorm over each head's ``dv`` values (no affine
    part per head), then one weight (and bias) over all ``nh * dv`` features.
    Input ``[b, s, nh, dv]``, output ``[b, s, nh * dv]``."""

    def __init__(self, num_heads: int, head_dim: int, eps: float, use_bias: bool, force_float32: bool):
        super().__init__()
        self.head_dim = head_dim
        self.eps = eps
        self.force_float32 = force_float32
        self.weight = nn.Parameter(torch.ones(num_heads * head_dim))
        self.bias = nn.Parameter(torch.zeros(num_heads * head_dim)) if use_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xr = x.float() if self.force_float32 else x
        y = F.layer_norm(xr, (self.head_dim,), eps=self.eps).to(x.dtype)
        y = y.flatten(2) * self.weight
        return y if self.bias is None else y + self.bias


class XLSTMFeedForward(nn.Module):
    """The gated FFN ``proj_down(silu(gate) * up)`` as one canonical SwiGLU node: separate
    ``proj_up_gate``/``proj_up`` (``single``) or stacked ``proj_up_gate_z``, gate rows first (``fused``)."""

    def __init__(self, config):
        super().__init__()
        self.fused = config.weight_mode == "fused"
        hidden, bias = config.hidden_size, config.use_bias
        up_dim = round_up(hidden * config.ffn_proj_factor, config.ffn_round_up_to_multiple_of)
        if self.fused:
            self.proj_up_gate_z = nn.Linear(hidden, 2 * up_dim, bias=bias)
        else:
            self.proj_up_gate = nn.Linear(hidden, up_dim, bias=bias)
            self.proj_up = nn.Linear(hidden, up_dim, bias=bias)
        self.proj_down = nn.Linear(up_dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = self.proj_down
        if self.fused:
            fused = self.proj_up_gate_z
            return ad.torch_fused_swiglu_mlp(x, fused.weight, down.weight, fused.bias, down.bias)
        gate, up = self.proj_up_gate, self.proj_up
        return ad.torch_swiglu_mlp(x, gate.weight, up.weight, down.weight, gate.bias, up.bias, down.bias)


class XLSTMLayer(nn.Module):
    """The mLSTM layer (HF ``xLSTMLayer``): projections, soft-capped gates, the mLSTM
    (``torch_mlstm``), the per-head LayerNorm, the sigmoid output gate and ``out_proj``.

    The widths are HF's layer widths ``int(hidden * factor)`` (not the config's ``qk_dim``/``v_dim``
    properties, which round up to 64 and only size HF's state cache)."""

    def __init__(self, config):
        super().__init__()
        hidden, bias = config.hidden_size, config.use_bias
        self.num_heads = config.num_heads
        self.qk_dim = int(hidden * config.qk_dim_factor)
        self.v_dim = int(hidden * config.v_dim_factor)
        for name, dim in (("qk", self.qk_dim), ("v", self.v_dim)):
            if dim % self.num_heads:
                raise ValueError(f"xLSTM: the {name} width {dim} (hidden_size * {name}_dim_factor) is not "
                                 f"divisible by num_heads={self.num_heads}")
        self.fused = config.weight_mode == "fused"
        self.gate_soft_cap = config.gate_soft_cap
        self.eps = config.eps
        if self.fused:
            self.qkv_opreact = nn.Linear(hidden, 2 * self.qk_dim + 2 * self.v_dim, bias=bias)
            self.ifgate_preact = nn.Linear(hidden, 2 * self.num_heads, bias=True)
        else:
            self.q = nn.Linear(hidden, self.qk_dim, bias=bias)
            self.k = nn.Linear(hidden, self.qk_dim, bias=bias)
            self.v = nn.Linear(hidden, self.v_dim, bias=bias)
            self.ogate_preact = nn.Linear(hidden, self.v_dim, bias=bias)
            self.igate_preact = nn.Linear(hidden, self.num_heads, bias=True)
            self.fgate_preact = nn.Linear(hidden, self.num_heads, bias=True)
        self.multihead_norm = XLSTMMultiHeadLayerNorm(self.num_heads, self.v_dim // self.num_heads, config.norm_eps,
                                                      bias, config.norm_reduction_force_float32)
        self.out_proj = nn.Linear(self.v_dim, hidden, bias=bias)

    def _projections(self, x: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """``(q, k, v, o_preact, i_preact, f_preact)``, the gates soft-capped as HF caps them."""
        if self.fused:
            q, k, v, o = torch.split(self.qkv_opreact(x), [self.qk_dim, self.qk_dim, self.v_dim, self.v_dim], dim=-1)
            i, f = soft_cap(self.ifgate_preact(x), self.gate_soft_cap).split(self.num_heads, dim=-1)
            return q, k, v, o, i, f
        cap = self.gate_soft_cap
        return (self.q(x), self.k(x), self.v(x), self.ogate_preact(x),
                soft_cap(self.igate_preact(x), cap), soft_cap(self.fgate_preact(x), cap))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v, o, i, f = self._projections(x)
        heads = [t.reshape(b, s, self.num_heads, -1) for t in (q, k, v)]
        h = ad.torch_mlstm(*heads, i, f, self.eps)  # [b, s, nh, dv]
        h = self.multihead_norm(h)  # [b, s, v_dim]
        return self.out_proj(torch.sigmoid(o) * h)


class XLSTMBlock(nn.Module):
    """Pre-norm residual block: ``x + mlstm(norm(x))``, then ``x + ffn(norm(x))``."""

    def __init__(self, config):
        super().__init__()
        eps, bias, f32 = config.norm_eps, config.use_bias, config.norm_reduction_force_float32
        self.norm_mlstm = XLSTMRMSNorm(config.hidden_size, eps, bias, f32)
        self.mlstm_layer = XLSTMLayer(config)
        self.norm_ffn = XLSTMRMSNorm(config.hidden_size, eps, bias, f32)
        self.ffn = XLSTMFeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mlstm_layer(self.norm_mlstm(x))
        return x + self.ffn(self.norm_ffn(x))


class XLSTMBackbone(nn.Module):
    """``backbone`` of the checkpoint: ``embeddings``, ``blocks``, ``out_norm`` (HF builds the
    last with its defaults: float32 reductions, no bias)."""

    def __init__(self, config):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.embedding_dim)
        self.blocks = nn.ModuleList(XLSTMBlock(config) for _ in range(config.num_blocks))
        self.out_norm = XLSTMRMSNorm(config.hidden_size, config.norm_eps)


def _check_config(config) -> None:
    """Refuse options HF's model has no path for (it would fail on them too)."""
    if config.weight_mode not in _WEIGHT_MODES:
        raise ValueError(f"xLSTM: unsupported weight_mode {config.weight_mode!r} (expected one of {_WEIGHT_MODES})")
    if config.mode not in _MODES:
        raise ValueError(f"xLSTM: unsupported mode {config.mode!r} (expected one of {_MODES})")
    if config.embedding_dim != config.hidden_size:
        raise ValueError(f"xLSTM: embedding_dim={config.embedding_dim} must equal hidden_size={config.hidden_size}")


@register_custom_model("xLSTMConfig")
class XLSTMForCausalLM(nn.Module):
    """Lean xLSTM with the checkpoint's parameter names (``backbone.blocks.N.mlstm_layer.q.weight``,
    ...; loads without hooks). No positions are used (the mLSTM is position-free), no masks, no
    cache: the pipeline serves it in recompute mode. Logits are float32 and soft-capped, as HF's."""

    def __init__(self, config):
        super().__init__()
        _check_config(config)
        self.config = config
        self.backbone = XLSTMBackbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.mode != "inference":
            logger.info("xLSTM: mode=%r only changes how HF evaluates the mLSTM; the parallel form computes the "
                        "same result", config.mode)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None, **unused) -> torch.Tensor:
        """``position_ids`` is part of the contract but unused: the recurrence orders tokens itself.
        ``unused`` absorbs what callers pass HF models (``use_cache=False``)."""
        hidden = self.backbone.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        for block in self.backbone.blocks:
            hidden = block(hidden)
        hidden = self.backbone.out_norm(hidden)
        logits = self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()
        return soft_cap(logits, self.config.output_logit_soft_cap)


__all__ = ["XLSTMForCausalLM", "soft_cap"]
