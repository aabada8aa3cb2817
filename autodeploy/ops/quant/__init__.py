"""Quantized ops: formats (numerics), canonical quantized linears, and their backends."""

from . import activation, formats, linear  # noqa: F401
