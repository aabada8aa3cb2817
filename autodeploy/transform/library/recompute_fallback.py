"""``recompute_fallback`` (cache_init): check the KV-cached graph, and run the model in recompute
mode when a KV cache cannot serve it.

Before (the usual case): the graph from ``insert_cached_attention`` with its paged KV caches.
It is run on two prompts scheduled two ways (``autodeploy.cache.consistency``); when the
logits agree nothing changes.

After, when the cached graph disagrees with itself (state outside attention: convolutions, SSM
scans, recurrences), when ``insert_cached_attention`` left the graph uncached (no canonical
attention, an unreadable mask, non-causal attention, a static-length export), or with
``mode: always``::

    graph(input_ids, position_ids, batch_info, seq_len, input_pos, cu_seqlen, page_table, token_cache)
    logits = recompute(...)   # RecomputeRunner: writes the new tokens into the paged token
                              # cache, runs the *uncached* graph over each sequence's history

(see ``autodeploy.cache.recompute``). Exact for any causal LM, but every step costs a full
forward per sequence, so it is logged as a warning with its reason; ``mode: never`` makes
the same cases errors instead.
"""

from typing import Literal, Optional, Tuple

import torch
from pydantic import Field
from torch import fx, nn

from ...cache import CachedSequenceInterface
from ...cache.consistency import check_cache_consistency, check_static_export_against_eager
from ...cache.recompute import TOKEN_CACHE, TokenCacheHandler, build_recompute_graph
from ...utils.errors import ConfigError
from ...utils.logging import get_logger
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry
from .initialize_cache import sizing_pages

logger = get_logger(__name__)


class RecomputeFallbackConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    run_per_gm: bool = False
    mode: Literal["auto", "never", "always"] = Field(
        default="auto",
        description="auto: recompute only when the KV cache cannot serve the model (with a warning); never: "
        "make those cases errors; always: recompute every model (a debugging reference).",
    )
    check_consistency: bool = Field(
        default=True,
        description="Run the cached graph on two prompts scheduled two ways and compare the logits; "
        "a mismatch means state outside attention.",
    )
    verify_static_export: bool = Field(
        default=True,
        description="For a graph exported with a static length (export_to_gm.static_seq_fallback), compare it "
        "once with the eager HF model at two real prompt lengths (loads the checkpoint a second time while "
        "building); a model that branches on the sequence length is then an error, not a wrong answer.",
    )


def export_lengths(gm: fx.GraphModule) -> Tuple[Optional[int], int]:
    """``(static_seq_len, min_seq_len)`` the exporter recorded: ``(None, 1)`` for a graph that
    takes any sequence length."""
    export_meta = gm.meta.get("autodeploy_export") or {}
    return export_meta.get("static_seq_len"), int(export_meta.get("min_seq_len", 1))


def export_shape_problem(gm: fx.GraphModule) -> Optional[str]:
    """Why the exported graph cannot take a step's tokens as one row (static or minimum length)."""
    static_len, min_len = export_lengths(gm)
    if static_len is not None:
        return (f"the graph was exported with a static sequence length ({static_len}), so it cannot take a "
                "step's tokens as one row")
    if min_len > 1:
        return (f"the graph was exported for sequences of at least {min_len} tokens (the named dynamic dim was "
                "rejected), so it cannot take one-token steps")
    return None


def cached_mode(cache: CachedSequenceInterface) -> str:
    """The cache mode of a graph the cache serves: which kinds of cache it holds."""
    kinds = [kind for kind, names in (("paged_kv", cache.paged_names), ("state", cache.state_names)) if names]
    return "+".join(kinds)


@TransformRegistry.register("recompute_fallback")
class RecomputeFallback(BaseTransform):
    config_class = RecomputeFallbackConfig
    run_after = ("insert_cached_attention", "gather_logits_before_lm_head", "initialize_cache")

    def _apply_to_full_model(self, mod: Optional[nn.Module], ctx: PipelineContext) -> Tuple[nn.Module, TransformInfo]:
        cfg: RecomputeFallbackConfig = self.config  # type: ignore[assignment]
        if not isinstance(mod, fx.GraphModule):
            raise RuntimeError("recompute_fallback needs the exported graph; is 'export_to_gm' enabled?")
        vocab = int(ctx.factory.vocab_size) if ctx.factory is not None else None
        cached = ctx.cache is not None and bool(ctx.cache.caches)
        reason = self._reason(mod, ctx, cfg, cached, vocab)
        if reason is None:
            ctx.cache_mode = cached_mode(ctx.cache)
            ctx.uncached_graph = None
            return mod, TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True,
                                      reason="not needed: the caches serve this model")
        if cfg.mode == "never":
            raise ConfigError(
                f"this model cannot run with a KV cache: {reason}. Set transforms.recompute_fallback.mode to "
                "'auto' to run it in recompute mode (exact, but each step recomputes every sequence)"
            )
        uncached = ctx.uncached_graph if cached else mod
        if uncached is None:
            raise RuntimeError("recompute_fallback: the graph before insert_cached_attention was not kept")
        static_len, min_len = export_lengths(uncached)
        padded = static_len is not None or min_len > 1  # histories are right-padded to a length
        gm = build_recompute_graph(uncached, ctx.page_size, static_len, min_len)
        ctx.cache = self._token_cache(ctx, keep_pages=ctx.cache.num_pages if cached and ctx.cache.fixed_size else None)
        ctx.cache_mode = "recompute"
        ctx.recompute_reason = reason
        logger.warning(
            "running in recompute mode: %s. Each step runs the whole history of every scheduled sequence%s; "
            "exact, but slower than a KV cache", reason, f" padded to {static_len} tokens" if static_len else "",
        )
        if cfg.check_consistency and vocab is not None:
            result = check_cache_consistency(gm, ctx.cache, vocab, ctx.dtype)
            if padded and cfg.verify_static_export and (result is None or result.ok):
                result = check_static_export_against_eager(gm.recompute, ctx.factory, ctx.dtype,
                                                           torch.device(ctx.device))
            if result is not None and not result.ok:
                hint = " (export with dynamic shapes failed, see the warning above)" if padded else ""
                raise RuntimeError(f"recompute mode cannot serve this model exactly{hint}: {result.detail}")
        ctx.uncached_graph = None
        return gm, TransformInfo(num_matches=1, is_clean=True, has_valid_shapes=True)

    @staticmethod
    def _reason(gm: fx.GraphModule, ctx: PipelineContext, cfg: RecomputeFallbackConfig, cached: bool,
                vocab: Optional[int]) -> Optional[str]:
        if not cached:
            shape_problem = export_shape_problem(gm)
            if shape_problem is not None:
                return shape_problem
            skipped = [r.error for r in ctx.history if r.key == "insert_cached_attention" and r.error]
            return ctx.uncached_reason or (f"insert_cached_attention was skipped: {skipped[-1]}"
                                                       if skipped else None) or (
                "no attention was canonicalised to torch_attention, so a KV cache has nothing to hold"
            )
        if cfg.mode == "always":
            return "recompute_fallback.mode is 'always'"
        if not cfg.check_consistency or vocab is None:
            return None
        # Runs for every compile backend. (It was once skipped for torch-compile: its eager runs added
        # variants of the process-wide compiled RMSNorm kernels until dynamo's recompile limit made a
        # later model's torch.compile fail with "Attempt to trace generator"; autodeploy.ops.compiled
        # now calls those kernels with uniform inputs.)
        result = check_cache_consistency(gm, ctx.cache, vocab, ctx.dtype)
        if result is None:
            logger.warning("KV-cache consistency check skipped: the page pool or max_seq_len is too small")
            return None
        logger.info("KV-cache consistency check: rel. RMSE %.1e (tolerance %.0e)", result.error, result.tolerance)
        if result.ok:
            return None
        return (f"the KV-cached graph disagrees with itself ({result.detail}): the model keeps state across "
                "tokens outside attention (a convolution, SSM or recurrent layer) that none of its caches holds: its op "
                "has no insert_cached_* state transform, or that transform is off")

    @staticmethod
    def _token_cache(ctx: PipelineContext, keep_pages: Optional[int]) -> CachedSequenceInterface:
        cache = CachedSequenceInterface(
            page_size=ctx.page_size, max_batch_size=ctx.max_batch_size, max_seq_len=ctx.max_seq_len,
            max_num_tokens=ctx.max_num_tokens, device=ctx.device,
        )
        cache.add_cache(TOKEN_CACHE, TokenCacheHandler())
        cache.allocate(keep_pages if keep_pages is not None else sizing_pages(cache))
        cache.fixed_size = keep_pages is not None
        cache.gathered_logits = True
        return cache
