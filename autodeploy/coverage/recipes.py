"""The size recipes of the coverage sweep: which sizes a tiny config gets, per field name.

Every model type is checked at two recipes, because a model can be right at one size and
wrong at another (a reshape that assumes ``hidden == heads * head_dim``, one KV group, one SSM
group, a chunked scan that only ever sees one chunk, top-k routing over so few experts that
every expert is picked). A type passes only when both pass.

* ``a`` (*regular*): hidden 64, 4 heads of 16, 2 KV heads, 4 experts top-2, one SSM group with
  the config's own chunk size, 8-token sliding windows.
* ``b`` (*odd*): sizes placed where models are sensitive: hidden 96 with 6 heads of 24
  (``head_dim != hidden / heads`` where the architecture allows it), 3 query heads per KV head,
  10 experts top-3 (more than ``top_k * 2``), 2 SSM groups scanned in chunks of 4 tokens (the
  13-token prompt spans 4 chunks, the last one partial), 4-token sliding windows (shorter than
  both prompts), a different vocabulary and MLA/linear-attention widths.

Both keep a 256-position table, so the check's ``max_seq_len`` must come from the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Sequence

KEEP = object()  # a rule's answer meaning "leave the default as it is"
Rule = Callable[[Any], Any]


@dataclass(frozen=True)
class Recipe:
    """Sizes of one tiny-config recipe (see the module docstring)."""

    name: str
    summary: str
    hidden: int
    intermediate: int
    moe_intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    max_positions: int
    window: int
    experts: int
    top_k: int
    # state-space layers: heads * head_dim == expand (2) * hidden
    ssm_heads: int
    ssm_head_dim: int
    ssm_groups: int
    ssm_state: int
    ssm_chunk: int  # chunk of chunked scans; 0: keep the config's own
    time_step_rank: int
    # linear attention / gated delta rule
    linear_key_heads: int
    linear_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    # multi-head latent attention
    kv_lora_rank: int
    q_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    rotary_dim: int
    per_layer_input: int
    low_rank: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


REGULAR = Recipe(
    name="a", summary="hidden 64, 4 heads x 16, 2 KV heads, vocab 512, 4 experts top-2, 1 SSM group, "
                      "8-token windows",
    hidden=64, intermediate=128, moe_intermediate=32, heads=4, kv_heads=2, head_dim=16, vocab=512,
    max_positions=256, window=8, experts=4, top_k=2,
    ssm_heads=8, ssm_head_dim=16, ssm_groups=1, ssm_state=16, ssm_chunk=0, time_step_rank=8,
    linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    rotary_dim=8, per_layer_input=16, low_rank=8,
)
ODD = Recipe(
    name="b", summary="hidden 96, 6 heads x 24, 2 KV heads (3 per group), vocab 400, 10 experts top-3, "
                      "2 SSM groups in 4-token chunks, 4-token windows",
    hidden=96, intermediate=160, moe_intermediate=48, heads=6, kv_heads=2, head_dim=24, vocab=400,
    max_positions=256, window=4, experts=10, top_k=3,
    ssm_heads=12, ssm_head_dim=16, ssm_groups=2, ssm_state=24, ssm_chunk=4, time_step_rank=6,
    linear_key_heads=2, linear_value_heads=6, linear_key_head_dim=24, linear_value_head_dim=16,
    kv_lora_rank=48, q_lora_rank=40, qk_rope_head_dim=12, qk_nope_head_dim=20, v_head_dim=28,
    rotary_dim=12, per_layer_input=24, low_rank=6,
)
RECIPES: Dict[str, Recipe] = {r.name: r for r in (REGULAR, ODD)}
DEFAULT_RECIPES = tuple(RECIPES)


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown coverage recipe '{name}'; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]


# ---- rules: what a field of a given name becomes -------------------------------------------------
def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(new: Any) -> Rule:
    """Replace a positive int default (None / 0 / bool / strings like 'auto' stay)."""
    return lambda v: new if is_int(v) and v > 0 else KEEP


def _always(new: Any) -> Rule:
    """Set even when the default is None (the config derives it otherwise, from full sizes)."""
    return lambda v: new if v is None or is_int(v) else KEEP


def _at_most(new: int) -> Rule:
    return lambda v: min(v, new) if is_int(v) else KEEP


HIDDEN_FIELDS = ("hidden_size", "n_embd", "d_model", "dim", "n_embed", "embed_dim", "emb_dim", "embedding_dim",
                 "hidden_dim", "model_dim", "embedding_size", "word_embed_proj_dim", "lru_width",
                 "attention_hidden_size", "backbone_hidden_size", "hidden_size_global")
# chunk sizes of chunked scans (Mamba-2's SSD, xLSTM's chunkwise mLSTM): the only causal-LM
# configs with these fields are recurrent models
CHUNK_FIELDS = ("chunk_size", "mamba_chunk_size", "ssm_chunk_size")


def size_rules(r: Recipe) -> Dict[str, Rule]:
    """Field name -> rule for recipe ``r``."""
    rules: Dict[str, Rule] = {}

    def rule(names: Sequence[str], fn: Rule) -> None:
        for name in names:
            rules[name] = fn

    rule(HIDDEN_FIELDS, _positive(r.hidden))
    rule(["intermediate_size", "intermediate_size_mlp", "dense_intermediate_size", "prefix_dense_intermediate_size",
          "ffn_hidden_size", "n_inner", "ffn_dim", "d_ff", "dff", "dim_ff", "feed_forward_size", "decoder_ffn_dim"],
         _positive(r.intermediate))
    rule(["moe_intermediate_size", "expert_ffn_hidden_size", "moe_ffn_hidden_size", "expert_intermediate_size",
          "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", "shared_intermediate_size",
          "shared_experts_intermediate_size"], _positive(r.moe_intermediate))
    rule(["num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads", "attention_heads",
          "swa_num_attention_heads"], _positive(r.heads))
    rule(["num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_n_heads", "multi_query_group_num",
          "swa_num_key_value_heads"], _always(r.kv_heads))
    rule(["swa_head_dim", "attention_head_dim", "kv_channels", "dim_head", "d_head", "attention_head_size"],
         _positive(r.head_dim))
    # head_dim also where the default is unset: some models read it without deriving it (HunYuan)
    rule(["head_dim"], _always(r.head_dim))
    rule(["vocab_size", "vocab_size_per_layer_input", "padded_vocab_size", "unpadded_vocab_size"],
         _positive(r.vocab))
    # hashed n-gram / byte-group embedding tables (tens of millions of rows by default)
    rule(["ngram_vocab_size_base", "encoder_hash_byte_group_vocab"], _positive(1024))
    rule(["max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length", "context_length",
          "model_max_length", "max_sequence_length"], _positive(r.max_positions))
    rule(["sliding_window", "sliding_window_size", "attention_window_size", "window_size",
          "local_attention_window_len", "attention_chunk_size", "local_attention", "keep_window_size"],
         _positive(r.window))
    rule(["num_experts", "num_local_experts", "moe_num_experts"], _positive(r.experts))
    # DeepSeek-style configs build MoE layers even when the default leaves the count unset (dots1)
    rule(["n_routed_experts"], _always(r.experts))
    # top-k also where the default is unset: the routers read it even then (e.g. DeepSeek-V2)
    rule(["num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "num_experts_per_token", "moe_top_k"],
         _always(r.top_k))
    rule(["n_group", "topk_group", "num_expert_group"], _positive(1))
    rule(["first_k_dense_replace", "num_dense_layers", "zero_expert_num"], _at_most(1))
    # multi-head latent attention (DeepSeek-style) and sparse-attention indexers
    rule(["kv_lora_rank", "o_lora_rank"], _positive(r.kv_lora_rank))
    rule(["q_lora_rank"], _positive(r.q_lora_rank))
    rule(["qk_rope_head_dim"], _positive(r.qk_rope_head_dim))
    rule(["qk_nope_head_dim", "index_head_dim", "indexer_head_dim"], _positive(r.qk_nope_head_dim))
    rule(["v_head_dim"], _positive(r.v_head_dim))
    rule(["qk_head_dim"], _positive(r.qk_head_dim))
    rule(["index_n_heads", "indexer_n_heads"], _positive(2))
    rule(["indexer_kv_heads"], _at_most(1))
    # linear attention / gated delta rule
    rule(["linear_key_head_dim", "linear_head_dim"], _positive(r.linear_key_head_dim))
    rule(["linear_value_head_dim"], _positive(r.linear_value_head_dim))
    rule(["linear_num_key_heads"], _positive(r.linear_key_heads))
    rule(["linear_num_value_heads", "linear_num_heads"], _positive(r.linear_value_heads))
    # state-space layers (d_inner = expand * hidden = ssm_heads * ssm_head_dim)
    rule(["mamba_d_state", "ssm_state_size", "state_size"], _positive(r.ssm_state))
    rule(["mamba_n_heads", "mamba_num_heads", "n_mamba_heads"], _positive(r.ssm_heads))
    rule(["mamba_head_dim", "mamba_d_head"], _positive(r.ssm_head_dim))
    rule(["mamba_d_ssm"], _positive(2 * r.hidden))
    rule(["mamba_n_groups", "mamba_ngroups", "n_groups"], _positive(r.ssm_groups))
    rule(["time_step_rank", "mamba_dt_rank"], _positive(r.time_step_rank))
    if r.ssm_chunk:
        rule(CHUNK_FIELDS, _positive(r.ssm_chunk))
    # partial rotary given as a dimension, per-layer inputs, low-rank adapters
    rule(["rotary_dim"], _positive(r.rotary_dim))
    rule(["hidden_size_per_layer_input"], _positive(r.per_layer_input))
    rule(["laurel_rank", "adapter_rank"], _positive(r.low_rank))
    rule(["hc_lowrank"], _positive(2 * r.low_rank))
    # fused kernels that exist only on CUDA: use the reference path
    rule(["use_mamba_kernels", "use_mem_eff_path"], lambda v: False if isinstance(v, bool) else KEEP)
    return rules


def quirks(r: Recipe) -> Dict[str, Dict[str, Any]]:
    """Families the generic rules cannot get right, with the reason (sizes from ``r``)."""
    out = _common_quirks(r)
    if r.heads % 4 or r.head_dim * r.heads != r.hidden:
        out.update(_odd_size_quirks(r))
    return out


def _odd_size_quirks(r: Recipe) -> Dict[str, Dict[str, Any]]:
    """Constraints of the architecture (HF eager fails without them) that odd sizes break."""
    return {
        # the fused qkv is split into 4 model-parallel parts: the head count must divide by 4
        # (8 heads of hidden / 8)
        "codegen": {"n_head": 8},
        # o_proj is sized hidden x hidden: heads * head_dim must equal the hidden size
        "helium": {"head_dim": r.hidden // r.heads},
        # sliding layers double the KV heads: the head count must divide by 2 * kv_heads
        "mimo_v2_flash": {"num_attention_heads": 4 * r.kv_heads},
    }


def _common_quirks(r: Recipe) -> Dict[str, Dict[str, Any]]:
    half = r.head_dim // 2
    return {
        # Mamba-2 needs num_heads * head_dim == expand * hidden_size; the generic rules would give
        # it the attention head count and head size
        "mamba2": {"num_heads": r.ssm_heads, "head_dim": r.ssm_head_dim},
        # the default DbrxAttentionConfig has no rope_theta and clip_qkv=None, which the model
        # cannot run with; real checkpoints carry both in attn_config
        "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
        # top-1 routing is all the model supports
        "zaya": {"num_experts_per_tok": 1},
        # attention_types is run-length encoded ([[pattern, repeats]]) and must expand to the depth
        "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
        # full-attention layers get their head size from the global_head_dim argument (not a
        # field); twice the sliding layers' keeps the two head sizes distinct
        "gemma4_text": {"global_head_dim": 2 * r.head_dim},
        "gemma4_unified_text": {"global_head_dim": 2 * r.head_dim},
        # sliding layers are sized by swa_* arguments (not fields) with full-size defaults
        "dots3_note_text": {"swa_num_attention_heads": r.heads, "swa_num_key_value_heads": r.heads,
                            "swa_q_lora_rank": r.q_lora_rank, "swa_kv_lora_rank": r.kv_lora_rank,
                            "swa_head_dim": r.qk_head_dim, "swa_qk_nope_head_dim": r.qk_nope_head_dim,
                            "swa_v_head_dim": r.v_head_dim},
        # the default rope_parameters is empty, but the model reads one entry per layer type (with
        # multimodal RoPE sections, here summing to head_dim / 2)
        "cohere_compass_text": {"rope_parameters": {"full_attention": {
            "rope_type": "default", "rope_theta": 10000.0,
            "mrope_section": [half - 2 * (half // 4), half // 4, half // 4]}}},
        # layer_types has no default (the model indexes it): short-conv and attention layers, with
        # the first layer's MLP dense and the others MoE
        "lfm2_moe": {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"]},
        # the default puts attention in every layer of a 2-layer stack: short-conv layers need
        # asking for
        "lfm2": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]},
        # the hybrid layers share one transformer block, tied from the first hybrid layer to the
        # others: the stack needs two of them
        "zamba": {"num_hidden_layers": 8, "layers_block_type": ["linear_attention"] * 2 + ["hybrid"]
                  + ["linear_attention"] * 4 + ["hybrid"]},
        # MoE layers always build a shared expert, whose count has no default
        "dots1": {"n_shared_experts": 1},
        # the default indexer of the indexed-attention layers is unset (None sizes); a real
        # checkpoint sets it. 16-token budget in blocks of 4: sparse for the longer prompt
        "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": r.head_dim,
                           "indexer_budget": 16, "indexer_compress_ratio": 4},
    }


__all__ = ["DEFAULT_RECIPES", "KEEP", "ODD", "RECIPES", "REGULAR", "Recipe", "get_recipe", "is_int", "quirks",
           "size_rules"]
