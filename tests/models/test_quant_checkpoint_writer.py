"""The quantized test checkpoints (tests/quant_checkpoints.py) are what they claim to be.

The library's quantized loading is judged against these checkpoints, so their layouts are
pinned here tensor by tensor, the packed formats are decoded a second time with plain bit
loops written from the formats' descriptions, and the quantization is shown to be real: the
decoded weights and the reference model's logits are close to the float original, not equal.

Measured (transformers 5.23, torch 2.13 CPU; the bounds below leave ~25-50% headroom):
  weight relative error (Frobenius, worst linear of llama; qwen3 / nemotron within 0.003):
  fp8 0.028, fp8_block 0.028, nvfp4 0.097, gptq 0.083, awq 0.083 (the same RTN grid as gptq),
  ct_int4 0.098.
  reference logits relative RMSE against the float model (4 x 24 random tokens):
  llama  fp8 0.046, fp8_block 0.043, nvfp4 0.157, gptq 0.097, awq 0.097, ct_int4 0.114;
  qwen3  fp8 0.051, gptq 0.107; nemotron fp8 0.097, gptq 0.210 (relu^2 amplifies errors).
"""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from quant_checkpoints import (
    FORMATS,
    QUANTIZED_LINEARS,
    dequantized_state_dict,
    e2m1_round,
    float_checkpoint,
    float_model,
    quantize_activation,
    quantized_checkpoint,
    reference_model,
)
import quant_checkpoints as qc

N_LAYERS = 2
K_PROJ = "model.layers.0.self_attn.k_proj"  # [32, 64]: small enough for bit-by-bit loops

# Worst per-linear relative weight error allowed after decoding (measured values in the docstring).
WEIGHT_ERR = {"fp8": 0.04, "fp8_block": 0.04, "nvfp4": 0.13, "gptq": 0.11, "awq": 0.11, "ct_int4": 0.13}
# Reference-model logits relative RMSE bound against the float model, per (model, format).
LOGIT_ERR = {
    ("llama", "fp8"): 0.08, ("llama", "fp8_block"): 0.08, ("llama", "nvfp4"): 0.25, ("llama", "gptq"): 0.15,
    ("llama", "awq"): 0.15, ("llama", "ct_int4"): 0.17,
    ("qwen3", "fp8"): 0.08, ("qwen3", "gptq"): 0.16, ("nemotron", "fp8"): 0.15, ("nemotron", "gptq"): 0.3,
}
SMOKE = [("qwen3", "fp8"), ("qwen3", "gptq"), ("nemotron", "fp8"), ("nemotron", "gptq")]

# The exact config entries, written out here (not taken from the writer) so the spec is pinned.
MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.29.0"}
EXPECTED_QCFG = {
    "fp8": {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"],
            "producer": MODELOPT_PRODUCER},
    "nvfp4": {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"],
              "producer": MODELOPT_PRODUCER},
    "fp8_block": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
                  "fmt": "e4m3", "modules_to_not_convert": ["lm_head"]},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": False,
             "checkpoint_format": "gptq"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True,
            "modules_to_not_convert": ["lm_head"]},
    "ct_int4": {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
                "ignore": ["lm_head"],
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                "group_size": 32},
                    "input_activations": None, "output_activations": None}}},
}
EXPECTED_HF_QUANT = {
    "fp8": {"producer": MODELOPT_PRODUCER,
            "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}},
    "nvfp4": {"producer": MODELOPT_PRODUCER,
              "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                               "exclude_modules": ["lm_head"]}},
}


def _expected_tensors(fmt: str, n: int, k: int):
    """suffix -> (dtype, shape) of one quantized [n, k] linear, from the format specs."""
    g = 32
    return {
        "fp8": {"weight": (torch.float8_e4m3fn, (n, k)), "weight_scale": (torch.float32, ()),
                "input_scale": (torch.float32, ())},
        "nvfp4": {"weight": (torch.uint8, (n, k // 2)), "weight_scale": (torch.float8_e4m3fn, (n, k // 16)),
                  "weight_scale_2": (torch.float32, ()), "input_scale": (torch.float32, ())},
        "fp8_block": {"weight": (torch.float8_e4m3fn, (n, k)),
                      "weight_scale_inv": (torch.float32, (-(-n // 128), -(-k // 128)))},
        "gptq": {"qweight": (torch.int32, (k // 8, n)), "qzeros": (torch.int32, (k // g, n // 8)),
                 "scales": (torch.float16, (k // g, n)), "g_idx": (torch.int32, (k,))},
        "awq": {"qweight": (torch.int32, (k, n // 8)), "qzeros": (torch.int32, (k // g, n // 8)),
                "scales": (torch.float16, (k // g, n))},
        # compressed-tensors writes weight_shape as torch.tensor(weight.shape): int64
        "ct_int4": {"weight_packed": (torch.int32, (n, k // 8)), "weight_scale": (torch.bfloat16, (n, k // g)),
                    "weight_shape": (torch.int64, (2,))},
    }[fmt]


def _float_sd(model: str):
    return load_file(os.path.join(float_checkpoint(model), "model.safetensors"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _rel_rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def _tokens() -> torch.Tensor:
    return torch.randint(0, 512, (4, 24), generator=torch.Generator().manual_seed(7))


def _u32(x: int) -> int:
    return x & 0xFFFFFFFF


# ---- layout: files, config entries, tensor names / dtypes / shapes ------------------------------


@pytest.mark.parametrize("model, fmt", [("llama", f) for f in FORMATS] + SMOKE)
def test_layout(model, fmt):
    directory = quantized_checkpoint(model, fmt)
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.exists(os.path.join(directory, name)), name
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["quantization_config"] == EXPECTED_QCFG[fmt]
    hf_quant = os.path.join(directory, "hf_quant_config.json")
    if fmt in EXPECTED_HF_QUANT:
        with open(hf_quant) as f:
            assert json.load(f) == EXPECTED_HF_QUANT[fmt]
    else:
        assert not os.path.exists(hf_quant)

    sd = load_file(os.path.join(directory, "model.safetensors"))
    float_sd = _float_sd(model)
    linears = QUANTIZED_LINEARS[model]
    assert len(linears) == N_LAYERS * (6 if model == "nemotron" else 7)
    expected = {}
    for prefix in linears:
        n, k = float_sd[f"{prefix}.weight"].shape
        expected.update({f"{prefix}.{s}": spec for s, spec in _expected_tensors(fmt, n, k).items()})
    # every other tensor (embeddings, norms, lm_head) is the float one, unchanged
    for name, t in float_sd.items():
        if name.rsplit(".", 1)[0] not in linears:
            expected[name] = (t.dtype, tuple(t.shape))
            assert torch.equal(sd[name], t), name
    assert {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()} == expected
    assert "lm_head.weight" in sd and sd["lm_head.weight"].dtype == torch.float32
    if fmt == "ct_int4":
        assert sd[f"{K_PROJ}.weight_shape"].tolist() == [32, 64]
    if fmt == "gptq":
        assert sd[f"{K_PROJ}.g_idx"].tolist() == [i // 32 for i in range(64)]


def test_input_scales_are_calibrated():
    """ModelOpt's input_scale is amax / 448 (fp8) or amax / (6 * 448) (nvfp4) of the same calibration."""
    fp8 = load_file(os.path.join(quantized_checkpoint("llama", "fp8"), "model.safetensors"))
    nvfp4 = load_file(os.path.join(quantized_checkpoint("llama", "nvfp4"), "model.safetensors"))
    for prefix in QUANTIZED_LINEARS["llama"]:
        amax = fp8[f"{prefix}.input_scale"] * 448
        assert amax > 0.1
        torch.testing.assert_close(nvfp4[f"{prefix}.input_scale"] * 6 * 448, amax)
    # inputs after a norm differ from inputs after attention / the activation function
    scales = {float(fp8[f"{p}.input_scale"]) for p in QUANTIZED_LINEARS["llama"]}
    assert len(scales) > 4


# ---- decoding: close to the float weights, and not equal to them --------------------------------


@pytest.mark.parametrize("model, fmt", [("llama", f) for f in FORMATS] + SMOKE)
def test_decode_close_to_float(model, fmt):
    deq = dequantized_state_dict(model, fmt)
    float_sd = _float_sd(model)
    assert deq.keys() == float_sd.keys()
    errors = []
    for prefix in QUANTIZED_LINEARS[model]:
        w, d = float_sd[f"{prefix}.weight"], deq[f"{prefix}.weight"]
        assert d.dtype == torch.float32 and d.shape == w.shape
        errors.append(_rel(d, w))
    assert max(errors) < WEIGHT_ERR[fmt], errors
    assert min(errors) > 0.01, errors  # the quantization is real
    for name, t in float_sd.items():
        if name.rsplit(".", 1)[0] not in QUANTIZED_LINEARS[model]:
            assert torch.equal(deq[name], t)


def test_gptq_and_awq_decode_to_the_same_weights():
    """Both use the same asymmetric round-to-nearest grid (every group has values of both signs),
    so two different bit layouts must decode to identical weights."""
    gptq, awq = dequantized_state_dict("llama", "gptq"), dequantized_state_dict("llama", "awq")
    for prefix in QUANTIZED_LINEARS["llama"]:
        assert torch.equal(gptq[f"{prefix}.weight"], awq[f"{prefix}.weight"]), prefix


def _tensors(fmt: str, prefix: str = K_PROJ):
    sd = load_file(os.path.join(quantized_checkpoint("llama", fmt), "model.safetensors"))
    return {k[len(prefix) + 1:]: v for k, v in sd.items() if k.startswith(prefix + ".")}


def test_gptq_packing_bit_by_bit():
    """AutoGPTQ: qweight [K/8, N], K-index 8r+j in bits 4j of row r; qzeros [K/g, N/8] holds
    zero - 1, column 8c+j in bits 4j; W[n, k] = (q - zero) * scale."""
    t = _tensors("gptq")
    qweight, qzeros, scales = t["qweight"].tolist(), t["qzeros"].tolist(), t["scales"].float()
    n_out, k_in = 32, 64
    w = torch.zeros(n_out, k_in)
    for k in range(k_in):
        for n in range(n_out):
            q = (_u32(qweight[k // 8][n]) >> (4 * (k % 8))) & 0xF
            zero = ((_u32(qzeros[k // 32][n // 8]) >> (4 * (n % 8))) & 0xF) + 1
            w[n, k] = (q - zero) * scales[k // 32, n]
    assert torch.equal(w, dequantized_state_dict("llama", "gptq")[f"{K_PROJ}.weight"])
    assert _rel(w, _float_sd("llama")[f"{K_PROJ}.weight"]) < WEIGHT_ERR["gptq"]


def test_awq_packing_bit_by_bit():
    """AutoAWQ GEMM: qweight [K, N/8]; nibble j (bits 4j) of word c holds output column
    8c + [0, 2, 4, 6, 1, 3, 5, 7][j]; qzeros [K/g, N/8] the same, zeros as they are."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    t = _tensors("awq")
    qweight, qzeros, scales = t["qweight"].tolist(), t["qzeros"].tolist(), t["scales"].float()
    n_out, k_in = 32, 64
    w = torch.full((n_out, k_in), float("nan"))
    q_interleaved = torch.zeros(k_in, n_out, dtype=torch.long)
    for k in range(k_in):
        for c in range(n_out // 8):
            for j in range(8):
                n = 8 * c + order[j]
                q = (_u32(qweight[k][c]) >> (4 * j)) & 0xF
                zero = (_u32(qzeros[k // 32][c]) >> (4 * j)) & 0xF
                w[n, k] = (q - zero) * scales[k // 32, n]
                q_interleaved[k, n] = q
    assert not w.isnan().any()
    assert torch.equal(w, dequantized_state_dict("llama", "awq")[f"{K_PROJ}.weight"])
    assert _rel(w, _float_sd("llama")[f"{K_PROJ}.weight"]) < WEIGHT_ERR["awq"]
    # the interleave matters: read in plain nibble order, most values land in other columns
    q_plain = torch.tensor([[(_u32(qweight[k][n // 8]) >> (4 * (n % 8))) & 0xF for n in range(n_out)]
                            for k in range(k_in)])
    assert (q_plain != q_interleaved).float().mean() > 0.5


def test_ct_int4_packing_bit_by_bit():
    """compressed-tensors pack-quantized: weight_packed [N, K/8], K-index 8c+i in bits 4i of word
    c, stored as q + 8; W = q * scale (symmetric, no zero point)."""
    t = _tensors("ct_int4")
    packed, scales = t["weight_packed"].tolist(), t["weight_scale"].float()
    w = torch.zeros(32, 64)
    for n in range(32):
        for k in range(64):
            q = ((_u32(packed[n][k // 8]) >> (4 * (k % 8))) & 0xF) - 8
            w[n, k] = q * scales[n, k // 32]
    assert torch.equal(w, dequantized_state_dict("llama", "ct_int4")[f"{K_PROJ}.weight"])
    # symmetric scale = group amax / 7.5 (bf16): the largest |value| of each group lands on -8 or 7
    float_w = _float_sd("llama")[f"{K_PROJ}.weight"].reshape(32, 2, 32)
    torch.testing.assert_close(scales, (float_w.abs().amax(-1) / 7.5).bfloat16().float())


def test_nvfp4_packing_bit_by_bit():
    """ModelOpt NVFP4: weight [N, K/2] uint8, element 2i in the low nibble; e2m1 code bits 0-2 index
    0, 0.5, 1, 1.5, 2, 3, 4, 6, bit 3 the sign; W = value * weight_scale (e4m3, per 16) * weight_scale_2."""
    values = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    t = _tensors("nvfp4")
    packed, block, scale_2 = t["weight"].tolist(), t["weight_scale"].float(), float(t["weight_scale_2"])
    w = torch.zeros(32, 64)
    for n in range(32):
        for k in range(64):
            code = (packed[n][k // 2] >> (4 * (k % 2))) & 0xF
            w[n, k] = (-1 if code & 8 else 1) * values[code & 7] * block[n, k // 16] * scale_2
    assert torch.equal(w, dequantized_state_dict("llama", "nvfp4")[f"{K_PROJ}.weight"])
    float_w = _float_sd("llama")[f"{K_PROJ}.weight"]
    assert scale_2 == pytest.approx(float_w.abs().max().item() / (6 * 448), rel=1e-6)
    # block scale = e4m3(block amax / 6 / weight_scale_2)
    expected = (float_w.reshape(32, 4, 16).abs().amax(-1) / (6 * scale_2)).to(torch.float8_e4m3fn).float()
    assert torch.equal(block, expected)


def test_fp8_block_edge_tiles():
    """A weight that is not a multiple of 128 gets partial edge tiles, each scaled by its own amax
    (the tiny models' linears all fit one tile, so this checks the writer on a bigger shape)."""
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(3))
    w[130:, 260:] *= 0.01  # a quiet corner tile
    t = qc._fp8_block(w)
    assert t["weight"].dtype == torch.float8_e4m3fn and t["weight"].shape == (200, 300)
    assert t["weight_scale_inv"].shape == (2, 3)
    torch.testing.assert_close(t["weight_scale_inv"][1, 2], w[128:, 256:].abs().max() / 448)
    torch.testing.assert_close(t["weight_scale_inv"][0, 0], w[:128, :128].abs().max() / 448)
    deq = qc._decode("fp8_block", t)
    assert _rel(deq, w) < 0.04
    assert _rel(deq[130:, 260:], w[130:, 260:]) < 0.04  # the corner kept its precision


def test_e2m1_rounding_follows_modelopt():
    x = torch.tensor([0.2, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 9.0, -0.74, -2.6, -100.0])
    expected = torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 3.0, 3.0, 4.0, 6.0, 6.0, -0.5, -3.0, -6.0])
    assert torch.equal(e2m1_round(x), expected)


# ---- activation fake-quant ----------------------------------------------------------------------


def test_activation_fake_quant():
    x = torch.randn(3, 5, 200, generator=torch.Generator().manual_seed(4))
    # fp8 static: values on the e4m3 grid times input_scale, saturating at 448 * input_scale
    s = torch.tensor(2.0**-8)  # a power of two, so y / s is exact
    y = quantize_activation("fp8", x, s)
    assert torch.equal((y / s).to(torch.float8_e4m3fn).float(), y / s)
    assert y.abs().max().item() == 448 * 2.0**-8 < x.abs().max().item()
    # fp8_block: per token and 128 channels (the second group partial), each group's max hits 448 * s
    y = quantize_activation("fp8_block", x)
    for lo, hi in ((0, 128), (128, 200)):
        amax = x[..., lo:hi].abs().amax(-1)
        torch.testing.assert_close(y[..., lo:hi].abs().amax(-1), amax)
        assert _rel(y[..., lo:hi], x[..., lo:hi]) < 0.05
    # nvfp4: per 16 channels, values are e2m1 * e4m3 block scale * input_scale
    g = torch.tensor(x.abs().max().item() / (6 * 448))
    x16 = x[..., :192]
    y = quantize_activation("nvfp4", x16, g)
    blocks_x, blocks_y = x16.reshape(3, 5, 12, 16), y.reshape(3, 5, 12, 16)
    scale = (blocks_x.abs().amax(-1, keepdim=True) / 6 / g).to(torch.float8_e4m3fn).float() * g
    torch.testing.assert_close(blocks_y / scale, e2m1_round(blocks_y / scale), rtol=0, atol=1e-5)
    assert 0.03 < _rel(y, x16) < 0.15
    # weight-only formats leave activations alone
    for fmt in ("gptq", "awq", "ct_int4"):
        assert quantize_activation(fmt, x) is x


# ---- the reference models -----------------------------------------------------------------------


def test_float_model_has_clear_greedy_tokens():
    """Weights are spread enough that the float model's top-2 logits are not near-ties."""
    with torch.no_grad():
        logits = float_model("llama")(_tokens()).logits
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[..., 0] - top2[..., 1]
    assert gaps.median() > 0.25 and (gaps < 0.01).float().mean() < 0.05


@pytest.mark.parametrize("model, fmt", [("llama", f) for f in FORMATS] + SMOKE)
def test_reference_logits_close_to_float(model, fmt):
    ids = _tokens()
    ref = reference_model(model, fmt)
    assert not ref.training and next(ref.parameters()).dtype == torch.float32
    with torch.no_grad():
        out, base = ref(ids).logits, float_model(model)(ids).logits
    err = _rel_rmse(out, base)
    assert 0.005 < err < LOGIT_ERR[(model, fmt)], err
    # greedy tokens mostly survive quantization
    assert (out.argmax(-1) == base.argmax(-1)).float().mean() > 0.5


@pytest.mark.parametrize("fmt", ["fp8", "fp8_block", "nvfp4"])
def test_reference_quantizes_activations(fmt):
    """W8A8 / W4A4 formats: the reference's activation hooks change the logits beyond the weights'
    effect (the same decoded weights without the hooks give other logits)."""
    ids = _tokens()
    ref = reference_model("llama", fmt)
    weights_only = qc._load_hf(quantized_checkpoint("llama", fmt), "llama", dequantized_state_dict("llama", fmt))
    with torch.no_grad():
        a, b = ref(ids).logits, weights_only(ids).logits
    assert _rel_rmse(a, b) > 1e-3


def test_cached_checkpoints_are_reused():
    path = quantized_checkpoint("llama", "fp8")
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert quantized_checkpoint("llama", "fp8") == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
    assert os.path.basename(path) == "quant-llama-fp8"
    assert not [d for d in os.listdir(os.path.dirname(path)) if ".tmp" in d and d.startswith("quant-")]


def test_transformers_decodes_fp8_block_and_fp4_nibbles_the_same():
    """Upstream cross-check (transformers 5.23, pinned): its ``Fp8Dequantize`` decodes the fp8_block
    tensors to exactly our weights, and its FP4 unpacker (low nibble first) reads our NVFP4 codes."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    op = Fp8Dequantize(None)
    block, nvfp4 = _tensors("fp8_block"), _tensors("nvfp4")
    ours = dequantized_state_dict("llama", "fp8_block")[f"{K_PROJ}.weight"]
    theirs = op._dequantize_one(block["weight"], block["weight_scale_inv"], output_dtype=torch.float32)
    assert torch.equal(theirs, ours)
    values = op._unpack_fp4(nvfp4["weight"].view(torch.int8))
    theirs = values * nvfp4["weight_scale"].float().repeat_interleave(16, 1) * nvfp4["weight_scale_2"]
    assert torch.equal(theirs, dequantized_state_dict("llama", "nvfp4")[f"{K_PROJ}.weight"])
