"""CPU packed-weight int4 / int8 linears (``autodeploy.ops.quant.cpu_kernels``) against the float32
product with the canonically dequantized weight, their refusals, fake kernels and speed probe.

Tolerance: the kernels round the activation, the scales, the int4 zero term and the output to
bf16 (relative error at most 2^-8, RMS ~1.1e-3, each). Over the shapes, groups and zero kinds below (3 seeds each) the
relative RMSE of the output against the float64 product with the canonical weight was at most
4.8e-3 (int4) and 3.7e-3 (int8); rounding only the activation to bf16 already gives up to
3.7e-3. ``REL_TOL`` is ~3x the worst measured. A wrong zero convention (zero point passed as the
kernel's zero) gives ~1e2, swapped nibbles ~1.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autodeploy.ops.quant import cpu_kernels as ck

ad = torch.ops.autodeploy
REL_TOL = 1.5e-2

needs_int4 = pytest.mark.skipif(not ck.kernel_available("int4"), reason="no int4 CPU kernel in this torch build")
needs_int8 = pytest.mark.skipif(not ck.kernel_available("int8"), reason="no int8 CPU kernel in this torch build")


def dequant_int4(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g: int) -> torch.Tensor:
    """Canonical int4: low nibble = even k; W = (q - zero) * scale per group (float64)."""
    q = torch.stack((w & 0xF, w >> 4), dim=-1).reshape(w.shape[0], -1).double()
    return (q - zeros.double().repeat_interleave(g, 1)) * scales.double().repeat_interleave(g, 1)


def random_int4(n: int, k: int, g: int, fractional: bool):
    w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    scales = torch.rand(n, k // g) * 0.02 + 1e-3
    zeros = torch.randint(0, 16, (n, k // g)).float()
    if fractional:
        zeros = zeros + torch.rand_like(zeros)
    return w, scales, zeros


def rel_rmse(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


INPUT_SHAPES = [(1,), (7,), (2, 3)]  # leading dims: 1 row, 7 rows, 3-D input


@needs_int4
@pytest.mark.parametrize("n,k", [(96, 256), (512, 1024)])
@pytest.mark.parametrize("g", [32, 64, 128])
@pytest.mark.parametrize("fractional", [False, True], ids=["int_zeros", "frac_zeros"])
def test_int4_matches_dequantized_reference(n, k, g, fractional):
    w, scales, zeros = random_int4(n, k, g, fractional)
    ref_w = dequant_int4(w, scales, zeros, g)
    packed = ck.pack_int4_for_cpu(w, scales, zeros, g)
    assert packed.weight.shape == (n, k // 2) and packed.scales_and_zeros.shape == (k // g, n, 2)
    for lead in INPUT_SHAPES:
        x = torch.randn(*lead, k)
        out = ck.int4_packed_linear(x, packed)
        assert out.dtype == torch.float32 and out.shape == (*lead, n)
        assert rel_rmse(out, x.double() @ ref_w.T) < REL_TOL
        assert torch.equal(ad.cpu_int4pack_linear(x, packed.weight, packed.scales_and_zeros, g, n), out)


@needs_int8
@pytest.mark.parametrize("n,k", [(96, 256), (512, 1024), (50, 64)])
def test_int8_matches_dequantized_reference(n, k):
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scales = torch.rand(n) * 0.01 + 1e-3
    ref_w = w.double() * scales.double()[:, None]
    packed = ck.pack_int8_for_cpu(w, scales)
    for lead in INPUT_SHAPES:
        x = torch.randn(*lead, k)
        out = ck.int8_packed_linear(x, packed)
        assert out.dtype == torch.float32 and out.shape == (*lead, n)
        assert rel_rmse(out, x.double() @ ref_w.T) < REL_TOL
        assert torch.equal(ad.cpu_int8pack_linear(x, packed.weight, packed.scales), out)


@needs_int4
@needs_int8
def test_bias_is_added_in_input_dtype():
    n, k, g = 64, 128, 32
    w4, s4, z4 = random_int4(n, k, g, fractional=True)
    p4 = ck.pack_int4_for_cpu(w4, s4, z4, g)
    w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    s8 = torch.rand(n) * 0.01 + 1e-3
    p8 = ck.pack_int8_for_cpu(w8, s8)
    bias = torch.randn(n)
    x = torch.randn(2, 3, k)
    cases = [
        (lambda x, b=None: ck.int4_packed_linear(x, p4, b), dequant_int4(w4, s4, z4, g)),
        (lambda x, b=None: ck.int8_packed_linear(x, p8, b), w8.double() * s8.double()[:, None]),
    ]
    for fn, ref_w in cases:
        out = fn(x, bias)
        assert torch.equal(out, fn(x) + bias)
        assert rel_rmse(out, x.double() @ ref_w.T + bias.double()) < REL_TOL
        # other input dtypes come back in their own dtype, bias included
        for dt in (torch.bfloat16, torch.float16):
            out_dt = fn(x.to(dt), bias.to(dt))
            assert out_dt.dtype == dt and out_dt.shape == (2, 3, n)
            assert rel_rmse(out_dt, x.to(dt).double() @ ref_w.T + bias.to(dt).double()) < 2 * REL_TOL


@needs_int8
def test_int8_misaligned_operands_are_copied_not_faulted():
    # the bf16 kernel uses aligned loads: views at odd offsets must be copied by the op
    n, k = 32, 64
    w = torch.randint(-128, 128, (n * k + 1,), dtype=torch.int8)[1:].view(n, k)
    scales = torch.rand(n) + 0.5
    x = torch.randn(3 * k + 1).bfloat16()[1:].view(3, k)
    assert w.data_ptr() % 16 and x.data_ptr() % 32
    out = ad.cpu_int8pack_linear(x, w, scales.bfloat16())
    assert rel_rmse(out, x.double() @ (w.double() * scales.bfloat16().double()[:, None]).T) < 2 * REL_TOL


def test_refused_shapes_raise_value_error_naming_the_shape():
    w4 = torch.zeros(40, 64, dtype=torch.uint8)  # N=40, K=128
    with pytest.raises(ValueError, match=r"N=40, K=128"):
        ck.pack_int4_for_cpu(w4, torch.ones(40, 4), torch.zeros(40, 4), 32)
    w4 = torch.zeros(32, 40, dtype=torch.uint8)  # K=80: not a multiple of 32
    with pytest.raises(ValueError, match=r"N=32, K=80.*group_size 32"):
        ck.pack_int4_for_cpu(w4, torch.ones(32, 2), torch.zeros(32, 2), 32)
    w4 = torch.zeros(32, 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"N=32, K=64.*group_size 16"):
        ck.pack_int4_for_cpu(w4, torch.ones(32, 4), torch.zeros(32, 4), 16)
    with pytest.raises(ValueError, match=r"scales must be \[N=32, K/g=2\]"):
        ck.pack_int4_for_cpu(w4, torch.ones(2, 32), torch.zeros(32, 2), 32)
    with pytest.raises(ValueError, match=r"N=8, K=24"):
        ck.pack_int8_for_cpu(torch.zeros(8, 24, dtype=torch.int8), torch.ones(8))
    with pytest.raises(ValueError, match=r"K=24"):
        ad.cpu_int8pack_linear(torch.randn(1, 24), torch.zeros(8, 24, dtype=torch.int8), torch.ones(8))
    assert ck.measure_weight_only_speedup("int4", 40, 128, 32) == 0.0


@needs_int4
@needs_int8
def test_opcheck_and_fake_kernels():
    n, k, g = 32, 64, 32
    p4 = ck.pack_int4_for_cpu(*random_int4(n, k, g, fractional=False), g)
    p8 = ck.pack_int8_for_cpu(torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n) + 0.5)
    x, bias = torch.randn(2, 3, k), torch.randn(n)
    int4_args = (p4.weight, p4.scales_and_zeros, g, n)
    torch.library.opcheck(ad.cpu_int4pack_linear, (x, *int4_args, bias))
    torch.library.opcheck(ad.cpu_int8pack_linear, (x, p8.weight, p8.scales, None))
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fake_args = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in int4_args]
        fake4 = ad.cpu_int4pack_linear(fx, *fake_args)
        fake8 = ad.cpu_int8pack_linear(fx, mode.from_tensor(p8.weight), mode.from_tensor(p8.scales))
    assert fake4.shape == fake8.shape == (2, 3, n) and fake4.dtype == fake8.dtype == torch.float32


@needs_int4
@needs_int8
def test_speedup_probe_is_cached_and_positive():
    for kind in ("int4", "int8"):
        first = ck.measure_weight_only_speedup(kind, 64, 256, 64, threads=1)
        assert first > 0.0
        assert ck.measure_weight_only_speedup(kind, 64, 256, 64, threads=1) == first
    with pytest.raises(ValueError):
        ck.kernel_available("int2")
