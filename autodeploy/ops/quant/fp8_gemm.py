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
multiples of 16. A per-row weight scale (after ``fuse_fp8_gemms``) needs cuBLAS's row-wise
variant, which writes bfloat16 only: a bfloat16 model uses it; a float32 model runs the
per-tensor kernel with a unit weight scale and float32 output and multiplies the rows' scales
afterwards, so its output is not rounded to bfloat16 (measured on an H100, 2026-11-26: the
bfloat16 rounding of the row-wise kernel changed a tiny FP8 Llama's greedy tokens against the
float32 reference; the float32 route keeps them).

``scaled_mm_fp8_block_linear`` is the fine-grained FP8 (128x128 weight tiles, activations per
token per 128 channels) GEMM: ``torch._scaled_mm`` with block-wise scales (1x128 for the
activation, 128x128 for the weight; CUDA 12.9+ on Hopper). What this torch (2.11, H100) took,
read off the GPU on 2026-11-26: the activation scales outer-dim-major (``s.t().contiguous().t()``),
the weight scales as the transposed view of the checkpoint's ``[N/128, K/128]``, bfloat16 output.
Rows (M) not a multiple of 4 were refused (CUBLAS_STATUS_NOT_SUPPORTED at M = 1, 5, 37), and -
worse - K blocks not a multiple of 4 ran but gave WRONG results (relative error 0.4 to 100 at
K = 256, 384, 640; 2e-3, the bfloat16 output's rounding, at K = 512 and 1024; torch's newer
``F.scaled_mm`` asks for the K blocks in fours). So the weight is padded once at load to N a
multiple of 128 and K of 512 (real checkpoints already are: DeepSeek-V3's and Qwen3's sizes are),
each call pads its rows to a multiple of ``BLOCK_ROWS`` and its columns to the padded K, and
``fuse_finegrained_fp8_linear`` runs trial GEMMs on the device before choosing it
(``block_scaled_mm_problem``), falling back to the decoded weight when the kernel refuses or
disagrees. On a CPU the op computes the same numbers from the decoded weight (torch's
CPU ``_scaled_mm`` has no block-wise scales).
"""

import functools
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .formats import FP8_MAX, dequantize_fp8_blocks, fake_quant_fp8_groups, fp8_encode

BLOCK = 128  # fine-grained FP8's tile edge (DeepSeek-V3, Qwen3-FP8)
K_ALIGN = 4 * BLOCK  # the K blocks in fours
N_ALIGN = BLOCK
BLOCK_ROWS = 16  # activation rows per call, padded to this


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
    elif x.device.type == "cuda" and out_dtype == torch.float32:
        # the row-wise kernel writes bfloat16 only: per-tensor in float32, the rows' scales after
        out = torch._scaled_mm(xq, weight.t(), scale_a=s_in, scale_b=s_w.new_ones(()), out_dtype=torch.float32)
        out = out * s_w.reshape(1, -1)
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


# ---- fine-grained FP8: block-wise scales ---------------------------------------------------------


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def pad_block_weight(weight: Tensor, scale_inv: Tensor) -> Tuple[Tensor, Tensor]:
    """A fine-grained FP8 weight ``[N, K]`` and its ``[ceil(N/128), ceil(K/128)]`` tile scales,
    padded with zero weights (and unit scales) to N a multiple of ``N_ALIGN`` and K of ``K_ALIGN``;
    the weight stays e4m3. Unchanged when already aligned (real checkpoints)."""
    n, k = weight.shape
    n_pad, k_pad = _round_up(n, N_ALIGN), _round_up(k, K_ALIGN)
    if (n_pad, k_pad) != (n, k):
        padded = torch.zeros(n_pad, k_pad, dtype=weight.dtype, device=weight.device)
        padded[:n, :k] = weight
        weight = padded
    nb, kb = n_pad // BLOCK, k_pad // BLOCK
    if tuple(scale_inv.shape) != (nb, kb):
        scales = torch.ones(nb, kb, dtype=torch.float32, device=scale_inv.device)
        scales[:scale_inv.shape[0], :scale_inv.shape[1]] = scale_inv.float()
        scale_inv = scales
    return weight.contiguous(), scale_inv.float().contiguous()


def _block_quantize_rows(rows: Tensor, k_pad: int) -> Tuple[Tensor, Tensor]:
    """Activation rows ``[M, K]`` -> e4m3 ``[M', k_pad]`` and their per-128 scales ``[M', k_pad/128]``
    (amax/448, as ``fake_quant_fp8_groups``), rows padded to a multiple of ``BLOCK_ROWS``."""
    m, k = rows.shape
    m_pad = _round_up(max(m, 1), BLOCK_ROWS)
    xb = F.pad(rows.float(), (0, k_pad - k, 0, m_pad - m)).reshape(m_pad, k_pad // BLOCK, BLOCK)
    scale = (xb.abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    return fp8_encode(xb / scale.unsqueeze(-1)).reshape(m_pad, k_pad), scale


@torch.library.custom_op("autodeploy::scaled_mm_fp8_block_linear", mutates_args=())
def scaled_mm_fp8_block_linear(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], weight_scale_inv: Tensor, out_features: int
) -> Tensor:
    """``torch_quant_finegrained_fp8_linear`` (128x128 tiles) with the e4m3 weight kept: the
    block-scaled FP8 GEMM on CUDA, the decoded weight elsewhere (see the module docstring).
    ``weight`` and ``weight_scale_inv`` are padded (``pad_block_weight``); ``out_features`` is N
    before padding."""
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    if x.device.type != "cuda":
        w = dequantize_fp8_blocks(weight, weight_scale_inv, (BLOCK, BLOCK))[:out_features, :k]
        out = F.linear(fake_quant_fp8_groups(rows, BLOCK), w)
    else:
        xq, scale = _block_quantize_rows(rows, weight.shape[1])
        out = torch._scaled_mm(xq, weight.t(), scale_a=scale.t().contiguous().t(), scale_b=weight_scale_inv.t(),
                               out_dtype=torch.bfloat16)
        out = out[:rows.shape[0], :out_features]
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out.reshape(*x.shape[:-1], out_features)


@scaled_mm_fp8_block_linear.register_fake
def _scaled_mm_fp8_block_linear_fake(x, weight, bias, weight_scale_inv, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


@functools.lru_cache(maxsize=None)
def block_scaled_mm_problem(device: str) -> Optional[str]:
    """Why the block-scaled FP8 GEMM cannot serve on ``device`` (a CUDA device string), or None:
    one trial GEMM of each row padding class against the reference op, once per device."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return "block-scaled FP8 GEMMs run on CUDA GPUs only"
    if torch.cuda.get_device_capability(dev) < (9, 0):
        return "block-scaled FP8 GEMMs need compute capability 9.0 or newer"
    gen = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(256, 320, device=dev, generator=gen)
    wb = F.pad(w, (0, 64)).reshape(2, 128, 3, 128)
    scale = (wb.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    wq = fp8_encode(wb / scale[:, None, :, None]).reshape(256, 384)[:, :320].contiguous()
    padded, padded_scale = pad_block_weight(wq, scale)
    for rows in (1, 5, 37):
        x = torch.randn(rows, 320, device=dev, generator=gen)
        expected = torch.ops.autodeploy.torch_quant_finegrained_fp8_linear(x, wq, None, scale, BLOCK, BLOCK)
        try:
            got = scaled_mm_fp8_block_linear(x, padded, None, padded_scale, 256)
        except RuntimeError as exc:  # the kernel refused the shapes or layouts
            return f"torch._scaled_mm refused block-wise scales: {str(exc).splitlines()[0][:200]}"
        err = ((got.float() - expected).norm() / expected.norm()).item()
        if not err < 1e-2:  # bfloat16 output: ~3e-3
            return f"the block-scaled FP8 GEMM disagrees with the reference (rel. error {err:.2e} at {rows} rows)"
    return None
