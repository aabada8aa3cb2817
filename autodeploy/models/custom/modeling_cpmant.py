"""Lean CPM-Ant (``CpmAntConfig``): HF's ``CpmAntForCausalLM`` forward written with the canonical ops.

What HF computes for a plain call ``model(input_ids)`` (the coverage reference's call):

* it prepends ``prompt_length`` learned prompt tokens (ids ``vocab + 2P .. vocab + 3P - 1``,
  segment 0) to the text (segment 2, or 0 for token id 0, CPM-Ant's pad id), embeds
  ``input_embedding(id) + segment_embedding(segment)`` and drops the prompt rows at the end;
* attention is **bidirectional**: HF sets ``context = 1`` for every token, so its
  ``_prepare_attention_mask`` lets every position see every other (also later) position. HF's
  full-sequence logits at position ``i`` therefore depend on the tokens after ``i``, and HF's own
  cached ``generate`` (prompt keys/values frozen at prefill) gives other tokens than re-running
  the full sequence each step (``generate(use_cache=False)``, what the coverage reference does);
* a learned per-head bias is added to the scores: for two tokens of the same segment the
  T5-style bucket of ``key_pos - query_pos`` (bidirectional buckets, log-spaced past
  ``num_buckets / 4``), for tokens of different segments a bucket per segment pair;
* token id 0 counts as left padding: with ``n0`` zeros in the row, the first ``n0`` text positions
  are masked as keys, and their own attention output is zero (HF zeroes the all-masked rows).

This module computes exactly that from ``input_ids`` and ``position_ids``: the bias (and the
padding rule) go to ``torch_attention`` as its additive ``attn_mask``, with ``is_causal=False``.
A KV cache cannot serve a bidirectional model, so the pipeline runs it in recompute mode
(``recompute_fallback``): every step re-runs the graph over the whole history, which is what HF's
full-sequence forward (and ``generate(use_cache=False)``) computes.
"""

import logging
import math
from typing import Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F
from transformers import CpmAntConfig

from . import register_custom_model

logger = logging.getLogger(__name__)
ad = torch.ops.autodeploy

TEXT_SEGMENT = 2  # HF: segment = where(input_ids != 0, 2, 0)
PROMPT_TYPE = 2  # HF prepends the third group of prompt embeddings: ids vocab + 2P .. vocab + 3P - 1


class CpmAntRMSNorm(nn.Module):
    """HF's ``CpmAntLayerNorm``: an RMSNorm without bias (normalise in fp32, scale by ``weight``)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ad.torch_rmsnorm(x, self.weight, self.eps)


class CpmAntAttention(nn.Module):
    """Multi-head attention (no GQA, no projection biases) whose scores get the per-head bias."""

    def __init__(self, config: CpmAntConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.dim_head = config.dim_head
        inner = self.num_heads * self.dim_head
        self.project_q = nn.Linear(config.hidden_size, inner, bias=False)
        self.project_k = nn.Linear(config.hidden_size, inner, bias=False)
        self.project_v = nn.Linear(config.hidden_size, inner, bias=False)
        self.attention_out = nn.Linear(inner, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, keep_row: torch.Tensor) -> torch.Tensor:
        """``bias``: ``[b, heads, S, S]`` additive (position bias, padded keys at -max);
        ``keep_row``: ``[b, S, 1, 1]``, 0 for the rows HF masks entirely (their output is zero)."""
        b, s, _ = x.shape
        q = self.project_q(x).view(b, s, self.num_heads, self.dim_head)
        k = self.project_k(x).view(b, s, self.num_heads, self.dim_head)
        v = self.project_v(x).view(b, s, self.num_heads, self.dim_head)
        out = ad.torch_attention(q, k, v, bias, 0.0, False, self.dim_head ** -0.5, None, None, None)
        return self.attention_out((out * keep_row).reshape(b, s, -1))


class CpmAntSelfAttentionBlock(nn.Module):
    """Pre-norm attention with its residual (HF's ``self_att``)."""

    def __init__(self, config: CpmAntConfig):
        super().__init__()
        self.layernorm_before_attention = CpmAntRMSNorm(config.hidden_size, config.eps)
        self.self_attention = CpmAntAttention(config)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, keep_row: torch.Tensor) -> torch.Tensor:
        return x + self.self_attention(self.layernorm_before_attention(x), bias, keep_row)


class CpmAntGatedGelu(nn.Module):
    """HF's ``CpmAntDenseGatedACT``: ``gelu(w_0 x) * w_1 x`` (exact, erf GELU)."""

    def __init__(self, config: CpmAntConfig):
        super().__init__()
        self.w_0 = nn.Linear(config.hidden_size, config.dim_ff, bias=False)
        self.w_1 = nn.Linear(config.hidden_size, config.dim_ff, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.w_0(x)) * self.w_1(x)


class CpmAntFeedForward(nn.Module):
    """Gated-GELU MLP (``w_in`` then ``w_out``); dropout is training-only and left out."""

    def __init__(self, config: CpmAntConfig):
        super().__init__()
        self.w_in = CpmAntGatedGelu(config)
        self.w_out = nn.Linear(config.dim_ff, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(self.w_in(x))


class CpmAntFFNBlock(nn.Module):
    """Pre-norm feed-forward with its residual (HF's ``ffn``)."""

    def __init__(self, config: CpmAntConfig):
        super().__init__()
        self.layernorm_before_ffn = CpmAntRMSNorm(config.hidden_size, config.eps)
        self.ffn = CpmAntFeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.layernorm_before_ffn(x))


class CpmAntTransformerBlock(nn.Module):
    """One layer: attention block then feed-forward block (HF's ``CpmAntTransformerBlock``)."""

    def __init__(self, config: CpmAntConfig):
        super().__init__()
        self.self_att = CpmAntSelfAttentionBlock(config)
        self.ffn = CpmAntFFNBlock(config)

    def forward(self, x: torch.Tensor, bias: torch.Tensor, keep_row: torch.Tensor) -> torch.Tensor:
        return self.ffn(self.self_att(x, bias, keep_row))


class CpmAntEncoder(nn.Module):
    def __init__(self, config: CpmAntConfig):
        super().__init__()
        self.layers = nn.ModuleList(CpmAntTransformerBlock(config) for _ in range(config.num_hidden_layers))
        self.output_layernorm = CpmAntRMSNorm(config.hidden_size, config.eps)


def position_bucket(relative: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """HF's ``_position_bucket`` (bidirectional T5 buckets) of ``key_pos - query_pos``.

    Half the buckets are for keys after the query. Of each half, distances below a quarter of
    ``num_buckets`` get their own bucket, larger ones log-spaced buckets up to ``max_distance``.
    The log's argument is clamped to 1 so that distance 0 (always an exact bucket) gives no -inf."""
    half = num_buckets // 2
    max_exact = half // 2
    bucket = (relative > 0).to(torch.int64) * half
    distance = relative.abs()
    scaled = (torch.log(distance.clamp(min=1).float() / max_exact) / math.log(max_distance / max_exact)
              * (half - max_exact))
    large = (max_exact + scaled.to(torch.int32)).clamp(max=half - 1).to(torch.int64)
    return bucket + torch.where(distance < max_exact, distance, large)


class CpmAntSegmentPositionBias(nn.Module):
    """HF's ``CpmAntSegmentPositionEmbedding``: a ``[b, heads, S, S]`` score bias looked up in
    ``relative_attention_bias`` (``[segments^2 + buckets, heads]``)."""

    def __init__(self, config: CpmAntConfig):
        super().__init__()
        self.num_buckets = config.position_bias_num_buckets
        self.max_distance = config.position_bias_max_distance
        self.num_segments = config.segment_types
        self.relative_attention_bias = nn.Parameter(
            torch.zeros(config.segment_types ** 2 + config.position_bias_num_buckets, config.num_attention_heads))

    def forward(self, positions: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
        """``positions``/``segments``: ``[b, S]`` absolute positions and segment ids of every token."""
        relative = positions[:, None, :] - positions[:, :, None]  # [b, query, key]: key_pos - query_pos
        same_segment = segments[:, :, None] == segments[:, None, :]
        segment_pair = segments[:, :, None] * self.num_segments + segments[:, None, :] + self.num_buckets
        buckets = torch.where(same_segment, position_bucket(relative, self.num_buckets, self.max_distance),
                              segment_pair)
        return F.embedding(buckets, self.relative_attention_bias).permute(0, 3, 1, 2)


class CpmAntModel(nn.Module):
    """Embeddings (text + segment + the learned prompt), the bias, the layers (HF's ``cpmant``)."""

    def __init__(self, config: CpmAntConfig):
        super().__init__()
        self.vocab_size = config.vocab_size
        self.prompt_length = config.prompt_length
        self.encoder = CpmAntEncoder(config)
        self.segment_embedding = nn.Embedding(config.segment_types, config.hidden_size)
        self.input_embedding = nn.Embedding(config.vocab_size + config.prompt_types * config.prompt_length,
                                            config.hidden_size)
        self.position_bias = CpmAntSegmentPositionBias(config)

    def embed(self, input_ids: torch.Tensor, inputs_embeds: Optional[torch.Tensor]) -> torch.Tensor:
        """``[b, P + s, hidden]``: the prompt tokens' embeddings, then the text's, each plus its
        segment embedding (the text's segment comes from the ids even with ``inputs_embeds``)."""
        b, p = input_ids.shape[0], self.prompt_length
        start = self.vocab_size + PROMPT_TYPE * p
        prompt_ids = torch.arange(start, start + p, device=input_ids.device).expand(b, p)
        text = self.input_embedding(input_ids) if inputs_embeds is None else inputs_embeds
        hidden = torch.cat((self.input_embedding(prompt_ids).to(text.dtype), text), dim=1)
        return hidden + self.segment_embedding(self.segments(input_ids)).to(text.dtype)

    def segments(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[b, P + s]`` segment ids: 0 for the prompt and for pad tokens (id 0), 2 for text."""
        text = torch.where(input_ids != 0, TEXT_SEGMENT, 0)
        return torch.cat((torch.zeros_like(input_ids[:, :1]).expand(-1, self.prompt_length), text), dim=1)

    def attention_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                         dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        """The per-head score bias ``[b, heads, P + s, P + s]`` (float32) and the row multiplier
        ``[b, P + s, 1, 1]``.

        HF treats the zeros in a row as left padding: with ``n0`` of them, the text positions below
        ``n0`` are neither attended to nor attend (HF's all-masked rows come out as zero). The
        masked keys get float32's lowest value instead of -inf, so a row never turns into NaN."""
        p = self.prompt_length
        prompt_pos = torch.arange(p, device=input_ids.device).expand(input_ids.shape[0], p)
        positions = torch.cat((prompt_pos, position_ids.to(prompt_pos.dtype) + p), dim=1)
        bias = self.position_bias(positions, self.segments(input_ids)).float()
        num_pad = (input_ids == 0).sum(dim=-1, keepdim=True)
        keep = torch.cat((torch.ones_like(prompt_pos, dtype=torch.bool), position_ids >= num_pad), dim=1)
        bias = bias.masked_fill(~keep[:, None, None, :], torch.finfo(torch.float32).min)
        return bias, keep[:, :, None, None].to(dtype)


@register_custom_model("CpmAntConfig")
class LeanCpmAntForCausalLM(nn.Module):
    """Lean ``CpmAntForCausalLM`` with the checkpoint's parameter names (``cpmant.encoder.layers.N.
    self_att.self_attention.project_q.weight``, ``cpmant.position_bias.relative_attention_bias``,
    ``lm_head.weight``, ...). HF does not tie ``lm_head`` to the (larger) input embedding, neither
    does this model.

    The attention is bidirectional (module docstring): served in recompute mode, it equals HF's
    full-sequence forward at every step."""

    def __init__(self, config: CpmAntConfig):
        super().__init__()
        _check_supported(config)
        self.config = config
        self.cpmant = CpmAntModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None, **unused) -> torch.Tensor:
        """``[b, s]`` ids and positions -> ``[b, s, vocab]`` logits; ``unused`` absorbs what callers
        pass HF models (``use_cache=False``). No cache: the pipeline recomputes (see the docstring)."""
        model = self.cpmant
        hidden = model.embed(input_ids, inputs_embeds)
        bias, keep_row = model.attention_inputs(input_ids, position_ids, hidden.dtype)
        for layer in model.encoder.layers:
            hidden = layer(hidden, bias, keep_row)
        hidden = model.encoder.output_layernorm(hidden)[:, model.prompt_length:]
        return self.lm_head(hidden)


def _check_supported(config: CpmAntConfig) -> None:
    """Refuse configs HF itself cannot run as a model with these buckets (a zero exact range
    divides by zero in HF's bucket formula)."""
    if config.position_bias_num_buckets < 4:
        raise ValueError(f"CpmAnt: position_bias_num_buckets={config.position_bias_num_buckets} is below 4; "
                         "HF's bucket formula divides by num_buckets // 4")
    if config.dropout_p:
        logger.info("CpmAnt: dropout_p=%s is ignored (inference only)", config.dropout_p)
