"""Quantized ops: formats (numerics), canonical quantized linears, and their backends."""

from . import activation, cpu_kernels, formats, linear  # noqa: F401
from . import fp8_gemm, fp8_grouped_gemm, fused, moe  # noqa: F401
