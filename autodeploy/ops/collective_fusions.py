"""All-reduce fused with the RMSNorm that reads it (``fuse_allreduce_residual_rmsnorm``).

Under tensor parallelism every row-parallel linear (``o_proj``, ``down_proj``) ends in
``torch_dist_all_reduce``, and in a pre-norm transformer that sum goes straight into the residual
add and the next RMSNorm. The ops here do those steps as one call:

* ``torch_dist_all_reduce_fused_add_rmsnorm(x, residual, w, eps) -> (rmsnorm(s), s)`` with
  ``s = all_reduce(x) + residual``: the sum over ranks is an intermediate nobody else reads, so it
  is reduced in place in a buffer this module owns (one copy in, one all-reduce, no allocation
  per call) and the fused add+norm reads it from there;
* ``torch_dist_all_reduce_rmsnorm(x, w, eps) -> (rmsnorm(r), r)`` with ``r = all_reduce(x)``: the
  plain pattern (no residual add). ``r`` is returned because it is the residual stream of whatever
  follows, so it is a fresh tensor reduced in place;
* ``native_*`` twins: the same with the norm computed by autodeploy's CPU kernel (the norm that
  ``fuse_rmsnorm`` chose), so fusing the collective never changes which norm kernel runs.
* quantized variants of all four, the norm output quantized as the norm fusions left it
  (``ops/quant/fused.py``): ``*_quant_fp8`` (static FP8 scale, ``fuse_rmsnorm_quant_fp8``),
  ``*_quant_nvfp4`` (NVFP4 with its calibrated global scale, ``fuse_rmsnorm_quant_nvfp4``) and
  ``*_quant_fp8_group`` (fine-grained FP8: dynamic, per token per ``group_size`` channels, also
  ``fuse_rmsnorm_quant_fp8``).

Each op computes its values with the very functions the unfused graph runs (the all-reduce sums
in the activation dtype, then the existing add+norm code), so a fused graph equals the unfused
one exactly. At world size 1 the all-reduce is skipped: the op is just the (add +) norm.

Why not mutate the input in place instead of copying into the buffer: a custom op that declares
no mutated arguments must not write to them (export, functionalization and CUDA graphs rely on
it), and the input is usually a linear's output that nothing else holds anyway, so the copy is
small next to the all-reduce itself. On CUDA this is NCCL's all-reduce plus the same norm; a
one-kernel fused collective (TensorRT-LLM's / FlashInfer's) is not written here (no GPU to verify
it on).

The buffer is per thread, per (device, dtype), grown to the largest token count seen and reused
as a prefix view; it is valid only during one call (nothing returned aliases it). Under CUDA-graph
capture the op reduces into a fresh tensor instead (untried: no GPU here).
"""

import threading
from typing import Dict, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.process_group import world_size
from . import native  # noqa: F401  (the native norm kernel the native_* twins use)
from .normalization import _fused_add_rmsnorm_fake, native_fused_add_rmsnorm, native_rmsnorm, torch_rmsnorm_impl
from .quant import fused as quant_fused


class _ReduceBuffers(threading.local):
    """Per-thread flat buffers keyed by (device, dtype): graphs run by two threads (two engines
    in one process) must not share the scratch space."""

    def __init__(self) -> None:
        self.flat: Dict[Tuple[torch.device, torch.dtype], Tensor] = {}


_BUFFERS = _ReduceBuffers()


def _reduced_scratch(x: Tensor) -> Tensor:
    """The sum of ``x`` over ranks, in this module's scratch buffer (valid until the next call);
    ``x`` itself at world size 1 (read only, never written)."""
    if world_size() == 1:
        return x
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        # a buffer grown during CUDA-graph capture would live in the graph's private pool
        return _reduced_fresh(x)
    key = (x.device, x.dtype)
    flat = _BUFFERS.flat.get(key)
    n = x.numel()
    if flat is None or flat.numel() < n:
        flat = torch.empty(n, dtype=x.dtype, device=x.device)
        _BUFFERS.flat[key] = flat
    buf = flat[:n].view(x.shape)
    buf.copy_(x)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return buf


def _reduced_fresh(x: Tensor) -> Tensor:
    """The sum of ``x`` over ranks in a new tensor (it is returned, so it cannot be scratch)."""
    out = x.clone(memory_format=torch.contiguous_format)
    if world_size() > 1:
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def _torch_add_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    summed = x + residual  # what torch_fused_add_rmsnorm computes
    return torch_rmsnorm_impl(summed, weight, eps), summed


def _norm_pair_fake(x: Tensor, weight: Tensor, *_: object) -> Tuple[Tensor, Tensor]:
    return torch.empty_like(x, dtype=torch.promote_types(x.dtype, weight.dtype)), torch.empty_like(x)


def _add_norm_fake(x: Tensor, residual: Tensor, weight: Tensor, eps: float, *_: object) -> Tuple[Tensor, Tensor]:
    return _fused_add_rmsnorm_fake(x, residual, weight, eps)


# ---- all-reduce + residual add + RMSNorm -------------------------------------------------------


@torch.library.custom_op("autodeploy::torch_dist_all_reduce_fused_add_rmsnorm", mutates_args=())
def torch_dist_all_reduce_fused_add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float
                                            ) -> Tuple[Tensor, Tensor]:
    """``s = all_reduce(x) + residual``; returns ``(rmsnorm(s), s)`` (``torch_fused_add_rmsnorm``
    of the reduced ``x``)."""
    return _torch_add_norm(_reduced_scratch(x), residual, weight, eps)


@torch.library.custom_op("autodeploy::native_dist_all_reduce_fused_add_rmsnorm", mutates_args=())
def native_dist_all_reduce_fused_add_rmsnorm(x: Tensor, residual: Tensor, weight: Tensor, eps: float
                                             ) -> Tuple[Tensor, Tensor]:
    """``torch_dist_all_reduce_fused_add_rmsnorm`` with the add and norm from the CPU kernel
    (the reference where it cannot take the inputs, as ``native_fused_add_rmsnorm`` does)."""
    return native_fused_add_rmsnorm(_reduced_scratch(x), residual, weight, eps)


# ---- all-reduce + RMSNorm (no residual add) ----------------------------------------------------


@torch.library.custom_op("autodeploy::torch_dist_all_reduce_rmsnorm", mutates_args=())
def torch_dist_all_reduce_rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    """``r = all_reduce(x)``; returns ``(rmsnorm(r), r)``."""
    reduced = _reduced_fresh(x)
    return torch_rmsnorm_impl(reduced, weight, eps), reduced


@torch.library.custom_op("autodeploy::native_dist_all_reduce_rmsnorm", mutates_args=())
def native_dist_all_reduce_rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    """``torch_dist_all_reduce_rmsnorm`` with the norm from the CPU kernel."""
    reduced = _reduced_fresh(x)
    return native_rmsnorm(reduced, weight, eps), reduced


# ---- the same, followed by static FP8 quantization of the normed output ------------------------


@torch.library.custom_op("autodeploy::torch_dist_all_reduce_fused_add_rmsnorm_quant_fp8", mutates_args=())
def torch_dist_all_reduce_fused_add_rmsnorm_quant_fp8(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                                                      input_scale: Tensor) -> Tuple[Tensor, Tensor]:
    """``torch_fused_add_rmsnorm_quant_fp8`` of the reduced ``x``: ``(fp8(rmsnorm(s)), s)``."""
    return quant_fused.torch_fused_add_rmsnorm_quant_fp8(_reduced_scratch(x), residual, weight, eps, input_scale)


@torch.library.custom_op("autodeploy::native_dist_all_reduce_fused_add_rmsnorm_quant_fp8", mutates_args=())
def native_dist_all_reduce_fused_add_rmsnorm_quant_fp8(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                                                       input_scale: Tensor) -> Tuple[Tensor, Tensor]:
    """``native_fused_add_rmsnorm_quant_fp8`` of the reduced ``x``."""
    return quant_fused.native_fused_add_rmsnorm_quant_fp8(_reduced_scratch(x), residual, weight, eps, input_scale)


@torch.library.custom_op("autodeploy::torch_dist_all_reduce_rmsnorm_quant_fp8", mutates_args=())
def torch_dist_all_reduce_rmsnorm_quant_fp8(x: Tensor, weight: Tensor, eps: float, input_scale: Tensor
                                            ) -> Tuple[Tensor, Tensor]:
    """``r = all_reduce(x)``; returns ``(fp8(rmsnorm(r)), r)``."""
    reduced = _reduced_fresh(x)
    return quant_fused.torch_rmsnorm_quant_fp8(reduced, weight, eps, input_scale), reduced


@torch.library.custom_op("autodeploy::native_dist_all_reduce_rmsnorm_quant_fp8", mutates_args=())
def native_dist_all_reduce_rmsnorm_quant_fp8(x: Tensor, weight: Tensor, eps: float, input_scale: Tensor
                                             ) -> Tuple[Tensor, Tensor]:
    """``torch_dist_all_reduce_rmsnorm_quant_fp8`` with the norm from the CPU kernel."""
    reduced = _reduced_fresh(x)
    return quant_fused.native_rmsnorm_quant_fp8(reduced, weight, eps, input_scale), reduced


# ---- the same, followed by NVFP4 quantization of the normed output -------------------------------


@torch.library.custom_op("autodeploy::torch_dist_all_reduce_fused_add_rmsnorm_quant_nvfp4", mutates_args=())
def torch_dist_all_reduce_fused_add_rmsnorm_quant_nvfp4(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                                                        input_scale: Tensor) -> Tuple[Tensor, Tensor]:
    """``torch_fused_add_rmsnorm_quant_nvfp4`` of the reduced ``x``: ``(nvfp4(rmsnorm(s)), s)``."""
    return quant_fused.torch_fused_add_rmsnorm_quant_nvfp4(_reduced_scratch(x), residual, weight, eps, input_scale)


@torch.library.custom_op("autodeploy::native_dist_all_reduce_fused_add_rmsnorm_quant_nvfp4", mutates_args=())
def native_dist_all_reduce_fused_add_rmsnorm_quant_nvfp4(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                                                         input_scale: Tensor) -> Tuple[Tensor, Tensor]:
    """``native_fused_add_rmsnorm_quant_nvfp4`` of the reduced ``x``."""
    return quant_fused.native_fused_add_rmsnorm_quant_nvfp4(_reduced_scratch(x), residual, weight, eps, input_scale)


@torch.library.custom_op("autodeploy::torch_dist_all_reduce_rmsnorm_quant_nvfp4", mutates_args=())
def torch_dist_all_reduce_rmsnorm_quant_nvfp4(x: Tensor, weight: Tensor, eps: float, input_scale: Tensor
                                              ) -> Tuple[Tensor, Tensor]:
    """``r = all_reduce(x)``; returns ``(nvfp4(rmsnorm(r)), r)``."""
    reduced = _reduced_fresh(x)
    return quant_fused.torch_rmsnorm_quant_nvfp4(reduced, weight, eps, input_scale), reduced


@torch.library.custom_op("autodeploy::native_dist_all_reduce_rmsnorm_quant_nvfp4", mutates_args=())
def native_dist_all_reduce_rmsnorm_quant_nvfp4(x: Tensor, weight: Tensor, eps: float, input_scale: Tensor
                                               ) -> Tuple[Tensor, Tensor]:
    """``torch_dist_all_reduce_rmsnorm_quant_nvfp4`` with the norm from the CPU kernel."""
    reduced = _reduced_fresh(x)
    return quant_fused.native_rmsnorm_quant_nvfp4(reduced, weight, eps, input_scale), reduced


# ---- the same, followed by per-group FP8 quantization (dynamic, per token per group_size) ------


@torch.library.custom_op("autodeploy::torch_dist_all_reduce_fused_add_rmsnorm_quant_fp8_group", mutates_args=())
def torch_dist_all_reduce_fused_add_rmsnorm_quant_fp8_group(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                                                            group_size: int) -> Tuple[Tensor, Tensor]:
    """``torch_fused_add_rmsnorm_quant_fp8_group`` of the reduced ``x``: ``(fp8g(rmsnorm(s)), s)``."""
    return quant_fused.torch_fused_add_rmsnorm_quant_fp8_group(_reduced_scratch(x), residual, weight, eps, group_size)


@torch.library.custom_op("autodeploy::native_dist_all_reduce_fused_add_rmsnorm_quant_fp8_group", mutates_args=())
def native_dist_all_reduce_fused_add_rmsnorm_quant_fp8_group(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                                                             group_size: int) -> Tuple[Tensor, Tensor]:
    """``native_fused_add_rmsnorm_quant_fp8_group`` of the reduced ``x``."""
    return quant_fused.native_fused_add_rmsnorm_quant_fp8_group(_reduced_scratch(x), residual, weight, eps, group_size)


@torch.library.custom_op("autodeploy::torch_dist_all_reduce_rmsnorm_quant_fp8_group", mutates_args=())
def torch_dist_all_reduce_rmsnorm_quant_fp8_group(x: Tensor, weight: Tensor, eps: float, group_size: int
                                                  ) -> Tuple[Tensor, Tensor]:
    """``r = all_reduce(x)``; returns ``(fp8g(rmsnorm(r)), r)``."""
    reduced = _reduced_fresh(x)
    return quant_fused.torch_rmsnorm_quant_fp8_group(reduced, weight, eps, group_size), reduced


@torch.library.custom_op("autodeploy::native_dist_all_reduce_rmsnorm_quant_fp8_group", mutates_args=())
def native_dist_all_reduce_rmsnorm_quant_fp8_group(x: Tensor, weight: Tensor, eps: float, group_size: int
                                                   ) -> Tuple[Tensor, Tensor]:
    """``torch_dist_all_reduce_rmsnorm_quant_fp8_group`` with the norm from the CPU kernel."""
    reduced = _reduced_fresh(x)
    return quant_fused.native_rmsnorm_quant_fp8_group(reduced, weight, eps, group_size), reduced


for _op in (torch_dist_all_reduce_fused_add_rmsnorm, native_dist_all_reduce_fused_add_rmsnorm,
            torch_dist_all_reduce_fused_add_rmsnorm_quant_fp8, native_dist_all_reduce_fused_add_rmsnorm_quant_fp8,
            torch_dist_all_reduce_fused_add_rmsnorm_quant_nvfp4, native_dist_all_reduce_fused_add_rmsnorm_quant_nvfp4,
            torch_dist_all_reduce_fused_add_rmsnorm_quant_fp8_group,
            native_dist_all_reduce_fused_add_rmsnorm_quant_fp8_group):
    _op.register_fake(_add_norm_fake)
for _op in (torch_dist_all_reduce_rmsnorm, native_dist_all_reduce_rmsnorm,
            torch_dist_all_reduce_rmsnorm_quant_fp8, native_dist_all_reduce_rmsnorm_quant_fp8,
            torch_dist_all_reduce_rmsnorm_quant_nvfp4, native_dist_all_reduce_rmsnorm_quant_nvfp4,
            torch_dist_all_reduce_rmsnorm_quant_fp8_group, native_dist_all_reduce_rmsnorm_quant_fp8_group):
    _op.register_fake(_norm_pair_fake)
del _op
