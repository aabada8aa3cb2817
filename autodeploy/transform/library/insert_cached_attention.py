"""``insert_cached_attention`` (cache_init): ``torch_attention`` -> the backend's cached op.

Before (per layer; the graph takes ``input_ids``/``position_ids``)::

    o = autodeploy.torch_attention(q, k, v, None, 0.0, True, scale, sinks, window, cap[, alibi_slopes=slopes]
                                   [, attention_chunk=C][, rel_logits=rel])

After (one prepare node per graph; metadata and per-layer cache inputs added)::

    graph(input_ids, position_ids, batch_info, seq_len, input_pos, cu_seqlen, page_table, slot_idx,
          use_initial_state, k_cache_0, v_cache_0, k_cache_1, ...)
    slots = autodeploy.torch_cached_attention_prepare_metadata(position_ids, seq_len, cu_seqlen, page_table, P)
    o = autodeploy.sdpa_cached_attention_with_cache(q, k, v, batch_info, seq_len, input_pos, cu_seqlen,
                                                    page_table, slots, k_cache_0, v_cache_0, scale, sinks, window, cap
                                                    [, alibi_slopes=slopes][, rel_logits=rel])

After this the graph is called with every token of a step flattened into one row
(``[1, total_tokens]``); see ``autodeploy.cache.sequence_info``. The metadata inputs are added
once for every cache transform (``_cache_inputs``); the state-cache transforms that run after
this one append their caches behind the KV caches. An attention that is not
causal or still carries an explicit mask cannot be cached correctly, and neither can a graph
exported with a static sequence length: with ``on_uncacheable: recompute`` (the default) the
graph is left uncached with the reason for ``recompute_fallback``; with ``error`` it is an
error naming the layer. Never a silently wrong answer.

``kv_cache_dtype: fp8`` stores the K/V pages as ``float8_e4m3fn`` (1 byte a value, so
``resize_kv_cache`` fits 4x the pages of an fp32 cache, 2x of bf16, in the same budget) and
appends each layer's per-tensor ``k_scale, v_scale`` to its cached op (see
``autodeploy.ops.cached_attention``)::

    o = autodeploy.sdpa_cached_attention_with_cache(q, k, v, ..., k_cache_0, v_cache_0, scale, sinks, window, cap,
                                                    0.0123, 0.0457)

The scales are a ModelOpt checkpoint's calibrated ones when it declares ``kv_cache_quant_algo:
FP8`` (``model.layers.N.self_attn.k_proj.k_scale`` / ``...v_proj.v_scale``, the names vLLM's and
TensorRT-LLM's loaders read; the attention node's ``nn_module_stack`` names its module), else
1.0, vLLM's default for a checkpoint without them (then keys/values beyond +-448 saturate).
"""

import math
import re
from typing import Iterator, List, Literal, Sequence, Set, Tuple

import torch
from pydantic import Field
from torch import fx

from ...cache import CachedSequenceInterface
from ...cache.attention_backends import KV_CACHE_DTYPES, AttentionDescriptor, attention_backends, get_attention_backend
from ...models.checkpoint import CheckpointReader
from ...utils.errors import ConfigError, ModelSourceError
from ...utils.logging import get_logger
from ..graph_utils import arg, is_op
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from ._cache_inputs import add_cache_input, step_inputs
from ._quant_from_config import warn_unused_kv_cache_scales
from .recompute_fallback import export_shape_problem

logger = get_logger(__name__)

# gm.meta key: the kv_cache_dtype the user asked for, read by insert_cached_mla_attention
KV_CACHE_DTYPE_REQUESTED = "autodeploy_kv_cache_dtype_requested"


class InsertCachedAttentionConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    requires_shape_prop: bool = True
    backend: str = Field(default="sdpa", description="Attention backend: " + ", ".join(["torch", "sdpa"]) + ".")
    on_uncacheable: Literal["recompute", "error"] = Field(
        default="recompute",
        description="When an attention cannot be KV-cached (explicit mask, not causal, static-length export): "
        "leave the graph uncached for recompute_fallback, or raise.",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        default="auto",
        description="KV-cache storage: auto = the model's dtype; fp8 = float8_e4m3fn (4x the pages of an fp32 "
        "cache, 2x of bf16, in the same memory) with per-layer per-tensor k/v scales: a ModelOpt checkpoint's "
        "calibrated k_scale/v_scale (kv_cache_quant_algo FP8), else 1.0 (vLLM's default; values beyond "
        "+-448 saturate).",
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
        gm.meta[KV_CACHE_DTYPE_REQUESTED] = cfg.kv_cache_dtype  # for the other KV caches' transforms (MLA)
        device = torch.device(ctx.device)
        if device.type not in backend.devices:
            raise ConfigError(f"attention backend '{backend.name}' does not run on {device.type}")
        graph = gm.graph
        attn_nodes = [n for n in graph.nodes if is_op(n, torch.ops.autodeploy.torch_attention)]
        problem = export_shape_problem(gm)
        if not attn_nodes or problem is not None and cfg.on_uncacheable == "recompute":
            if problem is not None:
                ctx.uncached_reason = problem
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True,
                                 reason=problem or "no canonical attention in the model")
        try:
            for node in attn_nodes:
                self._check_cacheable(node)
        except RuntimeError as err:
            problem = problem or str(err)
        if problem is not None:
            if cfg.on_uncacheable == "error":
                raise RuntimeError(problem)
            ctx.uncached_reason = problem
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True, reason=problem)
        if cfg.kv_cache_dtype not in backend.kv_cache_dtypes:
            raise ConfigError(f"attention backend '{backend.name}' has no {cfg.kv_cache_dtype} KV cache "
                              f"(it has: {', '.join(backend.kv_cache_dtypes)})")
        fp8 = cfg.kv_cache_dtype == "fp8"
        scales = kv_cache_scales(ctx, attn_nodes) if fp8 else [()] * len(attn_nodes)
        if not fp8:
            warn_unused_kv_cache_scales(gm)
        cache_dtype = KV_CACHE_DTYPES[cfg.kv_cache_dtype] if fp8 else ctx.dtype
        self._replace(gm, ctx, backend, attn_nodes, cache_dtype, scales)
        gm.meta["autodeploy_cached"] = {"attn_backend": backend.name, "layers": len(attn_nodes)}
        if fp8:
            gm.meta["autodeploy_cached"]["kv_cache_dtype"] = "fp8"
        return TransformInfo(num_matches=len(attn_nodes), is_clean=False, has_valid_shapes=False)

    @staticmethod
    def _replace(gm: fx.GraphModule, ctx: PipelineContext, backend: AttentionDescriptor, attn_nodes: List[fx.Node],
                 cache_dtype: torch.dtype, scales: Sequence[Tuple[float, ...]]) -> None:
        """Add the metadata and per-layer cache inputs, then swap each ``torch_attention`` for the
        backend's cached op (``scales``: each layer's trailing ``(k_scale, v_scale)``, or ``()``)."""
        graph = gm.graph
        meta = step_inputs(gm, ctx)
        cache: CachedSequenceInterface = ctx.cache  # type: ignore[assignment]
        layer_caches: List[List[fx.Node]] = []
        for layer, node in enumerate(attn_nodes):
            handlers = backend.cache_handlers(node.args[1].meta["val"], node.args[2].meta["val"], cache_dtype)
            layer_caches.append([add_cache_input(gm, ctx, f"{kind}_{layer}", h) for kind, h in handlers.items()])
        last = [n for n in graph.nodes if n.op == "placeholder"][-1]
        with graph.inserting_after(last):
            slots = graph.call_function(
                backend.prepare_metadata_op,
                (meta["position_ids"], meta["seq_len"], meta["cu_seqlen"], meta["page_table"], cache.page_size),
            )
        for node, cache_nodes, layer_scales in zip(attn_nodes, layer_caches, scales):
            q, k, v = node.args[:3]
            alibi, chunk = arg(node, 10, "alibi_slopes"), arg(node, 11, "attention_chunk")
            out_scale = arg(node, 12, "out_scale")  # fuse_trtllm_attn_quant_fp8's FP8 output
            rel_logits = arg(node, 13, "rel_logits")  # Inkling's relative position bias
            extra = {**({"alibi_slopes": alibi} if alibi is not None else {}),
                     **({"attention_chunk": chunk} if chunk is not None else {}),
                     **({"out_scale": out_scale} if out_scale is not None else {}),
                     **({"rel_logits": rel_logits} if rel_logits is not None else {})}
            with graph.inserting_before(node):
                cached = graph.call_function(
                    backend.cached_op,
                    (q, k, v, *(meta[m] for m in backend.metadata), slots, *cache_nodes,
                     arg(node, 6, "scale"), arg(node, 7, "sinks"), arg(node, 8, "sliding_window"),
                     arg(node, 9, "logit_cap"), *layer_scales),
                    extra,
                )
            cached.meta["val"] = node.meta.get("val")
            node.replace_all_uses_with(cached)
            graph.erase_node(node)

    @staticmethod
    def _check_cacheable(node: fx.Node) -> None:
        module = _module_of(node)
        layer = f"{node.name} ({module})" if module else node.name
        if arg(node, 3, "attn_mask") is not None:
            raise RuntimeError(
                f"attention {layer} still has an explicit mask the matchers could not read as causal/windowed; "
                "cached attention would ignore it. Export with attn_implementation 'autodeploy', or report the model"
            )
        if not arg(node, 5, "is_causal", False):
            raise RuntimeError(f"attention {layer} is not causal; a decoder KV cache cannot serve bidirectional attention")
        if arg(node, 4, "dropout_p", 0.0) != 0.0:
            raise RuntimeError(f"attention {layer} has dropout; inference graphs must not")


def _module_of(node: fx.Node) -> str:
    """The module that made ``node`` (export's ``nn_module_stack``): ``path, Class``, only ``Class``
    for the exported module itself (its path is empty), or '' when export recorded none."""
    stack = list((node.meta.get("nn_module_stack") or {}).values())
    if not stack:
        return ""
    path, cls = stack[-1]
    name = cls.__name__ if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1]
    return f"{path}, {name}" if path else name


# ---- FP8 KV cache: the per-layer scales -----------------------------------------------------

# Where a checkpoint keeps a layer's KV-cache scale, under the attention module's path: ModelOpt
# on the k/v projections (vLLM's ``maybe_remap_kv_scale_name``, TensorRT-LLM's HF loader), a fused
# QKV projection, or the attention module itself.
_SCALE_PLACES = {"k": ("k_proj.k_scale", "qkv_proj.k_scale", "k_scale"),
                 "v": ("v_proj.v_scale", "qkv_proj.v_scale", "v_scale")}


def kv_cache_scales(ctx: PipelineContext, attn_nodes: Sequence[fx.Node]) -> List[Tuple[float, float]]:
    """Each attention layer's ``(k_scale, v_scale)`` for an FP8 KV cache: the checkpoint's
    calibrated scales when it is ModelOpt with ``kv_cache_quant_algo: FP8``, else 1.0 (vLLM's
    default when a checkpoint has none; keys/values beyond +-448 then saturate)."""
    factory = ctx.factory
    info = getattr(factory, "quantization", None)
    algo = str((info.config if info is not None else {}).get("kv_cache_quant_algo") or "")
    if info is None or info.method != "modelopt" or algo.upper() != "FP8":
        if algo:
            logger.warning("kv_cache_dtype fp8: the checkpoint's KV-cache scales are for kv_cache_quant_algo %s, "
                           "not FP8; they are not used", algo)
        logger.info("kv_cache_dtype fp8: the checkpoint has no calibrated FP8 KV-cache scales; k_scale = v_scale "
                    "= 1.0 (vLLM's default), keys/values beyond +-448 saturate")
        return [(1.0, 1.0)] * len(attn_nodes)
    index = factory.checkpoint_index()
    names = set(index.weight_map)
    base = getattr(factory, "base_model_prefix", "") or ""
    scales: List[Tuple[float, float]] = []
    with CheckpointReader(index) as reader:
        for node in attn_nodes:
            found = [_find_scale(names, node, kind, base) for kind in ("k", "v")]
            scales.append((_read_scale(reader, found[0]), _read_scale(reader, found[1])))
    logger.info("kv_cache_dtype fp8: the checkpoint's calibrated KV-cache scales for %d layers (k_scale %.3g-%.3g, "
                "v_scale %.3g-%.3g)", len(scales), min(k for k, _ in scales), max(k for k, _ in scales),
                min(v for _, v in scales), max(v for _, v in scales))
    return scales


def _module_paths(node: fx.Node) -> Iterator[str]:
    """The modules the exported node was called in, innermost first (``model.layers.0.self_attn``,
    ``model.layers.0``, ...), from its ``nn_module_stack``. A decoder that iterates
    ``self.layers[:n]`` records ``layers.slice(None, n, None).0``: the slice is dropped."""
    stack = node.meta.get("nn_module_stack") or {}
    for entry in reversed(list(stack.values())):
        path = entry[0] if isinstance(entry, tuple) else str(entry)
        if path:
            yield re.sub(r"\.slice\([^)]*\)", "", path)


def _find_scale(names: Set[str], node: fx.Node, kind: str, base: str) -> str:
    """The checkpoint name of ``node``'s ``k_scale`` (``kind`` "k") or ``v_scale``; an error naming
    the layer when the checkpoint, which declares FP8 KV-cache scales, has none for it."""
    tried: List[str] = []
    for path in _module_paths(node):
        prefixes = [path] + ([path[len(base) + 1:]] if base and path.startswith(base + ".") else [])
        for prefix in prefixes:
            for place in _SCALE_PLACES[kind]:
                name = f"{prefix}.{place}"
                if name in names:
                    return name
                tried.append(name)
    where = next(_module_paths(node), None) or node.name
    raise ModelSourceError(
        f"the checkpoint declares kv_cache_quant_algo FP8 but has no {kind}_scale for the attention in '{where}' "
        f"(looked for {', '.join(tried[:3]) or 'a module path: the node has no nn_module_stack'}); "
        "set kv_cache_dtype: auto to run with a KV cache in the model's dtype"
    )


def _read_scale(reader: CheckpointReader, name: str) -> float:
    tensor = reader.get(name)
    value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else math.nan
    if not (math.isfinite(value) and value > 0):
        what = f"shape {list(tensor.shape)}" if tensor.numel() != 1 else f"value {value}"
        raise ModelSourceError(f"checkpoint tensor '{name}' is not a positive per-tensor KV-cache scale ({what})")
    return value
