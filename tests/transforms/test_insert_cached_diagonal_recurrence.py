"""insert_cached_diagonal_recurrence (cache_init): torch_diagonal_recurrence (RecurrentGemma's RG-LRU
scan, from the ``rg_lru`` export patch) -> torch_cached_diagonal_recurrence with an fp32 ``[slots, w]``
state per sequence.

On a real tiny RecurrentGemma checkpoint (the coverage sweep's config: recurrent blocks beside
sliding-window attention): the match count, the op swap, the block's convolution on its own
window state, numerics of the cached graph against the uncached one (two shapes, chunked prefill,
decodes beside another sequence, a reused slot), and a near miss (MiniMax: state ops, but no
diagonal recurrence).
"""

import pytest
import torch

from autodeploy.transform.interface import Stage
from helpers import build, count_op, coverage_checkpoint
from state_cache_checks import LIMITS, build_cached, run_all, state_handlers

ad = torch.ops.autodeploy


@pytest.fixture(scope="module")
def recurrent_gemma():
    path, vocab = coverage_checkpoint("recurrent_gemma")
    return build_cached(path, vocab)


def test_every_recurrent_block_gets_an_fp32_state_and_a_conv_window(recurrent_gemma):
    c = recurrent_gemma
    nodes = [n for n in c.uncached.graph.nodes if n.op == "call_function"
             and getattr(n.target, "overloadpacket", None) is ad.torch_diagonal_recurrence]
    blocks = c.context.factory.config.layers_block_type.count("linear_attention")  # type: ignore[union-attr]
    assert len(nodes) == blocks > 0
    record = next(r for r in c.context.history if r.key == "insert_cached_diagonal_recurrence")
    assert record.status == "ok" and record.num_matches == len(nodes)
    assert count_op(c.graph, ad.torch_diagonal_recurrence) == 0
    assert count_op(c.graph, ad.torch_cached_diagonal_recurrence) == len(nodes)
    handlers = state_handlers(c.cache, "recurrence_state")
    assert list(handlers) == [f"recurrence_state_{i}" for i in range(len(nodes))]
    for node, h in zip(nodes, handlers.values()):
        assert h.shape == (node.args[0].meta["val"].shape[-1],) and h.dtype == torch.float32
    assert count_op(c.graph, ad.torch_cached_causal_conv1d) == blocks  # each block's short conv
    assert c.cache.paged_names  # the attention layers keep their paged KV cache


def test_cached_graph_equals_the_uncached_graph(recurrent_gemma):
    run_all(recurrent_gemma)


def test_a_graph_without_a_diagonal_recurrence_is_left_alone():
    path, _ = coverage_checkpoint("minimax")
    res = build(path, up_to=Stage.CACHE_INIT, **LIMITS)
    record = next(r for r in res.context.history if r.key == "insert_cached_diagonal_recurrence")
    assert record.status == "skipped" and record.num_matches == 0
    assert not [n for n in res.cache.handlers if n.startswith("recurrence_state")]
    assert [n for n in res.cache.handlers if n.startswith("linear_state")]  # its own state ops were cached
