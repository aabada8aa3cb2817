"""``resize_kv_cache`` (cache_init): grow the page pool to a fraction of the free memory.

Before: the sizing pool from ``initialize_cache``. After: a pool of
``min(useful, budget / bytes_per_page)`` pages, where the budget is
``free_mem_ratio * (free - forward_peak)`` (on CPU at most ``cpu_max_cache_gb``), the forward
peak is measured by running one step of ``max_num_tokens`` tokens (CUDA: allocator peak and
``mem_get_info``; CPU: peak RSS and ``MemAvailable``), and ``useful`` is what ``max_batch_size``
sequences of ``max_seq_len`` tokens can ever hold. A pool fixed by
``initialize_cache.num_pages`` is kept; the forward still runs as a check.

Then the limits left to the pool are chosen (``autodeploy.cache.limits``): an unset
``max_batch_size`` from the sequences the pool holds; an unset ``max_seq_len`` (the model's own
limit) is lowered, with a warning, when the budget cannot hold one sequence that long. A
``max_seq_len`` the user set that does not fit is an error naming the numbers.
"""

from typing import Optional

import torch
from pydantic import Field
from torch import fx

from ...cache.sequence_info import build_sequence_info
from ...utils.logging import get_logger
from ...utils.memory import free_memory_bytes, measure_peak
from ...cache.limits import MAX_BATCH_SIZE_CAP, UNSIZED_STATE_BUDGET, auto_batch_size
from ...utils.errors import ConfigError
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

logger = get_logger(__name__)


class ResizeKVCacheConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    expect_mem_change: bool = True
    free_mem_ratio: float = Field(default=0.5, gt=0.0, le=0.95, description="Share of free memory the pool may take.")
    cpu_max_cache_gb: Optional[float] = Field(
        default=4.0, gt=0.0,
        description="On CPU, the most GiB the pool takes (RAM is shared with the machine; as vLLM's CPU "
        "default); null: only free_mem_ratio bounds it. Not used on CUDA.",
    )


def sizing_step(cache):
    """The largest prefill step the engine could run: ``max_num_tokens`` tokens over as few
    ``max_seq_len``-long sequences as hold them, within the pages the pool has."""
    tokens, tables, next_page = [], [], 0
    remaining = cache.max_num_tokens
    while remaining > 0 and len(tokens) < cache.max_batch_size:
        pages_left = cache.num_pages - next_page
        n = min(remaining, cache.max_seq_len, pages_left * cache.page_size)
        if n < 1:
            break
        pages = -(-n // cache.page_size)
        tokens.append([0] * n)
        tables.append(list(range(next_page, next_page + pages)))
        next_page += pages
        remaining -= n
    return build_sequence_info(tokens, [0] * len(tokens), tables, device=cache.device)


@TransformRegistry.register("resize_kv_cache")
class ResizeKVCache(BaseTransform):
    config_class = ResizeKVCacheConfig
    requires = ("initialize_cache",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        cfg: ResizeKVCacheConfig = self.config  # type: ignore[assignment]
        cache = ctx.cache
        if cache is None or not cache.caches:
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True, reason="no caches allocated")
        info = sizing_step(cache)
        with torch.inference_mode(), measure_peak(cache.device) as peak:
            gm(*cache.graph_args(info))
        forward_peak = peak[0]
        if getattr(cache, "fixed_size", False):
            logger.info("KV cache kept at %d pages (fixed); sizing forward peak %.1f MiB", cache.num_pages,
                        forward_peak / 2**20)
            choose_batch_size(ctx, cache)
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        # the sizing pool and states are given back and allocated again at their final sizes (token
        # buffers stay allocated: their size is fixed, and the free memory already excludes them)
        free = free_memory_bytes(cache.device) + cache.paged_bytes() + cache.state_bytes()
        budget = int(cfg.free_mem_ratio * max(0, free - forward_peak))
        if cache.device.type == "cpu" and cfg.cpu_max_cache_gb is not None:
            budget = min(budget, int(cfg.cpu_max_cache_gb * 2**30))
        # state slots come out of the same budget: one per sequence that may run, and the spare
        state_budget = max(0, budget - cache.min_pages * cache.bytes_per_page())
        batch_bound = MAX_BATCH_SIZE_CAP if ctx.auto_batch_size else cache.max_batch_size
        if ctx.auto_batch_size and cache.state_names:
            batch_bound = min(batch_bound, max(1, state_budget // cache.state_bytes_per_sequence() - 1))
        page_budget = max(0, budget - (batch_bound + 1) * cache.state_bytes_per_sequence())
        affordable = page_budget // max(1, cache.bytes_per_page())
        _fit_max_seq_len(ctx, cache, affordable, page_budget, max(0, free - forward_peak))
        # an unset max_batch_size is chosen from this pool, so the pool may hold as many as the bound
        pages = max(cache.min_pages, min(batch_bound * cache.pages_per_sequence, affordable))
        cache.allocate(pages)
        choose_batch_size(ctx, cache, state_budget)
        logger.info(
            "KV cache resized to %d pages (%.1f MiB, %d tokens of %d bytes; state caches %.1f MiB; token buffers "
            "%.1f MiB): free %.0f MiB, forward peak %.1f MiB, budget %.0f MiB, max_batch_size %d, max_seq_len %d",
            pages, cache.paged_bytes() / 2**20, pages * cache.page_size, cache.bytes_per_token(),
            cache.state_bytes() / 2**20,
            cache.buffer_bytes() / 2**20,
            free / 2**20, forward_peak / 2**20, budget / 2**20, cache.max_batch_size, cache.max_seq_len,
        )
        return TransformInfo(num_matches=1, is_clean=True, has_valid_shapes=True)


def choose_batch_size(ctx: PipelineContext, cache, state_budget: Optional[int] = UNSIZED_STATE_BUDGET) -> None:
    """An unset max_batch_size becomes what the pool (and the state budget) holds
    (``autodeploy.cache.limits``)."""
    if ctx.auto_batch_size:
        cache.max_batch_size = ctx.max_batch_size = auto_batch_size(cache, state_budget)


def _fit_max_seq_len(ctx: PipelineContext, cache, affordable_pages: int, budget: int, available: int) -> None:
    """The pool holds at least one sequence of max_seq_len. When the budget cannot: an automatic
    max_seq_len is lowered to what it holds; a user's is kept while one sequence fits in free
    memory (the pool then exceeds the budget, with a warning), and is an error beyond that."""
    if affordable_pages >= cache.min_pages:
        return
    per_seq = cache.min_pages * cache.bytes_per_page()
    fits = affordable_pages * cache.page_size
    if ctx.auto_seq_len and fits >= 2 * cache.page_size:
        logger.warning(
            "max_seq_len lowered from the model's %d to %d tokens: one sequence that long needs %s of cache, the "
            "budget is %s (set max_seq_len, or raise resize_kv_cache.free_mem_ratio / cpu_max_cache_gb)",
            cache.max_seq_len, fits, _size(per_seq), _size(budget),
        )
        cache.max_seq_len = ctx.max_seq_len = fits
        return
    if per_seq <= available:
        logger.warning("the cache budget (%s) is smaller than one sequence of max_seq_len=%d (%s); the pool holds "
                       "that one sequence", _size(budget), cache.max_seq_len, _size(per_seq))
        return
    raise ConfigError(
        f"one sequence of max_seq_len={cache.max_seq_len} tokens needs {_size(per_seq)} of cache, more than the "
        f"{_size(available)} of free memory; lower max_seq_len to at most {max(fits, 0)}"
    )


def _size(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:.1f} KiB"
