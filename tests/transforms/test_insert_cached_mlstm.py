"""insert_cached_mlstm (cache_init): torch_mlstm (the lean custom xLSTM's mLSTM) ->
torch_cached_mlstm with a packed fp32 ``[slots, nh, dqk + 1, dv + 1]`` C/n/m state per sequence.

On a real tiny xLSTM checkpoint (the coverage sweep's config): the match count, the op swap, the
state's shape, numerics of the cached graph against the uncached one (two shapes, chunked prefill,
decodes beside another sequence, a reused slot), and a near miss (RWKV: state ops, but no mLSTM).
"""

import pytest
import torch

from autodeploy.transform.interface import Stage
from helpers import build, count_op, coverage_checkpoint
from state_cache_checks import LIMITS, build_cached, run_all, state_handlers

ad = torch.ops.autodeploy


@pytest.fixture(scope="module")
def xlstm():
    path, vocab = coverage_checkpoint("xlstm")
    return build_cached(path, vocab)


def test_every_mlstm_layer_gets_a_packed_fp32_state(xlstm):
    c = xlstm
    nodes = [n for n in c.uncached.graph.nodes if n.op == "call_function"
             and getattr(n.target, "overloadpacket", None) is ad.torch_mlstm]
    layers = c.context.factory.config.num_hidden_layers  # type: ignore[union-attr]
    assert len(nodes) == layers > 0
    record = next(r for r in c.context.history if r.key == "insert_cached_mlstm")
    assert record.status == "ok" and record.num_matches == layers
    assert count_op(c.graph, ad.torch_mlstm) == 0 and count_op(c.graph, ad.torch_cached_mlstm) == layers
    handlers = state_handlers(c.cache, "mlstm_state")
    assert list(handlers) == [f"mlstm_state_{i}" for i in range(layers)]
    for node, h in zip(nodes, handlers.values()):
        q, v = node.args[0].meta["val"], node.args[2].meta["val"]
        assert h.shape == (q.shape[2], q.shape[3] + 1, v.shape[3] + 1) and h.dtype == torch.float32
    assert not c.cache.paged_names  # no attention: the state caches only


def test_cached_graph_equals_the_uncached_graph(xlstm):
    run_all(xlstm)


def test_a_graph_without_mlstm_is_left_alone():
    path, _ = coverage_checkpoint("rwkv")
    res = build(path, up_to=Stage.CACHE_INIT, **LIMITS)
    record = next(r for r in res.context.history if r.key == "insert_cached_mlstm")
    assert record.status == "skipped" and record.num_matches == 0
    assert not [n for n in res.cache.handlers if n.startswith("mlstm_state")]
    assert [n for n in res.cache.handlers if n.startswith("wkv_state")]  # its own state ops were cached
