"""Fast CPU backends for weight-only int4 / int8 linears: torch's own packed-weight kernels.

Why
---
A linear at decode time (one row, batch 1) reads every weight once per token and does little
else, so its time is the weight's bytes over memory bandwidth. Dequantizing a weight-only int4
or int8 checkpoint to float32 at load throws away its 8x / 4x smaller footprint. Torch ships CPU
kernels that read the quantized weight directly and dequantize in registers:

* ``aten._weight_int4pack_mm_for_cpu`` (with ``aten._convert_weight_to_int4pack_for_cpu``),
* ``aten._weight_int8pack_mm``.

This module packs canonical weights into their layouts once at load (``pack_int4_for_cpu``,
``pack_int8_for_cpu``), wraps the kernels as custom ops with fake kernels
(``autodeploy::cpu_int4pack_linear``, ``autodeploy::cpu_int8pack_linear``), and measures per
shape whether the kernel beats a float32 GEMV (``measure_weight_only_speedup``) so the caller
can fall back to dequantized float weights where it does not.

Canonical layouts (what the packers receive)
--------------------------------------------
* int4: ``weight`` uint8 [N, K/2], element k=2i in the low nibble and 2i+1 in the high nibble,
  q in 0..15; ``scales`` and ``zeros`` float32 [N, K/g] (zero points, usually integers 0..15,
  may be fractional); ``W[n, k] = (q[n, k] - zeros[n, k//g]) * scales[n, k//g]``.
* int8: ``weight`` int8 [N, K]; ``scales`` float32 [N]; ``W = q * scales[:, None]``.
* ``y = x @ W.T (+ bias)``.

Kernel semantics (torch 2.13.0+cpu; read from ATen's int4mm_kernel.cpp / int8mm_kernel.cpp and
the meta registrations, then checked by experiment on this machine)
---------------------------------------------------------------------------------------------
``_convert_weight_to_int4pack_for_cpu(w, innerKTiles) -> uint8 [N, K/2]``
    ``w`` must be int32 [N, K] holding one value 0..15 per element (a uint8 [N, K/2] input is
    refused: "expect weight to be kInt"). Requires N % 16 == 0 and K % 2 == 0. ``innerKTiles``
    is ignored on CPU (1, 2, 4, 8 give identical bytes). The output interleaves blocks of 64
    output channels (on AVX-512; 32 on AVX2) per k: an opaque layout only this kernel reads.
``_weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros) -> [M, N]``
    ``x`` [M, K], 2-D, contiguous, bf16 / fp16 / fp32; ``scales_and_zeros`` [K/g, N, 2] of
    *the same dtype as x* (mixing raises "expected scalar type ..."); output has x's dtype.
    ``group_size`` must be 32, 64, 128 or 256 and divide K. The kernel computes
    ``W = (q - 8) * scale + zero`` (gpt-fast's convention: the int4 lookup table is -8..7), so a
    canonical zero point ``zp`` becomes ``zero = (8 - zp) * scale``; passing ``zp`` itself
    gives a relative error of ~100 (verified). Accumulates in float32, stores the output in
    x's dtype. Only the bf16 path is vectorized (AVX-512 / AVX2 intrinsics); fp16 and fp32 run
    a scalar fallback ~30x slower (measured below), so bf16 is the input dtype used here. x and
    the packed weight may sit at any address (unaligned loads; checked with odd offsets).
``_weight_int8pack_mm(x, w, scales) -> [M, N]``
    ``x`` [M, K] bf16 / fp16 / fp32, ``w`` int8 [N, K], ``scales`` [N] of x's dtype
    (mixing raises). ``W = w * scales[:, None]``, float32 accumulation, output in x's dtype.
    Only bf16 is vectorized (fp32 / fp16 inputs: scalar, 6-15x slower). The AVX-512 bf16
    path walks K in steps of 16 with *aligned* loads (``_mm256_load_si256`` on x,
    ``_mm_load_si128`` on w) and checks neither K nor alignment: K % 16 != 0 gave garbage / inf
    or a segfault (K = 1, 5, 7, 8, 15, 24, 33, 40 tried; 16, 32, 48, 64 fine), and an x whose
    rows start off a 32-byte boundary segfaulted (offsets of 2 and 16 bytes tried; a weight
    offset by 1 or 8 bytes happened to run, the compiler folded that load). Hence K % 16 == 0
    is required here, and x (and, cheaply, w) are checked for alignment before each call and
    copied if off. Any N works.

Not used: ``_dyn_quant_matmul_4bit`` (KleidiAI, Arm; on x86 a scalar reference that also
quantizes the activation to int8) and ``_weight_int4pack_mm_with_scales_and_zeros`` (XPU).

Precision: the bf16 path rounds the activation, the scales, the int4 zero term and the output
to bf16 (8 significant bits: relative error at most 2^-8, RMS ~1.1e-3 each). Measured rel RMSE
of the output against the float64 product with the canonically dequantized weight: at most
4.8e-3 (int4) and 3.7e-3 (int8) over the test shapes and 3 seeds, of which rounding only the
activation accounts for up to 3.7e-3; small next to int4 / int8 quantization error itself.

Measured 2026-11-24: AMD EPYC, 2 cores (flags include avx2 fma f16c avx512f/dq/cd/bw/vl
avx512_bf16 avx512_vnni avx512_vbmi/vbmi2), L2 2x2 MiB, L3 32 MiB; torch 2.13.0+cpu, capability
AVX512. Microseconds per call, medians. Other sessions ran tests on this machine meanwhile, so
each case was measured in 7 rounds and then again until 3 tries (of at most 10) ran while
other processes used < 0.1 core; only such quiet tries are reported, and "~" marks cases whose
quiet medians still spread > 1.5x. With another process busy, every torch OpenMP kernel at 2
threads stalled ~8 ms per call (a scheduler slice), which is what the filter removes.
"stream" cycles through weight copies totalling >= 64 MiB, so every call reads its weight from
memory as a decode step does across layers; "hot" re-reads one weight (cache-resident up to
~L3 size). "kernel" = aten op on a bf16 input; "op" = ``cpu_int*pack_linear`` on a float32
input (conversion, cast back and custom-op dispatch included, ~15-40 us more). Columns:
N x K @ rows.

1 thread, stream   768x768 2048x768 768x2048 32000x768 4096x4096 2048x768@8 2048x768@32
fp32 F.linear          211      565      404      7614      4943        782        1536
bf16 F.linear          159      520~     313      5488      3722        451         917
int8 kernel             93      281      182      3785      1563        478        1514
int8 op                119      369~     226      3537      1539        636        1699
int4 g32 kernel         42      104~      90      1376       963        359        1190
int4 g128 kernel        36       93       93      1351       876        293        1290
int4 g128 op            60~     131      110      1356       920        330        1207

1 thread, hot
fp32 F.linear           45~     114~     127~     8334      3353~       433        1220
int8 kernel             33      102~      94      2765      1319        338        1351
int4 g32 kernel         35      101       87      1327       906        360        1289
int4 g128 kernel        33       93~      89      1284       865        290        1159
int8, fp32 input       493     1335     1311     20410     14202      10724~      41853
int4 g32, fp32 input  1006     2793     2680     41968     28694          -           -
int4 g128, fp32 input 1008     2697     2677     42076     28667      22252       85906
int8, fp16 input       609~    2139~    1596     25152~    16997          -           -
int4 g128, fp16 input 1147~    2954~    3376~    45745~    45760          -           -

2 threads, stream
fp32 F.linear          234      565      527      8638      3149        594~       1003~
bf16 F.linear          159      279      262~     4557      2046        324~        479
int8 kernel             58      160      136      2331       722~       341         929
int8 op                115      203      183      2691       911        454~        909
int4 g32 kernel         25       92       78~      730       457        177         644~
int4 g128 kernel        25~      66       51~      696       463        169         625~
int4 g128 op            47      117       76~      710       558        197         724

2 threads, hot
fp32 F.linear           59~     115      166~     7683      3149        316~        720
int8 kernel             23       52       50      2566       422        171         722
int4 g32 kernel         23       89~      88~      948       451~       169         609
int4 g128 kernel        21       55       50       643       428        168         639
int8, fp32 input       319     1142~     646     10128      7519      10281       22190~
int4 g128, fp32 input  531     1459     1416     21141~    14617      11312       45062

Reading: at one row the int4 kernel is ~4-6x faster than the float32 GEMV streaming at 1
thread (~3.5-5.5x through the op), the int8 kernel ~2-3x; on cache-resident small weights the
gain shrinks to ~1.2-1.4x and the op's fixed overhead can eat it (768x768 hot: 45 vs 53 us), which
is what ``measure_weight_only_speedup`` is for. The kernels re-dequantize the weight for every
block of 4 rows, so their time grows about linearly with rows: at 8 rows int4 is still
~1.5-3.5x faster than float32, at 32 rows 1.05-1.6x and slower than bf16 ``F.linear``; at
128-512 rows (prefill; measured once, under load) int4 and float32 ``F.linear`` took about the
same time. fp32 / fp16 inputs are useless (scalar, 6-40x slower than bf16).
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from autodeploy.utils.logging import get_logger

logger = get_logger(__name__)

#: The input dtype both kernels are fast for (the only vectorized path on x86).
KERNEL_DTYPE = torch.bfloat16
INT4_GROUP_SIZES = (32, 64, 128, 256)
INT4_N_MULTIPLE = 16
INT8_K_MULTIPLE = 16

# ---- packing (once, at load) ----------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Int4Packed:
    """An int4 weight in ``_weight_int4pack_mm_for_cpu``'s layout.

    ``weight``: uint8 [N, K/2], the kernel's interleaved layout (not the canonical nibble order);
    ``scales_and_zeros``: bf16 [K/g, N, 2], ``[..., 0]`` = scale, ``[..., 1]`` = (8 - zp) * scale.
    """

    weight: Tensor
    scales_and_zeros: Tensor
    group_size: int
    in_features: int
    out_features: int


@dataclass(frozen=True, eq=False)
class Int8Packed:
    """An int8 weight for ``_weight_int8pack_mm``: ``weight`` int8 [N, K] (contiguous, freshly
    allocated so it is 64-byte aligned), ``scales`` bf16 [N]."""

    weight: Tensor
    scales: Tensor
    in_features: int
    out_features: int


def int4_shape_problem(n: int, k: int, group_size: int) -> Optional[str]:
    """Why the int4 kernel cannot take an [n, k] weight with this group size, or None."""
    if group_size not in INT4_GROUP_SIZES:
        return f"group_size {group_size} is not one of {INT4_GROUP_SIZES}"
    if k % group_size:
        return f"K={k} is not a multiple of group_size {group_size}"
    if n % INT4_N_MULTIPLE:
        return f"N={n} is not a multiple of {INT4_N_MULTIPLE}"
    if n == 0 or k == 0:
        return "empty weight"
    return None


def int8_shape_problem(n: int, k: int) -> Optional[str]:
    """Why the int8 kernel cannot take an [n, k] weight, or None."""
    if k % INT8_K_MULTIPLE:
        return f"K={k} is not a multiple of {INT8_K_MULTIPLE} (the bf16 kernel reads K in aligned steps of 16)"
    if n == 0 or k == 0:
        return "empty weight"
    return None


def pack_int4_for_cpu(weight_u8: Tensor, scales: Tensor, zeros: Tensor, group_size: int) -> Int4Packed:
    """Canonical int4 (uint8 [N, K/2], float scales / zero points [N, K/g]) -> ``Int4Packed``.

    Raises ``ValueError`` naming the shape when the kernel cannot take it (the caller then
    dequantizes to float instead).
    """
    if weight_u8.dim() != 2 or weight_u8.dtype != torch.uint8:
        raise ValueError(
            f"int4 CPU kernel: weight must be uint8 [N, K/2], got {weight_u8.dtype} {list(weight_u8.shape)}"
        )
    n, k = weight_u8.shape[0], weight_u8.shape[1] * 2
    if _INT4_CONVERT is None or _INT4_MM is None:
        raise ValueError(f"int4 CPU kernel cannot take weight [N={n}, K={k}]: not in this torch build")
    problem = int4_shape_problem(n, k, group_size)
    if problem is not None:
        raise ValueError(f"int4 CPU kernel cannot take weight [N={n}, K={k}] with group_size {group_size}: {problem}")
    groups = k // group_size
    for name, t in (("scales", scales), ("zeros", zeros)):
        if tuple(t.shape) != (n, groups):
            raise ValueError(
                f"int4 CPU kernel: {name} must be [N={n}, K/g={groups}] for weight [N={n}, K={k}] "
                f"with group_size {group_size}, got {list(t.shape)}"
            )
    w = weight_u8.cpu()
    q = torch.stack((w & 0xF, w >> 4), dim=-1).reshape(n, k).to(torch.int32)
    packed = _INT4_CONVERT(q.contiguous(), 2)
    s = scales.detach().cpu().to(torch.float32)
    z = (8.0 - zeros.detach().cpu().to(torch.float32)) * s
    scales_and_zeros = torch.stack((s, z), dim=-1).transpose(0, 1).to(KERNEL_DTYPE).contiguous()
    return Int4Packed(packed, scales_and_zeros, int(group_size), int(k), int(n))


def pack_int8_for_cpu(weight_i8: Tensor, scales: Tensor) -> Int8Packed:
    """Canonical int8 (int8 [N, K], float scales [N]) -> ``Int8Packed``.

    Raises ``ValueError`` naming the shape when the kernel cannot take it.
    """
    if weight_i8.dim() != 2 or weight_i8.dtype != torch.int8:
        raise ValueError(f"int8 CPU kernel: weight must be int8 [N, K], got {weight_i8.dtype} {list(weight_i8.shape)}")
    n, k = weight_i8.shape
    if _INT8_MM is None:
        raise ValueError(f"int8 CPU kernel cannot take weight [N={n}, K={k}]: not in this torch build")
    problem = int8_shape_problem(n, k)
    if problem is not None:
        raise ValueError(f"int8 CPU kernel cannot take weight [N={n}, K={k}]: {problem}")
    if tuple(scales.shape) != (n,):
        raise ValueError(f"int8 CPU kernel: scales must be [N={n}] for weight [N={n}, K={k}], got {list(scales.shape)}")
    # a fresh allocation: torch's CPU allocator aligns to 64 bytes, the kernel's aligned loads need 16
    weight = torch.empty((n, k), dtype=torch.int8)
    weight.copy_(weight_i8.detach())
    return Int8Packed(weight, scales.detach().cpu().to(KERNEL_DTYPE).contiguous(), int(k), int(n))


# ---- ops --------------------------------------------------------------------------------------


def _aten(name: str) -> Optional[torch._ops.OpOverload]:
    """``torch.ops.aten.<name>.default`` (bound once: the overload is cheaper to call than the
    packet), or None where this torch build lacks it."""
    packet = getattr(torch.ops.aten, name, None)
    return None if packet is None else packet.default


_INT4_CONVERT = _aten("_convert_weight_to_int4pack_for_cpu")
_INT4_MM = _aten("_weight_int4pack_mm_for_cpu")
_INT8_MM = _aten("_weight_int8pack_mm")


def _as_kernel_rows(x: Tensor) -> Tensor:
    """``x`` [..., K] as a contiguous 2-D bf16 tensor, copying only where needed."""
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if rows.dtype != KERNEL_DTYPE:
        rows = rows.to(KERNEL_DTYPE)
    if not rows.is_contiguous():
        rows = rows.contiguous()
    return rows


def _finish(out: Tensor, x: Tensor, bias: Optional[Tensor]) -> Tensor:
    """Kernel output [M, N] -> ``x.dtype``, ``x``'s leading shape, plus ``bias`` (in x.dtype)."""
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    if x.dim() != 2:
        out = out.view(*x.shape[:-1], out.shape[-1])
    if bias is not None:
        # ``out`` is always a fresh tensor here, so adding in place mutates nothing of the caller's
        out.add_(bias if bias.dtype == out.dtype else bias.to(out.dtype))
    return out


def int4pack_linear(
    x: Tensor,
    packed_weight: Tensor,
    scales_and_zeros: Tensor,
    group_size: int,
    out_features: int,
    bias: Optional[Tensor] = None,
) -> Tensor:
    """``x @ W.T + bias`` for a weight-only int4 ``W`` packed by ``pack_int4_for_cpu``.

    ``x`` [..., K] of any float dtype is rounded to bf16 (the kernel's only vectorized input),
    the result cast back to ``x.dtype``; ``bias`` is added in ``x.dtype``. A plain function: the
    custom op ``autodeploy::cpu_int4pack_linear`` runs exactly this, for ~12-14 us more dispatch
    per call (measured), which graphs that are not exported or compiled can skip.
    """
    rows = _as_kernel_rows(x)
    if rows.shape[0] == 0:
        return _finish(rows.new_zeros(0, out_features), x, bias)
    if scales_and_zeros.dtype != KERNEL_DTYPE:
        scales_and_zeros = scales_and_zeros.to(KERNEL_DTYPE)
    return _finish(_INT4_MM(rows, packed_weight, group_size, scales_and_zeros), x, bias)


def int8pack_linear(x: Tensor, weight_i8: Tensor, scales: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ (weight_i8 * scales[:, None]).T + bias`` for an ``Int8Packed`` weight.

    ``x`` [..., K] of any float dtype is rounded to bf16, the result cast back to ``x.dtype``;
    ``bias`` is added in ``x.dtype``. K must be a multiple of 16 and both operands aligned (the
    kernel's aligned loads): a misaligned activation is copied, a misaligned weight too (slow,
    logged once; ``pack_int8_for_cpu`` never makes one). Plain function, as ``int4pack_linear``.
    """
    n, k = weight_i8.shape
    if k % INT8_K_MULTIPLE:
        raise ValueError(f"cpu_int8pack_linear: weight [N={n}, K={k}]: K must be a multiple of {INT8_K_MULTIPLE}")
    rows = _as_kernel_rows(x)
    if rows.shape[0] == 0:
        return _finish(rows.new_zeros(0, n), x, bias)
    if rows.data_ptr() % 32:
        rows = rows.clone()
    if weight_i8.data_ptr() % 16 or not weight_i8.is_contiguous():
        _warn_once("int8 weight is not a contiguous 16-byte aligned tensor; copied per call (use pack_int8_for_cpu)")
        weight_i8 = weight_i8.clone(memory_format=torch.contiguous_format)
    if scales.dtype != KERNEL_DTYPE:
        scales = scales.to(KERNEL_DTYPE)
    return _finish(_INT8_MM(rows, weight_i8, scales), x, bias)


@torch.library.custom_op("autodeploy::cpu_int4pack_linear", mutates_args=())
def cpu_int4pack_linear(
    x: Tensor,
    packed_weight: Tensor,
    scales_and_zeros: Tensor,
    group_size: int,
    out_features: int,
    bias: Optional[Tensor] = None,
) -> Tensor:
    """``int4pack_linear`` behind an op boundary (export / torch.compile see one opaque node)."""
    return int4pack_linear(x, packed_weight, scales_and_zeros, group_size, out_features, bias)


@cpu_int4pack_linear.register_fake
def _cpu_int4pack_linear_fake(x, packed_weight, scales_and_zeros, group_size, out_features, bias=None):
    return x.new_empty(*x.shape[:-1], out_features)


@torch.library.custom_op("autodeploy::cpu_int8pack_linear", mutates_args=())
def cpu_int8pack_linear(x: Tensor, weight_i8: Tensor, scales: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``int8pack_linear`` behind an op boundary."""
    return int8pack_linear(x, weight_i8, scales, bias)


@cpu_int8pack_linear.register_fake
def _cpu_int8pack_linear_fake(x, weight_i8, scales, bias=None):
    return x.new_empty(*x.shape[:-1], weight_i8.shape[0])


_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)


def int4_packed_linear(x: Tensor, packed: Int4Packed, bias: Optional[Tensor] = None) -> Tensor:
    """``int4pack_linear`` over an ``Int4Packed``."""
    return int4pack_linear(x, packed.weight, packed.scales_and_zeros, packed.group_size, packed.out_features, bias)


def int8_packed_linear(x: Tensor, packed: Int8Packed, bias: Optional[Tensor] = None) -> Tensor:
    """``int8pack_linear`` over an ``Int8Packed``."""
    return int8pack_linear(x, packed.weight, packed.scales, bias)


# ---- build-time choice --------------------------------------------------------------------------

_available: Dict[str, bool] = {}
_speedups: Dict[Tuple[str, int, int, int, int, int, bool], float] = {}

#: Weights cycled through per timed variant add up to at least this many bytes, so that, as in a
#: decode step across layers, they stream from memory rather than sit in the last-level cache.
_STREAM_BYTES = 64 << 20
_MAX_COPIES = 256


def kernel_available(kind: str) -> bool:
    """Whether the ``kind`` ("int4" or "int8") kernel exists in this torch build and gives the
    right answer on this CPU (tried once on a tiny shape, cached)."""
    if kind not in ("int4", "int8"):
        raise ValueError(f"unknown weight-only kind {kind!r} (int4 or int8)")
    if kind not in _available:
        try:
            _available[kind] = _try_tiny(kind)
        except Exception as exc:  # noqa: BLE001 - any failure means "not here"
            logger.info("CPU %s weight-only kernel unavailable: %s", kind, exc)
            _available[kind] = False
    return _available[kind]


def _try_tiny(kind: str) -> bool:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen)
    if kind == "int4":
        n, k, g = 32, 64, 32
        w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
        scales = torch.rand(n, k // g, generator=gen) + 0.5
        zeros = torch.randint(0, 16, (n, k // g), generator=gen).float()
        q = torch.stack((w & 0xF, w >> 4), dim=-1).reshape(n, k).float()
        ref_w = (q - zeros.repeat_interleave(g, 1)) * scales.repeat_interleave(g, 1)
        out = int4_packed_linear(x, pack_int4_for_cpu(w, scales, zeros, g))
    else:
        n, k = 8, 64
        w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
        scales = torch.rand(n, generator=gen) + 0.5
        ref_w = w.float() * scales[:, None]
        out = int8_packed_linear(x, pack_int8_for_cpu(w, scales))
    ref = x @ ref_w.T
    err = ((out - ref).norm() / ref.norm()).item()
    if not err < 2e-2:
        logger.info("CPU %s weight-only kernel gave rel error %.3g on a tiny shape; not used", kind, err)
        return False
    return True


def _median_time(fns: Iterator[Callable[[], object]], warmup: int, max_reps: int, budget_s: float) -> float:
    """Median seconds per call of the next functions from ``fns`` (at least 3 calls, at most
    ``max_reps``, stopping once ``budget_s`` is spent), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        next(fns)()
    times: List[float] = []
    start = time.perf_counter()
    while len(times) < max_reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        fn = next(fns)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copies(nbytes: int) -> int:
    return max(1, min(_MAX_COPIES, math.ceil(_STREAM_BYTES / max(1, nbytes))))


def measure_weight_only_speedup(
    kind: str,
    n: int,
    k: int,
    group_size: int,
    threads: Optional[int] = None,
    rows: int = 1,
    through_op: bool = True,
) -> float:
    """float32 ``F.linear`` time / packed-kernel time for one [n, k] weight at ``rows`` rows.

    The packed side is timed with a float32 input, its bf16 conversion and cast back included,
    through the custom op (``through_op``, ~12 us of dispatch per call) or the plain function;
    the float32 side is ``torch.nn.functional.linear``. Each side cycles
    through enough weight copies (>= 64 MiB) to stream them from memory as a decode step does.
    Values are constants: they do not change either kernel's time, and filling a large weight
    randomly would cost more than the measurement. Returns 0.0 where the kernel is unavailable
    or refuses the shape. Cached per (kind, n, k, group_size, threads, rows); ~0.1-0.3 s per
    new shape (more for weights of hundreds of MiB, which take that long to fill).
    ``group_size`` is ignored for int8.
    """
    if kind not in ("int4", "int8"):
        raise ValueError(f"unknown weight-only kind {kind!r} (int4 or int8)")
    if kind == "int8":
        group_size = 0
    nthreads = threads if threads is not None else torch.get_num_threads()
    key = (kind, int(n), int(k), int(group_size), int(nthreads), int(rows), bool(through_op))
    if key in _speedups:
        return _speedups[key]
    problem = int4_shape_problem(n, k, group_size) if kind == "int4" else int8_shape_problem(n, k)
    if problem is not None or not kernel_available(kind):
        logger.debug("weight-only %s [%d, %d] g=%d: %s", kind, n, k, group_size, problem or "kernel unavailable")
        _speedups[key] = 0.0
        return 0.0
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        t_start = time.perf_counter()
        fp32_t, packed_t = _time_pair(kind, n, k, group_size, rows, through_op)
        speedup = fp32_t / packed_t
        logger.debug(
            "weight-only %s [%d, %d] g=%d rows=%d threads=%d: fp32 %.1f us, packed %.1f us, %.2fx (%.2f s)",
            kind, n, k, group_size, rows, nthreads, fp32_t * 1e6, packed_t * 1e6, speedup,
            time.perf_counter() - t_start,
        )  # fmt: skip
    finally:
        if threads is not None:
            torch.set_num_threads(before)
    _speedups[key] = speedup
    return speedup


def _time_pair(
    kind: str, n: int, k: int, group_size: int, rows: int, through_op: bool, budget_s: float = 0.12
) -> Tuple[float, float]:
    """(float32 F.linear seconds, packed op seconds) per call, streamed weights."""
    x = torch.randn(rows, k)
    linear = torch.nn.functional.linear
    fp32_ws = [torch.full((n, k), 0.01) for _ in range(_copies(n * k * 4))]
    fp32_fns = [lambda w=w: linear(x, w) for w in fp32_ws]
    if kind == "int4":
        op = torch.ops.autodeploy.cpu_int4pack_linear if through_op else int4pack_linear
        sz = torch.full((k // group_size, n, 2), 0.01, dtype=KERNEL_DTYPE)
        ws = [torch.full((n, k // 2), 0x37, dtype=torch.uint8) for _ in range(_copies(n * k // 2))]
        packed_fns = [lambda w=w: op(x, w, sz, group_size, n, None) for w in ws]
    else:
        op8 = torch.ops.autodeploy.cpu_int8pack_linear if through_op else int8pack_linear
        s = torch.full((n,), 0.01, dtype=KERNEL_DTYPE)
        ws = [torch.full((n, k), 3, dtype=torch.int8) for _ in range(_copies(n * k))]
        packed_fns = [lambda w=w: op8(x, w, s, None) for w in ws]
    # each side cycles on through its copies (none read twice while still cached); the two sides
    # are interleaved twice so that a burst of load from other processes hits both
    fp32_cycle, packed_cycle = itertools.cycle(fp32_fns), itertools.cycle(packed_fns)
    a1 = _median_time(fp32_cycle, 2, 10, budget_s / 4)
    b1 = _median_time(packed_cycle, 2, 10, budget_s / 4)
    a2 = _median_time(fp32_cycle, 1, 10, budget_s / 4)
    b2 = _median_time(packed_cycle, 1, 10, budget_s / 4)
    return min(a1, a2), min(b1, b2)
