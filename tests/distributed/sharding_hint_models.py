"""Two sharding-aware lean custom models for ``apply_sharding_hints``: a dense Llama and a
Mixtral-style MoE, their projections written with ``autodeploy.torch_linear_with_hint``.

Each states its own tensor-parallel layout: q/k/v and the MLP's gate/up split by output features
(``colwise``; q/k/v with ``tp_min_local_shape = head_dim`` so a rank never holds part of a head,
and key/value heads fewer than the ranks are replicated), o and down by input features
(``rowwise``: an all-reduce follows), the untied LM head by vocabulary with an all-gather
(``colwise_gather``), the MoE router whole (``none``) and the experts split by whole experts
(``layer_type`` "moe"). Views use ``-1`` for head counts, so a rank's slice reshapes by itself.

They use the checkpoints' own parameter names (HF Llama / Mixtral), so they load the same tiny
checkpoints the HF classes load. Registered only inside the tests (``registered``): registered
for good, the factory would build them for every Llama / Mixtral user.
"""

from contextlib import contextmanager
from typing import Iterator, Optional, Tuple, Type

import torch
import torch.nn.functional as F
from torch import nn

from autodeploy.models.custom import register_custom_model, unregister_custom_model

ad = torch.ops.autodeploy


def hinted(x: torch.Tensor, layer: nn.Linear, tp_mode: str, layer_type: str, min_local: int = 1) -> torch.Tensor:
    return ad.torch_linear_with_hint(x, layer.weight, layer.bias, tp_mode, min_local, layer_type)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ad.torch_rmsnorm(x, self.weight, self.eps)


class HintedAttention(nn.Module):
    """Causal GQA attention (``bsnd``) whose projections carry their sharding."""

    def __init__(self, config):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        q = hinted(x, self.q_proj, "colwise", "attention", d).view(b, s, -1, d)
        k = hinted(x, self.k_proj, "colwise", "attention", d).view(b, s, -1, d)
        v = hinted(x, self.v_proj, "colwise", "attention", d).view(b, s, -1, d)
        q, k = ad.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 2)
        out = ad.torch_attention(q, k, v, None, 0.0, True, d ** -0.5, None, None, None)
        # rowwise: each rank's input slice must hold whole heads too
        return hinted(out.reshape(b, s, -1), self.o_proj, "rowwise", "attention", d)


class HintedMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = hinted(x, self.gate_proj, "colwise", "mlp")
        up = hinted(x, self.up_proj, "colwise", "mlp")
        return hinted(F.silu(gate) * up, self.down_proj, "rowwise", "mlp")


class Expert(nn.Module):
    """Mixtral's expert names: w1 gate, w3 up, w2 down."""

    def __init__(self, config):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.w1 = nn.Linear(h, i, bias=False)
        self.w2 = nn.Linear(i, h, bias=False)
        self.w3 = nn.Linear(h, i, bias=False)


class HintedSparseMoe(nn.Module):
    """Mixtral's routing (softmax, top-k, renormalised) into ``torch_moe``; the router stays
    whole on every rank (each rank routes every token), the experts are split by expert."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = nn.Linear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = nn.ModuleList(Expert(config) for _ in range(config.num_local_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(hinted(x, self.gate, "none", "moe").float(), dim=-1)
        weights, selected = torch.topk(probs, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        return ad.torch_moe(x, selected, weights, [e.w1.weight for e in self.experts],
                            [e.w3.weight for e in self.experts], [e.w2.weight for e in self.experts], [], [], [])


class HintedDecoderLayer(nn.Module):
    def __init__(self, config, moe: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = HintedAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if moe:
            self.block_sparse_moe = HintedSparseMoe(config)
        else:
            self.mlp = HintedMLP(config)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin)
        ffn = self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp
        return hidden + ffn(self.post_attention_layernorm(hidden))


def _rope_tables(config) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position (float32), as HF's default RoPE computes them."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.arange(config.max_position_embeddings, dtype=torch.float)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class HintedModel(nn.Module):
    def __init__(self, config, moe: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HintedDecoderLayer(config, moe) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        cos, sin = _rope_tables(config)
        self.register_buffer("rope_cos", cos, persistent=False)  # not in the checkpoint: built values kept
        self.register_buffer("rope_sin", sin, persistent=False)


class _HintedForCausalLM(nn.Module):
    MOE = False

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = HintedModel(config, self.MOE)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        # a head tied to the embedding cannot be split by vocabulary (the lookup needs every row)
        self.head_mode = "none" if config.tie_word_embeddings else "colwise_gather"
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None, **unused) -> torch.Tensor:
        hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos = self.model.rope_cos[position_ids].to(hidden.dtype)
        sin = self.model.rope_sin[position_ids].to(hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin)
        return hinted(self.model.norm(hidden), self.lm_head, self.head_mode, "lm_head")


class HintedLlamaForCausalLM(_HintedForCausalLM):
    """Dense, Llama's checkpoint names."""


class HintedMixtralForCausalLM(_HintedForCausalLM):
    """MoE, Mixtral's checkpoint names (``block_sparse_moe.gate``, ``experts.N.w1/w2/w3``)."""

    MOE = True


MODELS = {"LlamaConfig": HintedLlamaForCausalLM, "MixtralConfig": HintedMixtralForCausalLM}


@contextmanager
def registered(config_class: str) -> Iterator[Type[nn.Module]]:
    """The hinted model registered for ``config_class`` within the block only."""
    register_custom_model(config_class)(MODELS[config_class])
    try:
        yield MODELS[config_class]
    finally:
        unregister_custom_model(config_class)
