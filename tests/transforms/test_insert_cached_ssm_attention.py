"""insert_cached_ssm_attention (cache_init): torch_ssm / torch_ssm_mamba1 -> their cached variants
with an fp32 SSM state per sequence.

On real tiny Mamba2 (SSD scan, ``[slots, heads, head_dim, state]``) and Mamba (Mamba1 scan,
``[slots, channels, state]``) checkpoints: match counts, the op swap, numerics of the cached graph
against the uncached one (two shapes, chunked prefill, decodes beside another sequence, a
reused slot), and a near miss (LFM2: convs but no scan).
"""

import pytest
import torch
from transformers import AutoConfig

from autodeploy.transform.interface import Stage
from helpers import build, count_op, coverage_checkpoint
from state_cache_checks import LIMITS, build_cached, run_all, state_handlers

ad = torch.ops.autodeploy
FORMS = {"mamba2": (ad.torch_ssm, ad.torch_cached_ssm), "mamba": (ad.torch_ssm_mamba1, ad.torch_cached_ssm_mamba1)}


@pytest.fixture(scope="module", params=sorted(FORMS))
def model(request):
    path, vocab = coverage_checkpoint(request.param)
    return request.param, AutoConfig.from_pretrained(path), build_cached(path, vocab)


def _state_shape(family, cfg):
    if family == "mamba2":
        return (cfg.num_heads, cfg.head_dim, cfg.state_size)
    return (cfg.intermediate_size, cfg.state_size)


def test_every_scan_gets_an_fp32_state(model):
    family, cfg, c = model
    source, cached = FORMS[family]
    layers = cfg.num_hidden_layers
    record = next(r for r in c.context.history if r.key == "insert_cached_ssm_attention")
    assert record.status == "ok" and record.num_matches == layers
    assert count_op(c.graph, source) == 0 and count_op(c.graph, cached) == layers
    handlers = state_handlers(c.cache, "ssm_state")
    assert list(handlers) == [f"ssm_state_{i}" for i in range(layers)]
    for h in handlers.values():
        assert h.shape == _state_shape(family, cfg) and h.dtype == torch.float32
    # the conv in front of each scan has its window; no attention, so no paged cache holds anything
    assert len(state_handlers(c.cache, "conv_state")) == layers
    assert c.cache.paged_names == [] and c.cache.bytes_per_page() == 0


def test_cached_graph_equals_the_uncached_graph(model):
    run_all(model[2])


def test_a_graph_with_convs_but_no_scan_is_left_alone():
    path, _ = coverage_checkpoint("lfm2")
    res = build(path, up_to=Stage.CACHE_INIT, **LIMITS)
    record = next(r for r in res.context.history if r.key == "insert_cached_ssm_attention")
    assert record.status == "skipped" and record.num_matches == 0
    assert not state_handlers(res.cache, "ssm_state")
    assert state_handlers(res.cache, "conv_state")
