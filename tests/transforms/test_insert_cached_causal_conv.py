"""insert_cached_causal_conv (cache_init): torch_causal_conv1d -> torch_cached_causal_conv1d with a
per-sequence conv window ``[slots, c, k - 1]``.

On a real tiny LFM2 (short-conv layers beside attention layers): the match count, the op swap,
numerics of the cached graph against the uncached graph run on each sequence alone (two
shapes, chunked prefill, decodes beside another sequence, a reused slot), and two near misses
(a graph without convs; a graph ``insert_cached_attention`` declared uncacheable).
"""

import pytest
import torch
from transformers import AutoConfig

from autodeploy.transform.interface import PipelineContext, Stage
from autodeploy.transform.optimizer import build_transform
from helpers import build, count_op, coverage_checkpoint, family_checkpoint
from state_cache_checks import LIMITS, build_cached, run_all, state_handlers

ad = torch.ops.autodeploy


@pytest.fixture(scope="module")
def lfm2():
    path, vocab = coverage_checkpoint("lfm2")
    return path, vocab, build_cached(path, vocab)


def _conv_layers(path):
    return AutoConfig.from_pretrained(path).layer_types.count("conv")


def test_every_conv_gets_a_state_cache(lfm2):
    path, _, c = lfm2
    n = _conv_layers(path)
    assert n >= 1
    record = next(r for r in c.context.history if r.key == "insert_cached_causal_conv")
    assert record.status == "ok" and record.num_matches == n
    assert count_op(c.graph, ad.torch_causal_conv1d) == 0
    assert count_op(c.graph, ad.torch_cached_causal_conv1d) == n
    handlers = state_handlers(c.cache, "conv_state")
    assert list(handlers) == [f"conv_state_{i}" for i in range(n)]
    config = AutoConfig.from_pretrained(path)
    hidden, kernel = config.hidden_size, config.conv_L_cache
    for h in handlers.values():
        assert h.shape == (hidden, kernel - 1) and h.dtype == torch.float32
    assert c.cache.caches["conv_state_0"].shape == (LIMITS["max_batch_size"] + 1, hidden, kernel - 1)
    # the attention layers still get paged KV caches next to it
    assert c.cache.paged_names and c.context.cache_mode is None  # recompute_fallback is off here


def test_cached_graph_equals_the_uncached_graph(lfm2):
    run_all(lfm2[2])


def test_a_graph_without_convs_is_left_alone():
    res = build(family_checkpoint("llama"), up_to=Stage.CACHE_INIT, max_seq_len=32, max_batch_size=2)
    record = next(r for r in res.context.history if r.key == "insert_cached_causal_conv")
    assert record.status == "skipped" and record.num_matches == 0
    assert not res.cache.state_names and res.context.cache_mode == "paged_kv"


def test_an_uncacheable_graph_is_left_for_recompute(lfm2):
    """Near miss: the same convs, but attention already said the graph cannot be cached."""
    path, _, _ = lfm2
    gm = build(path, up_to=Stage.WEIGHT_LOAD, **LIMITS).graph
    ctx = PipelineContext(max_batch_size=3, max_seq_len=32, max_num_tokens=32, page_size=4,
                          uncached_reason="attention has an explicit mask")
    before = count_op(gm, ad.torch_causal_conv1d)
    out = build_transform("insert_cached_causal_conv", {})(gm, ctx)
    assert before >= 1 and count_op(out, ad.torch_causal_conv1d) == before
    assert count_op(out, ad.torch_cached_causal_conv1d) == 0 and ctx.cache is None
    assert [p.name for p in out.graph.nodes if p.op == "placeholder"] == ["input_ids", "position_ids"]


def test_without_the_transform_the_consistency_check_falls_back_to_recompute(lfm2):
    """The safety net: an uncached conv in the flattened graph mixes sequences; the build-time
    check sees it and the model runs in recompute mode instead of answering wrongly."""
    path, _, _ = lfm2
    res = build(path, overrides={"insert_cached_causal_conv": {"enabled": False}}, **LIMITS)
    assert res.context.cache_mode == "recompute"
    assert "disagrees with itself" in res.context.recompute_reason
