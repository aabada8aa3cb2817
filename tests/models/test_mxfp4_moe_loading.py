"""GPT-OSS MXFP4 checkpoints (``quant_method: mxfp4``: ``quantize_mxfp4_moe_from_config``, then
``fuse_mxfp4_moe``) load and run: with either backend (experts decoded once after loading, or kept
in MXFP4 and decoded per active expert) the logits at two shapes equal the float reference built from the same decoded tensors
(``tests/quant_moe_checkpoints.py``, whose HF ``Mxfp4Config(dequantize=True)`` load it equals
exactly), and greedy tokens through ``LLM`` are the reference's. A layer the checkpoint leaves
float stays a float MoE op; a missing scale tensor or blocks of the wrong expert count are one
error naming the tensor, before anything loads.
"""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import quant_moe_checkpoints as qm
from autodeploy import LLM, SamplingParams
from autodeploy.transform.graph_utils import count_op
from autodeploy.transform.interface import Stage
from autodeploy.utils.errors import ModelSourceError
from helpers import build, graph_logits, rel_rmse

ad = torch.ops.autodeploy
SHAPES = [(1, 7), (2, 12)]
LIMITS = dict(max_seq_len=64, max_batch_size=2, dtype="float32")
_BUILDS = {}


def _built(backend, checkpoint=None):
    key = (backend, checkpoint)
    if key not in _BUILDS:
        _BUILDS[key] = build(checkpoint or qm.mxfp4_checkpoint(), up_to=Stage.POST_LOAD_FUSION,
                             overrides={"fuse_mxfp4_moe": {"backend": backend}}, **LIMITS)
    return _BUILDS[key]


def _history(result, key):
    return next(r for r in result.context.history if r.key == key)


@pytest.mark.parametrize("backend", ["decoded", "mxfp4"])
def test_logits_equal_the_dequantized_reference(backend):
    result = _built(backend)
    gm = result.graph
    assert _history(result, "quantize_mxfp4_moe_from_config").num_matches == qm.LAYERS  # one MoE op per layer
    record = _history(result, "fuse_mxfp4_moe")
    if backend == "mxfp4":
        assert record.num_matches == 0
        assert count_op(gm, ad.torch_quant_mxfp4_moe_fused) == qm.LAYERS
        assert count_op(gm, ad.torch_moe_fused) == count_op(gm, ad.grouped_moe_fused) == 0
        buffers = dict(gm.named_buffers())
        blocks = buffers["model.layers.0.mlp.experts.gate_up_blocks"]
        assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (4, 256, 2, 16)
        assert not any(n.endswith("experts.gate_up_proj") for n, _ in gm.named_parameters())
    else:
        assert record.num_matches == qm.LAYERS  # every layer's experts decoded once, after loading
        assert count_op(gm, ad.torch_quant_mxfp4_moe_fused) == 0
        # fuse_moe runs them like a float checkpoint's (select_moe_backend: experts packed for oneDNN)
        assert count_op(gm, ad.onednn_grouped_moe_fused) == qm.LAYERS
        assert not any(n.endswith("_blocks") for n, _ in gm.named_buffers())  # the MXFP4 tensors are freed
    ref = qm.reference_model()
    g = torch.Generator().manual_seed(0)
    for b, s in SHAPES:
        ids = torch.randint(0, 512, (b, s), generator=g)
        with torch.no_grad():
            expected = ref(ids).logits
        err = rel_rmse(graph_logits(gm, ids), expected)
        assert err < 1e-5, (backend, b, s, err)


@pytest.mark.parametrize("backend", ["decoded", "mxfp4"])
def test_greedy_tokens_equal_the_reference(backend):
    llm = LLM(qm.mxfp4_checkpoint(), transforms={"fuse_mxfp4_moe": {"backend": backend}}, **LIMITS)
    ids = llm.tokenizer(qm.GREEDY_PROMPT)["input_ids"]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=qm.GREEDY_TOKENS, temperature=0,
                                                                   ignore_eos=True))[0]
    with torch.no_grad():
        ref = qm.reference_model().generate(torch.tensor([ids]), max_new_tokens=qm.GREEDY_TOKENS, do_sample=False)
    assert out.token_ids == ref[0, len(ids):].tolist()


def _variant(tmp_path, name, edit):
    """A copy of the MXFP4 checkpoint with its tensors changed by ``edit(state_dict)``."""
    src = qm.mxfp4_checkpoint()
    dst = tmp_path / name
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    sd = load_file(path)
    edit(sd)
    save_file(sd, path, metadata={"format": "pt"})
    return str(dst)


def test_a_layer_left_float_stays_a_float_moe(tmp_path):
    """Near miss: layer 1's experts are float in the checkpoint (as ``modules_to_not_convert`` may leave
    them); only layer 0 becomes the MXFP4 op, and the logits are the reference's with layer 1 float."""
    floats = load_file(os.path.join(qm.float_checkpoint(), "model.safetensors"))
    prefix = "model.layers.1.mlp.experts."

    def edit(sd):
        for proj in qm.EXPERT_PROJS:
            del sd[f"{prefix}{proj}_blocks"], sd[f"{prefix}{proj}_scales"]
            sd[f"{prefix}{proj}"] = floats[f"{prefix}{proj}"]

    result = _built("mxfp4", _variant(tmp_path, "mixed", edit))
    gm = result.graph
    assert _history(result, "quantize_mxfp4_moe_from_config").num_matches == 1
    assert count_op(gm, ad.torch_quant_mxfp4_moe_fused) == 1
    assert count_op(gm, ad.onednn_grouped_moe_fused) == 1  # layer 1 as a float checkpoint's (fuse_moe, then packed)
    ref = qm.reference_model()
    ref.load_state_dict({f"{prefix}{p}": floats[f"{prefix}{p}"] for p in qm.EXPERT_PROJS}, strict=False)
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
    assert rel_rmse(graph_logits(gm, ids), expected) < 1e-5


def test_missing_scales_are_named(tmp_path):
    path = _variant(tmp_path, "no-scales", lambda sd: sd.pop("model.layers.0.mlp.experts.down_proj_scales"))
    with pytest.raises(ModelSourceError, match=r"'model\.layers\.0\.mlp\.experts\.down_proj_scales' is missing"):
        _built("decoded", path)


def test_blocks_of_another_expert_count_are_named(tmp_path):
    def edit(sd):
        key = "model.layers.1.mlp.experts.gate_up_proj_blocks"
        sd[key] = sd[key][:3].contiguous()

    path = _variant(tmp_path, "three-experts", edit)
    with pytest.raises(ModelSourceError, match=r"'model\.layers\.1\.mlp\.experts\.gate_up_proj_blocks' has shape "
                                               r"\[3, 256, 2, 16\].*\[4, 256, 2, 16\]"):
        _built("mxfp4", path)


def test_config_declaring_mxfp4_without_blocks_is_refused(tmp_path):
    dst = tmp_path / "float-declared-mxfp4"
    shutil.copytree(qm.float_checkpoint(), dst)
    cfg_path = os.path.join(dst, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = dict(qm.QUANTIZATION_CONFIG)
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(ModelSourceError, match="no parameter of the model has '<name>_blocks'"):
        _built("decoded", str(dst))
