"""The runnable example of docs/onboarding.md: a lean custom Llama, checked against HF's
``LlamaForCausalLM`` down the hierarchy (block -> layer -> model -> export at two shapes) and
then served through ``autodeploy.LLM`` with greedy tokens equal to HF eager's.

Llama exports fine without a custom model, so this one is registered only inside these tests
(the ``registered`` fixture unregisters it): registered for good, the factory would prefer it
for every Llama user.
"""

import logging
from typing import Optional, Tuple

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from autodeploy import LLM, SamplingParams
from autodeploy.models.custom import register_custom_model, unregister_custom_model
from autodeploy.models.custom.testing import (
    assert_block_matches, assert_exports_at_two_shapes, assert_layer_matches, assert_logits_match, copy_weights,
)
from helpers import FAMILIES, family_checkpoint, hf_model

ad = torch.ops.autodeploy


# ---- the example custom model ---------------------------------------------------------------------
class ExampleRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ad.torch_rmsnorm(x, self.weight, self.eps)


class ExampleMLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ad.torch_swiglu_mlp(x, self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)


class ExampleAttention(nn.Module):
    """Causal GQA attention in the ``bsnd`` layout: no mask tensor, no cache (the pipeline adds the
    cache; ``is_causal`` says everything a mask would)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5
        h, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        q, k = ad.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 2)  # cos/sin [b, s, d] -> [b, s, 1, d]
        out = ad.torch_attention(q, k, v, None, 0.0, True, self.scale, None, None, None)
        return self.o_proj(out.reshape(b, s, -1))


class ExampleDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = ExampleRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = ExampleAttention(config)
        self.post_attention_layernorm = ExampleRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = ExampleMLP(config)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cos, sin)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class ExampleLlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(ExampleDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = ExampleRMSNorm(config.hidden_size, config.rms_norm_eps)
        cos, sin = _rope_tables(config)
        # Not in the checkpoint (persistent=False): the factory keeps their built values.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)


def _rope_tables(config: LlamaConfig) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, in float32, computed as HF's default RoPE computes them."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    freqs = torch.arange(config.max_position_embeddings, dtype=torch.float)[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class ExampleLlamaForCausalLM(nn.Module):
    """Lean Llama with the checkpoint's parameter names (``model.layers.N.self_attn.q_proj.weight``,
    ...), so it loads without hooks. RoPE cos/sin are looked up once per forward and passed down."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = ExampleLlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                inputs_embeds: Optional[torch.Tensor] = None, **unused) -> torch.Tensor:
        """``unused`` absorbs what callers pass HF models (``use_cache=False``); masks and caches
        are never used."""
        hidden = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos = self.model.rope_cos[position_ids].to(hidden.dtype)
        sin = self.model.rope_sin[position_ids].to(hidden.dtype)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin)
        return self.lm_head(self.model.norm(hidden))


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture
def registered():
    """The example registered for LlamaConfig during one test only."""
    register_custom_model("LlamaConfig")(ExampleLlamaForCausalLM)
    try:
        yield ExampleLlamaForCausalLM
    finally:
        unregister_custom_model("LlamaConfig")


@pytest.fixture(scope="module")
def pair():
    """HF Llama with random weights and the example with the same weights."""
    cfg = {k: v for k, v in FAMILIES["llama"].items() if k != "model_type"}
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**cfg, attn_implementation="eager")).eval()
    custom = ExampleLlamaForCausalLM(hf.config).eval()
    copy_weights(hf, custom)
    return hf, custom


def _ids(b: int, s: int) -> torch.Tensor:
    return torch.randint(0, FAMILIES["llama"]["vocab_size"], (b, s), generator=torch.Generator().manual_seed(b * s))


# ---- block -> layer -> model -> export ----------------------------------------------------------
def test_blocks_match(pair):
    hf, custom = pair
    x = torch.randn(2, 5, hf.config.hidden_size)
    assert_block_matches(hf.model.layers[0].mlp, custom.model.layers[0].mlp, x, msg="mlp")
    assert_block_matches(hf.model.layers[0].input_layernorm, custom.model.layers[0].input_layernorm, x, msg="norm")
    assert_block_matches(hf.model.norm, custom.model.norm, x, msg="final norm")


@pytest.mark.parametrize("layer", [0, 1])
def test_decoder_layers_match(pair, layer):
    hf, custom = pair
    assert_layer_matches(hf, custom, f"model.layers.{layer}", _ids(2, 9))


def test_logits_match(pair):
    hf, custom = pair
    for b, s in ((1, 11), (3, 4)):
        assert_logits_match(hf, custom, _ids(b, s))


def test_exports_at_two_shapes(pair):
    _, custom = pair
    gm = assert_exports_at_two_shapes(custom, custom.config.vocab_size, shapes=((2, 7), (1, 3)))
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert {ad.torch_attention.default, ad.torch_rope_with_explicit_cos_sin.default} <= targets


# ---- the full pipeline ----------------------------------------------------------------------------
def test_llm_greedy_tokens_equal_hf_and_come_from_the_custom_model(registered, caplog):
    path = family_checkpoint("llama")
    prompts = [_ids(1, n)[0].tolist() for n in (5, 12)]
    reference = hf_model(path)
    expected = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)
        expected.append(out[0, len(p):].tolist())
    with caplog.at_level(logging.INFO, logger="autodeploy"):
        llm = LLM(path, max_seq_len=64, max_batch_size=2, max_num_tokens=64)
    assert llm.build.factory.custom_model is registered  # the graph came from the custom model
    assert "building custom model ExampleLlamaForCausalLM for LlamaConfig" in caplog.text
    assert llm.build.context.cache_mode == "paged_kv"  # its canonical attention got the paged cache
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert [list(o.token_ids) for o in outs] == expected

