"""MXFP4 numerics and the MXFP4 MoE op: E8M0 scales read bit-exactly (a float cast would round),
nibble order, OCP MX scale choice, and ``torch_quant_mxfp4_moe_fused`` equal to
``torch_moe_fused`` over the decoded experts (silu and GPT-OSS's clamped activation, with and
without biases, at two token counts), with shape errors naming the layout."""

import pytest
import torch

import autodeploy.ops  # noqa: F401  (registers the ops)
from autodeploy.ops.quant.formats import dequantize_mxfp4, e8m0_decode, quantize_mxfp4

ad = torch.ops.autodeploy


def test_e8m0_decode_is_exact_and_255_is_nan():
    s = torch.tensor([0, 1, 126, 127, 128, 200, 254, 255], dtype=torch.uint8)
    got = e8m0_decode(s)
    want = [2.0 ** (v - 127) for v in (0, 1, 126, 127, 128, 200, 254)]
    assert got[:-1].tolist() == want and torch.isnan(got[-1])


def test_nibble_order_and_values():
    # one group of 32: element 0 = 0.5 (code 1), element 1 = -6 (code 15), rest 0; scale 2^1
    blocks = torch.zeros(1, 16, dtype=torch.uint8)
    blocks[0, 0] = 1 | (15 << 4)
    out = dequantize_mxfp4(blocks, torch.tensor([128], dtype=torch.uint8))
    assert out.shape == (32,)
    assert out[:3].tolist() == [1.0, -12.0, 0.0]


def test_quantize_picks_the_ocp_scale_and_round_trips_grid_values():
    w = torch.zeros(1, 32)
    w[0, :4] = torch.tensor([6.0, -3.0, 0.5, 1.5]) * 4  # amax 24: floor(log2 24) - 2 = 2
    blocks, scales = quantize_mxfp4(w)
    assert scales.tolist() == [[129]]
    assert torch.equal(dequantize_mxfp4(blocks, scales), w)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g)
    d = dequantize_mxfp4(*quantize_mxfp4(x))
    err = ((d - x).pow(2).mean() / x.pow(2).mean()).sqrt()
    assert 0.02 < err < 0.2  # real 4-bit rounding, not a copy
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(d)), d)  # grid values are fixed points


@pytest.mark.parametrize("act, alpha, limit, bias", [("silu", 1.0, 0.0, False), ("swiglu_oai", 1.702, 7.0, True)])
@pytest.mark.parametrize("tokens", [1, 13])
def test_op_equals_torch_moe_fused_over_decoded_experts(act, alpha, limit, bias, tokens):
    g = torch.Generator().manual_seed(tokens)
    e, h, i, k = 4, 64, 32, 2
    gb, gs = quantize_mxfp4(torch.randn(e, 2 * i, h, generator=g))
    db, ds = quantize_mxfp4(torch.randn(e, h, i, generator=g))
    x = torch.randn(tokens, h, generator=g)
    sel = torch.randint(0, e, (tokens, k), generator=g)
    w = torch.rand(tokens, k, generator=g)
    b1, b2 = (torch.randn(e, 2 * i, generator=g), torch.randn(e, h, generator=g)) if bias else (None, None)
    ref = ad.torch_moe_fused(x, sel, w, dequantize_mxfp4(gb, gs), dequantize_mxfp4(db, ds), b1, b2, act, alpha, limit)
    got = ad.torch_quant_mxfp4_moe_fused(x, sel, w, gb, gs, db, ds, b1, b2, act, alpha, limit)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_op_refuses_mismatched_layouts():
    gb, gs = quantize_mxfp4(torch.randn(4, 64, 64))
    db, ds = quantize_mxfp4(torch.randn(4, 64, 64))  # down would need I/32 = 1 group, has 2
    with pytest.raises(ValueError, match=r"\[E, 2I, H/32, 16\]"):
        ad.torch_quant_mxfp4_moe_fused(torch.randn(2, 64), torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1),
                                       gb, gs, db, ds)
