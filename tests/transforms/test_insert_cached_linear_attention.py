"""insert_cached_linear_attention (cache_init): torch_linear_attention (MiniMax's lightning attention,
from the ``lightning_attention`` export patch) -> torch_cached_linear_attention with an fp32
``[slots, h, dk, dv]`` state per sequence.

On a real tiny MiniMax checkpoint (the coverage sweep's config: lightning layers beside full
attention layers and a MoE): the match count, the op swap, numerics of the cached graph against
the uncached one (two shapes, chunked prefill, decodes beside another sequence, a reused slot),
and a near miss (Qwen3-Next: delta-rule state ops, but no linear attention).
"""

import pytest
import torch

from autodeploy.transform.interface import Stage
from helpers import build, count_op, coverage_checkpoint
from state_cache_checks import LIMITS, build_cached, run_all, state_handlers

ad = torch.ops.autodeploy


@pytest.fixture(scope="module")
def minimax():
    path, vocab = coverage_checkpoint("minimax")
    return build_cached(path, vocab)


def test_every_lightning_layer_gets_an_fp32_state(minimax):
    c = minimax
    nodes = [n for n in c.uncached.graph.nodes if n.op == "call_function"
             and getattr(n.target, "overloadpacket", None) is ad.torch_linear_attention]
    linear_layers = c.context.factory.config.layer_types.count("linear_attention")  # type: ignore[union-attr]
    assert len(nodes) == linear_layers > 0
    record = next(r for r in c.context.history if r.key == "insert_cached_linear_attention")
    assert record.status == "ok" and record.num_matches == len(nodes)
    assert count_op(c.graph, ad.torch_linear_attention) == 0
    assert count_op(c.graph, ad.torch_cached_linear_attention) == len(nodes)
    handlers = state_handlers(c.cache, "linear_state")
    assert list(handlers) == [f"linear_state_{i}" for i in range(len(nodes))]
    for node, h in zip(nodes, handlers.values()):
        k, v = node.args[1].meta["val"], node.args[2].meta["val"]
        assert h.shape == (v.shape[2], k.shape[3], v.shape[3]) and h.dtype == torch.float32
    assert c.cache.paged_names  # the full-attention layers keep their paged KV cache


def test_cached_graph_equals_the_uncached_graph(minimax):
    run_all(minimax)


def test_a_graph_without_linear_attention_is_left_alone():
    path, _ = coverage_checkpoint("qwen3_next")
    res = build(path, up_to=Stage.CACHE_INIT, **LIMITS)
    record = next(r for r in res.context.history if r.key == "insert_cached_linear_attention")
    assert record.status == "skipped" and record.num_matches == 0
    assert not [n for n in res.cache.handlers if n.startswith("linear_state")]
    assert [n for n in res.cache.handlers if n.startswith("delta_state")]  # its own state ops were cached
