"""Lean custom Doge (SmallDoge): dynamic mask attention and the cross-domain MoE, export-friendly.

Why a custom model: HF's ``DogeAttention.prepare_dynamic_mask`` switches to a top-k key selection
only ``if attn_mask.shape[-1] > keep_window_size``, a Python branch on the sequence length.
``torch.export`` freezes the branch it traced (or refuses the dynamic sequence), so the HF class
gives wrong logits at every length on the other side of ``keep_window_size``. Here the mask is
one custom op, ``torch_doge_dynamic_mask``, opaque to export: its eager body keeps HF's branch and
HF's exact ``topk`` call, and the graph stays dynamic in batch and sequence.

What Doge's attention computes (per batch row, query head ``h`` of KV group ``g``)::

    bias[g, j]  = exp(A[g] * softplus(dt_proj(v_j))[g])            # one value per key and KV head
    mask[g,i,j] = bias[g, j]  if j is causal (and in the sliding window) for query i, else min
    mask[g,i,:] = mask restricted to its top-keep_window_size entries (the rest -> min)
    out_i       = softmax(q_i k^T * scale + mask[g, i]) v

Two forms, chosen from the config (``_bias_channel_is_exact``):

* top-k possible (``keep_window_size`` below the context limit, or the CDMoE): the mask is an
  explicit ``torch_attention`` mask. Which keys a query keeps depends on every earlier key's bias,
  which the paged-KV attention ops (q, k, v, causal/window only) cannot express, so the pipeline
  serves the graph in recompute mode (each step reruns a sequence's whole history): exact, slower.
* top-k impossible (DogeConfig's defaults: window 2048 = max_position_embeddings): the bias rides in
  an extra key channel, the attention is plain causal and gets the paged KV cache.

The CDMoE (``is_moe``) forces the first form: HF's router reshapes its logits with
``view(2, batch * seq, num_keys)``, which pairs the logits of *different tokens*, so a token's
routing depends on everything in the same forward. It is reproduced as is (same checkpoints, same
outputs as HF's full forward over one sequence); recompute mode runs each sequence alone, as HF's
forward does (HF's own ``generate`` routes decode tokens alone and so disagrees with its forward).
"""

import math
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ...utils.logging import get_logger
from . import register_custom_model

logger = get_logger(__name__)
ad = torch.ops.autodeploy

# RoPE types whose inverse frequencies HF changes with the sequence length at run time
# (``dynamic_rope_update``): a data-dependent branch a static graph cannot follow.
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _head_dim(config) -> int:
    """HF's ``getattr(config, "head_dim", hidden // heads)`` (DogeConfig has no such field by default)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The config's ``hidden_act`` as transformers defines it (the MLP and the experts share it)."""
    from transformers.activations import ACT2FN

    return ACT2FN[name]


def _rope_inv_freq(config) -> Tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scaling factor, as ``DogeRotaryEmbedding`` builds them."""
    params = config.rope_parameters or {}
    rope_type = params.get("rope_type", "default")
    if any(kind in rope_type for kind in _LENGTH_DEPENDENT_ROPE):
        raise NotImplementedError(
            f"Doge custom model: rope_type '{rope_type}' rescales RoPE with the sequence length at run time "
            "(dynamic_rope_update), which one exported graph cannot follow; use a static RoPE type"
        )
    if rope_type == "default":
        dim = _head_dim(config)
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # static scaled variants (linear, yarn, ...)

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
    return inv_freq.float(), float(scaling)


class DogeRMSNorm(nn.Module):
    """RMSNorm (fp32 statistics, cast back, scaled by ``weight``): the canonical ``torch_rmsnorm``."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ad.torch_rmsnorm(x, self.weight, self.eps)


@torch.library.custom_op("autodeploy::torch_doge_dynamic_mask", mutates_args=())
def torch_doge_dynamic_mask(bias: torch.Tensor, keep: torch.Tensor, keep_window_size: int) -> torch.Tensor:
    """The additive ``[b, kv_heads, s_q, s_kv]`` mask of Doge's dynamic mask attention.

    ``bias``: ``[b, kv_heads, s_kv]`` per-key bias; ``keep``: ``[b, 1, s_q, s_kv]`` causal (and
    window) mask, True = attend; masked entries get ``bias``'s dtype minimum. Every step, shape and order is HF's ``prepare_dynamic_mask``, so
    ``topk`` sees the same tensor and breaks ties the way HF's does (``A == 0``, HF's init, makes
    every bias exactly 1: then *which* keys survive is decided by ``topk``'s tie-breaking alone).

    A custom op because of the length branch: the top-k selection runs only when ``s_kv`` exceeds
    the window, and the obvious branch-free form, ``topk(k=min(window, s_kv))``, leaves a guard
    ``min(w, s) <= s`` that torch.export's solver cannot prove, so it refuses the dynamic sequence.
    Inside an op the branch is plain eager code and the graph stays dynamic.
    """
    min_value = torch.finfo(bias.dtype).min  # from the tensor, so a graph cast to another dtype stays right
    mask = bias[:, :, None, :].expand(-1, -1, keep.shape[-2], -1).masked_fill(~keep, min_value)
    if mask.shape[-1] > keep_window_size:
        top = torch.topk(mask, keep_window_size, dim=-1, largest=True, sorted=False).indices
        active = torch.zeros_like(mask).scatter(-1, top, 1.0)
        mask = mask.masked_fill(active == 0.0, min_value)
    return mask


@torch_doge_dynamic_mask.register_fake
def _torch_doge_dynamic_mask_fake(bias, keep, keep_window_size):
    return bias.new_empty(bias.shape[0], bias.shape[1], keep.shape[-2], bias.shape[-1])


class DogeAttention(nn.Module):
    """Dynamic mask attention: q/k RMS-normed per head, RoPE, a value-derived per-key bias with an
    optional top-k key selection, GQA through ``torch_attention`` with that bias as its mask."""

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        self.scale = self.head_dim ** -0.5
        self.keep_window_size = config.keep_window_size
        self.sliding_window = config.sliding_window
        h, bias, kv = config.hidden_size, config.attention_bias, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, kv, bias=bias)
        self.v_proj = nn.Linear(h, kv, bias=bias)
        self.A = nn.Parameter(torch.zeros(self.num_kv_heads))  # per-KV-head gain of the dynamic bias
        self.dt_proj = nn.Linear(kv, self.num_kv_heads, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = DogeRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DogeRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keep: Optional[torch.Tensor]) -> torch.Tensor:
        """``x`` ``[b, s, hidden]``; ``cos``/``sin`` ``[b, s, head_dim]``; ``keep`` the causal keep-mask
        ``[b, 1, s, s]``, or None when the top-k selection can never trigger (``bias_channel``)."""
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim))
        v_flat = self.v_proj(x)
        v = v_flat.view(b, s, self.num_kv_heads, self.head_dim)
        q, k = ad.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 2)
        # the bias of each key from its value (HF: dt_proj over the keys' concatenated value heads)
        bias = torch.exp(self.A * F.softplus(self.dt_proj(v_flat)))  # [b, s, kv_heads]
        if keep is None:
            out = self._bias_channel_attention(q, k, v, bias)
        else:
            out = self._masked_attention(q, k, v, bias, keep)
        return self.o_proj(out.reshape(b, s, -1))

    def _masked_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                          keep: torch.Tensor) -> torch.Tensor:
        """HF's computation: the dynamic mask (bias + top-k) as ``torch_attention``'s explicit mask."""
        mask = ad.torch_doge_dynamic_mask(bias.transpose(-1, -2), keep, self.keep_window_size)
        mask = mask.repeat_interleave(self.num_heads // self.num_kv_heads, dim=1)  # query head h -> KV head h // rep
        return ad.torch_attention(q, k, v, mask, 0.0, True, self.scale, None, self.sliding_window, None)

    def _bias_channel_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                bias: torch.Tensor) -> torch.Tensor:
        """The same attention when no top-k can happen, with the per-key bias folded into the keys.

        ``(q . k + 1 * bias / scale) * scale = q . k * scale + bias``: an extra channel holding 1 in
        every query and ``bias / scale`` in its key (0 in the values) adds the bias through the dot
        product, so a plain causal ``torch_attention`` without a mask computes it and the paged KV
        cache stores the bias with the key. The channels are padded to a multiple of 8 (zeros) for
        kernels that want aligned head sizes; the output drops them again.
        """
        pad = 8 - self.head_dim % 8
        b, s, n, _ = q.shape
        q_extra = F.pad(q.new_ones(b, s, n, 1), (0, pad - 1))
        k_extra = F.pad((bias / self.scale).unsqueeze(-1), (0, pad - 1))
        q, k, v = torch.cat([q, q_extra], -1), torch.cat([k, k_extra], -1), F.pad(v, (0, pad))
        out = ad.torch_attention(q, k, v, None, 0.0, True, self.scale, None, self.sliding_window, None)
        return out[..., : self.head_dim]


class DogeMLP(nn.Module):
    """Gated MLP ``down(act(gate(x)) * up(x))``; the canonical SwiGLU node when ``act`` is SiLU."""

    def __init__(self, config):
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        self.silu = config.hidden_act == "silu"
        self.act_fn = _activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.silu:
            return ad.torch_swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight,
                                       self.gate_proj.bias, self.up_proj.bias, self.down_proj.bias)
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DogeCDMoE(DogeMLP):
    """Cross-domain MoE: the gated MLP as a shared expert plus ``num_experts`` one-neuron experts
    (``down_embed[e]`` reads the token, ``up_embed[e]`` writes it back) picked by product-key
    routing: two halves of the router give ``num_keys`` scores each, an expert is a pair of keys
    (score = sum of the two), and the top ``num_experts_per_tok`` pairs are mixed by softmax.

    The router's ``view(2, b * s, num_keys)`` is HF's: the "x" scores come from the first half of
    the flattened ``[b, s, 2 * num_keys]`` logits and the "y" scores from the second half, so
    tokens are paired across the batch and sequence. Kept, since checkpoints were trained with it.
    """

    def __init__(self, config):
        super().__init__(config)
        self.num_keys = math.floor(math.sqrt(config.num_experts))
        self.top_k = config.num_experts_per_tok
        if self.top_k > self.num_keys ** 2:
            raise ValueError(f"Doge CDMoE: num_experts_per_tok={self.top_k} exceeds the {self.num_keys ** 2} "
                             f"experts product-key routing reaches (floor(sqrt(num_experts))**2)")
        self.norm_topk_prob = config.norm_topk_prob
        self.router_gate = nn.Linear(config.hidden_size, self.num_keys * 2, bias=False)
        self.down_embed = nn.Embedding(config.num_experts, config.hidden_size)
        self.up_embed = nn.Embedding(config.num_experts, config.hidden_size)

    def route(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Expert ids and routing weights, each ``[b * s, top_k]``."""
        b, s, _ = x.shape
        # flattened first: viewing [b, s, 2k] straight as [2, b*s, k] makes export guard b == 2
        logits = self.router_gate(x).flatten().view(2, b * s, self.num_keys)
        (scores_x, scores_y), (ids_x, ids_y) = logits.topk(self.num_keys, dim=-1)
        pair_scores = (scores_x.unsqueeze(-1) + scores_y.unsqueeze(-2)).flatten(-2)
        pair_ids = (ids_x.unsqueeze(-1) * self.num_keys + ids_y.unsqueeze(-2)).flatten(-2)
        scores, picked = pair_scores.topk(self.top_k, dim=-1)
        weights = F.softmax(scores, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return pair_ids.gather(-1, picked), weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        ids, weights = self.route(x)
        tokens = x.reshape(b * s, h, 1)
        expert_in = torch.matmul(self.down_embed(ids), tokens).view(b * s, -1)  # [b*s, top_k]
        expert_in = self.act_fn(expert_in) * weights
        experts = torch.matmul(expert_in.view(b * s, 1, -1), self.up_embed(ids)).view(b, s, h)
        return super().forward(x) + experts


class DogeDecoderLayer(nn.Module):
    """Pre-norm layer whose residual branches are scaled per channel (``input_residual``,
    ``post_attention_residual``) before the sublayer output is added."""

    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = DogeRMSNorm(h, config.rms_norm_eps)
        self.self_attn = DogeAttention(config)
        self.input_residual = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = DogeRMSNorm(h, config.rms_norm_eps)
        self.mlp = DogeCDMoE(config) if config.is_moe else DogeMLP(config)
        self.post_attention_residual = nn.Parameter(torch.ones(h))

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                keep: Optional[torch.Tensor]) -> torch.Tensor:
        # The sublayer runs before the residual is scaled: the graph then has each norm ahead of the
        # other reader of its input, the order fuse_add_rms_norm needs (it places the fused op at the norm).
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, keep)
        hidden = self.input_residual * hidden + attn
        mlp = self.mlp(self.post_attention_layernorm(hidden))
        return self.post_attention_residual * hidden + mlp


def _bias_channel_is_exact(config) -> bool:
    """Whether the attention can drop the explicit mask (``DogeAttention._bias_channel_attention``).

    Exact when the top-k selection can never trigger: ``keep_window_size`` reaches the longest
    sequence the pipeline accepts (``max_seq_len`` may not exceed the model's context limit), as in
    DogeConfig's defaults (window 2048 = max_position_embeddings). Not for the CDMoE:
    its router pairs the logits of different tokens of one forward (``DogeCDMoE``), so a step that
    packs several sequences (or a chunk of one) routes differently from HF's forward over one
    sequence; with the explicit mask the pipeline runs each sequence's whole history alone.
    """
    from ..limits import model_context_limit

    limit = model_context_limit(config).tokens
    return not config.is_moe and limit is not None and config.keep_window_size >= limit


class DogeModel(nn.Module):
    """The ``model.`` prefix of the checkpoint names: embeddings, layers, final norm, RoPE frequencies."""

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DogeDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = DogeRMSNorm(config.hidden_size, config.rms_norm_eps)
        inv_freq, self.rope_scaling = _rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # not in the checkpoint


@register_custom_model("DogeConfig")
class DogeForCausalLM(nn.Module):
    """Doge with the checkpoint's parameter names; one graph for every batch and sequence length.

    The forward computes RoPE's cos/sin and the causal (windowed) keep-mask once and hands them to
    every layer; each layer derives its own dynamic mask from them (see ``torch_doge_dynamic_mask``)."""

    def __init__(self, config):
        super().__init__()
        if getattr(config, "attention_dropout", 0.0) or getattr(config, "hidden_dropout", 0.0):
            logger.info("Doge: dropout is ignored (inference only)")
        self.config = config
        self.bias_channel = _bias_channel_is_exact(config)
        logger.info("Doge: %s", "per-key bias in a key channel (KV-cacheable)" if self.bias_channel else
                    "dynamic mask as an explicit attention mask (served in recompute mode)")
        self.model = DogeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[b, s, head_dim]`` exactly as ``DogeRotaryEmbedding`` computes them."""
        freqs = position_ids[..., None].float() * self.model.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.model.rope_scaling
        return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None, **unused) -> torch.Tensor:
        """Logits ``[b, s, vocab]``; ``unused`` absorbs what callers pass HF models (``use_cache``)."""
        hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        b, s = hidden.shape[:2]
        cos, sin = self._rope(position_ids, hidden.dtype)
        keep = None
        if not self.bias_channel:  # the queries are the sequence's own tokens: the causal/window mask
            keep = ad.torch_causal_mask(b, s, s, self.config.sliding_window, torch.bool, hidden.device)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin, keep)
        return self.lm_head(self.model.norm(hidden))


__all__ = ["DogeForCausalLM", "torch_doge_dynamic_mask"]
