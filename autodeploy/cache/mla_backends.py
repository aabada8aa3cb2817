"""MLA backend descriptors: how a canonical ``torch_mla`` becomes a cached op.

The MLA counterpart of ``attention_backends``: a descriptor names the cached op, the step
metadata it takes (by name) and the one cache a layer needs, the latent cache
``[num_pages, page_size, 1, kv_lora_rank + qk_rope_head_dim]`` (``autodeploy.ops.mla``). It is a
``PagedKVHandler`` with one "head", so the page pool, ``resize_kv_cache`` and the build summary's
bytes per token count it like any KV cache. The slots of the step's tokens come from the same
prepare-metadata op as the KV cache's (one node per graph, shared when both kinds are present).
"""

from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch

from .attention_backends import PAGED_ATTENTION_METADATA
from .resources import PagedKVHandler


@dataclass(frozen=True)
class MLADescriptor:
    name: str
    cached_op: Callable
    metadata: Tuple[str, ...] = PAGED_ATTENTION_METADATA
    description: str = ""

    @property
    def source_op(self) -> Callable:
        return torch.ops.autodeploy.torch_mla.default

    @property
    def prepare_metadata_op(self) -> Callable:
        return torch.ops.autodeploy.torch_cached_attention_prepare_metadata.default

    @staticmethod
    def cache_handler(compressed_kv: torch.Tensor, kpe: torch.Tensor, dtype: torch.dtype) -> PagedKVHandler:
        """One latent cache per layer, sized from the layer's ``compressed_kv [b, s, L]`` and
        ``kpe [b, s, 1, d_rope]``."""
        return PagedKVHandler(1, int(compressed_kv.shape[-1]) + int(kpe.shape[-1]), dtype)

    @staticmethod
    def index_cache_handler(index_k: torch.Tensor, dtype: torch.dtype) -> PagedKVHandler:
        """One DSA indexer-key cache per indexer, sized from its keys ``[b, s, index_head_dim]``."""
        return PagedKVHandler(1, int(index_k.shape[-1]), dtype)


def mla_backends() -> Dict[str, MLADescriptor]:
    import autodeploy.ops  # noqa: F401  (registers the ops)

    ops = torch.ops.autodeploy
    return {
        "torch": MLADescriptor("torch", ops.torch_cached_mla_with_cache.default,
                               description="reference: one sequence at a time, the cached latent expanded"),
        "sdpa": MLADescriptor("sdpa", ops.sdpa_cached_mla_with_cache.default,
                              description="prefill expanded with SDPA, decode absorbed (never per-head K/V)"),
    }
