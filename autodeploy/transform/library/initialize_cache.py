"""``initialize_cache`` (cache_init): allocate the caches the cached ops read and write.

Before: cache inputs registered by ``insert_cached_*`` but no tensors.
After: one ``[num_pages, page_size, ...]`` tensor per paged cache input and one
``[max_batch_size + 1, ...]`` tensor per state cache input, zeroed, on the device (and one
``[max_num_tokens, ...]`` tensor per token buffer, e.g. captured hidden states). With
``num_pages`` unset the pool is just large enough for ``resize_kv_cache``'s sizing forward
(one step of ``max_num_tokens``), which then grows it; an unset ``max_batch_size`` is chosen
here for that pool (``autodeploy.cache.limits``) and again by ``resize_kv_cache``.
"""

from typing import Optional

from pydantic import Field
from torch import fx

from ...cache.limits import UNSIZED_STATE_BUDGET, auto_batch_size
from ...utils.errors import ConfigError
from ...utils.logging import get_logger
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

logger = get_logger(__name__)


class InitializeCacheConfig(TransformConfig):
    stage: Stage = Stage.CACHE_INIT
    expect_mem_change: bool = True
    num_pages: Optional[int] = Field(
        default=None, ge=1, description="Fixed pool size in pages (resize_kv_cache then keeps it)."
    )


def sizing_pages(cache) -> int:
    """Pages for one step of max_num_tokens spread over max_seq_len-long sequences."""
    tokens = cache.max_num_tokens
    sequences = -(-tokens // cache.max_seq_len)
    return max(cache.min_pages, -(-tokens // cache.page_size) + sequences)


def too_few_pages_error(num_pages: int, cache) -> ConfigError:
    """A fixed pool that cannot hold one sequence of max_seq_len is the user's setting, not a bug:
    say which settings to change and to what."""
    fits = num_pages * cache.page_size
    return ConfigError(
        f"transforms.initialize_cache.num_pages is {num_pages}, but one sequence of max_seq_len={cache.max_seq_len} "
        f"tokens needs {cache.min_pages} pages of {cache.page_size} tokens; set num_pages to at least "
        f"{cache.min_pages}, lower max_seq_len to at most {fits}, or leave num_pages unset to size the pool "
        "from free memory"
    )


@TransformRegistry.register("initialize_cache")
class InitializeCache(BaseTransform):
    config_class = InitializeCacheConfig
    requires = ("insert_cached_attention|transformers_replace_cached_attn",)

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        cfg: InitializeCacheConfig = self.config  # type: ignore[assignment]
        cache = ctx.cache
        if cache is None or not cache.handlers:
            return TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True, reason="no cache inputs")
        if cfg.num_pages is not None and cfg.num_pages < cache.min_pages:
            raise too_few_pages_error(cfg.num_pages, cache)
        pages = cfg.num_pages if cfg.num_pages is not None else sizing_pages(cache)
        if ctx.auto_batch_size and cache.state_names:
            # state slots cost memory per slot: allocate what the sizing step needs, not the cap
            cache.max_batch_size = -(-cache.max_num_tokens // cache.max_seq_len)
        cache.allocate(pages)
        cache.fixed_size = cfg.num_pages is not None
        if ctx.auto_batch_size:  # resize_kv_cache chooses again for the pool it makes
            cache.max_batch_size = ctx.max_batch_size = auto_batch_size(cache, UNSIZED_STATE_BUDGET)
        logger.info(
            "KV cache: %d pages x %d tokens, %.1f MiB; state caches: %d slots, %.1f MiB; token buffers: %.1f MiB "
            "(%d cache tensors)", pages, cache.page_size, cache.paged_bytes() / 2**20, cache.num_slots,
            cache.state_bytes() / 2**20, cache.buffer_bytes() / 2**20, len(cache.caches),
        )
        return TransformInfo(num_matches=len(cache.caches), is_clean=True, has_valid_shapes=True)
