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


def _rss_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_large_cpu_pool_is_zero_without_being_written_at_build(weights_graph):
    """Issue 21: a CPU pool of MiBs is anonymous memory the kernel zeroes on first touch, so the
    build neither writes nor faults in its pages (``torch.zeros`` did both: 2-3 s for the default
    4 GiB pool of ``small``). 4 caches of 16384 pages x 2 KiB = 128 MiB; the resize must not make
    them resident, reading them gives zeros (the shared zero page), and the graph writes them."""
    ctx = PipelineContext(page_size=16, max_seq_len=4096, max_batch_size=64, max_num_tokens=24)
    gm = build_transform("insert_cached_attention", {"backend": "sdpa"})(copy.deepcopy(weights_graph), ctx)
    gm = build_transform("initialize_cache", {})(gm, ctx)
    before = _rss_bytes()
    gm = build_transform("resize_kv_cache", {})(gm, ctx)
    grown = _rss_bytes() - before
    cache = ctx.cache
    pool = cache.paged_bytes()
    assert cache.num_pages == cache.useful_pages == 64 * 256 and pool == 128 * 2**20
    assert grown < pool // 4, f"the resize made {grown / 2**20:.0f} MiB resident for a {pool / 2**20:.0f} MiB pool"
    before = _rss_bytes()
    _zeroed_and_shaped(cache)
    assert _rss_bytes() - before < pool // 4  # reading untouched pages maps nothing
    last = cache.num_pages - 1
    with torch.no_grad():
        gm(*cache.graph_args(build_sequence_info([[3, 4, 5]], [0], [[last]])))
    assert cache.caches["k_cache_0"][last, :3].abs().sum() > 0 and cache.caches["k_cache_0"][last, 3:].abs().sum() == 0


def test_lazily_zeroed_pool_computes_what_a_written_zero_pool_does(weights_graph):
    """The same prefill + decode steps on the mapped pool and on ``torch.zeros`` copies of it
    give bit-identical logits and cache contents."""
    ctx = PipelineContext(page_size=16, max_seq_len=4096, max_batch_size=64, max_num_tokens=24)
    gm = build_transform("insert_cached_attention", {"backend": "sdpa"})(copy.deepcopy(weights_graph), ctx)
    gm = build_transform("initialize_cache", {})(gm, ctx)
    gm = build_transform("resize_kv_cache", {})(gm, ctx)
    cache = ctx.cache
    mapped = dict(cache.caches)
    written = {name: torch.zeros_like(t) for name, t in mapped.items()}
    ids, tables = [[7, 1, 9, 4, 2], [5, 3]], [[100, 101], [16383]]
    results = []
    for caches in (mapped, written):
        cache.caches = caches
        with torch.no_grad():
            prefill = gm(*cache.graph_args(build_sequence_info(ids, [0, 0], tables)))
            decode = gm(*cache.graph_args(build_sequence_info([[6], [8]], [5, 2], tables)))
        results.append((prefill, decode, {n: t[[100, 101, 16383]].clone() for n, t in caches.items()}))
    (p0, d0, c0), (p1, d1, c1) = results
    assert torch.equal(p0, p1) and torch.equal(d0, d1)
    assert all(torch.equal(c0[n], c1[n]) for n in c0)
    assert any(c0[n].abs().sum() > 0 for n in c0)  # the steps did write the pool


RESIZED = "autodeploy.transform.library.resize_kv_cache"


def _plan_of(ctx):
    return ctx.cache.num_pages, ctx.cache.max_batch_size, ctx.cache.max_seq_len


def test_sizing_forward_is_skipped_when_the_cpu_cap_decides(weights_graph, caplog):
    """Issue 21: with the 4 GiB CPU cap binding even for the graph's peak bound, the forward (a
    max_num_tokens prefill, 2-3 s of small's build) is not run, and the pool, batch size and
    max_seq_len are those of the measured path (``sizing_forward: always``). Unset max_batch_size
    (chosen from the pool) and a token budget of 64 over max_seq_len 4096."""
    settings = dict(page_size=16, max_seq_len=4096, max_batch_size=None, max_num_tokens=64)
    results = {}
    for mode in ("auto", "always"):
        ctx = PipelineContext(**{**settings, "max_batch_size": 256}, auto_batch_size=True)
        gm = build_transform("insert_cached_attention", {"backend": "sdpa"})(copy.deepcopy(weights_graph), ctx)
        gm = build_transform("initialize_cache", {})(gm, ctx)
        caplog.clear()
        with caplog.at_level("INFO", logger=RESIZED):
            build_transform("resize_kv_cache", {"sizing_forward": mode})(gm, ctx)
        results[mode] = (_plan_of(ctx), caplog.text)
    assert results["auto"][0] == results["always"][0]
    assert "so the forward was not run" in results["auto"][1]
    assert "so the forward was not run" not in results["always"][1] and "forward peak <=" not in results["always"][1]


def test_sizing_forward_runs_when_the_peak_can_matter(weights_graph, caplog):
    """Near miss: without the CPU cap the budget is a share of free memory minus the peak, so the
    peak must be measured."""
    with caplog.at_level("INFO", logger=RESIZED):
        _, ctx, _ = _pipeline(weights_graph, resize={"cpu_max_cache_gb": None})
    assert "so the forward was not run" not in caplog.text and "forward peak <=" not in caplog.text
    assert ctx.cache.num_pages == ctx.cache.useful_pages


def test_peak_bound_covers_the_measured_peak_and_needs_every_shape(weights_graph):
    """The bound is at least the measured peak of the sizing step and grows with the step; a graph
    that cannot be propagated (here: a cache input missing) gives no bound, so the forward runs."""
    from autodeploy.transform.library.resize_kv_cache import forward_peak_bound, sizing_step
    from autodeploy.utils.memory import measure_peak

    ctx = PipelineContext(page_size=16, max_seq_len=512, max_batch_size=4, max_num_tokens=512)
    gm = build_transform("insert_cached_attention", {"backend": "sdpa"})(copy.deepcopy(weights_graph), ctx)
    gm = build_transform("initialize_cache", {})(gm, ctx)
    args = ctx.cache.graph_args(sizing_step(ctx.cache))
    bound = forward_peak_bound(gm, args)
    with torch.inference_mode(), measure_peak(ctx.cache.device) as peak:
        gm(*args)
    # (the measured peak can read 0 in a long test process that reuses freed memory)
    assert bound is not None and bound > 0 and peak[0] <= bound
    # the bound grows with the step: the same graph at 4x the tokens
    bigger = forward_peak_bound(gm, ctx.cache.graph_args(build_sequence_info([[0] * 2048], [0], [list(range(128))])))
    assert bigger > 3 * bound
    # one input short (the last cache): the graph cannot be propagated, so no bound and the forward runs
    assert forward_peak_bound(gm, args[:-1]) is None


def test_peak_bound_leaves_the_graph_values_alone(weights_graph):
    """The bound runs the graph on fake tensors of the step's static shapes; the nodes keep their
    own (symbolic) values, which later shape propagation and transforms read."""
    from autodeploy.transform.graph_utils import run_shape_prop
    from autodeploy.transform.library.resize_kv_cache import forward_peak_bound, sizing_step

    ctx = PipelineContext(page_size=16, max_seq_len=512, max_batch_size=4, max_num_tokens=512)
    gm = build_transform("insert_cached_attention", {"backend": "sdpa"})(copy.deepcopy(weights_graph), ctx)
    gm = build_transform("initialize_cache", {})(gm, ctx)
    run_shape_prop(gm)
    before = {n: n.meta.get("val") for n in gm.graph.nodes}
    assert forward_peak_bound(gm, ctx.cache.graph_args(sizing_step(ctx.cache))) is not None
    assert all(n.meta.get("val") is before[n] for n in gm.graph.nodes)


@pytest.mark.parametrize("prefix_caching, snapshots", [(True, None), (True, 5), (False, None)])
def test_state_copies_of_prefix_caching_come_out_of_the_budget(prefix_caching, snapshots):
    """A state model whose states decide the batch cap (Mamba2, a 1 MiB budget, ~20 KiB a
    state): its slots, the spare and prefix caching's copies of states all fit in the budget,
    and the cap is the largest that does (without copies it is one state less than the budget)."""
    from autodeploy.cache.limits import snapshot_capacity
    from helpers import coverage_checkpoint

    budget = 2**20
    result = build(coverage_checkpoint("mamba2")[0], up_to=Stage.CACHE_INIT, enable_prefix_caching=prefix_caching,
                   prefix_state_snapshots=snapshots,
                   overrides={"resize_kv_cache": {"cpu_max_cache_gb": budget / 2**30}})
    ctx, cache = result.context, result.context.cache
    assert ctx.state_snapshots == (snapshots if prefix_caching else 0)
    per_state = cache.state_bytes_per_sequence()

    def states(batch):  # running slots, the spare, the copies
        return batch + 1 + (snapshot_capacity(ctx.state_snapshots, batch) if prefix_caching else 0)

    batch = cache.max_batch_size
    assert cache.state_bytes() == (batch + 1) * per_state
    assert states(batch) * per_state <= budget < states(batch + 1) * per_state
    assert batch == {(True, None): budget // per_state - 17, (True, 5): budget // per_state - 6,
                     (False, None): budget // per_state - 1}[(prefix_caching, snapshots)]
