"""fuse_rope_into_trtllm_attention (cache_init): the RoPE in front of a cached attention op moves into it.

On real tiny Llama, Qwen3 (q/k norms before RoPE), Gemma and Phi-3 with partial rotary (half of
each head roped; the RoPE stays bnsd with slices and a concatenation around it): the match count,
no RoPE node left, the cached graph's logits equal the unfused cached graph's at two shapes (a
prefill, then decodes), and a RoPE output with another reader left alone. DeepSeek-style MLA has
its own fusion (test_fuse_rope_into_trtllm_mla.py).
"""

import operator

import pytest
import torch

from autodeploy.ops.rope import ROPE_ROTATE_HALF
from autodeploy.transform.interface import Stage
from autodeploy.transform.optimizer import build_transform
from autodeploy.utils.fx import copy_graph_module
from helpers import FAMILIES, _cached_checkpoint, build, count_op, prefill_then_decode, rel_rmse

ad = torch.ops.autodeploy
aten = torch.ops.aten
LIMITS = dict(max_seq_len=32, max_num_tokens=32, max_batch_size=3, page_size=4)
ROPES = [ad.torch_rope_with_qk_interleaving, ad.torch_rope_with_explicit_cos_sin, ad.torch_rope_with_complex_freqs]
CACHED = ad.sdpa_cached_attention_with_cache
MODELS = {"llama": (FAMILIES["llama"], 0), "qwen3": (FAMILIES["qwen3"], 0), "gemma": (FAMILIES["gemma"], 0),
          "phi3-partial": (dict(FAMILIES["phi3"], partial_rotary_factor=0.5), FAMILIES["phi3"]["head_dim"] // 2)}
LAYERS = FAMILIES["llama"]["num_hidden_layers"]


def _build(model, fused):
    checkpoint = _cached_checkpoint(f"rope-{model}", MODELS[model][0])
    return build(checkpoint, up_to=Stage.CACHE_INIT,
                 overrides={"resize_kv_cache": {"enabled": False}, "gather_logits_before_lm_head": {"enabled": False},
                            "fuse_rope_into_trtllm_attention": {"enabled": fused}}, **LIMITS)


# Phi-3 partial rotary (the slices and concatenation around a bnsd RoPE) runs by default; the plain
# bsnd case (Llama), Qwen3 and Gemma with -m slow (two builds each, ~6 s)
@pytest.fixture(scope="module", params=["phi3-partial", pytest.param("llama", marks=pytest.mark.slow),
                                        pytest.param("qwen3", marks=pytest.mark.slow),
                                        pytest.param("gemma", marks=pytest.mark.slow)])
def pair(request):
    return request.param, _build(request.param, True), _build(request.param, False)


def _cached(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == CACHED.default]


def test_structure(pair):
    model, fused, unfused = pair
    record = next(r for r in fused.context.history if r.key == "fuse_rope_into_trtllm_attention")
    assert record.status == "ok" and record.num_matches == LAYERS
    assert count_op(unfused.graph, ROPES) == LAYERS
    assert count_op(fused.graph, ROPES) == 0
    if model == "phi3-partial":  # the slices and the re-joining concatenations went with the RoPE
        assert count_op(fused.graph, aten.cat) < count_op(unfused.graph, aten.cat)
    for node in _cached(fused.graph):
        assert node.kwargs["rope_style"] == ROPE_ROTATE_HALF
        assert node.kwargs["rotary_dim"] == MODELS[model][1]
        assert node.kwargs["rope_cos"].target == node.kwargs["rope_sin"].target == aten.embedding.default


@pytest.mark.parametrize("lengths", [(6,), (9, 3)])
def test_logits_equal_the_unfused_graph(pair, lengths):
    _, fused, unfused = pair
    gen = torch.Generator().manual_seed(sum(lengths))
    seqs = [torch.randint(0, FAMILIES["llama"]["vocab_size"], (n + 3,), generator=gen).tolist() for n in lengths]
    assert rel_rmse(prefill_then_decode(fused, seqs, lengths), prefill_then_decode(unfused, seqs, lengths)) < 1e-6


def test_a_rope_output_with_another_reader_is_left_alone(pair):
    model, _, unfused = pair
    if model != "phi3-partial":
        pytest.skip("one near-miss is enough")
    gm = copy_graph_module(unfused.graph)
    rope = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target in [r.default for r in ROPES])
    k_item = next(u for u in rope.users if u.target is operator.getitem and u.args[1] == 1)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        extra = gm.graph.call_function(aten.neg.default, (k_item,))
    output.args = ((*output.args[0], extra),) if isinstance(output.args[0], tuple) else ((output.args[0], extra),)
    gm.recompile()
    build_transform("fuse_rope_into_trtllm_attention", {})(gm, unfused.context)
    assert count_op(gm, ROPES) == 1  # that layer kept its RoPE node ...
    fused = [n for n in _cached(gm) if "rope_style" in n.kwargs]
    assert len(fused) == LAYERS - 1  # ... the other was fused
