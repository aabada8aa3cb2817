"""The per-expert quantized MoE ops (``torch_quant_fp8_moe``, ``torch_quant_finegrained_fp8_moe``,
``torch_quant_nvfp4_moe``) are ``torch_moe`` whose projections are the format's quantized linears
(checked against the linear ops, expert by expert), their ``_stacked`` forms equal them, and ``grouped_quant_moe_fused`` over the same
experts decoded once equals them (both strategies, two token counts, experts with distinct input
scales and experts no token chose)."""

from typing import Dict, List

import pytest
import torch
import torch.nn.functional as F

import autodeploy.ops  # noqa: F401  (registers the ops)
from autodeploy.ops.quant import formats

ad = torch.ops.autodeploy
E, H, I, K = 4, 64, 48, 2
PROJ_SHAPES = {"gate": (I, H), "up": (I, H), "down": (H, I)}


def _quantize(fmt: str, w: torch.Tensor, g: torch.Generator) -> Dict[str, torch.Tensor]:
    """One projection in ``fmt`` (the op's tensor kinds), with a random calibrated input scale."""
    amax = 1.0 + 3.0 * torch.rand((), generator=g)  # a distinct input scale per projection and expert
    if fmt == "fp8":
        scale = (w.abs().amax() / formats.FP8_MAX).reshape(())
        return {"weight": formats.fp8_encode(w / scale), "input_scale": amax / formats.FP8_MAX,
                "weight_scale": scale}
    if fmt == "fp8_block":
        q, s = formats.quantize_fp8_blocks(w, (128, 128))
        return {"weight": q, "weight_scale_inv": s}
    scale_2 = (w.abs().amax() / (formats.FP4_MAX * formats.FP8_MAX)).reshape(())
    codes, block_scales = formats.nvfp4_quantize(w, scale_2)
    return {"weight": formats.pack_nibbles(codes), "input_scale": amax / (formats.FP4_MAX * formats.FP8_MAX),
            "weight_scale": block_scales, "weight_scale_2": scale_2}


KINDS = {"fp8": ("weight", "input_scale", "weight_scale"), "fp8_block": ("weight", "weight_scale_inv"),
         "nvfp4": ("weight", "input_scale", "weight_scale", "weight_scale_2")}
OPS = {"fp8": ad.torch_quant_fp8_moe, "fp8_block": ad.torch_quant_finegrained_fp8_moe, "nvfp4": ad.torch_quant_nvfp4_moe}


def _experts(fmt: str) -> Dict[str, List[Dict[str, torch.Tensor]]]:
    g = torch.Generator().manual_seed(7)
    return {p: [_quantize(fmt, torch.randn(shape, generator=g) * 0.1, g) for _ in range(E)]
            for p, shape in PROJ_SHAPES.items()}


def _op_args(fmt: str, experts) -> list:
    args = [[experts[p][e][kind] for e in range(E)] for kind in KINDS[fmt] for p in ("gate", "up", "down")]
    return args + ([128, 128] if fmt == "fp8_block" else [])


def _linear(fmt: str, x: torch.Tensor, t: Dict[str, torch.Tensor]) -> torch.Tensor:
    if fmt == "fp8":
        return ad.torch_quant_fp8_linear(x, t["weight"], None, t["input_scale"], t["weight_scale"])
    if fmt == "fp8_block":
        return ad.torch_quant_finegrained_fp8_linear(x, t["weight"], None, t["weight_scale_inv"], 128, 128)
    return ad.torch_quant_nvfp4_linear(x, t["weight"], None, t["input_scale"], t["weight_scale"], t["weight_scale_2"])


def _routing(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g)
    # expert 3 never chosen: its weights must not matter
    sel = torch.stack([torch.randperm(3, generator=g)[:K] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, K, generator=g), -1)
    return x, sel, w


@pytest.mark.parametrize("fmt", ["fp8", "fp8_block", "nvfp4"])
@pytest.mark.parametrize("tokens", [1, 9])
def test_per_expert_op_is_the_quantized_linears(fmt, tokens):
    experts = _experts(fmt)
    x, sel, w = _routing(tokens, tokens)
    got = OPS[fmt](x, sel, w, *_op_args(fmt, experts))
    want = torch.zeros_like(x)
    for t in range(tokens):
        for k in range(K):
            e = int(sel[t, k])
            row = x[t:t + 1]
            h = F.silu(_linear(fmt, row, experts["gate"][e])) * _linear(fmt, row, experts["up"][e])
            want[t] += w[t, k] * _linear(fmt, h, experts["down"][e])[0]
    assert _rel(got, want) < 1e-3  # one row at a time vs an expert's rows together: summation order


@pytest.mark.parametrize("fmt", ["fp8", "fp8_block", "nvfp4"])
@pytest.mark.parametrize("bmm_max_pairs", [0, 1 << 20])
def test_grouped_op_on_decoded_experts_equals_the_per_expert_op(fmt, bmm_max_pairs):
    experts = _experts(fmt)

    def decode(t):
        if fmt == "fp8":
            return formats.dequantize_fp8(t["weight"], t["weight_scale"])
        if fmt == "fp8_block":
            return formats.dequantize_fp8_blocks(t["weight"], t["weight_scale_inv"], (128, 128))
        return formats.dequantize_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"])

    gate_up = torch.stack([torch.cat([decode(experts["gate"][e]), decode(experts["up"][e])]) for e in range(E)])
    down = torch.stack([decode(experts["down"][e]) for e in range(E)])
    scales = [None, None]
    if fmt != "fp8_block":
        for e in range(E):  # gate and up read the same input: give them one scale, as calibration does
            experts["up"][e]["input_scale"] = experts["gate"][e]["input_scale"]
        scales = [torch.stack([experts[p][e]["input_scale"] for e in range(E)]) for p in ("gate", "down")]
    act_quant = {"fp8": "fp8", "fp8_block": "fp8_group", "nvfp4": "nvfp4"}[fmt]
    for tokens in (1, 9):
        x, sel, w = _routing(tokens, 100 + tokens)
        want = OPS[fmt](x, sel, w, *_op_args(fmt, experts))
        got = ad.grouped_quant_moe_fused(x, sel, w, gate_up, down, *scales, None, None, "silu", 1.0, 0.0, act_quant,
                                         128, bmm_max_pairs)
        # another row grouping may sum in another order: room for a rounding boundary crossed
        assert _rel(got, want) < 1e-3
        # the per-expert scales are used: one shared scale gives other numbers
        if fmt != "fp8_block":
            shared = [s.max().expand(E).contiguous() for s in scales]
            other = ad.grouped_quant_moe_fused(x, sel, w, gate_up, down, *shared, None, None, "silu", 1.0, 0.0,
                                               act_quant, 128, bmm_max_pairs)
            assert _rel(other, want) > 1e-2


STACKED_OPS = {"fp8": ad.torch_quant_fp8_moe_stacked, "fp8_block": ad.torch_quant_finegrained_fp8_moe_stacked,
               "nvfp4": ad.torch_quant_nvfp4_moe_stacked}


@pytest.mark.parametrize("fmt", ["fp8", "fp8_block", "nvfp4"])
def test_stacked_op_equals_the_per_expert_op(fmt):
    """The ``_stacked`` form over each list stacked along a leading expert dim computes the same
    numbers exactly (it reads expert e's tensors at index e), at two token counts; a stack of
    another expert count than the others is refused."""
    experts = _experts(fmt)
    args = _op_args(fmt, experts)
    stacked = [torch.stack(a) if isinstance(a, list) else a for a in args]
    for tokens in (1, 9):
        x, sel, w = _routing(tokens, 300 + tokens)
        torch.testing.assert_close(STACKED_OPS[fmt](x, sel, w, *stacked), OPS[fmt](x, sel, w, *args), rtol=0, atol=0)
    stacked[1] = stacked[1][:-1]
    with pytest.raises(ValueError, match="one tensor per expert"):
        STACKED_OPS[fmt](x, sel, w, *stacked)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).pow(2).mean() / b.pow(2).mean()).sqrt())


def test_lists_of_different_lengths_are_refused():
    experts = _experts("fp8")
    args = _op_args("fp8", experts)
    args[0] = args[0][:-1]
    x, sel, w = _routing(2, 0)
    with pytest.raises(ValueError, match="one tensor per expert"):
        ad.torch_quant_fp8_moe(x, sel, w, *args)


def test_exact_activations_turns_the_rounding_off_and_back_on():
    """The KV-cache consistency check runs under ``exact_activations``: every activation
    quantization returns its input there (the check compares schedules, and FP8/FP4 rounding
    would turn reduction-order noise into flipped codes), and rounds again after it."""
    from autodeploy.ops.quant.formats import exact_activations

    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    scale = torch.tensor(0.01)
    ops = [lambda: ad.torch_quant_fp8_activation(x, scale), lambda: ad.torch_quant_fp8_group_activation(x, 128),
           lambda: ad.torch_quant_nvfp4_activation(x, scale)]
    rounded = [op() for op in ops]
    assert all(not torch.equal(r, x) for r in rounded)
    with exact_activations():
        assert all(torch.equal(op(), x) for op in ops)
    assert all(torch.equal(op(), r) for op, r in zip(ops, rounded))


@pytest.mark.parametrize("act_quant", ["none", "fp8", "fp8_group", "nvfp4"])
def test_onednn_op_equals_the_grouped_ops(act_quant):
    """``onednn_grouped_moe_fused`` over per-expert weights packed for oneDNN computes what the
    grouped op computes over the stacked ones (float experts, and each activation quantization)."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    g = torch.Generator().manual_seed(11)
    gate_up, down = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
    scales = [torch.rand(E, generator=g) * 0.01 + 0.005 for _ in range(2)] if act_quant in ("fp8", "nvfp4") else [None] * 2
    packed = [[torch.ops.mkldnn._reorder_linear_weight(w[e].contiguous()) for e in range(E)] for w in (gate_up, down)]
    for tokens in (1, 9):
        x, sel, w = _routing(tokens, 200 + tokens)
        if act_quant == "none":
            want = ad.grouped_moe_fused(x, sel, w, gate_up, down, None, None, "silu", 1.0, 0.0, 0)
        else:
            want = ad.grouped_quant_moe_fused(x, sel, w, gate_up, down, *scales, None, None, "silu", 1.0, 0.0,
                                              act_quant, 128, 0)
        got = ad.onednn_grouped_moe_fused(x, sel, w, *packed, None, None, "silu", 1.0, 0.0, act_quant, *scales, 128)
        if act_quant == "none":
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # oneDNN sums in another order than torch's BLAS: room for a rounding boundary crossed
            assert _rel(got, want) < 1e-3
