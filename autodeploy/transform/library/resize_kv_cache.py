"""``resize_kv_cache`` (cache_init): grow the page pool to a fraction of the free memory.

Before: the sizing pool from ``initialize_cache``. After: a pool of
``min(useful, free_mem_ratio * (free - forward_peak) / bytes_per_page)`` pages, where the
forward peak is measured by running one step of ``max_num_tokens`` tokens (CUDA: allocator
peak and ``mem_get_info``; CPU: peak RSS and ``MemAvailable``), and ``useful`` is what
``max_batch_size`` sequences of ``max_seq_len`` tokens can ever hold. A pool fixed by
``initialize_cache.num_pages`` is kept; the forward still runs as a check.
"""

import torch
from pydantic import Field
from torch import fx

from ...cache.sequence_info import build_sequence_info
from ...utils.logging import get_logger
from ...utils.memory import free_memory_bytes, measure_peak
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

logger = get_logger(__name__)


class ResizeKVCacheConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    expect_mem_change: bool = True
    free_mem_ratio: float = Field(default=0.5, gt=0.0, le=0.95, description="Share of free memory the pool may take.")


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
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True)
        info = sizing_step(cache)
        with torch.inference_mode(), measure_peak(cache.device) as peak:
            gm(*cache.graph_args(info))
        forward_peak = peak[0]
        if getattr(cache, "fixed_size", False):
            logger.info("KV cache kept at %d pages (fixed); sizing forward peak %.1f MiB", cache.num_pages,
                        forward_peak / 2**20)
            return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
        free = free_memory_bytes(cache.device) + cache.cache_bytes()  # the sizing pool is given back
        budget = int(cfg.free_mem_ratio * max(0, free - forward_peak))
        affordable = budget // max(1, cache.bytes_per_page())
        pages = max(cache.min_pages, min(cache.useful_pages, affordable))
        cache.allocate(pages)
        logger.info(
            "KV cache resized to %d pages (%.1f MiB): free %.0f MiB, forward peak %.1f MiB, useful max %d pages",
            pages, cache.cache_bytes() / 2**20, free / 2**20, forward_peak / 2**20, cache.useful_pages,
        )
        return TransformInfo(num_matches=1, is_clean=True, has_valid_shapes=True)
