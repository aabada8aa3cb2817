"""Attention backend descriptors: how a canonical ``torch_attention`` becomes a cached op.

A descriptor names, for its source op: the cached op, the step metadata it takes, an optional
prepare-metadata op (run once per step, its output shared by all layers), the caches one
layer needs (as resource handlers), and the KV-cache storage types its op handles (an FP8 cache
passes the layer's ``k_scale`` / ``v_scale`` as the op's two trailing arguments).
``insert_cached_attention`` only talks to descriptors, so a new backend (Triton, FlashInfer) is
a new descriptor, not a new transform.
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from .resources import PagedKVHandler, ResourceHandler

# The step metadata a paged attention op takes, by name (the graph has more: state slots).
PAGED_ATTENTION_METADATA = ("batch_info", "seq_len", "input_pos", "cu_seqlen", "page_table")
# Narrow KV-cache storage types by their config name (``auto`` is the model's own dtype).
KV_CACHE_DTYPES: Dict[str, torch.dtype] = {"fp8": torch.float8_e4m3fn}


@dataclass(frozen=True)
class AttentionDescriptor:
    name: str
    cached_op: Callable
    prepare_metadata_op: Optional[Callable]
    metadata: Tuple[str, ...] = PAGED_ATTENTION_METADATA
    devices: Tuple[str, ...] = ("cpu", "cuda")
    description: str = ""
    # insert_cached_attention.kv_cache_dtype values the cached op handles: "auto" (the model's
    # dtype) and "fp8" (float8_e4m3fn pages; the op takes k_scale, v_scale after logit_cap)
    kv_cache_dtypes: Tuple[str, ...] = ("auto", "fp8")

    @property
    def source_op(self) -> Callable:
        return torch.ops.autodeploy.torch_attention.default

    def cache_handlers(self, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> Dict[str, ResourceHandler]:
        """One paged K and one paged V cache per layer, shaped from the layer's k/v (bsnd), stored
        as ``dtype`` (the model's dtype, or ``KV_CACHE_DTYPES[...]``)."""
        return {
            "k_cache": PagedKVHandler(int(k.shape[2]), int(k.shape[3]), dtype),
            "v_cache": PagedKVHandler(int(v.shape[2]), int(v.shape[3]), dtype),
        }


def _descriptors() -> Dict[str, AttentionDescriptor]:
    ops = torch.ops.autodeploy
    prepare = ops.torch_cached_attention_prepare_metadata.default
    return {
        "torch": AttentionDescriptor(
            "torch", ops.torch_cached_attention_with_cache.default, prepare,
            description="reference: one sequence at a time with torch_attention's math",
        ),
        "sdpa": AttentionDescriptor(
            "sdpa", ops.sdpa_cached_attention_with_cache.default, prepare,
            description="batched decode and causal prefill with scaled_dot_product_attention",
        ),
    }


def attention_backends() -> Dict[str, AttentionDescriptor]:
    import autodeploy.ops  # noqa: F401  (registers the ops)

    return _descriptors()


def get_attention_backend(name: str) -> AttentionDescriptor:
    backends = attention_backends()
    if name not in backends:
        raise ValueError(f"unknown attention backend '{name}'; available: {', '.join(sorted(backends))}")
    return backends[name]
