"""fuse_trtllm_attn_quant_fp8 (post_load_fusion): the attention emits the FP8 input of o_proj.

On a ModelOpt FP8 Llama written by ``tests/quant_checkpoints.py``: one match per layer, every
attention carrying ``out_scale`` and the o_proj quantization gone, logits equal to the unfused
graph (bit for bit) and to the float reference at two shapes; the cached graphs (the sdpa and the
torch backend) equal the unfused cached graph over a prefill and decodes. Near misses: an
attention output with another reader, NVFP4 (its activations are not one static scale), a float
checkpoint.
"""

import copy

import pytest
import torch

import quant_checkpoints as qc
from autodeploy.transform.interface import Stage
from helpers import apply_transform, build, count_op, graph_logits, prefill_then_decode, rel_rmse

ad = torch.ops.autodeploy
KEY = "fuse_trtllm_attn_quant_fp8"
LAYERS = qc.TINY["num_hidden_layers"]
LIMITS = dict(max_seq_len=32, max_num_tokens=32, max_batch_size=3, page_size=4)
_BUILDS = {}


def _fused_linears(fmt: str = "fp8"):
    """The graph after the post_load_fusion stage with this transform off (built once)."""
    if fmt not in _BUILDS:
        off = {KEY: {"enabled": False}, "select_linear_backend": {"enabled": False}}  # packed weights do not copy
        _BUILDS[fmt] = build(qc.quantized_checkpoint("llama", fmt), up_to=Stage.POST_LOAD_FUSION, overrides=off,
                             max_seq_len=64, max_batch_size=2).graph
    return copy.deepcopy(_BUILDS[fmt])


def _attention(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == ad.torch_attention.default]


def test_the_attention_takes_the_o_proj_scale():
    before = _fused_linears()
    gm, record = apply_transform(KEY, copy.deepcopy(before))
    assert record.num_matches == LAYERS  # (a)
    activations = count_op(before, ad.torch_quant_fp8_activation)
    assert count_op(gm, ad.torch_quant_fp8_activation) == activations - LAYERS  # (b) o_proj's went
    for i, attn in enumerate(_attention(gm)):
        assert str(attn.kwargs["out_scale"].target) == f"model.layers.{i}.self_attn.o_proj.input_scale"
    ref = qc.reference_model("llama", "fp8")
    for b, s in ((1, 7), (3, 4)):  # (c) bit-equal to the unfused graph, and the float reference
        ids = torch.randint(0, 512, (b, s))
        fused = graph_logits(gm, ids)
        assert torch.equal(fused, graph_logits(before, ids))
        with torch.no_grad():
            assert rel_rmse(fused, ref(ids).logits) < 1e-5


def test_an_attention_output_with_another_reader_is_left_alone():
    gm = _fused_linears()
    attn = _attention(gm)[0]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(output):
        extra = gm.graph.call_function(torch.ops.aten.sum.default, (attn,))
    output.args = ((output.args[0][0] if isinstance(output.args[0], tuple) else output.args[0], extra),)
    gm.recompile()
    gm, record = apply_transform(KEY, gm)
    assert record.num_matches == LAYERS - 1  # (d) layer 0 keeps its separate quantization
    assert "out_scale" not in _attention(gm)[0].kwargs and "out_scale" in _attention(gm)[1].kwargs


@pytest.mark.parametrize("fmt", ["nvfp4"])
def test_other_activation_quantizations_are_left_alone(fmt):
    gm = _fused_linears(fmt)
    gm, record = apply_transform(KEY, gm)
    assert record.num_matches == 0 and not any("out_scale" in a.kwargs for a in _attention(gm))


def _cached(fused: bool, backend: str):
    return build(qc.quantized_checkpoint("llama", "fp8"), up_to=Stage.CACHE_INIT,
                 overrides={"resize_kv_cache": {"enabled": False}, "gather_logits_before_lm_head": {"enabled": False},
                            KEY: {"enabled": fused}, "insert_cached_attention": {"backend": backend}}, **LIMITS)


# ~9 s each (two cached builds): -m slow; in the default run the engine's greedy tokens for the FP8
# Llama (test_quantized_loading.py) go through the sdpa op with out_scale
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sdpa", "torch"])
def test_the_cached_op_rounds_its_output_like_the_unfused_graph(backend):
    fused, unfused = _cached(True, backend), _cached(False, backend)
    cached = [n for n in fused.graph.graph.nodes if n.op == "call_function" and "cached_attention_with_cache" in str(n.target)]
    assert len(cached) == LAYERS and all("out_scale" in n.kwargs for n in cached)
    seqs = [torch.randint(0, 512, (n + 3,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 9)]
    assert torch.equal(prefill_then_decode(fused, seqs, [6, 9]), prefill_then_decode(unfused, seqs, [6, 9]))
