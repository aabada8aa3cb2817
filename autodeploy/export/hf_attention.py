"""How HF attention reaches the IR during export.

transformers 5 routes every attention call of most models through ``AttentionInterface`` and
every mask through ``AttentionMaskInterface``. During export we use both hooks:

* Masks: for ``sdpa``, ``eager`` and ``autodeploy``, the mask builder is replaced by one that
  reads the meaning of HF's mask function (plain causal, causal with a sliding window, or Llama 4's
  chunked-local causal mask) and emits one ``torch_causal_mask`` node carrying that meaning. It
  produces exactly HF's mask values, so the graph before canonicalisation is still HF's
  computation; matchers then read causality and the window from one node (a chunked mask is
  read only by the ``autodeploy`` route, which passes ``attention_chunk`` to ``torch_attention``;
  the matchers leave it explicit). A mask it does not understand (bidirectional overlays,
  padding) is built by HF's own function and left to the generic path, so nothing is silently
  reinterpreted.
* Attention: the ``autodeploy`` implementation calls ``torch_attention`` directly with the
  module's own scale, window, soft-cap and sinks, in ``bsnd`` layout, with k/v unexpanded (and
  ``torch_mla`` over the latent for an MLA module's expanded k/v: ``hf_mla``). The
  ``sdpa`` and ``eager`` implementations stay HF's; the pattern matchers canonicalise them.
"""

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from ..utils.logging import get_logger
from .hf_dsa import claimed_indices
from .hf_mla import claimed_mla, mla_attention

logger = get_logger(__name__)

AD_ATTN_IMPL = "autodeploy"
SUPPORTED_ATTN_IMPLS = (AD_ATTN_IMPL, "sdpa", "eager")

# Masks emitted during the current export: id(tensor) -> (tensor, sliding_window, attention_chunk).
# The tensor is kept so its id cannot be reused while the export runs.
_EMITTED_MASKS: Dict[int, Tuple[torch.Tensor, Optional[int], Optional[int]]] = {}


class RouteUnsupportedError(NotImplementedError):
    """The ``autodeploy`` route met a mask it cannot express (the exporter retries with ``sdpa``)."""


def classify_mask_function(mask_function: Callable) -> Tuple[bool, Optional[int]]:
    """``(understood, sliding_window)`` for an HF mask function built by ``masking_utils``.

    Understood: ``causal_mask_function``; ``and_masks(sliding_window_overlay(w), causal)``; and
    either of them wrapped for packed sequences (each exported batch row is one sequence, so the
    packed wrapper changes nothing).
    """
    from transformers import masking_utils as mu

    fn = unwrap_packed(mask_function)
    name = getattr(fn, "__qualname__", "")
    if fn is mu.causal_mask_function:
        return True, None
    if name == "and_masks.<locals>.and_mask":
        parts = _closure(fn).get("mask_functions", ())
        if len(parts) == 2 and parts[1] is mu.causal_mask_function:
            overlay = parts[0]
            if getattr(overlay, "__qualname__", "") == "sliding_window_overlay.<locals>.inner_mask":
                window = _closure(overlay).get("sliding_window")
                if isinstance(window, int):
                    return True, window
    return False, None


def unwrap_packed(mask_function: Callable) -> Callable:
    """The mask function inside HF's packed-sequence wrapper (several sequences in one row, told
    apart by their positions), or ``mask_function`` itself. The wrapper changes nothing where each
    row is one sequence (export), and the cached ops keep sequences apart by the step metadata."""
    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return mask_function
    parts = _closure(mask_function).get("mask_functions", ())
    names = [getattr(p, "__qualname__", "") for p in parts]
    if names == ["packed_sequence_mask_function.<locals>.inner_mask",
                 "remap_positions_for_packed_sequence.<locals>.inner_mask"]:
        return _closure(parts[1]).get("mask_function")
    return mask_function


def chunk_of_mask_function(mask_function: Callable) -> Optional[int]:
    """The chunk size of HF's chunked-local causal mask (``and_masks(chunked_overlay(C, pad),
    causal)``, Llama 4), or ``None`` for any other mask. Its left padding is not inspected (a
    traced value): callers use the chunk only when no attention mask was given, where HF's left
    padding is zero by construction."""
    from transformers import masking_utils as mu

    mask_function = unwrap_packed(mask_function)
    if getattr(mask_function, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = _closure(mask_function).get("mask_functions", ())
    if len(parts) != 2 or parts[1] is not mu.causal_mask_function:
        return None
    if getattr(parts[0], "__qualname__", "") != "chunked_overlay.<locals>.inner_mask":
        return None
    chunk = _closure(parts[0]).get("chunk_size")
    return chunk if isinstance(chunk, int) and chunk >= 1 else None


def _closure(fn: Callable) -> Dict[str, Any]:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}


def _make_mask_builder(impl: str, hf_builder: Optional[Callable]) -> Callable:
    """A mask builder for ``impl`` that emits ``torch_causal_mask`` when it can."""

    def build(
        batch_size: int,
        q_length: int,
        kv_length: int,
        q_offset: int = 0,
        kv_offset: int = 0,
        mask_function: Optional[Callable] = None,
        attention_mask: Optional[torch.Tensor] = None,
        dtype: torch.dtype = torch.float32,
        device: Any = "cpu",
        **kwargs: Any,
    ) -> Optional[torch.Tensor]:
        understood, window = classify_mask_function(mask_function) if mask_function is not None else (False, None)
        chunk = chunk_of_mask_function(mask_function) if mask_function is not None and not understood else None
        plain = attention_mask is None and _is_zero(q_offset) and _is_zero(kv_offset)
        if (understood or chunk is not None) and plain:
            mask_dtype = torch.bool if impl == "sdpa" else dtype
            mask = torch.ops.autodeploy.torch_causal_mask(
                batch_size, q_length, kv_length, window, mask_dtype, torch.device(device), chunk
            )
            _EMITTED_MASKS[id(mask)] = (mask, window, chunk)
            return mask
        if hf_builder is None:
            raise RouteUnsupportedError(
                f"attention mask {getattr(mask_function, '__qualname__', mask_function)} is not supported by "
                f"the '{AD_ATTN_IMPL}' attention route; export with attn_implementation 'sdpa' or 'eager'"
            )
        logger.info("mask %s kept as HF builds it (generic path)", getattr(mask_function, "__qualname__", "?"))
        return hf_builder(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
            mask_function=mask_function, attention_mask=attention_mask, dtype=dtype, device=device, **kwargs,
        )

    return build


def _is_zero(x: Any) -> bool:
    return isinstance(x, int) and x == 0


# Tensor kwargs HF passes to attention functions that change nothing here (positions are
# already applied; packed-sequence lengths do not apply to one sequence per row), plus sinks.
_IGNORABLE_TENSOR_KWARGS = frozenset({"sinks", "position_ids", "cache_position", "cu_seq_lens_q", "cu_seq_lens_k"})


def autodeploy_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    s_aux: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> Tuple[torch.Tensor, None]:
    """HF attention-interface function: q/k/v arrive ``bnsd``, the output leaves ``bsnd``.

    A tensor argument it does not know (an additive ``position_bias``, say) would be dropped
    silently, so it is refused instead and the exporter retries with HF's sdpa route."""
    topk_indices = claimed_indices(kwargs.get("indices"))  # DSA's selection for torch_mla (hf_dsa)
    unknown = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in _IGNORABLE_TENSOR_KWARGS
                     and not (k == "indices" and topk_indices is not None))
    if unknown:
        raise RouteUnsupportedError(
            f"attention of {type(module).__name__} passes {', '.join(unknown)}, which the '{AD_ATTN_IMPL}' "
            "attention route does not express"
        )
    sinks = kwargs.get("sinks", s_aux)
    emitted = _EMITTED_MASKS.get(id(attention_mask)) if attention_mask is not None else None
    chunk = emitted[2] if emitted is not None else None
    if attention_mask is None or emitted is not None:
        mask = None
        is_causal = bool(getattr(module, "is_causal", True))
        if emitted is not None:
            window = emitted[1]
            if sliding_window is not None and window is not None and sliding_window != window:
                raise RuntimeError(
                    f"attention layer {type(module).__name__} says sliding_window={sliding_window} but its mask "
                    f"uses {window}"
                )
            sliding_window = window if window is not None else sliding_window
    else:
        # A mask we did not build: keep it explicit, the op honours any mask.
        mask, is_causal = attention_mask, False
    mla = claimed_mla(module, query, key)
    if mla is not None and mask is None and sliding_window is None and not softcap and chunk is None:
        return mla_attention(mla, query, is_causal, scaling, topk_indices, sinks), None
    if topk_indices is not None:
        raise RouteUnsupportedError(f"attention of {type(module).__name__} takes DSA top-k indices, which the "
                                    f"'{AD_ATTN_IMPL}' route expresses only for MLA over its latent")
    out = torch.ops.autodeploy.torch_attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        mask,
        0.0,
        is_causal,
        scaling,
        sinks,
        sliding_window,
        softcap,
        **({"attention_chunk": chunk} if chunk is not None else {}),
    )
    return out, None


@contextmanager
def hf_attention_route(model: nn.Module, attn_implementation: str) -> Iterator[None]:
    """Export ``model`` with the given attention implementation and our mask builders."""
    if attn_implementation not in SUPPORTED_ATTN_IMPLS:
        raise ValueError(f"attn_implementation must be one of {SUPPORTED_ATTN_IMPLS}, got '{attn_implementation}'")
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    attn_mapping = AttentionInterface._global_mapping
    saved_attn = attn_mapping.get(AD_ATTN_IMPL)
    AttentionInterface.register(AD_ATTN_IMPL, autodeploy_attention)
    mask_mapping = AttentionMaskInterface._global_mapping
    saved_masks = {k: mask_mapping.get(k) for k in SUPPORTED_ATTN_IMPLS}
    for impl in SUPPORTED_ATTN_IMPLS:
        hf_builder = saved_masks[impl] if impl != AD_ATTN_IMPL else None
        ALL_MASK_ATTENTION_FUNCTIONS.register(impl, _make_mask_builder(impl, hf_builder))
    configs = _attn_configs(model)
    saved_impls = [(cfg, getattr(cfg, "_attn_implementation", None)) for cfg in configs]
    try:
        for cfg in configs:
            cfg._attn_implementation = attn_implementation
        yield
    finally:
        for cfg, impl in saved_impls:
            cfg._attn_implementation = impl
        if saved_attn is None:
            attn_mapping.pop(AD_ATTN_IMPL, None)
        else:
            attn_mapping[AD_ATTN_IMPL] = saved_attn
        for impl, builder in saved_masks.items():
            if builder is None:
                mask_mapping.pop(impl, None)
            else:
                mask_mapping[impl] = builder
        _EMITTED_MASKS.clear()


def _attn_configs(model: nn.Module) -> list:
    """Every distinct config object a module of the model holds (text sub-configs included)."""
    seen: Dict[int, Any] = {}
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            seen[id(cfg)] = cfg
            for name in ("text_config",):
                child = getattr(cfg, name, None)
                if child is not None and hasattr(child, "_attn_implementation"):
                    seen[id(child)] = child
    return list(seen.values())
