"""The MXFP4 GPT-OSS test checkpoint (tests/quant_moe_checkpoints.py) is what it claims to be.

autodeploy's loading of quantized MoE checkpoints is judged against it, so its layout is pinned
tensor by tensor against OpenAI's GPT-OSS releases, transformers' own MXFP4 loader (the
reference: ``Mxfp4Config(dequantize=True)`` on CPU, no extra package) must read it to exactly
the writer's decoded weights, and the quantization is shown to be real MXFP4.

Measured (transformers 5.23, torch 2.13 CPU): expert weights' relative RMSE after MXFP4
0.114 per layer and projection; HF-loaded vs reference_model logits rel. RMSE ~1e-7; reference
vs float model logits rel. RMSE 0.11-0.18; greedy top-2 gaps on GREEDY_PROMPT 0.32-2.2 (logits
std ~2).

The forwards run on one thread: on this tiny model a 2-thread forward is ~100x slower than a
1-thread one when the machine's cores are shared (0.7 s vs 3 ms measured under load).
"""

import json
import os

import pytest
import torch
from safetensors import safe_open

from quant_moe_checkpoints import (
    E2M1_VALUES,
    GREEDY_PROMPT,
    GREEDY_TOKENS,
    QUANTIZED_PARAMS,
    dequantized_state_dict,
    e2m1_codes,
    float_checkpoint,
    float_model,
    mxfp4_checkpoint,
    mxfp4_dequantize,
    mxfp4_quantize,
    reference_model,
)

E, H, I, LAYERS = 4, 64, 128, 2
# The release's config entry, written out here (not taken from the writer) so the spec is pinned.
EXPECTED_QCFG = {"quant_method": "mxfp4",
                 "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                            "model.embed_tokens", "lm_head"]}
E2M1_MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()).item()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def files():
    path = os.path.join(mxfp4_checkpoint(), "model.safetensors")
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.fixture(scope="module")
def ref():
    return reference_model()


def test_layout_and_config_are_the_releases(files):
    for i in range(LAYERS):
        p = f"model.layers.{i}.mlp.experts."
        expected = {
            "gate_up_proj_blocks": ((E, 2 * I, H // 32, 16), torch.uint8),
            "gate_up_proj_scales": ((E, 2 * I, H // 32), torch.uint8),
            "gate_up_proj_bias": ((E, 2 * I), torch.bfloat16),
            "down_proj_blocks": ((E, H, I // 32, 16), torch.uint8),
            "down_proj_scales": ((E, H, I // 32), torch.uint8),
            "down_proj_bias": ((E, H), torch.bfloat16),
        }
        for suffix, (shape, dtype) in expected.items():
            t = files[p + suffix]
            assert (tuple(t.shape), t.dtype) == (shape, dtype), (p + suffix, t.shape, t.dtype)
        assert p + "gate_up_proj" not in files and p + "down_proj" not in files
    others = [k for k in files if ".mlp.experts." not in k]
    assert others and all(files[k].dtype == torch.bfloat16 for k in others)
    with open(os.path.join(mxfp4_checkpoint(), "config.json")) as f:
        cfg = json.load(f)
    assert cfg["quantization_config"] == EXPECTED_QCFG
    assert cfg["model_type"] == "gpt_oss" and cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert os.path.exists(os.path.join(mxfp4_checkpoint(), "tokenizer.json"))


def test_hf_mxfp4_loader_reads_the_writers_weights(ref):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Mxfp4Config

    hf = AutoModelForCausalLM.from_pretrained(
        mxfp4_checkpoint(), quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()  # (no device_map: that needs accelerate, which the venv does not have; CPU is the default)
    ours = dequantized_state_dict()
    theirs = hf.state_dict()
    assert all(t.device.type == "cpu" for t in theirs.values())
    assert set(ours) == set(theirs)
    for name in QUANTIZED_PARAMS:
        assert theirs[name].dtype == torch.float32 and torch.equal(theirs[name], ours[name]), name
    for name, t in ours.items():
        assert torch.equal(theirs[name].float(), t), name
    tok = AutoTokenizer.from_pretrained(mxfp4_checkpoint())
    ids = tok("The quick brown fox jumps over", return_tensors="pt").input_ids
    with torch.no_grad():
        assert _rel(hf(ids).logits, ref(ids).logits) < 1e-5


def test_quantization_is_real_mxfp4(files):
    floats = float_model().state_dict()
    deq = dequantized_state_dict()
    for name in QUANTIZED_PARAMS:
        w, q = floats[name], deq[name]
        assert 0.01 < _rel(q, w) < 0.2, (name, _rel(q, w))
        # Scale-free: each nonzero value's frexp mantissa is 0.5 or 0.75 (e2m1's 1.0 / 1.5 mantissas).
        mantissa, _ = torch.frexp(q[q != 0])
        assert torch.isin(mantissa.abs(), torch.tensor([0.5, 0.75])).all(), name
        # Every value is an e2m1 value times the power of two its group's e8m0 scale stores,
        # with the group's largest magnitude in [4, 6] (OCP: exponent floor(log2 amax) - 2).
        scales = files[f"{name}_scales"].to(torch.float64)  # [E, out, in/32]
        groups = q.transpose(1, 2).double().reshape(*scales.shape, 32) / torch.pow(2.0, scales - 127)[..., None]
        assert torch.isin(groups.abs(), torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)).all(), name
        gmax = groups.abs().amax(-1)
        assert ((gmax >= 4) & (gmax <= 6)).all(), name
        # ... and the nearest one to the float weight (brute force over the grid, saturating at 6).
        wg = w.transpose(1, 2).double().reshape(*scales.shape, 32) / torch.pow(2.0, scales - 127)[..., None]
        grid = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
        nearest = (wg.abs()[..., None] - grid).abs().amin(-1)
        assert torch.allclose((wg.abs() - groups.abs()).abs(), nearest), name
        assert (torch.sign(groups) * torch.sign(wg) >= 0).all(), name
    for name, t in floats.items():  # everything else is the float checkpoint's, unchanged
        if name not in QUANTIZED_PARAMS:
            assert torch.equal(deq[name], t), name


def test_hand_made_group_nibble_order_and_scale():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    # Codes chosen by hand (no 8: -0 has no distinct float value); the group's amax is
    # 6 * 2^-3 = 0.75, so the shared exponent is floor(log2 0.75) - 2 = -3, stored 124.
    codes = [1, 7, 9, 15, 2, 3, 10, 11, 4, 5, 12, 13, 6, 0, 14, 1] * 2
    values = E2M1_VALUES[codes] * 2.0**-3
    blocks, scales = mxfp4_quantize(values.reshape(1, 32))
    assert scales.tolist() == [[124]]
    expected = [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]
    assert blocks.reshape(-1).tolist() == expected
    assert blocks.reshape(-1)[:2].tolist() == [0x71, 0xF9]  # element 0 in the low nibble
    assert torch.equal(mxfp4_dequantize(blocks, scales).reshape(-1), values)
    # transformers' decoder (OpenAI's reference) agrees on the same bytes: [E, out, G, 16] -> [E, in, out].
    theirs = convert_moe_packed_tensors(blocks.reshape(1, 1, 1, 16), scales.reshape(1, 1, 1), dtype=torch.float32)
    assert torch.equal(theirs.reshape(-1), values)


def test_e2m1_rounding_ties_to_even_and_saturation():
    # Midpoints go to the even mantissa (code with last bit 0); past 6 saturates.
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 100.0, 0.26, 2.51, -0.75, -5.0, -0.1])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 0.5, 3.0, -1.0, -4.0, -0.0])
    assert torch.equal(E2M1_VALUES[e2m1_codes(x).long()], want)
    # Inside a group: amax 7 gives exponent floor(log2 7) - 2 = 0, so 7 saturates to 6.
    g = torch.zeros(32)
    g[:8] = torch.tensor([7.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    blocks, scales = mxfp4_quantize(g.reshape(1, 32))
    assert scales.item() == 127
    assert mxfp4_dequantize(blocks, scales)[0, :8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    # An all-zero group decodes to zeros with a valid (non-NaN) e8m0 scale.
    blocks, scales = mxfp4_quantize(torch.zeros(2, 32))
    assert (blocks == 0).all() and (scales != 255).all() and (mxfp4_dequantize(blocks, scales) == 0).all()


def test_greedy_generation_has_no_near_ties(ref):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(mxfp4_checkpoint())(GREEDY_PROMPT, return_tensors="pt").input_ids
    gaps = []
    with torch.no_grad():
        for _ in range(GREEDY_TOKENS):
            logits = ref(ids).logits[0, -1]
            top = logits.topk(2).values
            gaps.append((top[0] - top[1]).item())
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    assert min(gaps) > 0.02, gaps
    # The quantization moves the logits by a plausible amount (MXFP4, not a no-op).
    with torch.no_grad():
        err = _rel(ref(ids).logits, float_model()(ids).logits)
    assert 0.01 < err < 0.5, err


def test_float_checkpoint_is_a_plain_hf_checkpoint():
    with open(os.path.join(float_checkpoint(), "config.json")) as f:
        cfg = json.load(f)
    assert "quantization_config" not in cfg and cfg["dtype"] == "float32"
    assert os.path.exists(os.path.join(float_checkpoint(), "tokenizer.json"))
