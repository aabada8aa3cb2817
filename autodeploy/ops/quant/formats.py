"""Quantization formats: the numerics every quantized op and loader shares.

One place decodes and encodes each narrow type, so the reference ops, the load-time converters
and the weight-only quantizer cannot disagree on a rounding rule or a nibble order:

* **FP8 E4M3** (``float8_e4m3fn``): torch casts to and from it natively; a float32 -> e4m3 cast
  saturates at 448 only after an explicit clamp (torch's cast of a larger value gives NaN), so
  every encoder clamps first.
* **E2M1** (FP4, NVFP4's values): 16 codes, bit 3 the sign, magnitudes
  ``0, 0.5, 1, 1.5, 2, 3, 4, 6``. torch 2.13 has ``float4_e2m1fn_x2`` but cannot convert it to
  float32, so codes are decoded through a lookup table and encoded by rounding to the nearest
  magnitude (ties to the even code, as the IEEE-style formats do).
* **Packed nibbles**: two 4-bit codes per uint8, element ``2i`` in the low nibble and ``2i+1``
  in the high one (NVFP4's checkpoint layout, and autodeploy's canonical int4 layout).
* **Block scales**: a scale per tile of the weight (fine-grained FP8's 128x128 tiles, partial at
  the edges; NVFP4's and int4's groups along K) expanded to the weight's shape when decoding.
* **MXFP4** (OCP MX, GPT-OSS's experts): groups of 32 e2m1 values along K sharing one **E8M0**
  scale, a uint8 biased exponent: ``2 ** (s - 127)`` (255 is NaN). It is decoded explicitly:
  a float -> e8m0 cast would round to the nearest power of two instead of reading the bits.
  Every MXFP4 value (an e2m1 value times a power of two) is exact in bfloat16 and float32.
"""

import threading
from contextlib import contextmanager
from typing import Iterator, Tuple

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn magnitude
FP4_MAX = 6.0  # largest e2m1 magnitude
NVFP4_GROUP = 16
MXFP4_GROUP = 32
E8M0_BIAS = 127
E2M1_EMAX = 2  # exponent of e2m1's largest power of two (4): the MX scale is floor(log2(amax)) - 2

# e2m1 magnitudes of codes 0..7; codes 8..15 are their negatives (bit 3 is the sign)
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# midpoints between neighbouring magnitudes, and whether a value exactly on one rounds up (to the
# code with an even mantissa bit: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIE_UP = (False, True, False, True, False, True, False)


def e2m1_table(device: torch.device = torch.device("cpu")) -> Tensor:
    """float32 [16]: the value of each e2m1 code."""
    mags = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def e2m1_encode(x: Tensor) -> Tensor:
    """Round float values to the nearest e2m1 code (uint8 0..15; saturating at +-6)."""
    mag = x.abs().float()
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for bound, tie_up in zip(_E2M1_BOUNDS, _E2M1_TIE_UP):
        code += (mag >= bound if tie_up else mag > bound).to(torch.uint8)
    return code | ((x < 0) & (code > 0)).to(torch.uint8) << 3


def e2m1_decode(codes: Tensor) -> Tensor:
    """uint8 codes 0..15 -> float32 values."""
    return e2m1_table(codes.device)[codes.long()]


def e2m1_round(x: Tensor) -> Tensor:
    """``x`` rounded to the e2m1 grid (what encoding then decoding gives), in float32."""
    return e2m1_decode(e2m1_encode(x))


def pack_nibbles(codes: Tensor) -> Tensor:
    """[..., K] values 0..15 -> uint8 [..., K/2], element 2i in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number ({codes.shape[-1]}) of 4-bit values into bytes")
    codes = codes.to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """uint8 [..., K/2] -> uint8 [..., K] values 0..15 (the inverse of :func:`pack_nibbles`)."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def fp8_encode(x: Tensor) -> Tensor:
    """float -> float8_e4m3fn, saturating at +-448 (a bare cast would overflow to NaN)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def expand_groups(scale: Tensor, group: int, size: int, dim: int = -1) -> Tensor:
    """Repeat each entry of ``scale`` ``group`` times along ``dim`` and cut to ``size`` (the last
    group may be partial)."""
    return scale.repeat_interleave(group, dim=dim).narrow(dim, 0, size)


def expand_blocks(scale: Tensor, block: Tuple[int, int], shape: Tuple[int, int]) -> Tensor:
    """A [ceil(N/bn), ceil(K/bk)] per-tile scale expanded to the weight's [N, K]."""
    return expand_groups(expand_groups(scale, block[0], shape[0], 0), block[1], shape[1], 1)


# ---- activation quantization (what the formats do to a linear's input) ------------------------

_exact = threading.local()


@contextmanager
def exact_activations() -> Iterator[None]:
    """Within this block (on this thread) the activation quantizations below return their input
    unchanged (in float32). For checks that compare one schedule of the same tokens against
    another (the KV-cache consistency check): a GEMM of another row count sums in another order,
    the ~1e-7 difference moves a value across an FP8/FP4 rounding boundary now and then, and the
    flipped code (an e4m3 step is 1/8 of the value) grows through the layers into logits
    differences of ~1e-2 on a 240M model, which is the format's noise, not misplaced state."""
    before = getattr(_exact, "on", False)
    _exact.on = True
    try:
        yield
    finally:
        _exact.on = before


def _rounding_off() -> bool:
    return getattr(_exact, "on", False)


def fake_quant_fp8_static(x: Tensor, input_scale: Tensor) -> Tensor:
    """FP8 with a calibrated per-tensor scale (ModelOpt FP8): ``x`` as the linear sees it after
    quantizing to e4m3 and back, in float32."""
    if _rounding_off():
        return x.to(torch.float32, copy=True)  # a copy: custom ops must not return their input
    return fp8_encode(x.float() / input_scale).float() * input_scale


def fake_quant_fp8_groups(x: Tensor, group: int = 128) -> Tensor:
    """FP8 per token and per ``group`` channels with a scale of amax/448 computed at run time
    (fine-grained FP8's dynamic activations; the last group may be partial), in float32."""
    if _rounding_off():
        return x.to(torch.float32, copy=True)  # a copy: custom ops must not return their input
    k = x.shape[-1]
    groups = -(-k // group)
    pad = groups * group - k
    xf = torch.nn.functional.pad(x.float(), (0, pad)).reshape(*x.shape[:-1], groups, group)
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    out = fp8_encode(xf / scale).float() * scale
    return out.reshape(*x.shape[:-1], groups * group)[..., :k]


def nvfp4_block_scales(x: Tensor, global_scale: Tensor) -> Tensor:
    """NVFP4's e4m3 scale per 16 values along the last dim: amax/6 relative to ``global_scale``
    (the per-tensor ``weight_scale_2`` / ``input_scale``), as float32 values of the e4m3 codes."""
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // NVFP4_GROUP, NVFP4_GROUP)
    return fp8_encode(blocks.abs().amax(dim=-1) / FP4_MAX / global_scale).float()


def nvfp4_quantize(x: Tensor, global_scale: Tensor) -> Tuple[Tensor, Tensor]:
    """``x`` [..., K] (K a multiple of 16) -> (e2m1 codes uint8 [..., K], e4m3 block scales
    float8 [..., K/16]): NVFP4 with per-tensor ``global_scale``."""
    if x.shape[-1] % NVFP4_GROUP:
        raise ValueError(f"NVFP4 quantizes groups of {NVFP4_GROUP} values; the last dim is {x.shape[-1]}")
    scales = nvfp4_block_scales(x, global_scale)
    denom = expand_groups(scales * global_scale, NVFP4_GROUP, x.shape[-1])
    values = torch.where(denom > 0, x.float() / torch.where(denom > 0, denom, 1.0), 0.0)
    return e2m1_encode(values), scales.to(FP8_DTYPE)


def nvfp4_dequantize(codes: Tensor, block_scales: Tensor, global_scale: Tensor) -> Tensor:
    """e2m1 codes [..., K] and e4m3 block scales [..., K/16] -> float32 values."""
    scale = expand_groups(block_scales.float() * global_scale, NVFP4_GROUP, codes.shape[-1])
    return e2m1_decode(codes) * scale


def fake_quant_nvfp4(x: Tensor, input_scale: Tensor) -> Tensor:
    """NVFP4 activations (W4A4): per 16 values an e4m3 scale relative to the calibrated
    ``input_scale``, values rounded to e2m1; returned dequantized in float32."""
    if _rounding_off():
        return x.to(torch.float32, copy=True)  # a copy: custom ops must not return their input
    codes, scales = nvfp4_quantize(x, input_scale)
    return nvfp4_dequantize(codes, scales, input_scale)


# ---- weight decoding ------------------------------------------------------------------------


def dequantize_fp8(weight: Tensor, weight_scale: Tensor) -> Tensor:
    """``weight_scale``: one per tensor ([] or [1]) or one per output row ([N])."""
    return weight.float() * weight_scale.float().reshape(-1, 1)


def dequantize_fp8_blocks(weight: Tensor, scale_inv: Tensor, block: Tuple[int, int]) -> Tensor:
    return weight.float() * expand_blocks(scale_inv.float(), block, tuple(weight.shape))


def dequantize_nvfp4(weight: Tensor, weight_scale: Tensor, weight_scale_2: Tensor) -> Tensor:
    """``weight_scale_2``: one per tensor ([] or [1]) or one per output row ([N])."""
    return nvfp4_dequantize(unpack_nibbles(weight), weight_scale, weight_scale_2.float().reshape(-1, 1))


def dequantize_int4(weight: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Tensor:
    """Canonical int4: uint8 [N, K/2] nibbles, W = (q - zero) * scale per group of K."""
    q = unpack_nibbles(weight).float()
    k = q.shape[-1]
    return (q - expand_groups(zeros.float(), group_size, k)) * expand_groups(scales.float(), group_size, k)


def dequantize_int8(weight: Tensor, scales: Tensor) -> Tensor:
    return weight.float() * scales.float()[:, None]


_BYTE_TABLES: dict = {}


def e2m1_byte_table(device: torch.device = torch.device("cpu")) -> Tensor:
    """float32 [256, 2]: the two e2m1 values of each byte (low nibble first): decoding packed
    codes is then one gather per byte instead of two shifts, a stack and two lookups."""
    table = _BYTE_TABLES.get(device)
    if table is None:
        codes = torch.arange(256, dtype=torch.int64, device=device)
        values = e2m1_table(device)
        table = _BYTE_TABLES[device] = torch.stack([values[codes & 0x0F], values[codes >> 4]], dim=-1)
    return table


def e8m0_decode(scales: Tensor) -> Tensor:
    """uint8 biased exponents -> float32 ``2 ** (s - 127)`` (255: NaN, as the OCP MX spec says)."""
    exp = scales.to(torch.int32) - E8M0_BIAS
    out = torch.ldexp(torch.ones_like(exp, dtype=torch.float32), exp)
    return out.masked_fill(scales == 255, float("nan"))


def dequantize_mxfp4(blocks: Tensor, scales: Tensor) -> Tensor:
    """MXFP4 ``blocks`` uint8 [..., G, 16] (32 nibbles per group, element 2i low) with ``scales``
    uint8 [..., G] -> float32 [..., G * 32]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"([..., G, {MXFP4_GROUP // 2}] and [..., G])")
    pairs = e2m1_byte_table(blocks.device)[blocks.long()]  # [..., G, 16, 2]: one lookup per byte
    values = pairs.reshape(*scales.shape, MXFP4_GROUP) * e8m0_decode(scales)[..., None]
    return values.reshape(*scales.shape[:-1], scales.shape[-1] * MXFP4_GROUP)


# ---- weight encoding (weight-only quantization of float checkpoints) -----------------------


def quantize_int8(w: Tensor) -> Tuple[Tensor, Tensor]:
    """Symmetric per-output-channel int8: (q int8 [N, K], scales float32 [N]), W ~ q * scale."""
    scales = (w.float().abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def quantize_int4(w: Tensor, group_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    """Asymmetric 4-bit per group of ``group_size`` input channels (min/max range, integer zero
    point): (packed uint8 [N, K/2], scales float32 [N, K/g], zeros float32 [N, K/g])."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 groups of {group_size} do not divide the input size {k}")
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1).clamp(max=0.0), g.amax(-1).clamp(min=0.0)
    scales = ((hi - lo) / 15.0).clamp(min=1e-12)
    zeros = torch.round(-lo / scales).clamp(0, 15)
    q = torch.round(g / scales[..., None] + zeros[..., None]).clamp(0, 15).reshape(n, k)
    return pack_nibbles(q), scales, zeros


def quantize_mxfp4(w: Tensor) -> Tuple[Tensor, Tensor]:
    """OCP MX FP4 along the last dim: (blocks uint8 [..., K/32, 16], scales uint8 [..., K/32]);
    each group's scale is ``2 ** (floor(log2(amax)) - 2)``, its values e2m1-rounded (saturating)."""
    k = w.shape[-1]
    if k % MXFP4_GROUP:
        raise ValueError(f"MXFP4 groups of {MXFP4_GROUP} do not divide the input size {k}")
    g = w.float().reshape(*w.shape[:-1], k // MXFP4_GROUP, MXFP4_GROUP)
    amax = g.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0 ** -126))) - E2M1_EMAX,
                      torch.full_like(amax, -E8M0_BIAS)).clamp(-E8M0_BIAS, E8M0_BIAS)
    codes = e2m1_encode(g / torch.ldexp(torch.ones_like(exp), exp.to(torch.int32))[..., None])
    return pack_nibbles(codes).contiguous(), (exp + E8M0_BIAS).to(torch.uint8).contiguous()


def quantize_fp8_blocks(w: Tensor, block: Tuple[int, int] = (128, 128)) -> Tuple[Tensor, Tensor]:
    """Fine-grained FP8 (DeepSeek-V3's layout): (e4m3 [N, K], float32 multiplier per
    ``block`` tile [ceil(N/bn), ceil(K/bk)] = tile amax / 448; edge tiles are partial)."""
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(w.float(), (0, cols * bk - k, 0, rows * bn - n))
    tiles = padded.reshape(rows, bn, cols, bk)
    scale_inv = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = fp8_encode(tiles / scale_inv[:, None, :, None]).reshape(rows * bn, cols * bk)[:n, :k]
    return q.contiguous(), scale_inv
