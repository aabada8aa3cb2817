"""ModelOpt FP8 experts as grouped FP8 GEMMs: ``torch._scaled_grouped_mm`` on CUDA.

``scaled_grouped_mm_fp8_moe`` computes what ``torch_quant_fp8_moe`` does (each expert's
projections an FP8 linear: e4m3 weight with a per-tensor scale, the expert's own static input
scale) with the experts' weights stacked in e4m3 (1 byte per weight) and two grouped GEMMs per
layer, one for every expert's gate+up rows and one for every down projection:

    pairs (token, k) sorted by expert -> rows [P, H], offsets of each expert's run
    rows_q = e4m3(rows / s_in[expert])                       scale_a = s_in[expert], one per row
    h = grouped_mm(rows_q, W_gate_up[e]^T) * scale_a * s_w   s_w: [E, 2I], gate's scale on the gate
                                                             rows, up's on the up rows
    a = act(h[:, :I], h[:, I:]);  the same for down;  out[token] += routing weight * y

On CUDA (Hopper and newer) both GEMMs are ``torch._scaled_grouped_mm`` with row-wise scales
(float32 accumulation, bfloat16 output): read off an H100 with torch 2.11 on 2026-11-26, it takes
the stacked weight as the transposed view ``W.transpose(-2, -1)`` of ``[E, N, K]`` (a contiguous
``[E, K, N]`` is refused), offsets as int32 ends of each expert's run, experts with no rows
included, and agreed with the float32 reference to 1.7e-3 (bfloat16 output). Elsewhere the op
runs the same numbers expert by expert from the weights decoded per call (the reference's
arithmetic), so CPU tests check the stacking, ordering and scales exactly.

Per-expert input scales are kept (each row is quantized with its expert's scale, as the
reference does); the gate and up projections of an expert share the larger of their two scales,
as ``grouped_quant_moe_fused`` does.
"""

import functools
from typing import Optional

import torch
from torch import Tensor

from ..moe import expert_activation
from .formats import fp8_encode

# the kernel's alignment: K and N of each GEMM in multiples of 16 bytes of e4m3
ALIGN = 16


def _grouped_gemm(rows: Tensor, experts: Tensor, counts: Tensor, offsets: Tensor, weight: Tensor,
                  input_scale: Tensor, weight_scale: Tensor) -> Tensor:
    """One grouped FP8 GEMM over rows sorted by expert: ``[P, K] -> [P, N]`` in float32 (CPU) or
    bfloat16 (CUDA)."""
    s_in = input_scale.float()[experts]  # one static scale per row: its expert's
    xq = fp8_encode(rows.float() / s_in[:, None])
    if rows.device.type == "cuda":
        return torch._scaled_grouped_mm(xq, weight.transpose(-2, -1), s_in.contiguous(), weight_scale.float(),
                                        offs=offsets, out_dtype=torch.bfloat16)
    out = rows.new_zeros(rows.shape[0], weight.shape[1], dtype=torch.float32)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            seen = xq[start:start + n].float() * s_in[start:start + n, None]
            w = weight[e].float() * weight_scale[e].float()[:, None]
            out[start:start + n] = torch.nn.functional.linear(seen, w)
        start += n
    return out


@torch.library.custom_op("autodeploy::scaled_grouped_mm_fp8_moe", mutates_args=())
def scaled_grouped_mm_fp8_moe(
    x: Tensor, selected_experts: Tensor, routing_weights: Tensor,
    gate_up_weight: Tensor, down_weight: Tensor, gate_up_input_scale: Tensor, down_input_scale: Tensor,
    gate_up_weight_scale: Tensor, down_weight_scale: Tensor,
    act: str = "silu", alpha: float = 1.0, limit: float = 0.0,
) -> Tensor:
    """ModelOpt FP8 experts stacked in e4m3: ``gate_up_weight`` ``[E, 2I, H]`` (gate rows, then up
    rows), ``down_weight`` ``[E, H, I]``, input scales ``[E]``, weight scales per output row
    ``[E, 2I]`` / ``[E, H]`` (see the module docstring)."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    k = selected_experts.shape[-1]
    flat = selected_experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    tokens = order // k
    # scatter_add, not bincount: bincount reads the largest id back to the host (no CUDA graphs)
    counts = torch.zeros(gate_up_weight.shape[0], dtype=torch.int64, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    offsets = counts.cumsum(0).to(torch.int32)
    h = _grouped_gemm(x2[tokens], experts, counts, offsets, gate_up_weight, gate_up_input_scale,
                      gate_up_weight_scale).to(x.dtype)
    inter = h.shape[-1] // 2
    a = expert_activation(h[:, :inter], h[:, inter:], act, alpha, limit)
    y = _grouped_gemm(a, experts, counts, offsets, down_weight, down_input_scale, down_weight_scale).to(x.dtype)
    acc = torch.promote_types(torch.promote_types(x.dtype, routing_weights.dtype), torch.float32)
    weighted = y.to(acc) * routing_weights.reshape(-1)[order].to(acc)[:, None]
    out = torch.zeros(x2.shape[0], hidden, dtype=acc, device=x.device).index_add_(0, tokens, weighted)
    return out.to(x.dtype).reshape(x.shape)


@scaled_grouped_mm_fp8_moe.register_fake
def _scaled_grouped_mm_fp8_moe_fake(x, *args, **kwargs):
    return torch.empty_like(x)


def grouped_scaled_mm_supported(device: torch.device, hidden: int, inter: int) -> Optional[str]:
    """Why the grouped FP8 GEMM cannot serve experts of these sizes on ``device``, or None."""
    if device.type != "cuda":
        return "grouped FP8 GEMMs run on CUDA GPUs only"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return "this torch has no _scaled_grouped_mm"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return "grouped FP8 GEMMs need compute capability 9.0 or newer"
    if hidden % ALIGN or inter % ALIGN:
        return f"grouped FP8 GEMMs need hidden and intermediate sizes in multiples of {ALIGN} (got {hidden}, {inter})"
    return _trial(str(device))


@functools.lru_cache(maxsize=None)
def _trial(device: str) -> Optional[str]:
    """One small grouped GEMM (an expert without rows included) against the CPU arithmetic."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev).manual_seed(0)
    experts, hidden, inter = 3, 64, 32
    x = torch.randn(6, hidden, device=dev, generator=gen)
    sel = torch.tensor([[0, 2], [2, 0], [0, 2], [2, 2], [0, 0], [2, 0]], device=dev)
    rw = torch.rand(6, 2, device=dev, generator=gen)
    gu = fp8_encode(torch.randn(experts, 2 * inter, hidden, device=dev, generator=gen) * 100)
    dn = fp8_encode(torch.randn(experts, hidden, inter, device=dev, generator=gen) * 100)
    args = (gu, dn, torch.full((experts,), 0.02, device=dev), torch.full((experts,), 0.05, device=dev),
            torch.full((experts, 2 * inter), 0.01, device=dev), torch.full((experts, hidden), 0.01, device=dev))
    try:
        got = scaled_grouped_mm_fp8_moe(x, sel, rw, *args)
    except RuntimeError as exc:
        return f"torch._scaled_grouped_mm refused: {str(exc).splitlines()[0][:200]}"
    cpu = [t.cpu() for t in (x, sel, rw, *args)]
    expected = scaled_grouped_mm_fp8_moe(*cpu).to(dev)
    err = ((got.float() - expected).norm() / expected.norm()).item()
    return None if err < 2e-2 else f"the grouped FP8 GEMM disagrees with the reference (rel. error {err:.2e})"
