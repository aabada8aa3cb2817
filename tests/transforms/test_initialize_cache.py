"""initialize_cache (cache_init): one zeroed paged cache per registered cache input.

The llama graph is built once up to weight_load; each test runs insert_cached_attention and
initialize_cache on its own copy with the limits it needs.
"""

import copy

import pytest
import torch

from autodeploy.cache import CachedSequenceInterface, build_sequence_info
from autodeploy.transform.interface import PipelineContext, Stage
from autodeploy.transform.library.resize_kv_cache import sizing_step
from autodeploy.transform.optimizer import build_transform
from autodeploy.utils.errors import ConfigError
from helpers import build, family_checkpoint

N_KV, HEAD_DIM, NUM_LAYERS = 2, 16, 2


@pytest.fixture(scope="module")
def weights_graph():
    return build(family_checkpoint("llama"), up_to=Stage.WEIGHT_LOAD).graph


def _cache_init(gm, *, dtype=torch.float32, page_size=4, max_seq_len=32, max_batch_size=3, max_num_tokens=32,
                **init):
    ctx = PipelineContext(dtype=dtype, page_size=page_size, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
                          max_num_tokens=max_num_tokens)
    gm = build_transform("insert_cached_attention", {"backend": "sdpa"})(copy.deepcopy(gm), ctx)
    gm = build_transform("initialize_cache", init)(gm, ctx)
    return gm, ctx


def test_one_zeroed_cache_per_registered_input(weights_graph):
    gm, ctx = _cache_init(weights_graph)
    cache = ctx.cache
    record = ctx.history[-1]
    assert record.key == "initialize_cache" and record.status == "ok" and record.num_matches == 2 * NUM_LAYERS
    assert list(cache.caches) == cache.cache_names == [f"{kind}_{i}" for i in range(NUM_LAYERS)
                                                       for kind in ("k_cache", "v_cache")]
    assert cache.num_pages >= cache.min_pages == 8
    storages = set()
    for name, t in cache.caches.items():
        assert t.shape == (cache.num_pages, 4, N_KV, HEAD_DIM), name
        assert t.dtype == torch.float32 and t.device.type == "cpu"
        assert (t == 0).all()
        storages.add(t.untyped_storage().data_ptr())
    assert len(storages) == 2 * NUM_LAYERS  # no two inputs share memory
    assert cache.fixed_size is False
    assert cache.cache_bytes() == cache.num_pages * cache.bytes_per_page()


def test_sizing_pool_holds_the_sizing_step(weights_graph):
    """Without num_pages the pool must at least fit resize_kv_cache's one max_num_tokens step."""
    gm, ctx = _cache_init(weights_graph, max_seq_len=16, max_num_tokens=40, page_size=4)
    cache = ctx.cache
    info = sizing_step(cache)
    assert info.num_tokens == 40
    assert cache.num_pages > int(info.page_table.max())
    with torch.no_grad():
        out = gm(*cache.graph_args(info))
    assert out.shape[:2] == (1, 40) and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_caches_use_the_context_dtype(weights_graph, dtype):
    _, ctx = _cache_init(weights_graph, dtype=dtype)
    assert {t.dtype for t in ctx.cache.caches.values()} == {dtype}
    assert ctx.cache.bytes_per_page() == 2 * NUM_LAYERS * 4 * N_KV * HEAD_DIM * 2


def test_explicit_num_pages_is_honoured(weights_graph):
    gm, ctx = _cache_init(weights_graph, num_pages=13)
    cache = ctx.cache
    assert cache.num_pages == 13 and cache.fixed_size is True
    assert all(t.shape == (13, 4, N_KV, HEAD_DIM) for t in cache.caches.values())
    # the graph runs on the allocated pool, writing into the last page
    info = build_sequence_info([[1, 2, 3, 4, 5]], [0], [[12, 0]])
    with torch.no_grad():
        gm(*cache.graph_args(info))
    assert cache.caches["k_cache_0"][12].abs().sum() > 0
    assert cache.caches["k_cache_0"][1:12].abs().sum() == 0


@pytest.mark.parametrize("page_size, expected_min", [(1, 32), (5, 7), (64, 1)])
def test_page_size_sets_geometry(weights_graph, page_size, expected_min):
    _, ctx = _cache_init(weights_graph, page_size=page_size, num_pages=expected_min)
    cache = ctx.cache
    assert cache.page_size == page_size and cache.min_pages == expected_min
    assert all(t.shape == (expected_min, page_size, N_KV, HEAD_DIM) for t in cache.caches.values())


def test_pool_smaller_than_one_sequence_is_rejected(weights_graph):
    # the user's setting, so a ConfigError that says what to set (tests/cli/test_cli_errors.py)
    with pytest.raises(ConfigError, match=r"num_pages is 7, but one sequence of max_seq_len=32 .* at least 8"):
        _cache_init(weights_graph, num_pages=7)  # 32 tokens need 8 pages of 4


def test_interface_allocate_rejects_too_few_pages():
    cache = CachedSequenceInterface(page_size=16, max_batch_size=2, max_seq_len=100, max_num_tokens=100)
    assert cache.min_pages == 7 and cache.useful_pages == 14
    with pytest.raises(ValueError, match="max_seq_len=100"):
        cache.allocate(6)
    cache.allocate(7)
    assert cache.num_pages == 7


def test_num_pages_must_be_positive():
    with pytest.raises(ConfigError, match="initialize_cache.num_pages"):
        build_transform("initialize_cache", {"num_pages": 0})


def test_no_cache_inputs_is_skipped():
    ctx = PipelineContext()
    from torch import fx, nn

    gm = fx.symbolic_trace(nn.Linear(2, 2))
    out = build_transform("initialize_cache", {})(gm, ctx)
    assert out is gm and ctx.history[-1].status == "skipped" and ctx.cache is None
