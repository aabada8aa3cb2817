"""Rotary position embeddings (RoPE), in the three forms HF models spell them.

All three take q and k together because every model rotates both with the same angles: one
node per attention layer keeps later fusions (cached attention with RoPE inside) simple.
``unsqueeze_dim`` says where cos/sin (``[b, s, d]``) gain the head axis: 1 for ``bnsd``
tensors, 2 for ``bsnd``.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import native


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@torch.library.custom_op("autodeploy::torch_rope_with_explicit_cos_sin", mutates_args=())
def torch_rope_with_explicit_cos_sin(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
) -> Tuple[Tensor, Tensor]:
    """Llama's rotate-half RoPE: ``x * cos + rotate_half(x) * sin``.

    For bsnd float32 CPU tensors autodeploy's kernel (``native.rope``) computes the same values
    bit for bit in one call per tensor instead of ten torch ops; the expression below is the
    reference and the fallback."""
    if unsqueeze_dim == 2:
        q_out, k_out = native.rope(q, cos, sin), native.rope(k, cos, sin)
        if q_out is not None and k_out is not None:
            return q_out, k_out
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@torch_rope_with_explicit_cos_sin.register_fake
def _rope_explicit_fake(q, k, cos, sin, unsqueeze_dim=1):
    dt = torch.promote_types(q.dtype, cos.dtype)
    return torch.empty_like(q, dtype=dt), torch.empty_like(k, dtype=dt)


@torch.library.custom_op("autodeploy::torch_rope_with_qk_interleaving", mutates_args=())
def torch_rope_with_qk_interleaving(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1
) -> Tuple[Tensor, Tensor]:
    """DeepSeek's RoPE: q/k hold interleaved pairs ``(x0, x1), (x2, x3), ...``, pair j rotated by
    angle j; ``cos``/``sin`` are ``[b, s, d/2]`` (one angle per pair). The output is
    de-interleaved: ``cat(x_even * cos - x_odd * sin, x_odd * cos + x_even * sin)``."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)

    def rotate(x: Tensor) -> Tensor:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)

    return rotate(q), rotate(k)


@torch_rope_with_qk_interleaving.register_fake
def _rope_interleave_fake(q, k, cos, sin, unsqueeze_dim=1):
    dt = torch.promote_types(q.dtype, cos.dtype)
    return torch.empty_like(q, dtype=dt), torch.empty_like(k, dtype=dt)


@torch.library.custom_op("autodeploy::torch_rope_with_complex_freqs", mutates_args=())
def torch_rope_with_complex_freqs(
    q: Tensor, k: Tensor, freqs_cis: Tensor, unsqueeze_dim: int = 2
) -> Tuple[Tensor, Tensor]:
    """Llama-4 / Meta-reference RoPE: pairs ``(x0, x1)`` are complex numbers multiplied by
    ``freqs_cis`` (complex, ``[b, s, d/2]``); computed in fp32, cast back to the input dtype."""
    freqs = freqs_cis.unsqueeze(unsqueeze_dim)

    def rotate(x: Tensor) -> Tensor:
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs).flatten(-2).to(x.dtype)

    return rotate(q), rotate(k)


@torch_rope_with_complex_freqs.register_fake
def _rope_complex_fake(q, k, freqs_cis, unsqueeze_dim=2):
    return torch.empty_like(q), torch.empty_like(k)


# ---- RoPE inside cached attention ops (fuse_rope_into_trtllm_attention / _mla) ----------------

# rope_style of the cached attention ops: no RoPE inside (q / k arrive roped), or which RoPE op's
# math they apply to the unroped q / k (bsnd) with rope_cos / rope_sin (complex: rope_cos holds freqs_cis)
ROPE_NONE, ROPE_ROTATE_HALF, ROPE_INTERLEAVED, ROPE_COMPLEX = -1, 0, 1, 2


def apply_rope(q: Tensor, k: Tensor, cos: Optional[Tensor], sin: Optional[Tensor], style: int,
               rotary_dim: int = 0) -> Tuple[Tensor, Tensor]:
    """bsnd ``q`` / ``k`` roped with the canonical RoPE op of ``style`` (unchanged for ``ROPE_NONE``);
    ``rotary_dim`` > 0 ropes only the first that many features of each head (partial rotary)."""
    if style == ROPE_NONE:
        return q, k
    if rotary_dim:
        q_rot, k_rot = apply_rope(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin, style)
        return torch.cat([q_rot, q[..., rotary_dim:]], dim=-1), torch.cat([k_rot, k[..., rotary_dim:]], dim=-1)
    ops = torch.ops.autodeploy
    if style == ROPE_ROTATE_HALF:
        return ops.torch_rope_with_explicit_cos_sin(q, k, cos, sin, 2)
    if style == ROPE_INTERLEAVED:
        return ops.torch_rope_with_qk_interleaving(q, k, cos, sin, 2)
    if style == ROPE_COMPLEX:
        return ops.torch_rope_with_complex_freqs(q, k, cos, 2)
    raise ValueError(f"unknown rope_style {style}")
