"""Quantized checkpoints load: the ``quantize_*_linear_from_config`` transforms and the
``fuse_*_linear`` backends, against an independent float reference.

The checkpoints are written by ``tests/quant_checkpoints.py`` with each format's real numerics and
its own encoder (it shares no code with ``autodeploy.ops.quant``). HF cannot be the reference on
CPU for these formats (it drops ModelOpt's scales, needs optional packages for GPTQ/AWQ/
compressed-tensors), so the reference is the HF model class with the weights decoded from the
written files and the format's activation quantization applied in forward hooks.
"""

import copy
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from autodeploy.llm import LLM
from autodeploy.runtime.sampling_params import SamplingParams
from autodeploy.transform.graph_utils import count_op
from autodeploy.transform.interface import Stage
from autodeploy.utils.errors import ModelSourceError

import quant_checkpoints as qc
from helpers import apply_transform, build, graph_logits, rel_rmse

ad = torch.ops.autodeploy
aten = torch.ops.aten
OPS = {
    "fp8": ad.torch_quant_fp8_linear.default,
    "nvfp4": ad.torch_quant_nvfp4_linear.default,
    "fp8_block": ad.torch_quant_finegrained_fp8_linear.default,
    "gptq": ad.torch_quant_int4_linear.default,
    "awq": ad.torch_quant_int4_linear.default,
    "ct_int4": ad.torch_quant_int4_linear.default,
}
TRANSFORMS = {
    "fp8": "quantize_fp8_linear_from_config",
    "nvfp4": "quantize_nvfp4_linear_from_config",
    "fp8_block": "quantize_finegrained_fp8_linear_from_config",
    "gptq": "quantize_int4_linear_from_config",
    "awq": "quantize_int4_linear_from_config",
    "ct_int4": "quantize_int4_linear_from_config",
}
# the backend that splits each canonical op into activation quantization + a float linear
FUSE = {"fp8": ("fuse_fp8_linear", ad.torch_quant_fp8_activation.default),
        "nvfp4": ("fuse_nvfp4_linear", ad.torch_quant_nvfp4_activation.default),
        "fp8_block": ("fuse_finegrained_fp8_linear", ad.torch_quant_fp8_group_activation.default)}
SHAPES = ((1, 7), (3, 4))
_BUILDS = {}


def _loaded(model: str, fmt: str):
    """The graph after weight loading (canonical quantized ops, nothing fused), built once."""
    if (model, fmt) not in _BUILDS:
        _BUILDS[(model, fmt)] = build(qc.quantized_checkpoint(model, fmt), up_to=Stage.WEIGHT_LOAD, max_seq_len=64,
                                      max_batch_size=2)
    return _BUILDS[(model, fmt)]


def _assert_matches_reference(gm, model: str, fmt: str, tol: float) -> None:
    ref = qc.reference_model(model, fmt)
    for b, s in SHAPES:
        ids = torch.randint(0, 512, (b, s))
        with torch.no_grad():
            expected = ref(ids).logits
        err = rel_rmse(graph_logits(gm, ids), expected)
        assert err < tol, f"{model}/{fmt} at {(b, s)}: rel rmse {err} against the float reference"


def _history(result, key):
    return next(r for r in result.context.history if r.key == key)


@pytest.mark.parametrize("model, fmt", [(m, f) for f in qc.FORMATS for m in ("llama",)] + [
    ("qwen3", "fp8_block"), ("qwen3", "gptq"), ("nemotron", "nvfp4"), ("nemotron", "awq")])
def test_quantized_checkpoint_loads_into_canonical_ops(model, fmt):
    result = _loaded(model, fmt)
    gm = result.graph
    n = len(qc.QUANTIZED_LINEARS[model])
    # (a) every quantized linear matched, and only by its format's transform
    assert _history(result, TRANSFORMS[fmt]).num_matches == n
    for key in set(TRANSFORMS.values()) - {TRANSFORMS[fmt]}:
        assert _history(result, key).num_matches == 0
    # (b) the canonical op replaced them; the LM head (float in every format) is the one aten.linear left
    assert count_op(gm, OPS[fmt]) == n
    assert count_op(gm, aten.linear) == 1 and count_op(gm, ad.torch_swiglu_mlp) == 0
    # (c) logits equal the float reference (decoded weights, the format's activation rounding) at two shapes
    _assert_matches_reference(gm, model, fmt, tol=1e-5)


def test_float_checkpoint_is_a_near_miss():
    """(d) a float checkpoint of the same model: no transform matches, the linears stay float (the
    MLPs become float SwiGLU ops, which the quantized builds above must not form)."""
    result = build(qc.float_checkpoint("llama"), up_to=Stage.WEIGHT_LOAD, max_seq_len=64, max_batch_size=2)
    assert all(_history(result, key).num_matches == 0 for key in set(TRANSFORMS.values()))
    assert count_op(result.graph, aten.linear) == 9 and count_op(result.graph, ad.torch_swiglu_mlp) == 2
    assert not any(count_op(result.graph, op) for op in OPS.values())


@pytest.mark.parametrize("fmt", sorted(FUSE))
def test_fuse_quantized_linear_decodes_once(fmt):
    key, activation = FUSE[fmt]
    gm = copy.deepcopy(_loaded("llama", fmt).graph)
    gm, record = apply_transform(key, gm)
    n = len(qc.QUANTIZED_LINEARS["llama"])
    assert record.num_matches == n  # (a)
    assert count_op(gm, OPS[fmt]) == 0 and count_op(gm, activation) == n  # (b)
    assert count_op(gm, aten.linear) == n + 1
    weights = [p for name, p in gm.named_parameters() if name.endswith("weight") and p.dim() == 2]
    assert all(w.dtype == torch.float32 for w in weights)
    assert not any(b.dtype in (torch.float8_e4m3fn, torch.uint8) for b in gm.buffers())  # narrow tensors freed
    _assert_matches_reference(gm, "llama", fmt, tol=1e-5)  # (c)
    # (d) the other formats' backends leave this graph alone
    for other_key, _ in (v for f, v in FUSE.items() if f != fmt):
        assert apply_transform(other_key, copy.deepcopy(_loaded("llama", fmt).graph))[1].num_matches == 0


@pytest.mark.parametrize("fmt", ["gptq", "fp8"])
def test_engine_generates_the_reference_tokens(fmt):
    """The whole pipeline (fused backends, KV cache, sampler): greedy tokens equal the reference's."""
    llm = LLM(qc.quantized_checkpoint("llama", fmt), max_seq_len=64, max_batch_size=4)
    prompts = [[5, 17, 33, 2, 99, 100], [7, 8, 9]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    ref = qc.reference_model("llama", fmt)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            expected = ref.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                    pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected


# ---- bad checkpoints: one clear error naming the tensor -------------------------------------


def _broken_copy(tmp_path, fmt: str, edit) -> str:
    src = qc.quantized_checkpoint("llama", fmt)
    dst = str(tmp_path / f"broken-{fmt}")
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def _build_error(directory: str) -> str:
    with pytest.raises(ModelSourceError) as err:
        build(directory, up_to=Stage.WEIGHT_LOAD, max_seq_len=64, max_batch_size=2)
    return str(err.value)


Q = "model.layers.0.self_attn.q_proj"


def test_missing_scale_tensor_is_named(tmp_path):
    msg = _build_error(_broken_copy(tmp_path, "fp8", lambda t: t.pop(f"{Q}.input_scale")))
    assert f"'{Q}.input_scale' is missing" in msg and "static per-tensor input scale" in msg


def test_wrong_scale_shape_is_named(tmp_path):
    def edit(t):
        t[f"{Q}.weight_scale"] = torch.ones(t[f"{Q}.weight_scale"].shape[0], 2, dtype=torch.float8_e4m3fn)

    msg = _build_error(_broken_copy(tmp_path, "nvfp4", edit))
    assert f"'{Q}.weight_scale' has shape [64, 2]" in msg and "[64, 4]" in msg and "e4m3 scale per 16 inputs" in msg


def test_wrong_weight_dtype_is_named(tmp_path):
    msg = _build_error(_broken_copy(tmp_path, "fp8_block", lambda t: t.__setitem__(f"{Q}.weight", t[f"{Q}.weight"].float())))
    assert f"'{Q}.weight' is float32" in msg and "float8_e4m3fn" in msg


def test_act_order_gptq_is_refused(tmp_path):
    def edit(t):
        g = t[f"{Q}.g_idx"]
        t[f"{Q}.g_idx"] = g.flip(0).contiguous()

    msg = _build_error(_broken_copy(tmp_path, "gptq", edit))
    assert "g_idx" in msg and "act-order" in msg


def test_gptq_desc_act_config_is_refused(tmp_path):
    d = _broken_copy(tmp_path, "gptq", lambda t: None)
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["quantization_config"]["desc_act"] = True
    with open(path, "w") as f:
        json.dump(cfg, f)
    assert "desc_act" in _build_error(d)


def test_nvfp4_needs_inputs_in_groups_of_16():
    from autodeploy.transform.library.quantize_nvfp4_linear_from_config import NVFP4_LINEAR
    from autodeploy.transform.library._quant_from_config import validate_linear

    with pytest.raises(ModelSourceError) as err:
        validate_linear(NVFP4_LINEAR, "model.layers.0.mlp.down_proj", 64, 40, [], {}, {})
    assert "'model.layers.0.mlp.down_proj' (64 outputs, 40 inputs) cannot be ModelOpt NVFP4" in str(err.value)
    assert "not a multiple of 16" in str(err.value)
