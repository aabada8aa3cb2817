"""``transformers_replace_cached_attn`` (cache_init; the "transformers" mode): the HF module on the KV cache.

Before: the loaded HF module and ``ctx.hf_attention_layers`` (``detect_hf_attn_layers``).
After, when every layer can be served: a cache interface with a paged K and V cache per layer,
and a one-node graph with the cached interface's inputs::

    graph(input_ids, position_ids, batch_info, seq_len, input_pos, cu_seqlen, page_table, slot_idx,
          use_initial_state, logits_index, k_cache_0, v_cache_0, k_cache_1, ...)
    logits = hf_runner(...)   # CachedHFRunner: the HF model on the step's row, each attention call
                              # answered by the backend's cached op over that layer's caches

The graph returns the rows ``logits_index`` names (HF's ``logits_to_keep`` when the model takes
it). The HF module with its own attention is kept for ``recompute_fallback``, whose consistency
check then tells whether the cached run is exact (state outside attention is not).

When a layer cannot be served (``HFAttentionLayer.problems``) or none calls the attention
interface, nothing is cached: the result is the HF module with its own attention behind the
``(input_ids, position_ids)`` interface, with the reason, and ``recompute_fallback`` runs it in
recompute mode. Never a silently wrong answer.
"""

from typing import List, Optional, Tuple

import torch
from pydantic import Field
from torch import nn

from ...cache import CachedSequenceInterface
from ...cache.attention_backends import attention_backends, get_attention_backend
from ...cache.resources import PagedKVHandler
from ...models.transformers_mode import CachedHFRunner, HFAttentionLayer, UncachedHFModel, runner_graph
from ...utils.logging import get_logger
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

logger = get_logger(__name__)


class TransformersReplaceCachedAttnConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    run_per_gm: bool = False
    requires_clean_graph: bool = False
    backend: str = Field(default="sdpa", description="Attention backend: " + ", ".join(["torch", "sdpa"]) + ".")


def _uncacheable_reason(layers: List[HFAttentionLayer]) -> Optional[str]:
    if not layers:
        return "no attention layer calls transformers' attention interface, so a KV cache has nothing to hold"
    troubled = [layer for layer in layers if layer.problems]
    if troubled:
        first = troubled[0]
        return (f"{len(troubled)} of {len(layers)} attention layers cannot be served from the KV cache "
                f"({first.name}: {'; '.join(first.problems)})")
    return None


@TransformRegistry.register("transformers_replace_cached_attn")
class TransformersReplaceCachedAttn(BaseTransform):
    config_class = TransformersReplaceCachedAttnConfig
    requires = ("detect_hf_attn_layers",)

    def _apply_to_full_model(self, mod: Optional[nn.Module], ctx: PipelineContext) -> Tuple[nn.Module, TransformInfo]:
        cfg: TransformersReplaceCachedAttnConfig = self.config  # type: ignore[assignment]
        if mod is None:
            raise RuntimeError("transformers_replace_cached_attn needs the HF model (build_and_load_factory_model)")
        backend = get_attention_backend(cfg.backend)
        if torch.device(ctx.device).type not in backend.devices:
            raise ValueError(f"attention backend '{cfg.backend}' does not run on {ctx.device}; available: "
                             f"{', '.join(sorted(attention_backends()))}")
        own_impl = getattr(getattr(mod, "config", None), "_attn_implementation", None)
        uncached = runner_graph(UncachedHFModel(mod, own_impl), ["input_ids", "position_ids"])
        layers: List[HFAttentionLayer] = ctx.hf_attention_layers or []
        reason = ctx.uncached_reason or _uncacheable_reason(layers)
        if reason is not None:
            ctx.uncached_reason = reason
            logger.warning("transformers mode: %s", reason)
            return uncached, TransformInfo(skipped=True, reason=reason[:200], is_clean=True, has_valid_shapes=True)
        cache = CachedSequenceInterface(
            page_size=ctx.page_size, max_batch_size=ctx.max_batch_size, max_seq_len=ctx.max_seq_len,
            max_num_tokens=ctx.max_num_tokens, device=ctx.device,
        )
        for i, layer in enumerate(layers):
            cache.add_cache(f"k_cache_{i}", PagedKVHandler(layer.num_kv_heads, layer.head_dim, ctx.dtype))
            cache.add_cache(f"v_cache_{i}", PagedKVHandler(layer.num_kv_heads, layer.v_head_dim, ctx.dtype))
        cache.gathered_logits = True  # the runner returns the logits_index rows
        runner = CachedHFRunner(mod, layers, backend.cached_op, backend.prepare_metadata_op, ctx.page_size)
        ctx.cache = cache
        ctx.uncached_graph = uncached
        logger.info("transformers mode: %d attention layers on the paged KV cache (%s backend)", len(layers),
                    cfg.backend)
        return runner_graph(runner, cache.input_names), TransformInfo(num_matches=len(layers), is_clean=True,
                                                                      has_valid_shapes=True)
