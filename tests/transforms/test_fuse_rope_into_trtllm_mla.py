"""fuse_rope_into_trtllm_mla (cache_init): the RoPE in front of a cached MLA op moves into it.

On a real tiny DeepSeek-V3 (interleaved RoPE) and DeepSeek-V2 (complex-frequency RoPE): the match
count, no RoPE node and no query concatenation left, the cached graph's logits equal the unfused
cached graph's at two shapes (a prefill then decodes), and a RoPE output with another reader is
left alone.
"""

import copy
import operator

import pytest
import torch

from autodeploy.ops.rope import ROPE_COMPLEX, ROPE_INTERLEAVED
from autodeploy.utils.fx import copy_graph_module
from autodeploy.transform.optimizer import build_transform
from autodeploy.transform.interface import Stage
from helpers import MOE_FAMILIES, build, count_op, moe_family_checkpoint, prefill_then_decode, rel_rmse

ad = torch.ops.autodeploy
aten = torch.ops.aten
LIMITS = dict(max_seq_len=32, max_num_tokens=32, max_batch_size=3, page_size=4)
ROPES = [ad.torch_rope_with_qk_interleaving, ad.torch_rope_with_explicit_cos_sin, ad.torch_rope_with_complex_freqs]
V2 = dict(MOE_FAMILIES["deepseek_v3"], model_type="deepseek_v2", topk_method="greedy", n_group=1, topk_group=1,
          first_k_dense_replace=1)
MODELS = {"deepseek_v3": (lambda: moe_family_checkpoint("deepseek_v3"), ROPE_INTERLEAVED),
          "deepseek_v2": (lambda: _v2_checkpoint(), ROPE_COMPLEX)}


def _v2_checkpoint():
    from helpers import _cached_checkpoint

    return _cached_checkpoint("moe-deepseek_v2", V2)


def _build(model, fused):
    return build(MODELS[model][0](), up_to=Stage.CACHE_INIT,
                 overrides={"resize_kv_cache": {"enabled": False}, "gather_logits_before_lm_head": {"enabled": False},
                            "fuse_rope_into_trtllm_mla": {"enabled": fused}}, **LIMITS)


# DeepSeek-V2's complex-frequency RoPE runs with -m slow (each model is two builds, ~8 s each)
@pytest.fixture(scope="module", params=[pytest.param("deepseek_v2", marks=pytest.mark.slow), "deepseek_v3"])
def pair(request):
    return request.param, _build(request.param, True), _build(request.param, False)


def _cached_mla(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == ad.sdpa_cached_mla_with_cache.default]


def test_structure(pair):
    model, fused, unfused = pair
    layers = MOE_FAMILIES["deepseek_v3"]["num_hidden_layers"]
    record = next(r for r in fused.context.history if r.key == "fuse_rope_into_trtllm_mla")
    assert record.status == "ok" and record.num_matches == layers
    assert count_op(unfused.graph, ROPES) == layers  # what the fusion found
    assert count_op(fused.graph, ROPES) == 0
    assert count_op(fused.graph, aten.cat) < count_op(unfused.graph, aten.cat)  # the query is no longer re-joined
    for node in _cached_mla(fused.graph):
        assert node.args[-1] == MODELS[model][1]
        cos, sin = node.args[13:15]
        if MODELS[model][1] == ROPE_COMPLEX:  # freqs_cis (optimize_rope does not tabulate complex RoPE)
            assert sin is None and cos.meta["val"].is_complex()
        else:  # the rows of the tables optimize_rope computed
            assert cos.target == sin.target == aten.embedding.default


@pytest.mark.parametrize("lengths", [(6,), (9, 3)])
def test_logits_equal_the_unfused_graph(pair, lengths):
    _, fused, unfused = pair
    vocab = MOE_FAMILIES["deepseek_v3"]["vocab_size"]
    gen = torch.Generator().manual_seed(sum(lengths))
    seqs = [torch.randint(0, vocab, (n + 3,), generator=gen).tolist() for n in lengths]
    assert rel_rmse(prefill_then_decode(fused, seqs, lengths), prefill_then_decode(unfused, seqs, lengths)) < 1e-6


def test_a_rope_output_with_another_reader_is_left_alone(pair):
    model, _, unfused = pair
    if model != "deepseek_v3":
        pytest.skip("one near-miss is enough")
    gm = copy_graph_module(unfused.graph)
    rope = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target in [r.default for r in ROPES])
    k_item = next(u for u in rope.users if u.target is operator.getitem and u.args[1] == 1)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        extra = gm.graph.call_function(aten.neg.default, (k_item,))
    output.args = ((*output.args[0], extra),) if isinstance(output.args[0], tuple) else ((output.args[0], extra),)
    gm.recompile()
    build_transform("fuse_rope_into_trtllm_mla", {})(gm, copy.copy(unfused.context))
    layers = MOE_FAMILIES["deepseek_v3"]["num_hidden_layers"]
    assert count_op(gm, ROPES) == 1  # that layer kept its RoPE node ...
    styles = [n.args[-1] if len(n.args) > 13 else -1 for n in _cached_mla(gm)]
    assert sorted(styles) == [-1] + [ROPE_INTERLEAVED] * (layers - 1)  # ... the other was fused
