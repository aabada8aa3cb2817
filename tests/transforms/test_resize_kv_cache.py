"""resize_kv_cache (cache_init): grow the sizing pool to what memory allows, capped at useful_pages.

On a CPU host the free RAM dwarfs a tiny model's cache, so the default ratio reaches the
useful_pages cap; a tiny ratio leaves exactly min_pages; an explicit num_pages is kept.
"""

import copy

import pytest
import torch

from autodeploy.cache import build_sequence_info
from autodeploy.transform.interface import PipelineContext, Stage
from autodeploy.transform.optimizer import build_transform
from autodeploy.utils.errors import ConfigError
from helpers import build, family_checkpoint, rel_rmse

N_KV, HEAD_DIM, NUM_LAYERS = 2, 16, 2


@pytest.fixture(scope="module")
def weights_graph():
    return build(family_checkpoint("llama"), up_to=Stage.WEIGHT_LOAD).graph


def _pipeline(gm, *, init=None, resize=None, page_size=4, max_seq_len=30, max_batch_size=3, max_num_tokens=24):
    ctx = PipelineContext(page_size=page_size, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                          max_num_tokens=max_num_tokens)
    gm = build_transform("insert_cached_attention", {"backend": "sdpa"})(copy.deepcopy(gm), ctx)
    gm = build_transform("initialize_cache", init or {})(gm, ctx)
    sizing = ctx.cache.num_pages
    gm = build_transform("resize_kv_cache", resize or {})(gm, ctx)
    return gm, ctx, sizing


def _zeroed_and_shaped(cache):
    for t in cache.caches.values():
        assert t.shape == (cache.num_pages, cache.page_size, N_KV, HEAD_DIM)
        assert (t == 0).all()


def test_grows_to_useful_pages(weights_graph):
    gm, ctx, sizing = _pipeline(weights_graph)
    cache = ctx.cache
    assert cache.pages_per_sequence == 8 and cache.useful_pages == 24 and cache.min_pages == 8  # ceil(30/4)
    assert sizing < cache.useful_pages  # there was something to grow
    assert cache.num_pages == cache.useful_pages
    assert ctx.history[-1].key == "resize_kv_cache" and ctx.history[-1].num_matches == 1
    _zeroed_and_shaped(cache)


def test_resized_pool_is_what_the_graph_uses(weights_graph):
    gm, ctx, sizing = _pipeline(weights_graph)
    cache = ctx.cache
    assert cache.num_pages == cache.useful_pages > sizing  # the last page exists only in the grown pool
    last = cache.num_pages - 1
    info = build_sequence_info([[3, 4, 5]], [0], [[last]])
    with torch.no_grad():
        gm(*cache.graph_args(info))
    assert cache.caches["v_cache_1"][last, :3].abs().sum() > 0
    assert cache.caches["v_cache_1"][last, 3:].abs().sum() == 0


def test_tiny_free_mem_ratio_gives_min_pages(weights_graph):
    """A token budget above max_seq_len makes the sizing pool bigger than min_pages, so reaching
    min_pages is the resize's doing (the pool shrinks to one sequence)."""
    _, ctx, sizing = _pipeline(weights_graph, resize={"free_mem_ratio": 1e-9}, max_seq_len=16, max_num_tokens=40)
    assert ctx.cache.min_pages == 4 and sizing > 4
    assert ctx.history[-1].key == "resize_kv_cache" and ctx.history[-1].num_matches == 1
    assert ctx.cache.num_pages == ctx.cache.min_pages
    _zeroed_and_shaped(ctx.cache)


@pytest.mark.parametrize("ratio", [1e-9, 0.5])
def test_pool_stays_between_min_and_useful(weights_graph, ratio):
    _, ctx, _ = _pipeline(weights_graph, resize={"free_mem_ratio": ratio}, max_batch_size=1, page_size=7)
    cache = ctx.cache
    assert ctx.history[-1].key == "resize_kv_cache" and ctx.history[-1].num_matches == 1  # it chose the size
    assert cache.min_pages == cache.useful_pages == 5 == cache.num_pages


def test_explicit_num_pages_is_kept(weights_graph):
    gm, ctx, sizing = _pipeline(weights_graph, init={"num_pages": 11})
    cache = ctx.cache
    assert sizing == 11 and cache.fixed_size is True
    assert cache.num_pages == 11
    record = ctx.history[-1]
    assert record.key == "resize_kv_cache" and record.status == "ok" and record.num_matches == 0
    assert all(t.shape[0] == 11 for t in cache.caches.values())


def test_explicit_min_pool_with_large_token_budget_is_kept(weights_graph):
    # num_pages = min_pages is valid (one full sequence fits), but the sizing step's
    # max_num_tokens=24 over max_seq_len=8 sequences uses 3 sequences' worth of pages.
    _, ctx, _ = _pipeline(weights_graph, init={"num_pages": 2}, max_seq_len=8, max_num_tokens=24)
    assert ctx.cache.num_pages == 2
    record = ctx.history[-1]
    assert record.key == "resize_kv_cache" and record.status == "ok" and record.num_matches == 0


def test_free_mem_ratio_is_validated():
    for bad in (0.0, 0.99):
        with pytest.raises(ConfigError, match="resize_kv_cache.free_mem_ratio"):
            build_transform("resize_kv_cache", {"free_mem_ratio": bad})


def test_page_size_setting_through_the_pipeline():
    res = build(family_checkpoint("llama"), up_to=Stage.CACHE_INIT, page_size=8, max_seq_len=30, max_batch_size=3,
                max_num_tokens=16)
    cache = res.cache
    assert cache.page_size == 8 and cache.pages_per_sequence == 4 and cache.useful_pages == 12
    assert cache.num_pages == 12
    _zeroed_and_shaped(cache)
    assert {r.key: r.status for r in res.context.history}["resize_kv_cache"] == "ok"
    prepare = [n for n in res.graph.graph.nodes if n.op == "call_function"
               and n.target == torch.ops.autodeploy.torch_cached_attention_prepare_metadata.default]
    assert len(prepare) == 1 and prepare[0].args[-1] == 8
    # a step across a page boundary of 8 gives the same logits as a fresh two-page prefill
    ids = list(range(1, 11))
    with torch.no_grad():
        full = res.graph(*cache.graph_args(build_sequence_info([ids], [0], [[5, 2]])))[0]
        cache.allocate(cache.num_pages)
        res.graph(*cache.graph_args(build_sequence_info([ids[:9]], [0], [[7, 3]])))
        dec = res.graph(*cache.graph_args(build_sequence_info([ids[9:]], [9], [[7, 3]])))[0]
    assert rel_rmse(dec[0], full[-1]) < 1e-5
