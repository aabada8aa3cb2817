"""Which model types to cover, which of them are decoder-only, and a tiny config for each.

Every model type in transformers' causal-LM auto-mapping is a candidate. Types that are not
plain text decoders (encoders used as decoders, the decoder half of encoder-decoder models,
multimodal or audio models) are reported but excluded from the percentage: their causal-LM
class needs inputs the product does not take (images, audio codes, encoder states).

A tiny config is the config class's own defaults with the *sizes* shrunk to one of the
``recipes`` (two per model type: regular sizes, and odd ones where models are sensitive) and the
layer count cut to the shortest prefix of the default layer pattern that still holds every kind of
layer (attention / sliding / linear-attention / SSM, dense / MoE MLP, ...). Everything is found
by inspecting the config class (its dataclass fields and the per-layer lists its
``__post_init__`` derives), so a new model type usually needs no entry here; the few families
that need one are in ``recipes.quirks`` with the reason.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Dict, List, Optional, Tuple

from ..utils.logging import get_logger
from .recipes import KEEP, REGULAR, Recipe, get_recipe, is_int, quirks, size_rules

logger = get_logger(__name__)

DECODER_ONLY = "decoder-only"
ENCODER = "encoder"
ENCODER_DECODER = "encoder-decoder"
MULTIMODAL = "multimodal"
DRAFTER = "drafter"

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

def tiny_config(model_type: str, recipe: str | Recipe = REGULAR) -> Dict[str, Any]:
    """``{"model_type": ..., **fields}`` of a tiny random config at ``recipe`` (see the module
    docstring and ``recipes``)."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"'{model_type}' is not a model type of the installed transformers")
    r = get_recipe(recipe) if isinstance(recipe, str) else recipe
    cfg = _merge(_tiny_kwargs(CONFIG_MAPPING[model_type], r), quirks(r).get(model_type, {}))
    return {"model_type": model_type, **cfg}


def _merge(base: Dict[str, Any], extra: Dict[str, Any]) -> Dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _tiny_kwargs(cls: type, r: Recipe) -> Dict[str, Any]:
    default = _global_view(cls())
    names = [f.name for f in _fields(cls)]
    rules = size_rules(r)
    kwargs: Dict[str, Any] = {}
    for name in names:
        if name in rules:
            new = rules[name](getattr(default, name, None))
            if new is not KEEP:
                kwargs[name] = new
        elif name.endswith(_TOKEN_ID_SUFFIXES) and name not in ("pad_token_id", "bos_token_id", "eos_token_id"):
            value = getattr(default, name, None)
            if is_int(value) and value >= r.vocab:  # keep special ids inside the tiny vocabulary
                kwargs[name] = 3
    _keep_equalities(default, kwargs, r)
    for key, sub_cls in (getattr(cls, "sub_configs", None) or {}).items():
        sub_default = getattr(default, key, None)
        if sub_default is None or not hasattr(sub_default, "to_dict"):
            continue
        sub = _tiny_kwargs(type(sub_default), r)
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


def _keep_equalities(default: Any, kwargs: Dict[str, Any], r: Recipe) -> None:
    """Sizes the model code assumes equal must stay equal after shrinking.

    Multi-head latent attention expands K/V to every query head (KV heads = heads) and often
    sizes its rotary table by ``head_dim`` (= the rotary part of the head); Gemma scales queries
    by ``query_pre_attn_scalar`` (= head_dim).
    """
    if "kv_lora_rank" in kwargs:
        heads = getattr(default, "num_attention_heads", None)
        if "num_key_value_heads" in kwargs and getattr(default, "num_key_value_heads", None) in (None, heads):
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", r.heads)
        rope = getattr(default, "qk_rope_head_dim", None)
        if "head_dim" in kwargs and rope is not None and getattr(default, "head_dim", None) == rope:
            kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
        elif "head_dim" in kwargs and getattr(default, "head_dim", None) is None:
            del kwargs["head_dim"]  # derived from the latent sizes by the config itself
    # widths defined as a multiple of the hidden size (e.g. an attention input that concatenates
    # the residual stream with the embeddings) keep the multiple
    # (other widths, e.g. BLT's hidden_size_global, name another module's hidden size: the
    # recipe's hidden size too)
    hidden = getattr(default, "hidden_size", None)
    for name in ("attention_hidden_size",):
        value = getattr(default, name, None)
        if name in kwargs and is_int(hidden) and is_int(value) and value > hidden and value % hidden == 0:
            kwargs[name] = value // hidden * r.hidden
    scalar = getattr(default, "query_pre_attn_scalar", None)
    if is_int(scalar) and scalar == getattr(default, "head_dim", None) and "head_dim" in kwargs:
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
    if not is_int(depth) or depth < 1:
        return {}
    per_layer, index_lists = _layer_fields(probe, names, depth)
    kinds = [_kind(i, depth, probe, per_layer, index_lists) for i in range(depth)]
    all_kinds = set(kinds)
    prefix = next(i + 1 for i in range(depth) if set(kinds[: i + 1]) == all_kinds)
    for name in _PERIOD_FIELDS:
        value = getattr(probe, name, None)
        if is_int(value) and value > 1:
            prefix = max(prefix, value)
    for name in _OFFSET_FIELDS:
        value = getattr(probe, name, None)
        if is_int(value) and value > 0:
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
    if is_int(shared) and shared > 0:
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
        if (isinstance(value, (list, tuple)) and value and all(is_int(v) for v in value)
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
        if is_int(value):
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


__all__ = ["DECODER_ONLY", "DRAFTER", "ENCODER", "ENCODER_DECODER", "MULTIMODAL", "causal_lm_model_types", "classify",
           "tiny_config"]
