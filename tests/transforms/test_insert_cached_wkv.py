"""insert_cached_wkv (cache_init): torch_wkv (RWKV-4's WKV, from the ``rwkv`` export patch) ->
torch_cached_wkv with an fp32 ``[slots, 3, c]`` state per sequence.

On a real tiny RWKV checkpoint (the coverage sweep's config): the match count, the op swap, the
token shifts on their one-token conv windows, numerics of the cached graph against the uncached
one (two shapes, chunked prefill, decodes beside another sequence, a reused slot), and a near miss
(RecurrentGemma: a conv and a recurrence, but no WKV).
"""

import pytest
import torch

from autodeploy.transform.interface import Stage
from helpers import build, count_op, coverage_checkpoint
from state_cache_checks import LIMITS, build_cached, run_all, state_handlers

ad = torch.ops.autodeploy


@pytest.fixture(scope="module")
def rwkv():
    path, vocab = coverage_checkpoint("rwkv")
    return build_cached(path, vocab)


def test_every_block_gets_an_fp32_wkv_state_and_two_shift_windows(rwkv):
    c = rwkv
    nodes = [n for n in c.uncached.graph.nodes if n.op == "call_function"
             and getattr(n.target, "overloadpacket", None) is ad.torch_wkv]
    layers = c.context.factory.config.num_hidden_layers  # type: ignore[union-attr]
    assert len(nodes) == layers > 0
    record = next(r for r in c.context.history if r.key == "insert_cached_wkv")
    assert record.status == "ok" and record.num_matches == layers
    assert count_op(c.graph, ad.torch_wkv) == 0 and count_op(c.graph, ad.torch_cached_wkv) == layers
    handlers = state_handlers(c.cache, "wkv_state")
    assert list(handlers) == [f"wkv_state_{i}" for i in range(layers)]
    for node, h in zip(nodes, handlers.values()):
        assert h.shape == (3, node.args[2].meta["val"].shape[-1]) and h.dtype == torch.float32
    assert count_op(c.graph, ad.torch_cached_causal_conv1d) == 2 * layers  # attention's and FFN's token shift
    assert not c.cache.paged_names  # no attention: state caches only


def test_cached_graph_equals_the_uncached_graph(rwkv):
    run_all(rwkv)


def test_a_graph_without_wkv_is_left_alone():
    path, _ = coverage_checkpoint("recurrent_gemma")
    res = build(path, up_to=Stage.CACHE_INIT, **LIMITS)
    record = next(r for r in res.context.history if r.key == "insert_cached_wkv")
    assert record.status == "skipped" and record.num_matches == 0
    assert not [n for n in res.cache.handlers if n.startswith("wkv_state")]
    assert [n for n in res.cache.handlers if n.startswith("recurrence_state")]  # its own state ops were cached
