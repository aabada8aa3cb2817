"""FP8 GEMM through ``torch._scaled_mm``: the e4m3 weight stays in one byte per value.

``scaled_mm_fp8_linear`` computes what ``torch_quant_fp8_linear`` does (static per-tensor FP8
activation, per-tensor or per-row weight scale) with the narrow GEMM itself: the activation is
quantized to e4m3 and both operands go to ``torch._scaled_mm`` with their scales, which
accumulates in float32. On Hopper/Ada GPUs (compute capability 8.9+) that is the native FP8 tensor
core GEMM; on a CPU torch runs it too, exact to float32 with a float32 output but without a fast
kernel (measured 2026-11-25, AMD EPYC, 2 threads, one row: 4.2 ms for a 768x2048 weight and 8.3 ms
for 2048x768, against 0.15 ms for the decoded float path), so ``fuse_fp8_linear`` chooses it on
CPU only when asked, for the weight memory.

Constraints of the CUDA kernel, checked before choosing it (``scaled_mm_supported``): K and N
multiples of 16; a per-row weight scale needs the row-wise variant, whose output must be
bfloat16 (a float32 input is then computed in bfloat16 and cast back).
"""

from typing import Optional

import torch
from torch import Tensor

from .formats import fp8_encode


def scaled_mm_supported(device: torch.device, n: int, k: int) -> Optional[str]:
    """Why ``_scaled_mm`` cannot serve an [n, k] FP8 weight on ``device``, or None."""
    if not hasattr(torch, "_scaled_mm"):
        return "this torch has no _scaled_mm"
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 9):
            return "FP8 GEMMs need compute capability 8.9 or newer"
        if n % 16 or k % 16:
            return f"the FP8 GEMM needs both sizes to be multiples of 16 (got N={n}, K={k})"
    return None


@torch.library.custom_op("autodeploy::scaled_mm_fp8_linear", mutates_args=())
def scaled_mm_fp8_linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], input_scale: Tensor, weight_scale: Tensor
) -> Tensor:
    """``torch_quant_fp8_linear``'s numerics with the weight kept in e4m3 (see module docstring)."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    s_in = input_scale.float().reshape(())
    xq = fp8_encode(rows.float() / s_in)
    s_w = weight_scale.float()
    out_dtype = x.dtype
    if s_w.numel() == 1:
        out = torch._scaled_mm(xq, weight.t(), scale_a=s_in, scale_b=s_w.reshape(()), out_dtype=out_dtype)
    else:
        if x.device.type == "cuda":
            out_dtype = torch.bfloat16  # the row-wise CUDA kernel writes bfloat16 only
        scale_a = s_in.reshape(1, 1).expand(rows.shape[0], 1).contiguous()
        out = torch._scaled_mm(xq, weight.t(), scale_a=scale_a, scale_b=s_w.reshape(1, -1).contiguous(),
                               out_dtype=out_dtype)
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])


@scaled_mm_fp8_linear.register_fake
def _scaled_mm_fp8_linear_fake(x, weight, bias, input_scale, weight_scale):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
