"""Linear."""

import math
import threading
from contextlib import contextmanager
from typing import Iterator, Optional, Tuple

import torch
from torch import Tensor

from . import native


def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ weight.T + bias`` for ops that hold weights: ``weight`` may be a oneDNN-packed
    tensor (``select_linear_backend`` with backend onednn), which only oneDNN's linear can read."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


@torch.library.custom_op("autodeploy::torch_linear_simple", mutates_args=())
def torch_linear_simple(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ weight.T + bias`` behind an op boundary.

    Export IR already spells a plain linear as ``aten.linear``; this op exists for passes that
    want every linear as one opaque node (sharding, quantisation) whatever form the model used.
    """
    return torch.nn.functional.linear(x, weight, bias)


@torch_linear_simple.register_fake
def _torch_linear_simple_fake(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# Tensor-parallel modes a ``torch_linear_with_hint`` may state (``apply_sharding_hints``).
TP_MODES: Tuple[str, ...] = ("none", "colwise", "rowwise", "colwise_gather")


def check_sharding_hint(tp_mode: str, tp_min_local_shape: int) -> None:
    """Raise ``ValueError`` naming the allowed values for a hint that cannot mean anything.

    Checked in the op itself (so a wrong hint fails at the first eager call or at export, in
    the model author's code) and again by ``apply_sharding_hints`` for graphs built by hand."""
    if tp_mode not in TP_MODES:
        raise ValueError(f"torch_linear_with_hint: tp_mode {tp_mode!r} is not one of {list(TP_MODES)}")
    if tp_min_local_shape < 1:
        raise ValueError(f"torch_linear_with_hint: tp_min_local_shape must be >= 1, got {tp_min_local_shape}")


@torch.library.custom_op("autodeploy::torch_linear_with_hint", mutates_args=())
def torch_linear_with_hint(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, tp_mode: str = "none",
                           tp_min_local_shape: int = 1, layer_type: str = "") -> Tensor:
    """``x @ weight.T + bias`` that states how tensor parallelism splits it.

    Why: a model that knows its own sharding (a custom model written with the canonical ops)
    says so in the graph instead of leaving it to ``detect_sharding``'s pattern search.
    ``tp_mode``: ``"colwise"`` splits the output features (each rank its heads / hidden slice, no
    communication), ``"rowwise"`` the input features (an all-reduce completes the partial sums),
    ``"colwise_gather"`` a column split whose slices are all-gathered (the vocab-parallel LM
    head), ``"none"`` keeps it whole. ``tp_min_local_shape``: the smallest output slice a column
    split may leave on one rank (a K/V projection's head_dim: with fewer key/value heads than
    ranks each head is then replicated rather than cut). ``layer_type`` ("attention", "mlp",
    "moe", "lm_head", ...) lets ``apply_sharding_hints.shard_layers`` pick what to split.

    On one rank, and wherever the hint is not applied, it is exactly ``F.linear``;
    ``apply_sharding_hints`` lowers it to ``aten.linear`` after reading the hint.
    """
    check_sharding_hint(tp_mode, tp_min_local_shape)
    return torch.nn.functional.linear(x, weight, bias)


@torch_linear_with_hint.register_fake
def _torch_linear_with_hint_fake(x, weight, bias=None, tp_mode="none", tp_min_local_shape=1, layer_type=""):
    check_sharding_hint(tp_mode, tp_min_local_shape)
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("autodeploy::blas_linear", mutates_args=())
def blas_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x @ weight.T + bias`` through NumPy's BLAS (OpenBLAS in the NumPy wheels).

    Why: on the CPUs this project measured (AVX2, 2 cores), OpenBLAS streams fp32 weights at
    about twice the bandwidth of the BLAS torch ships for matrix-vector products (decode at
    batch 1) and is 5-15% faster for small batches. CPU, float32, contiguous weights only;
    anything else falls back to ``torch.nn.functional.linear``.
    """
    if x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32 or not weight.is_contiguous():
        return torch.nn.functional.linear(x, weight, bias)
    import numpy as np

    rows = x.reshape(-1, x.shape[-1])
    if not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.from_numpy(np.matmul(rows.numpy(), weight.numpy().T))
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


@blas_linear.register_fake
def _blas_linear_fake(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("autodeploy::onednn_linear", mutates_args=())
def onednn_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """oneDNN's linear over a packed weight (``select_linear_backend``), behind an op boundary.

    torch-simple graphs call ``mkldnn._linear_pointwise`` directly (no custom-op dispatch cost);
    graphs for ``torch.compile`` use this op instead, because inductor cannot lower the mkldnn op
    itself but runs an opaque custom op as an external kernel.
    """
    return linear(x, weight, bias)


@onednn_linear.register_fake
def _onednn_linear_fake(x, weight, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


_exact = threading.local()


@contextmanager
def exact_linears() -> Iterator[None]:
    """Within this block (on this thread) ``dual_linear`` reads its float32 weight for every row
    count. For checks that compare one schedule of the same tokens against another (the KV-cache
    consistency check): the narrow GEMV copy would make the one-row steps differ by its
    rounding, which is not what those checks look for."""
    before = getattr(_exact, "on", False)
    _exact.on = True
    try:
        yield
    finally:
        _exact.on = before


@torch.library.custom_op("autodeploy::dual_linear", mutates_args=())
def dual_linear(
    x: Tensor, weight: Tensor, gemv_weight: Tensor, bias: Optional[Tensor] = None, gemv_max_rows: int = 1
) -> Tensor:
    """``x @ weight.T + bias``, read from a narrower copy of the weight when ``x`` has at most
    ``gemv_max_rows`` rows (decode at batch 1).

    Why: a matrix-vector product reads every weight once per token and does little else, so
    its speed is the weight's bytes over memory bandwidth. On the CPUs measured here torch's
    float16/bfloat16 GEMV (activations rounded to that dtype, float32 accumulation) ran 1.4-2.7x
    faster than oneDNN's float32 one at one row, and was slower from two rows on, where the
    float32 ``weight`` (which may be oneDNN-packed) still serves. The rounding makes this
    lossy, hence opt-in (``select_linear_backend.gemv_dtype``). A float16 result that overflowed
    is computed again in float32 rather than returned as ``inf``.
    """
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if gemv_weight.dtype == x.dtype and 0 < rows <= gemv_max_rows:
        # a float32 copy in the plain layout: exact, so it serves inside exact_linears() too
        if rows == 1:
            out = native.gemv(x, gemv_weight, bias)
            if out is not None:
                return out
        return torch.nn.functional.linear(x, gemv_weight, bias)
    if 0 < rows <= gemv_max_rows and not getattr(_exact, "on", False):
        out = torch.nn.functional.linear(x.to(gemv_weight.dtype), gemv_weight).to(x.dtype)
        # one reduction instead of isfinite's three ops: a float32 sum of float16-range values
        # cannot overflow, so it is finite exactly when each of them is
        if gemv_weight.dtype != torch.float16 or math.isfinite(out.sum().item()):
            return out if bias is None else out + bias
    return linear(x, weight, bias)


@dual_linear.register_fake
def _dual_linear_fake(x, weight, gemv_weight, bias=None, gemv_max_rows=1):
    return x.new_empty(*x.shape[:-1], gemv_weight.shape[0])


def linear_forms() -> Tuple[object, ...]:
    """Every op a plain ``x @ weight.T + bias`` can be in a graph: export's ``aten.linear``,
    ``torch_linear_simple`` (``match_linear_simple``) and what ``select_linear_backend`` turns
    linears into. A pass that must recognise a linear in any of its forms (the LM head search of
    ``gather_logits_before_lm_head``) tests against this one list, so a new backend op is added
    here once."""
    forms: Tuple[object, ...] = (
        torch.ops.aten.linear,
        torch.ops.autodeploy.torch_linear_simple,
        torch.ops.autodeploy.blas_linear,
        torch.ops.autodeploy.onednn_linear,
        torch.ops.autodeploy.dual_linear,
    )
    if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        forms += (torch.ops.mkldnn._linear_pointwise,)
    from .quant.linear import quant_linear_ops  # quantized linears (the LM head of a quantized model)

    ad = torch.ops.autodeploy
    return forms + quant_linear_ops() + (ad.cpu_int4pack_linear.default, ad.cpu_int8pack_linear.default,
                                         ad.scaled_mm_fp8_linear.default)
