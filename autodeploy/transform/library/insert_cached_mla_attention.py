"""``insert_cached_mla_attention`` (cache_init): ``torch_mla`` -> the backend's cached MLA op.

Before (per layer; ``export/hf_mla.py`` emits ``torch_mla`` for HF's MLA attention)::

    o = autodeploy.torch_mla(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, True, scale)

After (the step metadata as for ``insert_cached_attention``, one latent cache per layer)::

    graph(input_ids, position_ids, batch_info, seq_len, input_pos, cu_seqlen, page_table, ...,
          mla_cache_0, mla_cache_1, ...)
    slots = autodeploy.torch_cached_attention_prepare_metadata(position_ids, seq_len, cu_seqlen, page_table, P)
    o = autodeploy.sdpa_cached_mla_with_cache(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, batch_info,
                                              seq_len, input_pos, cu_seqlen, page_table, slots, mla_cache_0, scale)

DeepSeek Sparse Attention (``torch_dsa_indexer``, whose ``topk_indices`` feed ``torch_mla``) becomes
``torch_cached_dsa_indexer`` with the layer's indexer keys in a paged cache of their own
(``index_cache_<i>``, ``index_head_dim`` values a token); the cached MLA op takes the indices::

    idx = autodeploy.torch_cached_dsa_indexer(q_idx, k_idx, w_idx, batch_info, ..., slots, index_cache_0, s, topk)
    o = autodeploy.sdpa_cached_mla_with_cache(..., mla_cache_0, scale, None, None, -1, idx)

A layer with attention sinks (``torch_mla``'s ``sinks``, HY-V4) hands them on the same way, after the indices.

Each cache page holds, per token, the normalised latent ``c_kv`` and the roped key part ``k_pe``
(``kv_lora_rank + qk_rope_head_dim`` values: 576 for DeepSeek-V3, where an expanded cache
holds ``128 x (192 + 128)``). The ``sdpa`` backend decodes by weight absorption
(``autodeploy.ops.mla``). The prepare node is shared with ``insert_cached_attention`` when a
graph has both kinds of attention.

Like the KV cache, a graph that cannot take a step's tokens as one row (static or minimum
length export), or that ``insert_cached_attention`` already declared uncacheable, is left
alone for ``recompute_fallback``; a non-causal ``torch_mla`` is an error or recompute
(``on_uncacheable``), never a silently wrong answer. An FP8 KV cache
(``insert_cached_attention.kv_cache_dtype: fp8``) is not built for the latent cache, which is
kept in the model's dtype (a warning says so).
"""

from typing import List, Literal, Optional

import torch
from pydantic import Field
from torch import fx

from ...cache import CachedSequenceInterface
from ...cache.mla_backends import MLADescriptor, mla_backends
from ...ops.rope import ROPE_NONE
from ...utils.errors import ConfigError
from ...utils.logging import get_logger
from ..graph_utils import arg, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._cache_inputs import add_cache_input, step_inputs
from .insert_cached_attention import KV_CACHE_DTYPE_REQUESTED
from .recompute_fallback import export_shape_problem

logger = get_logger(__name__)


class InsertCachedMLAAttentionConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    requires_shape_prop: bool = True
    backend: Literal["torch", "sdpa"] = Field(
        default="sdpa",
        description="MLA backend: sdpa = prefill expanded with SDPA, decode by weight absorption (never builds "
        "per-head K/V); torch = the reference, each sequence's cached latent expanded.",
    )
    on_uncacheable: Literal["recompute", "error"] = Field(
        default="recompute",
        description="When an MLA attention cannot be cached (not causal): leave the graph uncached for "
        "recompute_fallback, or raise.",
    )


@TransformRegistry.register("insert_cached_mla_attention")
class InsertCachedMLAAttention(BaseTransform):
    config_class = InsertCachedMLAAttentionConfig
    requires = ("load_weights",)
    run_after = ("insert_cached_attention",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        cfg: InsertCachedMLAAttentionConfig = self.config  # type: ignore[assignment]
        backend = mla_backends()[cfg.backend]
        nodes = [n for n in gm.graph.nodes if is_op(n, torch.ops.autodeploy.torch_mla)]
        problem = export_shape_problem(gm)
        if not nodes or problem is not None or ctx.uncached_reason:
            if problem is not None:
                ctx.uncached_reason = ctx.uncached_reason or problem
            why = "no torch_mla in the model" if not nodes else (problem or "the model runs in recompute mode")
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True, reason=why)
        not_causal = [n.name for n in nodes if not arg(n, 5, "is_causal", True)]
        if not_causal:
            problem = f"MLA attention {not_causal[0]} is not causal; a decoder cache cannot serve it"
            if cfg.on_uncacheable == "error":
                raise ConfigError(problem)
            ctx.uncached_reason = problem
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True, reason=problem)
        if gm.meta.get(KV_CACHE_DTYPE_REQUESTED, "auto") != "auto":
            logger.warning("kv_cache_dtype %s is not built for the MLA latent cache: it stays in %s (an ordinary "
                           "attention's KV cache, if any, gets %s)", gm.meta[KV_CACHE_DTYPE_REQUESTED],
                           str(ctx.dtype).replace("torch.", ""), gm.meta[KV_CACHE_DTYPE_REQUESTED])
        self._replace(gm, ctx, backend, nodes)
        meta = gm.meta.setdefault("autodeploy_cached", {})
        meta.update({"mla_backend": backend.name, "mla_layers": len(nodes)})
        return TransformInfo(num_matches=len(nodes), is_clean=False, has_valid_shapes=False)

    @staticmethod
    def _replace(gm: fx.GraphModule, ctx: PipelineContext, backend: MLADescriptor, nodes: List[fx.Node]) -> None:
        graph = gm.graph
        meta = step_inputs(gm, ctx)
        cache: CachedSequenceInterface = ctx.cache  # type: ignore[assignment]
        first = sum(name.startswith("mla_cache_") for name in cache.handlers)
        caches = [add_cache_input(gm, ctx, f"mla_cache_{first + i}",
                                  backend.cache_handler(n.args[2].meta["val"], n.args[3].meta["val"], ctx.dtype))
                  for i, n in enumerate(nodes)]
        indexers = [n for n in graph.nodes if is_op(n, torch.ops.autodeploy.torch_dsa_indexer)]
        index_caches = [add_cache_input(gm, ctx, f"index_cache_{i}", backend.index_cache_handler(n.args[1].meta["val"],
                                                                                                 ctx.dtype))
                        for i, n in enumerate(indexers)]
        slots = _prepare_node(graph, backend, meta, cache.page_size)
        for node, cache_node in zip(indexers, index_caches):
            q, k, weights = node.args[:3]
            with graph.inserting_before(node):
                cached = graph.call_function(
                    torch.ops.autodeploy.torch_cached_dsa_indexer.default,
                    (q, k, weights, *(meta[m] for m in backend.metadata), slots, cache_node, node.args[3], node.args[4]))
            cached.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(cached)
            graph.erase_node(node)
        for node, cache_node in zip(nodes, caches):
            q_nope, q_pe, compressed_kv, kpe, weight = node.args[:5]
            topk, sinks = arg(node, 7, "topk_indices"), arg(node, 8, "sinks")
            extra = () if topk is None and sinks is None else (None, None, ROPE_NONE, topk, sinks)
            with graph.inserting_before(node):
                cached = graph.call_function(
                    backend.cached_op,
                    (q_nope, q_pe, compressed_kv, kpe, weight, *(meta[m] for m in backend.metadata), slots,
                     cache_node, arg(node, 6, "scale")) + extra,
                )
            cached.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(cached)
            graph.erase_node(node)


def _prepare_node(graph: fx.Graph, backend: MLADescriptor, meta: dict, page_size: int) -> fx.Node:
    """The step's cache slots: ``insert_cached_attention``'s prepare node when it made one, else a new one."""
    existing: Optional[fx.Node] = next((n for n in graph.nodes if n.target == backend.prepare_metadata_op), None)
    if existing is not None:
        return existing
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(last):
        return graph.call_function(
            backend.prepare_metadata_op,
            (meta["position_ids"], meta["seq_len"], meta["cu_seqlen"], meta["page_table"], page_size),
        )
