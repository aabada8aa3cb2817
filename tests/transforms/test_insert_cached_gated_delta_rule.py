"""insert_cached_gated_delta_rule (cache_init): the gated delta rules -> their cached variants with an
fp32 ``[slots, h, dk, dv]`` state per sequence.

On real tiny Qwen3-Next (Gated DeltaNet, a decay per head) and Kimi-Linear (KDA, a decay per key
channel) checkpoints, hybrids with attention layers: match counts, the op swap, numerics of the
cached graph against the uncached one (two shapes, chunked prefill, decodes beside another
sequence, a reused slot), and a near miss (Mamba2: state ops, but no delta rule).
"""

import pytest
import torch

from autodeploy.transform.interface import Stage
from helpers import build, count_op, coverage_checkpoint
from state_cache_checks import LIMITS, build_cached, run_all, state_handlers

ad = torch.ops.autodeploy
FORMS = {
    "qwen3_next": (ad.torch_gated_delta_rule, ad.torch_cached_gated_delta_rule),
    "kimi_linear": (ad.torch_gated_delta_rule_channelwise, ad.torch_cached_gated_delta_rule_channelwise),
}


# Kimi-Linear's channel-wise form runs with -m slow (a 10 s build; its cached op has op tests in
# tests/ops/test_delta_rule_ops.py and the coverage sweep runs the model)
@pytest.fixture(scope="module", params=["qwen3_next", pytest.param("kimi_linear", marks=pytest.mark.slow)])
def model(request):
    path, vocab = coverage_checkpoint(request.param)
    return request.param, build_cached(path, vocab)


def _delta_layers(c):
    return [n for n in c.uncached.graph.nodes if n.op == "call_function"
            and getattr(n.target, "overloadpacket", None) in {ad.torch_gated_delta_rule,
                                                              ad.torch_gated_delta_rule_channelwise}]


def test_every_delta_rule_gets_an_fp32_state(model):
    family, c = model
    source, cached = FORMS[family]
    nodes = _delta_layers(c)
    assert nodes and all(n.target.overloadpacket is source for n in nodes)
    record = next(r for r in c.context.history if r.key == "insert_cached_gated_delta_rule")
    assert record.status == "ok" and record.num_matches == len(nodes)
    assert count_op(c.graph, source) == 0 and count_op(c.graph, cached) == len(nodes)
    handlers = state_handlers(c.cache, "delta_state")
    assert list(handlers) == [f"delta_state_{i}" for i in range(len(nodes))]
    for node, h in zip(nodes, handlers.values()):
        k, v = node.args[1].meta["val"], node.args[2].meta["val"]
        assert h.shape == (v.shape[2], k.shape[3], v.shape[3]) and h.dtype == torch.float32
    assert c.cache.paged_names  # the hybrid's attention layers keep their paged KV cache


def test_cached_graph_equals_the_uncached_graph(model):
    run_all(model[1])


def test_a_graph_without_delta_rules_is_left_alone():
    path, _ = coverage_checkpoint("mamba2")
    res = build(path, up_to=Stage.CACHE_INIT, **LIMITS)
    record = next(r for r in res.context.history if r.key == "insert_cached_gated_delta_rule")
    assert record.status == "skipped" and record.num_matches == 0
    assert not [n for n in res.cache.handlers if n.startswith("delta_state")]
