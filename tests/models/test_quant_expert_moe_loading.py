"""Per-expert quantized MoE checkpoints load and run: ModelOpt FP8 and NVFP4 and fine-grained FP8
experts of Qwen3-MoE and DeepSeek-V3 (MLA + MoE), written by ``tests/quant_expert_checkpoints.py``.

``quantize_<format>_moe_from_config`` turns each quantized ``torch_moe`` layer into the format's
per-expert op; ``fuse_<format>_moe`` keeps it or decodes the experts once into
``grouped_quant_moe_fused`` (on CPU then packed for oneDNN by ``select_moe_backend``). With either backend the logits at two shapes equal the float
reference built from the same decoded tensors with the format's activation rounding (HF's model
class with the dequantized weights: HF itself loads none of these formats on CPU with activation
quantization), and greedy tokens through ``LLM`` are the reference's. A layer the checkpoint
leaves float stays a float MoE; a missing scale, a scale of the wrong block shape, and an expert
missing from a layer are each one error naming the tensor, before anything loads.
"""

import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import quant_expert_checkpoints as qe
from autodeploy import LLM, SamplingParams
from autodeploy.transform.graph_utils import count_op
from autodeploy.transform.interface import Stage
from autodeploy.utils.errors import ModelSourceError
from helpers import build, graph_logits, rel_rmse

ad = torch.ops.autodeploy
SHAPES = [(1, 7), (2, 12)]
LIMITS = dict(max_seq_len=64, max_batch_size=2, dtype="float32")
CASES = [("qwen3_moe", "fp8"), ("qwen3_moe", "fp8_block"), ("qwen3_moe", "nvfp4"), ("deepseek_v3", "fp8_block"),
         ("deepseek_v3", "nvfp4")]
QUANTIZE = {"fp8": "quantize_fp8_moe_from_config", "fp8_block": "quantize_finegrained_fp8_moe_from_config",
            "nvfp4": "quantize_nvfp4_moe_from_config"}
FUSE = {"fp8": "fuse_fp8_moe", "fp8_block": "fuse_finegrained_fp8_moe", "nvfp4": "fuse_nvfp4_moe"}
KEPT = {"fp8": "fp8", "fp8_block": "fp8", "nvfp4": "nvfp4"}
ACT_QUANT = {"fp8": "fp8", "fp8_block": "fp8_group", "nvfp4": "nvfp4"}  # each fusion's name for "keep the format"
PER_EXPERT_OP = {"fp8": ad.torch_quant_fp8_moe, "fp8_block": ad.torch_quant_finegrained_fp8_moe,
                 "nvfp4": ad.torch_quant_nvfp4_moe}
STACKED_OP = {"fp8": ad.torch_quant_fp8_moe_stacked, "fp8_block": ad.torch_quant_finegrained_fp8_moe_stacked,
              "nvfp4": ad.torch_quant_nvfp4_moe_stacked}
WEIGHT_DTYPE = {"fp8": torch.float8_e4m3fn, "fp8_block": torch.float8_e4m3fn, "nvfp4": torch.uint8}
# Both backends compute the reference's numerics; what is left is float32 summation order (measured
# 1.3e-7 to 2.5e-7 here). Another CPU's GEMM kernels sum in another order, which can move an
# activation across an FP8/FP4 rounding boundary (one code step, 1/8 of that value): the bound
# leaves room for that. A wrong numeric misses by far more: one input scale per layer (the max
# over experts) instead of each expert's own by 0.05 to 0.16, unquantized activations by ~0.07.
TOL = 1e-3
_BUILDS = {}


def _built(checkpoint, fmt, backend, layout="auto"):
    key = (checkpoint, fmt, backend, layout)
    if key not in _BUILDS:
        _BUILDS[key] = build(checkpoint, up_to=Stage.POST_LOAD_FUSION, overrides={
            FUSE[fmt]: {"backend": backend}, "export_to_gm": {"experts_layout": layout}}, **LIMITS)
    return _BUILDS[key]


def _history(result, key):
    return next(r for r in result.context.history if r.key == key)


def _assert_logits_match(gm, ref, tol=TOL):
    g = torch.Generator().manual_seed(0)
    for b, s in SHAPES:
        ids = torch.randint(0, 512, (b, s), generator=g)
        with torch.no_grad():
            expected = ref(ids).logits
        err = rel_rmse(graph_logits(gm, ids), expected)
        assert err < tol, (b, s, err)


# every case decoded (experts exported stacked, the default); the kept ops are one per format and
# layout, so Qwen3-MoE's three per layout cover them; one decoded case per expert. Suite time: the
# decoded runs of a format that another model's decoded run already covers go to -m slow.
_SLOW_DECODED = {("qwen3_moe", "fp8_block"), ("qwen3_moe", "nvfp4"), ("deepseek_v3", "nvfp4")}
BACKEND_CASES = ([pytest.param(m, f, "decoded", "auto", marks=pytest.mark.slow if (m, f) in _SLOW_DECODED else ())
                  for m, f in CASES] + [("deepseek_v3", "fp8_block", "decoded", "per_expert")]
                 + [("qwen3_moe", f, "kept", layout) for f in ("fp8", "fp8_block", "nvfp4")
                    for layout in ("auto", "per_expert")])


@pytest.mark.parametrize("model,fmt,backend,layout", BACKEND_CASES)
def test_logits_equal_the_dequantized_reference(model, fmt, backend, layout):
    """``layout`` auto: the experts are exported stacked and become the format's ``_stacked`` op
    (one [E, ...] buffer per tensor kind and projection, filled from the per-expert tensors);
    per_expert: one buffer per checkpoint tensor and the per-expert op."""
    result = _built(qe.quantized_checkpoint(model, fmt), fmt, "decoded" if backend == "decoded" else KEPT[fmt],
                    layout)
    gm = result.graph
    layers = qe.MOE_LAYERS[model]
    experts = qe.NUM_EXPERTS[model]
    assert _history(result, QUANTIZE[fmt]).num_matches == layers
    assert count_op(gm, ad.torch_moe) == count_op(gm, ad.grouped_moe_fused) == count_op(gm, ad.torch_moe_fused) == 0
    buffers = dict(gm.named_buffers())
    if backend == "kept":
        op, other = (STACKED_OP, PER_EXPERT_OP) if layout == "auto" else (PER_EXPERT_OP, STACKED_OP)
        assert _history(result, FUSE[fmt]).num_matches == 0
        assert count_op(gm, op[fmt]) == layers and count_op(gm, other[fmt]) == 0
        if layout == "auto":
            weight = buffers["model.layers.1.mlp.experts.up_weight"]
            assert weight.shape[0] == experts
            assert not any(".experts.0." in n for n in buffers)
        else:
            weight = buffers["model.layers.1.mlp.experts.0.gate_proj.weight"]
        assert weight.dtype == WEIGHT_DTYPE[fmt]
    else:
        assert _history(result, FUSE[fmt]).num_matches == layers
        assert count_op(gm, PER_EXPERT_OP[fmt]) == count_op(gm, STACKED_OP[fmt]) == 0
        assert count_op(gm, ad.grouped_quant_moe_fused) == 0  # made, then packed for oneDNN (select_moe_backend)
        assert count_op(gm, ad.onednn_grouped_moe_fused) == layers
        assert all(n.args[10] == ACT_QUANT[fmt] for n in gm.graph.find_nodes(
            op="call_function", target=ad.onednn_grouped_moe_fused.default))
        # the quantized tensors (per expert, or stacked per kind and projection) are freed
        assert not any(re.search(r"\.experts\.(\d+\.|(gate|up|down)_)", n) for n in buffers)
    _assert_logits_match(gm, qe.reference_model(model, fmt))


# Suite time: DeepSeek-V3's greedy runs (5-7 s each) and Qwen3-MoE's FP8 ones with -m slow (the logits tests
# above cover every case in the default run; NVFP4, the coarsest format, keeps its greedy run there)
@pytest.mark.parametrize("model,fmt", [c if c == ("qwen3_moe", "nvfp4") else pytest.param(*c, marks=pytest.mark.slow)
                                       for c in CASES])
def test_greedy_tokens_equal_the_reference(model, fmt):
    llm = LLM(qe.quantized_checkpoint(model, fmt), log_summary=False, **LIMITS)
    ids = llm.tokenizer(qe.GREEDY_PROMPT[model])["input_ids"]
    params = SamplingParams(max_tokens=qe.GREEDY_TOKENS, temperature=0, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ids}, params)[0]
    with torch.no_grad():
        ref = qe.reference_model(model, fmt).generate(torch.tensor([ids]), max_new_tokens=qe.GREEDY_TOKENS,
                                                      do_sample=False)
    assert out.token_ids == ref[0, len(ids):].tolist()


def _variant(tmp_path, model, fmt, name, edit):
    """A copy of a quantized checkpoint with its tensors changed by ``edit(state_dict)``."""
    dst = tmp_path / name
    shutil.copytree(qe.quantized_checkpoint(model, fmt), dst)
    path = os.path.join(dst, "model.safetensors")
    sd = load_file(path)
    edit(sd)
    save_file(sd, path, metadata={"format": "pt"})
    return str(dst)


_SUFFIXES = {"fp8": ("weight_scale", "input_scale"), "fp8_block": ("weight_scale_inv",),
             "nvfp4": ("weight_scale", "weight_scale_2", "input_scale")}


@pytest.mark.parametrize("fmt", ["fp8_block", "nvfp4"])
def test_a_layer_left_float_stays_a_float_moe(tmp_path, fmt):
    """Near miss: layer 1's experts are float in the checkpoint; only layer 0 becomes the quantized
    op, layer 1 runs as a float checkpoint's MoE (``fuse_moe``), and the logits are the reference's
    with layer 1's experts float and unquantized."""
    floats = load_file(os.path.join(qe.float_checkpoint("qwen3_moe"), "model.safetensors"))
    prefix = "model.layers.1.mlp.experts."

    def edit(sd):
        for name in [n for n in sd if n.startswith(prefix)]:
            del sd[name]
        sd.update({n: t for n, t in floats.items() if n.startswith(prefix)})

    result = _built(_variant(tmp_path, "qwen3_moe", fmt, "mixed", edit), fmt, "decoded")
    gm = result.graph
    assert _history(result, QUANTIZE[fmt]).num_matches == 1
    acts = [n.args[10] for n in gm.graph.find_nodes(op="call_function", target=ad.onednn_grouped_moe_fused.default)]
    assert acts == [ACT_QUANT[fmt], "none"]  # layer 1, fused by fuse_moe as a float checkpoint's
    ref = qe.reference_model("qwen3_moe", fmt)
    ref_experts = ref.model.layers[1].mlp.experts
    float_ref = qe.float_model("qwen3_moe").model.layers[1].mlp.experts
    ref.model.layers[1].mlp.experts = float_ref  # a float layer: float weights, no activation rounding
    assert ref_experts is not float_ref
    _assert_logits_match(gm, ref)


def test_missing_input_scale_is_named(tmp_path):
    key = "model.layers.0.mlp.experts.2.up_proj.input_scale"
    path = _variant(tmp_path, "qwen3_moe", "fp8", "no-input-scale", lambda sd: sd.pop(key))
    with pytest.raises(ModelSourceError, match=rf"'{key}' is missing"):
        _built(path, "fp8", "decoded")


def test_scale_of_another_block_shape_is_named(tmp_path):
    key = "model.layers.1.mlp.experts.5.down_proj.weight_scale_inv"

    def edit(sd):
        sd[key] = torch.ones(2, 2)  # down_proj [64, 96] has one 128x128 tile

    path = _variant(tmp_path, "qwen3_moe", "fp8_block", "bad-tiles", edit)
    with pytest.raises(ModelSourceError, match=rf"'{key}' has shape \[2, 2\].*\[1, 1\]"):
        _built(path, "fp8_block", "decoded")


def test_an_expert_missing_from_a_layer_is_named(tmp_path):
    """The config says 8 experts; the checkpoint's layer 1 has only 7 (expert 7's tensors gone)."""

    def edit(sd):
        for name in [n for n in sd if ".layers.1.mlp.experts.7." in n]:
            del sd[name]

    path = _variant(tmp_path, "qwen3_moe", "nvfp4", "seven-experts", edit)
    with pytest.raises(ModelSourceError, match=r"'model\.layers\.1\.mlp\.experts\.7\.gate_proj\.weight' is missing"
                                               r".*declares more experts than the checkpoint stores"):
        _built(path, "nvfp4", "decoded")
