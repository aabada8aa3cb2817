"""``insert_cached_attention`` (cache_init): ``torch_attention`` -> the backend's cached op.

Before (per layer; the graph takes ``input_ids``/``position_ids``)::

    o = autodeploy.torch_attention(q, k, v, None, 0.0, True, scale, sinks, window, cap)

After (one prepare node per graph; metadata and per-layer cache inputs added)::

    graph(input_ids, position_ids, batch_info, seq_len, input_pos, cu_seqlen, page_table, slot_idx,
          use_initial_state, k_cache_0, v_cache_0, k_cache_1, ...)
    slots = autodeploy.torch_cached_attention_prepare_metadata(position_ids, seq_len, cu_seqlen, page_table, P)
    o = autodeploy.sdpa_cached_attention_with_cache(q, k, v, batch_info, seq_len, input_pos, cu_seqlen,
                                                    page_table, slots, k_cache_0, v_cache_0, scale, sinks, window, cap)

After this the graph is called with every token of a step flattened into one row
(``[1, total_tokens]``); see ``autodeploy.cache.sequence_info``. The metadata inputs are added
once for every cache transform (``_cache_inputs``); the state-cache transforms that run after
this one append their caches behind the KV caches. An attention that is not
causal or still carries an explicit mask cannot be cached correctly, and neither can a graph
exported with a static sequence length: with ``on_uncacheable: recompute`` (the default) the
graph is left uncached with the reason for ``recompute_fallback``; with ``error`` it is an
error naming the layer. Never a silently wrong answer.
"""

from typing import List, Literal

import torch
from pydantic import Field
from torch import fx

from ...cache import CachedSequenceInterface
from ...cache.attention_backends import attention_backends, get_attention_backend
from ...utils.errors import ConfigError
from ..graph_utils import arg, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._cache_inputs import add_cache_input, step_inputs
from .recompute_fallback import export_shape_problem


class InsertCachedAttentionConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    requires_shape_prop: bool = True
    backend: str = Field(default="sdpa", description="Attention backend: " + ", ".join(["torch", "sdpa"]) + ".")
    on_uncacheable: Literal["recompute", "error"] = Field(
        default="recompute",
        description="When an attention cannot be KV-cached (explicit mask, not causal, static-length export): "
        "leave the graph uncached for recompute_fallback, or raise.",
    )


@TransformRegistry.register("insert_cached_attention")
class InsertCachedAttention(BaseTransform):
    config_class = InsertCachedAttentionConfig
    requires = ("load_weights",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        cfg: InsertCachedAttentionConfig = self.config  # type: ignore[assignment]
        if cfg.backend not in attention_backends():
            raise ConfigError(
                f"transforms.insert_cached_attention.backend: unknown attention backend '{cfg.backend}'; "
                f"available: {', '.join(sorted(attention_backends()))}"
            )
        backend = get_attention_backend(cfg.backend)
        device = torch.device(ctx.device)
        if device.type not in backend.devices:
            raise ConfigError(f"attention backend '{backend.name}' does not run on {device.type}")
        graph = gm.graph
        attn_nodes = [n for n in graph.nodes if is_op(n, torch.ops.autodeploy.torch_attention)]
        problem = export_shape_problem(gm)
        if not attn_nodes or problem is not None and cfg.on_uncacheable == "recompute":
            if problem is not None:
                ctx.uncached_reason = problem
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True)
        try:
            for node in attn_nodes:
                self._check_cacheable(node)
        except RuntimeError as err:
            problem = problem or str(err)
        if problem is not None:
            if cfg.on_uncacheable == "error":
                raise RuntimeError(problem)
            ctx.uncached_reason = problem
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True)
        meta = step_inputs(gm, ctx)
        cache: CachedSequenceInterface = ctx.cache  # type: ignore[assignment]
        layer_caches: List[List[fx.Node]] = []
        for layer, node in enumerate(attn_nodes):
            handlers = backend.cache_handlers(node.args[1].meta["val"], node.args[2].meta["val"], ctx.dtype)
            layer_caches.append([add_cache_input(gm, ctx, f"{kind}_{layer}", h) for kind, h in handlers.items()])
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last):
            slots = graph.call_function(
                backend.prepare_metadata_op,
                (meta["position_ids"], meta["seq_len"], meta["cu_seqlen"], meta["page_table"], cache.page_size),
            )
        for node, cache_nodes in zip(attn_nodes, layer_caches):
            q, k, v = node.args[:3]
            with graph.inserting_before(node):
                cached = graph.call_function(
                    backend.cached_op,
                    (q, k, v, *(meta[m] for m in backend.metadata), slots, *cache_nodes,
                     arg(node, 6, "scale"), arg(node, 7, "sinks"), arg(node, 8, "sliding_window"),
                     arg(node, 9, "logit_cap")),
                )
            cached.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(cached)
            graph.erase_node(node)
        gm.meta["autodeploy_cached"] = {"attn_backend": backend.name, "layers": len(attn_nodes)}
        return TransformInfo(num_matches=len(attn_nodes), is_clean=False, has_valid_shapes=False)

    @staticmethod
    def _check_cacheable(node: fx.Node) -> None:
        where = node.meta.get("stack_trace", "").strip().splitlines()
        layer = node.name + (f" ({where[-2].strip()})" if len(where) >= 2 else "")
        if arg(node, 3, "attn_mask") is not None:
            raise RuntimeError(
                f"attention {layer} still has an explicit mask the matchers could not read as causal/windowed; "
                "cached attention would ignore it. Export with attn_implementation 'autodeploy', or report the model"
            )
        if not arg(node, 5, "is_causal", False):
            raise RuntimeError(f"attention {layer} is not causal; a decoder KV cache cannot serve bidirectional attention")
        if arg(node, 4, "dropout_p", 0.0) != 0.0:
            raise RuntimeError(f"attention {layer} has dropout; inference graphs must not")
