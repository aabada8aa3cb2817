"""``resize_kv_cache`` (cache_init): grow the page pool to a fraction of the free memory.

Before: the sizing pool from ``initialize_cache``. After: a pool of
``min(useful, budget / bytes_per_page)`` pages, where the budget is
``free_mem_ratio * (free - forward_peak)`` (on CPU at most ``cpu_max_cache_gb``), the forward
peak is measured by running one step of ``max_num_tokens`` tokens (CUDA: allocator peak and
``mem_get_info``; CPU: peak RSS and ``MemAvailable``), and ``useful`` is what ``max_batch_size``
sequences of ``max_seq_len`` tokens can ever hold. The budget also pays for the state caches: a
slot for each of ``max_batch_size`` sequences, the spare, and the copies prefix caching keeps of
states at page boundaries (``PipelineContext.state_snapshots``). A pool fixed by
``initialize_cache.num_pages`` is kept; the forward still runs as a check.

On CPU the forward is a prefill of ``max_num_tokens`` tokens (2-3 s of ``small``'s build), and
its peak (~90 MiB there) rarely matters: the pool is capped at ``cpu_max_cache_gb`` whenever
``free_mem_ratio * (free - peak)`` exceeds the cap. So first an upper bound of the peak is taken
from the graph itself: twice the bytes of every value it computes at the sizing step's shapes
(``forward_peak_bound``, a fake-tensor propagation; no value is freed in that sum, and the factor
covers the ops' own scratch). When the pool with the bound equals the pool with any smaller peak (the cap decides,
and one sequence of ``max_seq_len`` fits), the forward is not run (``sizing_forward: auto``);
``always`` runs it anyway.

Then the limits left to the pool are chosen (``autodeploy.cache.limits``): an unset
``max_batch_size`` from the sequences the pool holds; an unset ``max_seq_len`` (the model's own
limit) is lowered, with a warning, when the budget cannot hold one sequence that long. A
``max_seq_len`` the user set that does not fit is an error naming the numbers.
"""

from typing import Any, Dict, List, Literal, Optional, Tuple

import torch
import torch.utils._pytree as pytree
from pydantic import Field
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from ...cache.sequence_info import build_sequence_info
from ...utils.logging import get_logger
from ...utils.memory import free_memory_bytes, measure_peak
from ...cache.limits import (MAX_BATCH_SIZE_CAP, UNSIZED_STATE_BUDGET, auto_batch_size, batch_for_states,
                             snapshot_capacity)
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
    sizing_forward: Literal["auto", "always"] = Field(
        default="auto",
        description="auto: skip the sizing forward when an upper bound of its memory peak (from the graph's "
        "shapes) gives the same pool (on CPU, when cpu_max_cache_gb decides); always: run and measure it.",
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
        fixed = getattr(cache, "fixed_size", False)
        skip_allowed = not fixed and cfg.sizing_forward == "auto"
        bounded = self._peak_bound_if_decisive(gm, ctx, cache, info) if skip_allowed else None
        measured = bounded is None
        if bounded is not None:
            forward_peak, free = bounded
        else:
            with torch.inference_mode(), measure_peak(cache.device) as peak:
                gm(*cache.graph_args(info))
            forward_peak = peak[0]
            if fixed:
                logger.info("KV cache kept at %d pages (fixed); sizing forward peak %.1f MiB", cache.num_pages,
                            forward_peak / 2**20)
                choose_batch_size(ctx, cache)
                return TransformInfo(num_matches=0, is_clean=True, has_valid_shapes=True)
            free = _free_for_pool(cache)
        plan = _plan(cfg, ctx, cache, free, forward_peak)
        budget, state_budget, batch_bound = plan["budget"], plan["state_budget"], plan["batch_bound"]
        affordable = plan["affordable"]
        _fit_max_seq_len(ctx, cache, affordable, plan["page_budget"], max(0, free - forward_peak))
        # an unset max_batch_size is chosen from this pool, so the pool may hold as many as the bound
        pages = max(cache.min_pages, min(batch_bound * cache.pages_per_sequence, affordable))
        cache.allocate(pages)
        choose_batch_size(ctx, cache, state_budget)
        logger.info(
            "KV cache resized to %d pages (%.1f MiB, %d tokens of %d bytes; state caches %.1f MiB%s; token buffers "
            "%.1f MiB): free %.0f MiB, forward peak %s%.1f MiB%s, budget %.0f MiB, max_batch_size %d, max_seq_len %d",
            pages, cache.paged_bytes() / 2**20, pages * cache.page_size, cache.bytes_per_token(),
            cache.state_bytes() / 2**20, _copies_note(plan["copies"], cache),
            cache.buffer_bytes() / 2**20,
            free / 2**20, "" if measured else "<= ", forward_peak / 2**20, "" if measured else
            " (bound from the graph's shapes: the budget is the cap either way, so the forward was not run)",
            budget / 2**20, cache.max_batch_size, cache.max_seq_len,
        )
        return TransformInfo(num_matches=1, is_clean=True, has_valid_shapes=True)

    def _peak_bound_if_decisive(self, gm: fx.GraphModule, ctx: PipelineContext, cache,
                                info) -> Optional[Tuple[int, int]]:
        """``(peak bound, free memory)`` when the pool planned with the bound is the pool any smaller
        peak gives (the CPU cap decides and one max_seq_len sequence fits, so ``_fit_max_seq_len``
        changes nothing); else None: the forward runs and its peak is measured."""
        cfg: ResizeKVCacheConfig = self.config  # type: ignore[assignment]
        if cache.device.type != "cpu" or cfg.cpu_max_cache_gb is None:
            return None
        bound = forward_peak_bound(gm, cache.graph_args(info))
        if bound is None:
            return None
        free = _free_for_pool(cache)
        cap = int(cfg.cpu_max_cache_gb * 2**30)
        if int(cfg.free_mem_ratio * max(0, free - bound)) < cap:
            return None
        # the budget is the cap with the bound, so with any smaller peak: the same plan
        if _plan(cfg, ctx, cache, free, bound)["affordable"] < cache.min_pages:
            return None
        return bound, free


def _free_for_pool(cache) -> int:
    """Free memory plus what the sizing pool and states hold: they are given back and allocated
    again at their final sizes (token buffers stay allocated: their size is fixed, and the free
    memory already excludes them)."""
    return free_memory_bytes(cache.device) + cache.paged_bytes() + cache.state_bytes()


def _plan(cfg: ResizeKVCacheConfig, ctx: PipelineContext, cache, free: int, forward_peak: int) -> Dict[str, int]:
    """The budget and what it affords, for a forward peak: ``budget`` (all caches),
    ``state_budget``, ``batch_bound``, ``page_budget`` and ``affordable`` pages."""
    budget = int(cfg.free_mem_ratio * max(0, free - forward_peak))
    if cache.device.type == "cpu" and cfg.cpu_max_cache_gb is not None:
        budget = min(budget, int(cfg.cpu_max_cache_gb * 2**30))
    # state slots come out of the same budget: one per sequence that may run, the spare, and the
    # copies prefix caching keeps of them (ctx.state_snapshots)
    state_budget = max(0, budget - cache.min_pages * cache.bytes_per_page())
    batch_bound = MAX_BATCH_SIZE_CAP if ctx.auto_batch_size else cache.max_batch_size
    per_state = cache.state_bytes_per_sequence()
    if ctx.auto_batch_size and per_state:
        batch_bound = min(batch_bound, batch_for_states(state_budget // per_state, ctx.state_snapshots))
    copies = snapshot_capacity(ctx.state_snapshots, batch_bound) if per_state else 0
    page_budget = max(0, budget - (batch_bound + 1 + copies) * per_state)
    affordable = page_budget // max(1, cache.bytes_per_page())
    return dict(budget=budget, state_budget=state_budget, batch_bound=batch_bound, page_budget=page_budget,
                affordable=affordable, copies=copies)


# The bound is this many times the bytes of every value the graph computes: none of them is freed
# in the sum (the real peak holds a few layers' values at once), and the factor leaves as much again
# for what ops allocate inside and free before returning (attention scores, GEMM packing).
PEAK_BOUND_FACTOR = 2


def forward_peak_bound(gm: fx.GraphModule, args: List[Any]) -> Optional[int]:
    """An upper bound of the extra memory one call ``gm(*args)`` takes, from the graph's shapes:
    ``PEAK_BOUND_FACTOR`` times the bytes of every call's value, propagated with fake tensors of
    ``args``' exact shapes (0.1-0.2 s for ``small``, against 2-3 s for running it). None when
    that cannot be done (an op without a fake kernel, a data-dependent size): then only running
    the forward tells."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # the weights stay real; ops see fakes of them
    prop = _ValueBytes(gm)
    try:
        with mode:
            prop.run(*[mode.from_tensor(a, static_shapes=True) for a in args])
    except Exception as exc:  # noqa: BLE001 - no bound; the forward is measured, as it always was
        logger.debug("no peak bound for the sizing forward (%s: %s)", type(exc).__name__, exc)
        return None
    return PEAK_BOUND_FACTOR * prop.total


class _ValueBytes(fx.Interpreter):
    """Runs the graph (on fake tensors) and sums the bytes of every call's tensor values. A plain
    interpreter: ``FakeTensorProp`` would overwrite the nodes' ``meta['val']`` (the graph's
    symbolic shapes) with these static ones."""

    def __init__(self, module: fx.GraphModule):
        super().__init__(module)
        self.total = 0

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.op in ("call_function", "call_method"):
            for value in pytree.tree_leaves(result):
                if isinstance(value, torch.Tensor):
                    self.total += value.numel() * value.element_size()
        return result


def choose_batch_size(ctx: PipelineContext, cache, state_budget: Optional[int] = UNSIZED_STATE_BUDGET) -> None:
    """An unset max_batch_size becomes what the pool (and the state budget) holds
    (``autodeploy.cache.limits``)."""
    if ctx.auto_batch_size:
        cache.max_batch_size = ctx.max_batch_size = auto_batch_size(cache, state_budget, ctx.state_snapshots)


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


def _copies_note(copies: int, cache) -> str:
    if not copies:
        return ""
    return f" and {_size(copies * cache.state_bytes_per_sequence())} kept for {copies} state copies (prefix caching)"


def _size(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MiB" if num_bytes >= 2**20 else f"{num_bytes / 2**10:.1f} KiB"
