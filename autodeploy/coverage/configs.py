"""Which model types to cover, which of them are decoder-only, and a tiny config for each.

Every model type in transformers' causal-LM auto-mapping is a candidate. Types that are not
plain text decoders (encoders used as decoders, the decoder half of encoder-decoder models,
multimodal or audio models) are reported but excluded from the percentage: their causal-LM
class needs inputs the product does not take (images, audio codes, encoder states).

A tiny config is the config class's own defaults with the *sizes* shrunk (hidden 64, 4 heads,
2 KV heads, head dim 16, vocab 512, 4 experts top-2, sliding windows of 8 tokens) and the layer
count cut to the shortest prefix of the default layer pattern that still holds every kind of
layer (attention / sliding / linear-attention / SSM, dense / MoE MLP, ...). Everything is found
by inspecting the config class (its dataclass fields and the per-layer lists its
``__post_init__`` derives), so a new model type usually needs no entry here; the few families
that need one are in ``QUIRKS`` with the reason.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..utils.logging import get_logger

logger = get_logger(__name__)

DECODER_ONLY = "decoder-only"
ENCODER = "encoder"
ENCODER_DECODER = "encoder-decoder"
MULTIMODAL = "multimodal"
DRAFTER = "drafter"

# Sizes of every tiny config (the numbers).
HIDDEN = 64
INTERMEDIATE = 128
MOE_INTERMEDIATE = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
VOCAB = 512
MAX_POSITIONS = 256
WINDOW = 8
EXPERTS = 4
TOP_K = 2
MIN_LAYERS = 2
# A default layer pattern whose every kind shows up within this many layers is kept as a prefix
# (derived patterns such as "attention every 8th layer" stay right); longer patterns are cut to
# the first layer of each kind.
MAX_PREFIX_LAYERS = 12

# Explicit classifications the mappings do not give (why in the comment).
_EXPLICIT_CLASS = {
    "bert-generation": ENCODER,  # a BERT encoder run with a causal mask
    "xlnet": ENCODER,  # permutation LM with bidirectional memory, not a causal decoder
    "trocr": ENCODER_DECODER,  # the text decoder of VisionEncoderDecoder (cross-attention)
    # speculative-decoding drafters: their forward ignores input_ids and reads the target
    # model's embeddings and KV states
    "gemma4_assistant": DRAFTER,
    "gemma4_unified_assistant": DRAFTER,
}
_EXPLICIT_REASON = {
    ENCODER: "encoder run as a decoder",
    ENCODER_DECODER: "decoder half of an encoder-decoder",
    DRAFTER: "speculative-decoding drafter: needs the target model's embeddings and KV states",
}
# sub-config names that mean the model takes non-text inputs
_NON_TEXT_SUBCONFIG_WORDS = ("vision", "audio", "vq", "image", "speech")


def causal_lm_model_types() -> List[str]:
    """Every model type in transformers' causal-LM auto-mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def classify(model_type: str) -> Tuple[str, str]:
    """(category, reason): ``decoder-only`` or why the type is excluded from the percentage."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto import modeling_auto as ma

    if model_type in _EXPLICIT_CLASS:
        category = _EXPLICIT_CLASS[model_type]
        return category, _EXPLICIT_REASON[category]
    if model_type not in CONFIG_MAPPING:
        return DECODER_ONLY, ""  # unknown: let the check report it at the config stage
    cls = CONFIG_MAPPING[model_type]
    if model_type in ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES or _default_field(cls, "is_encoder_decoder"):
        return ENCODER_DECODER, "decoder half of an encoder-decoder model"
    subconfigs = [k for k in getattr(cls, "sub_configs", {}) if any(w in k for w in _NON_TEXT_SUBCONFIG_WORDS)]
    if subconfigs:
        return MULTIMODAL, f"takes non-text inputs ({', '.join(sorted(subconfigs))})"
    if model_type in ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES:
        return MULTIMODAL, "image-text-to-text model"
    if model_type in ma.MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return ENCODER, "masked-LM encoder run as a decoder"
    return DECODER_ONLY, ""


def _default_field(cls: type, name: str) -> Any:
    for f in _fields(cls):
        if f.name == name and f.default is not dataclasses.MISSING:
            return f.default
    return None


def _fields(cls: type) -> List[Any]:
    try:
        return list(dataclasses.fields(cls))
    except TypeError:  # not a dataclass config: fall back to the constructor's parameters
        params = inspect.signature(cls.__init__).parameters.values()
        return [_Param(p.name, p.default if p.default is not inspect.Parameter.empty else dataclasses.MISSING)
                for p in params if p.name != "self" and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


@dataclasses.dataclass
class _Param:
    name: str
    default: Any


# ---- size rules ---------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(new: Any) -> Callable[[Any], Any]:
    """Replace a positive int default (None / 0 / bool / strings like 'auto' stay)."""
    return lambda v: new if _is_int(v) and v > 0 else _KEEP


def _always(new: Any) -> Callable[[Any], Any]:
    """Set even when the default is None (the config derives it otherwise, from full sizes)."""
    return lambda v: new if v is None or _is_int(v) else _KEEP


def _at_most(new: int) -> Callable[[Any], Any]:
    return lambda v: min(v, new) if _is_int(v) else _KEEP


_KEEP = object()
_RULES: Dict[str, Callable[[Any], Any]] = {}


def _rule(names: Sequence[str], fn: Callable[[Any], Any]) -> None:
    for name in names:
        _RULES[name] = fn


_HIDDEN_FIELDS = ("hidden_size", "n_embd", "d_model", "dim", "n_embed", "embed_dim", "emb_dim", "embedding_dim",
                  "hidden_dim", "model_dim", "embedding_size", "word_embed_proj_dim", "lru_width",
                  "attention_hidden_size", "backbone_hidden_size", "hidden_size_global")
_rule(_HIDDEN_FIELDS, _positive(HIDDEN))
_rule(["intermediate_size", "intermediate_size_mlp", "dense_intermediate_size", "prefix_dense_intermediate_size",
       "ffn_hidden_size", "n_inner", "ffn_dim", "d_ff", "dff", "dim_ff", "feed_forward_size", "decoder_ffn_dim"],
      _positive(INTERMEDIATE))
_rule(["moe_intermediate_size", "expert_ffn_hidden_size", "moe_ffn_hidden_size", "expert_intermediate_size",
       "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size", "shared_intermediate_size",
       "shared_experts_intermediate_size"], _positive(MOE_INTERMEDIATE))
_rule(["num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads", "attention_heads",
       "swa_num_attention_heads"], _positive(HEADS))
_rule(["num_key_value_heads", "num_kv_heads", "n_kv_heads", "kv_n_heads", "multi_query_group_num",
       "swa_num_key_value_heads"],
      _always(KV_HEADS))
_rule(["swa_head_dim", "attention_head_dim", "kv_channels", "dim_head", "d_head", "attention_head_size"],
      _positive(HEAD_DIM))
# head_dim also where the default is unset: some models read it without deriving it (HunYuan)
_rule(["head_dim"], _always(HEAD_DIM))
_rule(["vocab_size", "vocab_size_per_layer_input", "padded_vocab_size", "unpadded_vocab_size"], _positive(VOCAB))
# hashed n-gram / byte-group embedding tables (tens of millions of rows by default)
_rule(["ngram_vocab_size_base", "encoder_hash_byte_group_vocab"], _positive(1024))
_rule(["max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length", "context_length",
       "model_max_length", "max_sequence_length"], _positive(MAX_POSITIONS))
_rule(["sliding_window", "sliding_window_size", "attention_window_size", "window_size", "local_attention_window_len",
       "attention_chunk_size", "local_attention", "keep_window_size"], _positive(WINDOW))
_rule(["num_experts", "num_local_experts", "moe_num_experts"], _positive(EXPERTS))
# DeepSeek-style configs build MoE layers even when the default leaves the count unset (dots1)
_rule(["n_routed_experts"], _always(EXPERTS))
# top-k also where the default is unset: the routers read it even then (e.g. DeepSeek-V2)
_rule(["num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "num_experts_per_token", "moe_top_k"],
      _always(TOP_K))
_rule(["n_group", "topk_group", "num_expert_group"], _positive(1))
_rule(["first_k_dense_replace", "num_dense_layers", "zero_expert_num"], _at_most(1))
# multi-head latent attention (DeepSeek-style) and sparse-attention indexers
_rule(["kv_lora_rank", "q_lora_rank", "o_lora_rank"], _positive(32))
_rule(["qk_rope_head_dim"], _positive(8))
_rule(["qk_nope_head_dim", "v_head_dim", "index_head_dim", "indexer_head_dim"], _positive(HEAD_DIM))
_rule(["qk_head_dim"], _positive(24))
_rule(["index_n_heads", "indexer_n_heads"], _positive(2))
_rule(["indexer_kv_heads"], _at_most(1))
# linear attention / gated delta rule
_rule(["linear_key_head_dim", "linear_value_head_dim", "linear_head_dim"], _positive(HEAD_DIM))
_rule(["linear_num_key_heads"], _positive(2))
_rule(["linear_num_value_heads", "linear_num_heads"], _positive(HEADS))
# state-space layers (d_inner = expand * hidden = 128 = 8 heads of 16)
_rule(["mamba_d_state", "ssm_state_size", "state_size"], _positive(16))
_rule(["mamba_n_heads", "mamba_num_heads", "n_mamba_heads"], _positive(8))
_rule(["mamba_head_dim", "mamba_d_head"], _positive(16))
_rule(["mamba_d_ssm"], _positive(2 * HIDDEN))
_rule(["mamba_n_groups", "mamba_ngroups", "n_groups"], _positive(1))
_rule(["time_step_rank", "mamba_dt_rank"], _positive(8))
# partial rotary given as a dimension, per-layer inputs, low-rank adapters
_rule(["rotary_dim"], _positive(8))
_rule(["hidden_size_per_layer_input"], _positive(16))
_rule(["laurel_rank", "adapter_rank"], _positive(8))
_rule(["hc_lowrank"], _positive(16))
# fused kernels that exist only on CUDA: use the reference path
_rule(["use_mamba_kernels", "use_mem_eff_path"], lambda v: False if isinstance(v, bool) else _KEEP)

# fields counting layers from the end or the start of the stack; handled with the layer cut
_LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "num_blocks", "decoder_layers")
# ints that make a layer kind repeat with a period: the prefix must reach one full period
_PERIOD_FIELDS = ("decoder_sparse_step", "interleave_moe_layer_step", "no_rope_layer_interval",
                  "global_attn_every_n_layers", "attn_layer_period", "expert_layer_period", "moe_layer_interval",
                  "sliding_window_pattern", "moe_layer_freq")
_OFFSET_FIELDS = ("attn_layer_offset", "expert_layer_offset", "moe_layer_start_index")
# names of lists of layer indices (e.g. full_attn_idxs=[3, 7, 11]), remapped after the cut
_INDEX_LIST_HINTS = ("idxs", "indices", "_layers", "layer_ids")
_NOT_PER_LAYER = {"time_step_limit", "architectures"}
_TOKEN_ID_SUFFIXES = ("_token_id", "_token_index")

# Families the generic rules cannot get right, with the reason.
QUIRKS: Dict[str, Dict[str, Any]] = {
    # Mamba-2 needs num_heads * head_dim == expand * hidden_size (8 * 16 == 2 * 64); the
    # generic rule would give it the attention head count
    "mamba2": {"num_heads": 8},
    # the default DbrxAttentionConfig has no rope_theta and clip_qkv=None, which the model cannot
    # run with; real checkpoints carry both in attn_config
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    # top-1 routing is all the model supports
    "zaya": {"num_experts_per_tok": 1},
    # attention_types is run-length encoded ([[pattern, repeats]]) and must expand to the depth
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # full-attention layers get their head size from the global_head_dim argument (not a field);
    # 32 against the sliding layers' 16 keeps the two head sizes distinct
    "gemma4_text": {"global_head_dim": 32},
    "gemma4_unified_text": {"global_head_dim": 32},
    # sliding layers are sized by swa_* arguments (not fields) with full-size defaults
    "dots3_note_text": {"swa_num_attention_heads": HEADS, "swa_num_key_value_heads": HEADS, "swa_q_lora_rank": 32,
                        "swa_kv_lora_rank": 32, "swa_head_dim": 24, "swa_qk_nope_head_dim": HEAD_DIM,
                        "swa_v_head_dim": HEAD_DIM},
    # the default rope_parameters is empty, but the model reads one entry per layer type (with
    # multimodal RoPE sections, here summing to head_dim / 2)
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                   "mrope_section": [4, 2, 2]}}},
    # layer_types has no default (the model indexes it): short-conv and attention layers, with
    # the first layer's MLP dense and the others MoE
    "lfm2_moe": {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"]},
    # the default puts attention in every layer of a 2-layer stack: short-conv layers need asking for
    "lfm2": {"num_hidden_layers": 2, "layer_types": ["conv", "full_attention"]},
    # the hybrid layers share one transformer block, tied from the first hybrid layer to the
    # others: the stack needs two of them
    "zamba": {"num_hidden_layers": 8, "layers_block_type": ["linear_attention"] * 2 + ["hybrid"]
              + ["linear_attention"] * 4 + ["hybrid"]},
    # MoE layers always build a shared expert, whose count has no default
    "dots1": {"n_shared_experts": 1},
    # the default indexer of the indexed-attention layers is unset (None sizes); a real
    # checkpoint sets it. 16-token budget in blocks of 4: sparse for the longer prompt
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM,
                       "indexer_budget": 16, "indexer_compress_ratio": 4},
}


def tiny_config(model_type: str) -> Dict[str, Any]:
    """``{"model_type": ..., **fields}`` of a tiny random config (see the module docstring)."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"'{model_type}' is not a model type of the installed transformers")
    cfg = _merge(_tiny_kwargs(CONFIG_MAPPING[model_type]), QUIRKS.get(model_type, {}))
    return {"model_type": model_type, **cfg}


def _merge(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _tiny_kwargs(cls: type) -> Dict[str, Any]:
    default = _global_view(cls())
    names = [f.name for f in _fields(cls)]
    kwargs: Dict[str, Any] = {}
    for name in names:
        if name in _RULES:
            new = _RULES[name](getattr(default, name, None))
            if new is not _KEEP:
                kwargs[name] = new
        elif name.endswith(_TOKEN_ID_SUFFIXES) and name not in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(default, name, None)
            if _is_int(value) and value >= VOCAB:  # keep special ids inside the tiny vocabulary
                kwargs[name] = 3
    _keep_equalities(default, kwargs)
    for key, sub_cls in (getattr(cls, "sub_configs", None) or {}).items():
        sub_default = getattr(default, key, None)
        if sub_default is None or not hasattr(sub_default, "to_dict"):
            continue
        sub = _tiny_kwargs(type(sub_default))
        if getattr(type(sub_default), "model_type", None) and getattr(sub_cls, "__name__", "") == "AutoConfig":
            sub = {"model_type": type(sub_default).model_type, **sub}
        kwargs[key] = sub
    kwargs.update(_cut_layers(cls, kwargs))
    return kwargs


def _global_view(config: Any) -> Any:
    """Let a heterogeneous config (per-layer overrides) answer global attribute reads: the
    defaults are only read here, never used to build a model."""
    if getattr(config, "is_heterogeneous", False):
        config.allow_global_per_layer_attribute_access = True
    return config


def _keep_equalities(default: Any, kwargs: Dict[str, Any]) -> None:
    """Sizes the model code assumes equal must stay equal after shrinking.

    Multi-head latent attention expands K/V to every query head (KV heads = heads) and often
    sizes its rotary table by ``head_dim`` (= the rotary part of the head); Gemma scales queries
    by ``query_pre_attn_scalar`` (= head_dim).
    """
    if "kv_lora_rank" in kwargs:
        heads = getattr(default, "num_attention_heads", None)
        if "num_key_value_heads" in kwargs and getattr(default, "num_key_value_heads", None) in (None, heads):
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", HEADS)
        rope = getattr(default, "qk_rope_head_dim", None)
        if "head_dim" in kwargs and rope is not None and getattr(default, "head_dim", None) == rope:
            kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
        elif "head_dim" in kwargs and getattr(default, "head_dim", None) is None:
            del kwargs["head_dim"]  # derived from the latent sizes by the config itself
    # widths defined as a multiple of the hidden size (e.g. an attention input that concatenates
    # the residual stream with the embeddings) keep the multiple
    # (other widths, e.g. BLT's hidden_size_global, name another module's hidden size: 64 too)
    hidden = getattr(default, "hidden_size", None)
    for name in ("attention_hidden_size",):
        value = getattr(default, name, None)
        if name in kwargs and _is_int(hidden) and _is_int(value) and value > hidden and value % hidden == 0:
            kwargs[name] = value // hidden * HIDDEN
    scalar = getattr(default, "query_pre_attn_scalar", None)
    if _is_int(scalar) and scalar == getattr(default, "head_dim", None) and "head_dim" in kwargs:
        kwargs["query_pre_attn_scalar"] = kwargs["head_dim"]


# ---- layer cut ----------------------------------------------------------------------------------
def _cut_layers(cls: type, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Layer count and per-layer fields for the shortest stack that has every layer kind."""
    names = {f.name for f in _fields(cls)}
    count_field = next((n for n in _LAYER_COUNT_FIELDS if n in names), None)
    if count_field is None:
        return {}
    # the full-depth layer pattern, with the tiny sizes (a pattern may depend on them)
    try:
        probe = _global_view(cls(**kwargs))
    except Exception:  # noqa: BLE001 - the sizes alone made an invalid config; the check reports it
        probe = _global_view(cls())
    depth = getattr(probe, count_field, None)
    if not _is_int(depth) or depth < 1:
        return {}
    per_layer, index_lists = _layer_fields(probe, names, depth)
    kinds = [_kind(i, depth, probe, per_layer, index_lists) for i in range(depth)]
    all_kinds = set(kinds)
    prefix = next(i + 1 for i in range(depth) if set(kinds[: i + 1]) == all_kinds)
    for name in _PERIOD_FIELDS:
        value = getattr(probe, name, None)
        if _is_int(value) and value > 1:
            prefix = max(prefix, value)
    for name in _OFFSET_FIELDS:
        value = getattr(probe, name, None)
        if _is_int(value) and value > 0:
            prefix = max(prefix, value + 1)
    prefix = max(prefix, MIN_LAYERS)
    if prefix <= MAX_PREFIX_LAYERS or not per_layer:
        selected = list(range(min(prefix, depth)))
    else:
        first = {}
        for i, kind in enumerate(kinds):
            first.setdefault(kind, i)
        selected = sorted(first.values())
        while len(selected) < MIN_LAYERS and len(selected) < depth:
            selected.append(next(i for i in range(depth) if i not in selected))
    out: Dict[str, Any] = {}
    shared = getattr(probe, "num_kv_shared_layers", None)
    if _is_int(shared) and shared > 0:
        # KV sharing: the last layers reuse an earlier layer's cache. Repeat the pattern once and
        # let the repeat share, so every shared layer has an owner of its own kind.
        n = len(selected)
        selected = selected + [i + (selected[-1] + 1) for i in selected]
        selected = [i for i in selected if i < depth]
        out["num_kv_shared_layers"] = len(selected) - n
    out[count_field] = len(selected)
    for name, values in per_layer.items():
        picked = [values[i] for i in selected]
        out[name] = "".join(picked) if isinstance(values, str) else type(values)(picked) if isinstance(
            values, tuple) else picked
    for name, idx in index_lists.items():
        out[name] = [selected.index(i) for i in idx if i in selected]
    logger.debug("%s: %d of %d layers (%s)", cls.__name__, len(selected), depth, selected)
    return out


def _layer_fields(probe: Any, names: set, depth: int) -> Tuple[Dict[str, Any], Dict[str, List[int]]]:
    """Settable fields holding one entry per layer, and lists of layer indices."""
    per_layer: Dict[str, Any] = {}
    index_lists: Dict[str, List[int]] = {}
    for name in sorted(names - _NOT_PER_LAYER):
        value = getattr(probe, name, None)
        if (isinstance(value, (list, tuple)) and value and all(_is_int(v) for v in value)
                and any(h in name for h in _INDEX_LIST_HINTS) and len(value) <= depth
                and all(0 <= v < depth for v in value) and list(value) == sorted(set(value))):
            index_lists[name] = list(value)
        elif isinstance(value, (list, tuple, str)) and len(value) == depth and depth > 1 and (
                not isinstance(value, str) or name.endswith(("pattern", "types", "type"))):
            per_layer[name] = value
    return per_layer, index_lists


def _kind(i: int, depth: int, probe: Any, per_layer: Dict[str, Any], index_lists: Dict[str, List[int]]) -> tuple:
    parts: List[Any] = [str(v[i]) for v in per_layer.values()]
    parts += [i in idx for idx in index_lists.values()]
    for name in ("first_k_dense_replace", "num_dense_layers"):
        value = getattr(probe, name, None)
        if _is_int(value):
            parts.append(i < value)
    # derived per-layer properties (e.g. a pattern computed from a period and an offset)
    for name in ("layers_block_type", "layer_types", "block_types"):
        value = _safe_getattr(probe, name)
        if isinstance(value, (list, tuple)) and len(value) == depth and name not in per_layer:
            parts.append(str(value[i]))
    return tuple(parts)


def _safe_getattr(obj: Any, name: str) -> Optional[Any]:
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - a property that needs other fields
        return None


__all__ = ["DECODER_ONLY", "DRAFTER", "ENCODER", "ENCODER_DECODER", "MULTIMODAL", "QUIRKS", "causal_lm_model_types", "classify",
           "tiny_config"]
