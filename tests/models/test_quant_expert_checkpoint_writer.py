"""The quantized-expert test checkpoints (tests/quant_expert_checkpoints.py) are what they claim to be.

autodeploy's loading of quantized Qwen3-MoE / DeepSeek-V3 checkpoints is judged against them, so
their layout is pinned here tensor by tensor (per expert, as the releases store them), the exclude
lists are checked against both matchers that read them (fnmatch as vLLM's ModelOpt loader, and
transformers' ``should_convert_module``), the weights are decoded a second time by transformers'
own FP8 / FP4 helpers, the per-expert input scales are recomputed from HF's own forward, the
reference's experts loop is shown to be HF's eager experts when it does not quantize, and the
quantization is shown to be real (close to the float model, not equal).

Measured (transformers 5.23, torch 2.13 CPU; the bounds leave ~25-50% headroom):
  weight relative error (Frobenius, per linear, worst over dense linears and expert projections;
  the best is within 0.007 of it): fp8 0.027, fp8_block 0.028, nvfp4 0.099.
  reference logits relative RMSE against the float model (4 x 24 random tokens):
  qwen3_moe fp8 0.073, fp8_block 0.068, nvfp4 0.180; deepseek_v3 fp8_block 0.107, nvfp4 0.274.
  the reference with every expert's static input scales replaced by its layer's largest (what a
  loader keeping one scale per layer computes, e.g. vLLM's per-tensor FP8 MoE, which takes the max
  over experts) is 0.054 (qwen3_moe fp8), 0.096 (qwen3_moe nvfp4), 0.160 (deepseek_v3 nvfp4) away
  from the reference: other roundings, noise of the quantization's own size. So a loading test
  only tells per-expert scales from a shared one with a tolerance well below the format's error.
  per-expert input scales: every expert reached by calibration; per layer the 8 down scales all
  differ (max / min 1.5-2.1), the gate/up ones take 6 distinct values (1.15-1.3).
  greedy top-2 logit gaps on GREEDY_PROMPT over every format and the first 8 steps: min 0.375
  (qwen3_moe), 0.242 (deepseek_v3); logits std 1.9-2.1.

The forwards run on one thread (a 2-thread forward of a model this small is much slower when the
machine's cores are shared).
"""

import functools
import json
import os
from fnmatch import fnmatch

import pytest
import torch
from safetensors.torch import load_file

import quant_expert_checkpoints as qe
from quant_expert_checkpoints import (
    FORMATS,
    GREEDY_PROMPT,
    GREEDY_TOKENS,
    MODELS,
    MOE_LAYERS,
    NUM_EXPERTS,
    QUANTIZED_EXPERT_PROJS,
    QUANTIZED_LINEARS,
    dequantized_state_dict,
    float_checkpoint,
    float_model,
    input_scales,
    quantized_checkpoint,
    reference_model,
)

CASES = [(m, f) for m in MODELS for f in FORMATS[m]]
STATIC = [(m, f) for m, f in CASES if f in ("fp8", "nvfp4")]
H = 64
INTER = {"qwen3_moe": 96, "deepseek_v3": 48}
MOE_IDS = {"qwen3_moe": (0, 1), "deepseek_v3": (1, 2)}
BOUND = {"fp8": 448.0, "nvfp4": 6 * 448.0}

WEIGHT_ERR = {"fp8": 0.04, "fp8_block": 0.045, "nvfp4": 0.14}
LOGIT_ERR = {("qwen3_moe", "fp8"): 0.11, ("qwen3_moe", "fp8_block"): 0.1, ("qwen3_moe", "nvfp4"): 0.26,
             ("deepseek_v3", "fp8_block"): 0.15, ("deepseek_v3", "nvfp4"): 0.38}
MIN_GREEDY_GAP = 0.1

# The exact config entries, written out here (not taken from the writer) so the spec is pinned.
PRODUCER = {"name": "modelopt", "version": "0.29.0"}
_QWEN_FLOAT = ["lm_head", "model.layers.*.mlp.gate"]
_DS_NVFP4_FLOAT = ["lm_head", "model.layers.*.self_attn*", "model.layers.*.mlp.gate"]
_FP8_BLOCK = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
EXPECTED_QCFG = {
    ("qwen3_moe", "fp8"): {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": _QWEN_FLOAT,
                           "producer": PRODUCER},
    ("qwen3_moe", "nvfp4"): {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                             "exclude_modules": _QWEN_FLOAT, "producer": PRODUCER},
    ("qwen3_moe", "fp8_block"): {**_FP8_BLOCK, "modules_to_not_convert": _QWEN_FLOAT},
    ("deepseek_v3", "fp8_block"): {**_FP8_BLOCK, "modules_to_not_convert": _QWEN_FLOAT},
    ("deepseek_v3", "nvfp4"): {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                               "exclude_modules": _DS_NVFP4_FLOAT, "producer": PRODUCER},
}
EXPECTED_HF_QUANT = {
    ("qwen3_moe", "fp8"): {"producer": PRODUCER, "quantization": {
        "quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": _QWEN_FLOAT}},
    ("qwen3_moe", "nvfp4"): {"producer": PRODUCER, "quantization": {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": _QWEN_FLOAT}},
    ("deepseek_v3", "nvfp4"): {"producer": PRODUCER, "quantization": {
        "quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": _DS_NVFP4_FLOAT}},
}


def _expected_tensors(fmt: str, n: int, k: int):
    """suffix -> (dtype, shape) of one quantized [n, k] linear, from the format specs."""
    return {
        "fp8": {"weight": (torch.float8_e4m3fn, (n, k)), "weight_scale": (torch.float32, ()),
                "input_scale": (torch.float32, ())},
        "nvfp4": {"weight": (torch.uint8, (n, k // 2)), "weight_scale": (torch.float8_e4m3fn, (n, k // 16)),
                  "weight_scale_2": (torch.float32, ()), "input_scale": (torch.float32, ())},
        "fp8_block": {"weight": (torch.float8_e4m3fn, (n, k)),
                      "weight_scale_inv": (torch.float32, (-(-n // 128), -(-k // 128)))},
    }[fmt]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def _float_sd(model: str):
    return load_file(os.path.join(float_checkpoint(model), "model.safetensors"))


@functools.lru_cache(maxsize=None)
def _files(model: str, fmt: str):
    return load_file(os.path.join(quantized_checkpoint(model, fmt), "model.safetensors"))


@functools.lru_cache(maxsize=None)
def _deq(model: str, fmt: str):
    return dequantized_state_dict(model, fmt)


@functools.lru_cache(maxsize=None)
def _ref(model: str, fmt: str):
    return reference_model(model, fmt)


@functools.lru_cache(maxsize=None)
def _float(model: str):
    return float_model(model)


def _quantized(model: str, fmt: str):
    return tuple(QUANTIZED_LINEARS[(model, fmt)]) + QUANTIZED_EXPERT_PROJS[model]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _rel_rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def _tokens() -> torch.Tensor:
    return torch.randint(0, 512, (4, 24), generator=torch.Generator().manual_seed(7))


# ---- the float checkpoint -----------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_float_checkpoint_is_a_plain_hf_checkpoint_with_per_expert_names(model):
    from transformers import AutoModelForCausalLM

    directory = float_checkpoint(model)
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32" and cfg["model_type"] == model
    for name in ("generation_config.json", "tokenizer.json"):
        assert os.path.exists(os.path.join(directory, name)), name
    sd = _float_sd(model)
    assert not [k for k in sd if k.endswith(("gate_up_proj", "experts.down_proj"))]  # no stacked names
    experts = sorted({k.split(".mlp.experts.")[0] for k in sd if ".mlp.experts." in k})
    assert experts == [f"model.layers.{i}" for i in MOE_IDS[model]] and len(experts) == MOE_LAYERS[model]
    inter = INTER[model]
    for i in MOE_IDS[model]:
        for e in range(NUM_EXPERTS[model]):
            p = f"model.layers.{i}.mlp.experts.{e}"
            assert sd[f"{p}.gate_proj.weight"].shape == sd[f"{p}.up_proj.weight"].shape == (inter, H)
            assert sd[f"{p}.down_proj.weight"].shape == (H, inter)
        assert sd[f"model.layers.{i}.mlp.gate.weight"].shape == (NUM_EXPERTS[model], H)
        assert 0.06 < sd[f"model.layers.{i}.mlp.gate.weight"].std() < 0.1
    assert len(QUANTIZED_EXPERT_PROJS[model]) == MOE_LAYERS[model] * NUM_EXPERTS[model] * 3
    if model == "deepseek_v3":  # layer 0 dense, the MoE layers with a shared expert and a correction bias
        assert sd["model.layers.0.mlp.gate_proj.weight"].shape == (128, H)
        for i in MOE_IDS[model]:
            assert sd[f"model.layers.{i}.mlp.shared_experts.up_proj.weight"].shape == (inter, H)
            bias = sd[f"model.layers.{i}.mlp.gate.e_score_correction_bias"]
            assert bias.dtype == torch.float32 and 0.005 < bias.std() < 0.05
    norms = [t for k, t in sd.items() if k.endswith("norm.weight")]
    assert norms and all(0.5 < t.mean() < 1.5 for t in norms)
    # transformers' own loader (its per-expert -> stacked conversion) gives exactly our float model,
    # so gate rows come first in gate_up_proj, as _stack_experts writes them.
    theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).state_dict()
    ours = _float(model).state_dict()
    assert set(theirs) == set(ours)
    for name, t in ours.items():
        assert torch.equal(theirs[name], t), name


# ---- layout: files, config entries, tensor names / dtypes / shapes ------------------------------


@pytest.mark.parametrize("model, fmt", CASES)
def test_layout(model, fmt):
    directory = quantized_checkpoint(model, fmt)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.exists(os.path.join(directory, name)), name
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["quantization_config"] == EXPECTED_QCFG[(model, fmt)]
    hf_quant = os.path.join(directory, "hf_quant_config.json")
    if (model, fmt) in EXPECTED_HF_QUANT:
        with open(hf_quant) as f:
            assert json.load(f) == EXPECTED_HF_QUANT[(model, fmt)]
    else:
        assert not os.path.exists(hf_quant)

    sd, float_sd = _files(model, fmt), _float_sd(model)
    quantized = set(_quantized(model, fmt))
    assert len(quantized) == len(_quantized(model, fmt))
    expected = {}
    for prefix in quantized:
        n, k = float_sd[f"{prefix}.weight"].shape
        assert k % 16 == 0, prefix  # NVFP4's group along K
        expected.update({f"{prefix}.{s}": spec for s, spec in _expected_tensors(fmt, n, k).items()})
    for name, t in float_sd.items():  # every other tensor is the float one, unchanged
        if name.rsplit(".", 1)[0] not in quantized:
            expected[name] = (t.dtype, tuple(t.shape))
            assert torch.equal(sd[name], t), name
    assert {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()} == expected
    # the routers (and DeepSeek's correction bias), lm_head and embeddings stay float
    for i in MOE_IDS[model]:
        assert sd[f"model.layers.{i}.mlp.gate.weight"].dtype == torch.float32
    assert sd["lm_head.weight"].dtype == sd["model.embed_tokens.weight"].dtype == torch.float32
    p = f"model.layers.{MOE_IDS[model][0]}.mlp.experts.0"
    inter = INTER[model]
    if fmt == "fp8_block":  # partial edge tiles: one tile each, scale by the tile's own amax
        assert sd[f"{p}.gate_proj.weight_scale_inv"].shape == sd[f"{p}.down_proj.weight_scale_inv"].shape == (1, 1)
    if fmt == "nvfp4":
        assert sd[f"{p}.gate_proj.weight"].shape == (inter, H // 2) and sd[f"{p}.down_proj.weight"].shape == (H, inter // 2)
    if model == "deepseek_v3":
        attn = "model.layers.1.self_attn.kv_a_proj_with_mqa"
        if fmt == "fp8_block":
            assert sd[f"{attn}.weight"].dtype == torch.float8_e4m3fn and sd[f"{attn}.weight"].shape == (40, H)
        else:  # nvfp4: attention float, the MLPs quantized
            assert sd[f"{attn}.weight"].dtype == torch.float32
            assert sd["model.layers.0.mlp.down_proj.weight"].dtype == torch.uint8
            assert sd["model.layers.2.mlp.shared_experts.gate_proj.weight"].dtype == torch.uint8


@pytest.mark.parametrize("model, fmt", CASES)
def test_quantization_config_parses_and_classifies_every_linear(model, fmt):
    """transformers parses the fine-grained FP8 entry with its own class (5.23 has no ModelOpt
    config class: pinned, so that one appearing is noticed), and the exclude patterns keep exactly
    the non-quantized linears float, read as fnmatch wildcards (vLLM's ModelOpt loader) and as
    transformers' ``should_convert_module`` patterns."""
    from transformers import AutoConfig, FineGrainedFP8Config
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING
    from transformers.quantizers.quantizers_utils import should_convert_module

    qcfg = EXPECTED_QCFG[(model, fmt)]
    if fmt == "fp8_block":
        parsed = FineGrainedFP8Config.from_dict(dict(qcfg))
        assert list(parsed.weight_block_size) == [128, 128] and parsed.activation_scheme == "dynamic"
        assert parsed.modules_to_not_convert == qcfg["modules_to_not_convert"]
        loaded = AutoConfig.from_pretrained(quantized_checkpoint(model, fmt)).quantization_config
        assert (loaded if isinstance(loaded, dict) else loaded.to_dict())["quant_method"] == "fp8"
        patterns = qcfg["modules_to_not_convert"]
    else:
        assert "modelopt" not in AUTO_QUANTIZATION_CONFIG_MAPPING
        patterns = qcfg["exclude_modules"]
    quantized = set(_quantized(model, fmt))
    linears = sorted(k[: -len(".weight")] for k, t in _float_sd(model).items()
                     if k.endswith(".weight") and t.ndim == 2 and "embed_tokens" not in k)
    assert "lm_head" in linears and f"model.layers.{MOE_IDS[model][0]}.mlp.gate" in linears
    assert quantized < set(linears)
    for name in linears:
        by_fnmatch = any(fnmatch(name, p) for p in patterns)
        by_hf = not should_convert_module(name, patterns)
        assert by_fnmatch == by_hf == (name not in quantized), name


# ---- decoding: close to the float weights, not equal, and decoded the same a second way -----------


@pytest.mark.parametrize("model, fmt", CASES)
def test_decode_close_to_float(model, fmt):
    deq, float_sd = _deq(model, fmt), _float_sd(model)
    assert deq.keys() == float_sd.keys()
    errors = {}
    for prefix in _quantized(model, fmt):
        w, d = float_sd[f"{prefix}.weight"], deq[f"{prefix}.weight"]
        assert d.dtype == torch.float32 and d.shape == w.shape
        errors[prefix] = _rel(d, w)
    assert max(errors.values()) < WEIGHT_ERR[fmt], max(errors.items(), key=lambda kv: kv[1])
    assert min(errors.values()) > 0.005, min(errors.items(), key=lambda kv: kv[1])  # the quantization is real
    for name, t in float_sd.items():
        if name.rsplit(".", 1)[0] not in set(_quantized(model, fmt)):
            assert torch.equal(deq[name], t), name


@pytest.mark.parametrize("model, fmt", CASES)
def test_transformers_decodes_every_quantized_linear_the_same(model, fmt):
    """A second decode per linear: transformers 5.23's ``Fp8Dequantize`` (fp8_block tiles; its FP4
    unpacker, low nibble first, for NVFP4), or a float64 product (fp8), equals ours exactly."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    op = Fp8Dequantize(None)
    sd, deq = _files(model, fmt), _deq(model, fmt)
    for prefix in _quantized(model, fmt):
        t = {s: sd[f"{prefix}.{s}"] for s in ("weight", "weight_scale", "weight_scale_2", "weight_scale_inv")
             if f"{prefix}.{s}" in sd}
        if fmt == "fp8_block":
            theirs = op._dequantize_one(t["weight"], t["weight_scale_inv"], output_dtype=torch.float32)
        elif fmt == "nvfp4":
            values = op._unpack_fp4(t["weight"].view(torch.int8))
            theirs = values * t["weight_scale"].float().repeat_interleave(16, 1) * t["weight_scale_2"]
        else:
            theirs = (t["weight"].double() * t["weight_scale"].double()).float()
        assert torch.equal(theirs, deq[f"{prefix}.weight"]), prefix


@pytest.mark.parametrize("model", MODELS)
def test_transformers_loads_the_fine_grained_fp8_checkpoint_to_the_reference_weights(model):
    """HF's own loader of fine-grained FP8 (``FineGrainedFP8Config(dequantize=True)``, its CPU path)
    reads the checkpoint's per-expert names, stacks the experts and decodes every tile: the model
    it builds holds exactly the reference's weights (it does not quantize activations, so only
    the weights are compared)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    hf = AutoModelForCausalLM.from_pretrained(qe.quantized_checkpoint(model, "fp8_block"), dtype=torch.float32,
                                              quantization_config=FineGrainedFP8Config(dequantize=True))
    ours = qe.reference_model(model, "fp8_block").state_dict()
    theirs = hf.state_dict()
    assert set(theirs) == set(ours)
    for name, value in theirs.items():
        assert torch.equal(value.float(), ours[name].float()), name


def test_weight_scales_follow_modelopt():
    """NVFP4: weight_scale_2 = amax / (6 * 448), shared (max) by linears reading the same input:
    q/k/v, every gate/up pair (dense MLP, shared experts, each routed expert). FP8 per-tensor: each
    linear keeps its own amax / 448 (ModelOpt does not fuse FP8 scales)."""
    for model in MODELS:
        sd, float_sd = _files(model, "nvfp4"), _float_sd(model)
        groups = qe.shared_input_groups(model, "nvfp4")
        grouped = {p for g in groups for p in g}
        assert len(groups) == MOE_LAYERS[model] * NUM_EXPERTS[model] + (2 if model == "qwen3_moe" else 3)
        assert set(QUANTIZED_EXPERT_PROJS[model]) - grouped == {p for p in QUANTIZED_EXPERT_PROJS[model]
                                                                 if p.endswith("down_proj")}
        for group in groups:
            amax = max(float_sd[f"{p}.weight"].abs().max().item() for p in group)
            for p in group:
                assert sd[f"{p}.weight_scale_2"].item() == pytest.approx(amax / (6 * 448), rel=1e-6), p
        for p in set(_quantized(model, "nvfp4")) - grouped:
            amax = float_sd[f"{p}.weight"].abs().max().item()
            assert sd[f"{p}.weight_scale_2"].item() == pytest.approx(amax / (6 * 448), rel=1e-6), p
    sd, float_sd = _files("qwen3_moe", "fp8"), _float_sd("qwen3_moe")
    differ = 0
    for p in _quantized("qwen3_moe", "fp8"):
        assert sd[f"{p}.weight_scale"].item() == pytest.approx(float_sd[f"{p}.weight"].abs().max().item() / 448, rel=1e-6)
        if p.endswith("gate_proj"):
            differ += sd[f"{p}.weight_scale"].item() != sd[f"{p[:-9]}up_proj.weight_scale"].item()
    assert differ == MOE_LAYERS["qwen3_moe"] * NUM_EXPERTS["qwen3_moe"]


# ---- static input scales, per expert --------------------------------------------------------------


def _hf_expert_amax(model: str):
    """Per MoE layer and expert: (amax of the routed rows, amax of silu(gate) * up on them), from
    HF's own eager forward (a pre-hook on its experts module sees its input and top-k routing)."""
    hf = _float(model)
    seen = {}
    handles = [hf.model.layers[i].mlp.experts.register_forward_pre_hook(
        lambda mod, args, i=i: seen.__setitem__(i, (args[0].detach(), args[1].detach()))) for i in MOE_IDS[model]]
    with torch.no_grad():
        hf(qe.calibration_tokens())
    for h in handles:
        h.remove()
    float_sd = _float_sd(model)
    out = {}
    for i, (x, top_k) in seen.items():
        for e in range(NUM_EXPERTS[model]):
            rows = x[(top_k == e).any(-1)]
            if rows.shape[0] == 0:
                continue
            p = f"model.layers.{i}.mlp.experts.{e}"
            h = torch.nn.functional.silu(rows @ float_sd[f"{p}.gate_proj.weight"].T) * (rows @ float_sd[f"{p}.up_proj.weight"].T)
            out[(i, e)] = (rows.abs().max().item(), h.abs().max().item())
    return out


@pytest.mark.parametrize("model, fmt", STATIC)
def test_expert_input_scales_are_per_expert_calibrations(model, fmt):
    scales = {k: v.item() for k, v in input_scales(model, fmt).items()}
    assert set(scales) == set(_quantized(model, fmt))
    measured = _hf_expert_amax(model)
    bound = BOUND[fmt]
    for i in MOE_IDS[model]:
        p = f"model.layers.{i}.mlp.experts"
        reached = {e: measured[(i, e)] for e in range(NUM_EXPERTS[model]) if (i, e) in measured}
        assert len(reached) >= NUM_EXPERTS[model] - 1
        top_in, top_mid = max(a for a, _ in reached.values()), max(b for _, b in reached.values())
        gate_up, down = [], []
        for e in range(NUM_EXPERTS[model]):
            a_in, a_mid = reached.get(e, (top_in, top_mid))  # unreached: the layer's largest
            g, u, d = (scales[f"{p}.{e}.{proj}"] for proj in ("gate_proj", "up_proj", "down_proj"))
            assert g == u, (p, e)  # gate and up read the same input
            assert g == pytest.approx(a_in / bound, rel=1e-5), (p, e)
            assert d == pytest.approx(a_mid / bound, rel=1e-4), (p, e)
            gate_up.append(g)
            down.append(d)
        # Genuinely per expert: the down scales all differ; gate/up mostly (a top-2 token with the
        # batch's largest value reaches two experts, which then share that amax).
        assert len(set(down)) == NUM_EXPERTS[model], down
        assert len(set(gate_up)) >= NUM_EXPERTS[model] - 3, gate_up
        assert max(gate_up) / min(gate_up) > 1.1 and max(down) / min(down) > 1.2
    # dense linears: the largest |input| they see; q/k/v (and gate/up) read the same input
    dense = QUANTIZED_LINEARS[(model, fmt)]
    assert all(scales[p] > 0.1 / bound for p in dense)
    for p in dense:
        if p.endswith(("k_proj", "v_proj")):
            assert scales[p] == scales[p[:-6] + "q_proj"]


def test_fp8_and_nvfp4_scales_come_from_the_same_calibration():
    fp8, nvfp4 = input_scales("qwen3_moe", "fp8"), input_scales("qwen3_moe", "nvfp4")
    assert fp8.keys() == nvfp4.keys()
    for p in fp8:
        torch.testing.assert_close(fp8[p] * 448, nvfp4[p] * 6 * 448)


def test_unreached_expert_gets_its_layers_largest_amax():
    assert qe._fill_unreached({0: 1.0, 3: 2.5, 1: 0.5}, 5) == {0: 1.0, 1: 0.5, 2: 2.5, 3: 2.5, 4: 2.5}
    with pytest.raises(ValueError):
        qe._fill_unreached({}, 4)


# ---- the reference models ---------------------------------------------------------------------


@pytest.mark.parametrize("model", MODELS)
def test_reference_experts_loop_is_hf_eager_without_quantization(model):
    """The replacement experts forward with identity activations and the float weights is HF's
    own eager model: the reference differs from it only by the format's quantization."""
    directory = float_checkpoint(model)
    plain = qe._reference(model, FORMATS[model][0], directory, _float_sd(model), {}, quantize_activations=False)
    assert all(type(plain.model.layers[i].mlp.experts).forward is not plain.model.layers[i].mlp.experts.forward.__func__
               for i in MOE_IDS[model])
    with torch.no_grad():
        assert _rel_rmse(plain(_tokens()).logits, _float(model)(_tokens()).logits) < 1e-6


@pytest.mark.parametrize("model, fmt", CASES)
def test_reference_logits_close_to_float(model, fmt):
    ids = _tokens()
    ref = _ref(model, fmt)
    assert not ref.training and next(ref.parameters()).dtype == torch.float32
    assert ref.config._experts_implementation == "eager" and ref.config._attn_implementation == "eager"
    with torch.no_grad():
        out, base = ref(ids).logits, _float(model)(ids).logits
    err = _rel_rmse(out, base)
    assert 0.01 < err < LOGIT_ERR[(model, fmt)], err
    assert (out.argmax(-1) == base.argmax(-1)).float().mean() > 0.5
    # the activation fake-quant is active: the same decoded weights without it give other logits
    weights_only = qe._reference(model, fmt, quantized_checkpoint(model, fmt), _deq(model, fmt), {},
                                 quantize_activations=False)
    with torch.no_grad():
        assert _rel_rmse(out, weights_only(ids).logits) > 1e-3


@pytest.mark.parametrize("model, fmt", STATIC)
def test_per_expert_scales_matter(model, fmt):
    """The reference applies each expert's own scales: with every expert's scales replaced by the
    layer's largest (one scale per layer and projection kind), the logits move measurably."""
    scales = dict(input_scales(model, fmt))
    for i in MOE_IDS[model]:
        p = f"model.layers.{i}.mlp.experts"
        for projs in (("gate_proj", "up_proj"), ("down_proj",)):
            names = [f"{p}.{e}.{proj}" for e in range(NUM_EXPERTS[model]) for proj in projs]
            top = max(scales[n] for n in names)
            scales.update({n: top for n in names})
    layer_max = qe._reference(model, fmt, quantized_checkpoint(model, fmt), _deq(model, fmt), scales)
    ids = _tokens()
    with torch.no_grad():
        err = _rel_rmse(layer_max(ids).logits, _ref(model, fmt)(ids).logits)
    assert err > 0.02, err


@pytest.mark.parametrize("model", MODELS)
def test_greedy_prompt_has_clear_gaps_in_every_format(model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(float_checkpoint(model))
    for fmt in FORMATS[model]:
        ids = tok(GREEDY_PROMPT[model], return_tensors="pt").input_ids
        gaps, stds = [], []
        with torch.no_grad():
            for _ in range(GREEDY_TOKENS):
                logits = _ref(model, fmt)(ids).logits[0, -1]
                top = logits.topk(2).values
                gaps.append((top[0] - top[1]).item())
                stds.append(logits.std().item())
                ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
        assert min(gaps) >= MIN_GREEDY_GAP, (fmt, gaps)
        assert 1.0 < min(stds) and max(stds) < 3.0, (fmt, stds)


def test_cached_checkpoints_are_reused():
    path = quantized_checkpoint("qwen3_moe", "fp8")
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert quantized_checkpoint("qwen3_moe", "fp8") == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
    assert os.path.basename(path) == "quant_experts-qwen3_moe-fp8"
    assert os.path.basename(float_checkpoint("deepseek_v3")) == "quant_experts-deepseek_v3-float"
    with open(os.path.join(path, ".writer-version")) as f:
        assert f.read().strip() == qe.WRITER_VERSION
    assert not [d for d in os.listdir(os.path.dirname(path)) if d.startswith("quant_experts-") and ".tmp" in d]
    with pytest.raises(ValueError):
        quantized_checkpoint("deepseek_v3", "fp8")
