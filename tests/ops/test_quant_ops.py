"""Quantized ops and formats against the independent encoder/decoder of ``tests/quant_checkpoints.py``.

The weights here are larger than the tiny models' (200 x 320): fine-grained FP8 then has partial
128-tiles on both axes and a 2 x 3 scale grid (the tiny models fit one tile), and every int4 layout
has several groups and packed words in both directions.
"""

import pytest
import torch

import quant_checkpoints as qc
from autodeploy.ops.quant import formats
from autodeploy.transform.library.quantize_int4_linear_from_config import int4_format
from helpers import rel_rmse

ad = torch.ops.autodeploy
N, K = 200, 320


def _weight(seed: int = 0) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) * 0.05


def _input(rows: int = 5, seed: int = 1) -> torch.Tensor:
    return torch.randn(2, rows, K, generator=torch.Generator().manual_seed(seed))


def _canonical_int4(fmt: str, tensors):
    """The writer's GPTQ / AWQ / compressed-tensors tensors through the loader's conversion hooks."""
    method = {"gptq": "gptq", "awq": "awq", "ct_int4": "compressed-tensors"}[fmt]
    spec = int4_format(method, qc.INT4_GROUP)
    return [buf.convert([tensors[s] for s in buf.sources]) for buf in spec.buffers]


def _run_op(fmt: str, x: torch.Tensor, t, input_scale):
    if fmt == "fp8":
        return ad.torch_quant_fp8_linear(x, t["weight"], None, input_scale, t["weight_scale"])
    if fmt == "nvfp4":
        return ad.torch_quant_nvfp4_linear(x, t["weight"], None, input_scale, t["weight_scale"], t["weight_scale_2"])
    if fmt == "fp8_block":
        return ad.torch_quant_finegrained_fp8_linear(x, t["weight"], None, t["weight_scale_inv"], 128, 128)
    weight, scales, zeros = _canonical_int4(fmt, t)
    return ad.torch_quant_int4_linear(x, weight, None, scales, zeros, qc.INT4_GROUP)


@pytest.mark.parametrize("fmt", qc.FORMATS)
def test_quantized_linear_equals_decoded_weight_and_quantized_activation(fmt):
    t = qc._WRITERS[fmt](_weight())
    if fmt == "fp8_block":
        assert t["weight_scale_inv"].shape == (2, 3)
    x = _input()
    input_scale = torch.tensor(x.abs().max().item() / (448.0 * (6.0 if fmt == "nvfp4" else 1.0)))
    expected = qc.quantize_activation(fmt, x, input_scale) @ qc._decode(fmt, t).T
    out = _run_op(fmt, x, t, input_scale)
    assert out.shape == (2, 5, N) and out.dtype == x.dtype
    assert rel_rmse(out, expected) < 1e-6
    # the quantization is real: the plain float product differs
    assert rel_rmse(out, x @ _weight().T) > 1e-3


@pytest.mark.parametrize("fmt", ["fp8", "fp8_block", "nvfp4"])
def test_activation_ops_equal_the_formats_rounding(fmt):
    x = _input(rows=9)
    scale = torch.tensor(x.abs().max().item() / (448.0 * (6.0 if fmt == "nvfp4" else 1.0)))
    out = {"fp8": lambda: ad.torch_quant_fp8_activation(x, scale),
           "fp8_block": lambda: ad.torch_quant_fp8_group_activation(x, 128),
           "nvfp4": lambda: ad.torch_quant_nvfp4_activation(x, scale)}[fmt]()
    expected = qc.quantize_activation(fmt, x, scale)
    assert rel_rmse(out, expected) < 1e-6 and not torch.equal(out, x)


def test_int8_linear():
    w = _weight()
    q, scales = formats.quantize_int8(w)
    assert q.dtype == torch.int8 and scales.shape == (N,)
    x = _input()
    out = ad.torch_quant_int8_linear(x, q, None, scales)
    assert rel_rmse(out, x @ (q.float() * scales[:, None]).T) < 1e-6
    assert 1e-4 < rel_rmse(out, x @ w.T) < 1e-2


@pytest.mark.parametrize("group", [32, 64, 160])
def test_int4_quantizer_roundtrip(group):
    w = _weight()
    packed, scales, zeros = formats.quantize_int4(w, group)
    assert packed.shape == (N, K // 2) and scales.shape == zeros.shape == (N, K // group)
    assert zeros.min() >= 0 and zeros.max() <= 15 and torch.equal(zeros, zeros.round())
    err = rel_rmse(formats.dequantize_int4(packed, scales, zeros, group), w)
    assert 0.02 < err < 0.15  # 4 bits: ~1/30 of the range per group


def test_e2m1_codes_and_nibbles():
    table = formats.e2m1_table()
    assert table[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0] and torch.equal(table[8:], -table[:8])
    # every grid value encodes to itself; beyond 6 saturates
    assert torch.equal(formats.e2m1_round(table), table)
    assert formats.e2m1_round(torch.tensor([7.0, -100.0])).tolist() == [6.0, -6.0]
    # the writer's independent encoder agrees away from exact ties
    x = torch.randn(4096) * 3
    assert torch.equal(formats.e2m1_round(x), qc.e2m1_round(x))
    codes = torch.randint(0, 16, (3, 10), dtype=torch.uint8)
    packed = formats.pack_nibbles(codes)
    assert packed.shape == (3, 5) and torch.equal(packed[:, 0] & 15, codes[:, 0]) and torch.equal(packed[:, 0] >> 4, codes[:, 1])
    assert torch.equal(formats.unpack_nibbles(packed), codes)
    with pytest.raises(ValueError, match="odd number"):
        formats.pack_nibbles(codes[:, :3])


def test_fp8_encode_saturates():
    assert formats.fp8_encode(torch.tensor([1000.0, -1000.0])).float().tolist() == [448.0, -448.0]


@pytest.mark.parametrize("op, args", [
    ("torch_quant_fp8_linear", lambda: (torch.randn(3, 32), torch.zeros(16, 32, dtype=torch.float8_e4m3fn), None,
                                        torch.tensor(0.1), torch.tensor(0.2))),
    ("torch_quant_int4_linear", lambda: (torch.randn(3, 32), torch.zeros(16, 16, dtype=torch.uint8), torch.randn(16),
                                         torch.ones(16, 1), torch.full((16, 1), 8.0), 32)),
    ("torch_quant_int8_linear", lambda: (torch.randn(2, 3, 32), torch.ones(16, 32, dtype=torch.int8), None,
                                         torch.ones(16))),
])
def test_fake_kernels_match_real_shapes(op, args):
    # (test_schema multiplies inputs to check aliasing, which float8 tensors do not support on CPU)
    torch.library.opcheck(getattr(ad, op).default, args(), test_utils=("test_faketensor",))
