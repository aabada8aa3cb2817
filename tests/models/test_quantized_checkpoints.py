"""Quantized checkpoints autodeploy cannot load are refused with an actionable error instead of loading
as garbage (the formats it loads are tested in ``test_quantized_loading.py``).

Every checkpoint here is real and written by the test: a tiny float Llama saved by transformers,
then quantized with the numerics of each format (ModelOpt per-tensor FP8 with calibrated input
scales, fine-grained 128x128 block FP8, int8 per-channel), with the format's config files.
"""

import json
import logging
import os
import shutil
from typing import Dict

import pytest
import torch
from safetensors.torch import load_file, save_file

from autodeploy.config import load_deploy_config
from autodeploy.models.factory import ModelFactory
from autodeploy.models.presets import PRESETS
from autodeploy.pipeline import build_graph
from autodeploy.utils.errors import ModelSourceError

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
Q_PROJ = "model.layers.0.self_attn.q_proj"


def _is_linear_weight(name: str) -> bool:
    return name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS


def _edit_config(directory: str, **changes) -> None:
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)


def _variant(float_dir: str, dst: str, tensors: Dict[str, torch.Tensor], **config_changes) -> str:
    """A copy of the float checkpoint's files with other tensors and config.json edits."""
    shutil.copytree(float_dir, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    _edit_config(dst, **config_changes)
    return dst


def _input_amax(model: torch.nn.Module) -> Dict[str, float]:
    """Calibration: the largest |input| each linear sees on a batch of random tokens."""
    amax: Dict[str, float] = {}
    hooks = [
        module.register_forward_hook(
            lambda m, args, out, name=name: amax.__setitem__(name, max(amax.get(name, 0.0), args[0].abs().max().item()))
        )
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in LINEARS
    ]
    with torch.no_grad():
        model(torch.randint(0, model.config.vocab_size, (2, 16)))
    for h in hooks:
        h.remove()
    return amax


def _fp8_per_tensor(w: torch.Tensor):
    scale = w.abs().amax().float() / FP8_MAX
    q = (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.reshape(())


def _fp8_block(w: torch.Tensor, block: int = 128):
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(nr * block, nc * block)
    padded[:rows, :cols] = w.float()
    tiles = padded.reshape(nr, block, nc, block)
    scale_inv = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(nr * block, nc * block)
    return q[:rows, :cols].to(torch.float8_e4m3fn).contiguous(), scale_inv


def _int8_per_channel(w: torch.Tensor):
    scale = (w.abs().amax(dim=1, keepdim=True).float() / 127).clamp(min=1e-12)
    return (w.float() / scale).round().clamp(-127, 127).to(torch.int8), scale


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit values along dim 0, eight to an int32 (GPTQ's layout)."""
    q = q.to(torch.int64).reshape(q.shape[0] // 8, 8, *q.shape[1:])
    packed = sum(q[:, k] << (4 * k) for k in range(8))
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _gptq_int4(w: torch.Tensor, group: int = 32):
    """Asymmetric 4-bit, per group of ``group`` input channels (AutoGPTQ layout, zeros stored minus one)."""
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = (-lo / scale).round().clamp(0, 15)
    q = ((g / scale[..., None]).round() + zero[..., None]).clamp(0, 15).reshape(out_f, in_f)
    return {
        "qweight": _pack_int4(q.T.contiguous()),
        "qzeros": _pack_int4((zero - 1).clamp(min=0)).T.contiguous(),  # [in / group, out / 8]
        "scales": scale.T.contiguous().half(),
        "g_idx": torch.arange(in_f, dtype=torch.int32) // group,
    }


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("quantized")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=256)
    model = LlamaForCausalLM(config).eval()
    float_dir = str(root / "float")
    model.save_pretrained(float_dir)
    sd = load_file(os.path.join(float_dir, "model.safetensors"))
    amax = _input_amax(model)
    out = {"float": float_dir, "state_dict": sd}

    # a. ModelOpt FP8: per-tensor weight scales, calibrated static input scales; lm_head excluded.
    modelopt = {}
    for name, t in sd.items():
        if _is_linear_weight(name):
            q, scale = _fp8_per_tensor(t)
            prefix = name[: -len(".weight")]
            modelopt[name] = q
            modelopt[f"{prefix}.weight_scale"] = scale
            modelopt[f"{prefix}.input_scale"] = torch.tensor(amax[prefix] / FP8_MAX, dtype=torch.float32)
        else:
            modelopt[name] = t
    out["modelopt"] = _variant(float_dir, str(root / "modelopt"), modelopt, quantization_config={
        "quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_scheme": None,
        "producer": {"name": "modelopt", "version": "0.29.0"}, "exclude_modules": ["lm_head"],
    })
    with open(os.path.join(out["modelopt"], "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "modelopt", "version": "0.29.0"},
                   "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None,
                                    "exclude_modules": ["lm_head"]}}, f)

    # b. fine-grained FP8 (DeepSeek-V3 style): 128x128 blocks, scale_inv multiplies back.
    block = {}
    for name, t in sd.items():
        if _is_linear_weight(name):
            block[name], block[name[: -len(".weight")] + ".weight_scale_inv"] = _fp8_block(t)
        else:
            block[name] = t
    out["fp8_block"] = _variant(float_dir, str(root / "fp8_block"), block, quantization_config={
        "quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3",
    })

    # c. the ModelOpt FP8 tensors, with config.json no longer saying so.
    out["fp8_no_config"] = _variant(float_dir, str(root / "fp8_no_config"), modelopt)

    # c (int8). per-channel int8 weights (+ weight_scale), no quantization_config: caught by the loader.
    int8 = {}
    for name, t in sd.items():
        if _is_linear_weight(name):
            int8[name], int8[name[: -len(".weight")] + ".weight_scale"] = _int8_per_channel(t)
        else:
            int8[name] = t
    out["int8_no_config"] = _variant(float_dir, str(root / "int8_no_config"), int8)

    # c (pickle). FP8 weights in a pickled checkpoint (no safetensors header to read before the build).
    pickled = str(root / "fp8_pickled")
    shutil.copytree(float_dir, pickled, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(modelopt, os.path.join(pickled, "pytorch_model.bin"))
    out["fp8_pickled"] = pickled

    # c (GPTQ). int4 qweight/qzeros/scales/g_idx instead of each weight, no quantization_config.
    gptq = {}
    for name, t in sd.items():
        if _is_linear_weight(name):
            prefix = name[: -len(".weight")]
            gptq.update({f"{prefix}.{k}": v for k, v in _gptq_int4(t).items()})
        else:
            gptq[name] = t
    out["gptq_no_config"] = _variant(float_dir, str(root / "gptq_no_config"), gptq)

    # d. float weights plus one stray ModelOpt scale.
    out["float_plus_scale"] = _variant(float_dir, str(root / "float_plus_scale"),
                                       {**sd, f"{Q_PROJ}.weight_scale": modelopt[f"{Q_PROJ}.weight_scale"]})
    # e. float weights (stored bf16: cast to fp32 on load) plus a harmless stale RoPE table.
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    out["float_plus_inv_freq"] = _variant(
        float_dir, str(root / "float_plus_inv_freq"),
        {**{k: v.to(torch.bfloat16) for k, v in sd.items()}, "model.layers.0.self_attn.rotary_emb.inv_freq": inv_freq},
    )
    # ModelOpt's hf_quant_config.json alone (older exports leave config.json untouched).
    out["modelopt_json_only"] = _variant(float_dir, str(root / "modelopt_json_only"), modelopt)
    with open(os.path.join(out["modelopt_json_only"], "hf_quant_config.json"), "w") as f:
        json.dump({"producer": {"name": "modelopt", "version": "0.29.0"},
                   "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                    "exclude_modules": ["lm_head"]}}, f)
    return out


def _build(directory: str, **settings):
    settings = {"max_seq_len": 64, "max_batch_size": 2, **settings}
    return build_graph(load_deploy_config(model=directory, **settings), log_summary=False)


# ---- the fixtures are what they claim ---------------------------------------------------------


def test_fixture_quantization_is_real(ckpts):
    """The quantized weights dequantize back to the float ones (so the formats are genuine)."""
    w = ckpts["state_dict"][f"{Q_PROJ}.weight"]
    mo = load_file(os.path.join(ckpts["modelopt"], "model.safetensors"))
    assert mo[f"{Q_PROJ}.weight"].dtype == torch.float8_e4m3fn
    deq = mo[f"{Q_PROJ}.weight"].float() * mo[f"{Q_PROJ}.weight_scale"]
    assert (deq - w).norm() / w.norm() < 0.05
    fg = load_file(os.path.join(ckpts["fp8_block"], "model.safetensors"))
    assert fg[f"{Q_PROJ}.weight_scale_inv"].shape == (1, 1)
    down = fg["model.layers.0.mlp.down_proj.weight"].float()
    assert fg["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 1)
    deq = down * fg["model.layers.0.mlp.down_proj.weight_scale_inv"][0, 0]
    ref = ckpts["state_dict"]["model.layers.0.mlp.down_proj.weight"]
    assert (deq - ref).norm() / ref.norm() < 0.05
    gq = load_file(os.path.join(ckpts["gptq_no_config"], "model.safetensors"))
    qweight, qzeros, scales = (gq[f"{Q_PROJ}.{k}"] for k in ("qweight", "qzeros", "scales"))
    shifts = torch.arange(0, 32, 4)
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, qweight.shape[1])  # [in, out]
    zeros = ((qzeros[:, :, None] >> shifts) & 15).reshape(qzeros.shape[0], -1) + 1  # [in / group, out]
    deq = ((q - zeros.repeat_interleave(32, 0)) * scales.float().repeat_interleave(32, 0)).T
    assert (deq - w).norm() / w.norm() < 0.15


# ---- config.json / hf_quant_config.json: refused before anything is built ----------------------


def test_modelopt_hf_quant_config_alone_is_read(ckpts):
    """Older ModelOpt exports declare the format only in hf_quant_config.json: it is read from there."""
    factory = ModelFactory(ckpts["modelopt_json_only"])
    factory.config
    info = factory.quantization
    assert (info.method, info.algo, info.declared_in) == ("modelopt", "NVFP4", "hf_quant_config.json")
    assert info.transform == "quantize_nvfp4_linear_from_config"


def test_declared_format_that_does_not_match_the_tensors_is_an_error(ckpts):
    """The JSON says NVFP4, the tensors are FP8: no linear has NVFP4's tensors, and the FP8 weights
    are refused rather than cast."""
    with pytest.raises(ModelSourceError) as err:
        _build(ckpts["modelopt_json_only"])
    msg = str(err.value)
    assert "float8_e4m3fn" in msg and "looks quantized" in msg and "declares a supported format" in msg


@pytest.mark.parametrize("qcfg, named", [
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "quant_method 'modelopt', quant_algo W4A8_AWQ"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {}},
     "quant_method 'compressed-tensors', quant_algo float-quantized"),
    ({"quant_method": "mxint8"}, "quant_method 'mxint8'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
     "quant_method 'bitsandbytes', quant_algo nf4"),
    ({"load_in_8bit": True}, "quant_method 'bitsandbytes', quant_algo 8-bit"),
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}, "quant_method 'fbgemm_fp8'"),
])
def test_any_quant_method_is_refused(ckpts, tmp_path, qcfg, named):
    d = _variant(ckpts["float"], str(tmp_path / "q"), ckpts["state_dict"], quantization_config=qcfg)
    with pytest.raises(ModelSourceError) as err:
        ModelFactory(d).config
    msg = str(err.value)
    assert named in msg and "cannot load this quantization format" in msg
    assert "supported: awq, compressed-tensors (PACK-QUANTIZED), fp8, gptq, modelopt (FP8, NVFP4), mxfp4" in msg


def test_float_checkpoint_and_presets_still_read(ckpts):
    factory = ModelFactory(ckpts["float"])
    assert factory.config.hidden_size == 64 and factory.quantization is None
    preset = ModelFactory(sorted(PRESETS)[0])
    assert preset.config is not None and preset.quantization is None


# ---- the checkpoint's tensors, whatever its config says ---------------------------------------


def test_fp8_tensors_without_config_fail_on_dtype(ckpts):
    """Refused from the safetensors headers when the model is built, before export and loading."""
    with pytest.raises(ModelSourceError, match="down_proj.weight' \\(float8_e4m3fn\\)"):
        ModelFactory(ckpts["fp8_no_config"]).build_model()
    with pytest.raises(ModelSourceError) as err:
        _build(ckpts["fp8_no_config"])
    msg = str(err.value)
    assert "'model.layers.0.mlp.down_proj.weight' (float8_e4m3fn)" in msg and "expects float32 weights" in msg
    assert "looks quantized" in msg and "float checkpoint" in msg


def test_int8_weights_without_config_fail_on_dtype(ckpts):
    with pytest.raises(ModelSourceError) as err:
        _build(ckpts["int8_no_config"])
    msg = str(err.value)
    assert "'model.layers.0.self_attn.q_proj.weight' is int8" in msg and "expects float32" in msg
    assert "looks quantized" in msg


def test_pickled_fp8_weights_fail_on_dtype_in_loader(ckpts):
    with pytest.raises(ModelSourceError) as err:
        _build(ckpts["fp8_pickled"], allow_pickle=True, dtype="bfloat16")
    msg = str(err.value)
    assert "'model.layers.0.self_attn.q_proj.weight' is float8_e4m3fn" in msg and "expects bfloat16" in msg


def test_gptq_tensors_without_config_name_the_format_not_only_missing_weights(ckpts):
    with pytest.raises(ModelSourceError) as err:
        _build(ckpts["gptq_no_config"])
    msg = str(err.value)
    assert "model.layers.0.mlp.down_proj.g_idx" in msg and "looks quantized" in msg
    assert "14 model tensors have no float weight" in msg


def test_stray_quantization_scale_is_an_error(ckpts):
    with pytest.raises(ModelSourceError) as err:
        _build(ckpts["float_plus_scale"])
    msg = str(err.value)
    assert f"{Q_PROJ}.weight_scale" in msg and "looks quantized" in msg


def test_harmless_extra_tensor_still_loads_with_warning(ckpts, caplog):
    with caplog.at_level(logging.WARNING, logger="autodeploy"):
        result = _build(ckpts["float_plus_inv_freq"])
    assert result.graph is not None
    assert any("rotary_emb.inv_freq" in r.getMessage() and "not used" in r.getMessage() for r in caplog.records)
