"""Attention: the canonical ``torch_attention`` op and the causal-mask marker.

``torch_attention`` is the one attention op of the IR. Layout is ``bsnd``: q ``[b, s_q, n, d]``,
k/v ``[b, s_kv, n_kv, d]`` with ``n % n_kv == 0`` (GQA is native: k/v are never expanded), output
``[b, s_q, n, d_v]``. Causality and windows are bottom-right aligned, i.e. the queries are the
last ``s_q`` positions of the ``s_kv`` keys, which is what decoding with a cache needs.

ALiBi (BLOOM, MPT) is a feature of the op, not a mask: ``alibi_slopes`` (one float32 slope per
query head) adds ``slope_h * (key_pos - query_pos)`` to the scaled scores, with the positions
absolute in the sequence. HF adds ``slope_h * key_pos`` instead; the two differ by a constant per
query row, which softmax cancels. Keeping it as slopes rather than a materialised bias is what
lets the cached backends serve it: a cached step knows each token's absolute position.

``torch_causal_mask`` materialises the mask HF would build for a causal (optionally windowed)
attention. The export patches emit it instead of HF's mask subgraph so that matchers can read
the mask's meaning from one node rather than reverse-engineer index arithmetic.
"""

import math
from typing import Optional

import torch
from torch import Tensor

from .quant import formats


def _additive_bias(
    attn_mask: Optional[Tensor],
    s_q: int,
    s_kv: int,
    is_causal: bool,
    sliding_window: Optional[int],
    device: torch.device,
    attention_chunk: Optional[int] = None,
) -> Optional[Tensor]:
    """Combine the explicit mask and the implied causal/window/chunk mask into one fp32 bias."""
    bias = None
    if is_causal or sliding_window is not None or attention_chunk is not None:
        q_pos = torch.arange(s_q, device=device)[:, None] + (s_kv - s_q)
        k_pos = torch.arange(s_kv, device=device)[None, :]
        keep = torch.ones(s_q, s_kv, dtype=torch.bool, device=device)
        if is_causal:
            keep &= k_pos <= q_pos
        if sliding_window is not None:
            keep &= k_pos > q_pos - sliding_window
        if attention_chunk is not None:
            keep &= k_pos // attention_chunk == q_pos // attention_chunk
        bias = torch.zeros(s_q, s_kv, device=device).masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            explicit = torch.zeros(attn_mask.shape, device=device).masked_fill(~attn_mask, float("-inf"))
        else:
            explicit = attn_mask.float()
        bias = explicit if bias is None else bias + explicit
    return bias


def alibi_bias(slopes: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``slopes[h] * (k_pos - q_pos)`` as an fp32 ``[heads, len(q_pos), len(k_pos)]`` bias.

    Shared by the reference op and every cached backend so that they add the same numbers.
    """
    rel = (k_pos[None, :] - q_pos[:, None]).float()
    return slopes.float().reshape(-1, 1, 1) * rel


@torch.library.custom_op("autodeploy::torch_attention", mutates_args=())
def torch_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    sinks: Optional[Tensor] = None,
    sliding_window: Optional[int] = None,
    logit_cap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    attention_chunk: Optional[int] = None,
    out_scale: Optional[Tensor] = None,
    rel_logits: Optional[Tensor] = None,
) -> Tensor:
    """Reference attention in ``bsnd`` layout, computed in fp32 and cast back to q's dtype.

    ``attn_mask`` is boolean (True = attend) or additive, broadcastable to ``[b, n, s_q, s_kv]``.
    ``logit_cap`` applies ``cap * tanh(scores / cap)`` (Gemma-2 soft-capping). ``sinks`` is one
    learned logit per head that joins the softmax denominator and then is dropped (GPT-OSS).
    ``dropout_p`` exists for parity with SDPA; inference graphs always carry 0.
    ``alibi_slopes`` (``[n]``, one per query head) adds ``slope_h * (key_pos - query_pos)`` after
    the scale and soft-cap (positions bottom-right aligned like the causal mask).
    ``attention_chunk`` (Llama 4's chunked-local attention): a query sees only the keys of its own
    chunk of that many positions (``key_pos // chunk == query_pos // chunk``), with the same alignment.
    ``out_scale`` (``fuse_trtllm_attn_quant_fp8``): the output leaves as the FP8 e4m3 values the
    following FP8 projection reads, ``e4m3(out / out_scale) * out_scale`` in q's dtype.
    ``rel_logits`` (``[b, s_q, n, R]``, Inkling's query-conditioned relative position bias) adds
    ``rel_logits[b, i, h, d]`` to query ``i``'s score of the key ``d = q_pos - k_pos`` positions
    back, for ``0 <= d < R`` (nothing elsewhere), after the scale (positions aligned as the causal
    mask's).
    """
    if dropout_p != 0.0:
        raise ValueError("torch_attention is an inference op: dropout_p must be 0.0")
    b, s_q, n, d = q.shape
    s_kv, n_kv = k.shape[1], k.shape[2]
    if n % n_kv != 0:
        raise ValueError(f"torch_attention: {n} query heads are not a multiple of {n_kv} kv heads")
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qh = q.transpose(1, 2).float()  # [b, n, s_q, d]
    kh = k.transpose(1, 2).float().repeat_interleave(n // n_kv, dim=1)
    vh = v.transpose(1, 2).float().repeat_interleave(n // n_kv, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if logit_cap is not None and logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    bias = _additive_bias(attn_mask, s_q, s_kv, is_causal, sliding_window, q.device, attention_chunk)
    if alibi_slopes is not None:
        if alibi_slopes.numel() != n:
            raise ValueError(f"torch_attention: {alibi_slopes.numel()} ALiBi slopes for {n} query heads")
        q_pos = torch.arange(s_q, device=q.device) + (s_kv - s_q)
        alibi = alibi_bias(alibi_slopes, q_pos, torch.arange(s_kv, device=q.device))
        bias = alibi if bias is None else bias + alibi
    if rel_logits is not None:
        q_pos = torch.arange(s_q, device=q.device) + (s_kv - s_q)
        rel = relative_bias(rel_logits, q_pos[:, None] - torch.arange(s_kv, device=q.device)[None, :])
        bias = rel if bias is None else bias + rel
    if bias is not None:
        scores = scores + bias
    if sinks is not None:
        sink_col = sinks.float().reshape(1, n, 1, 1).expand(b, n, s_q, 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vh).to(q.dtype)
    return fp8_output(out.transpose(1, 2).contiguous(), out_scale)


def relative_bias(rel_logits: Tensor, distance: Tensor) -> Tensor:
    """``[b, n, s_q, s_kv]`` fp32: ``rel_logits [b, s_q, n, R]`` read at each key's ``distance`` back
    from its query (query position minus key position, broadcastable to ``[b, n, s_q, s_kv]``: one
    ``[s_q, s_kv]`` grid, or one row per sequence), zero outside ``0 <= distance < R`` (Inkling's
    bias; the causal mask, not this, hides later keys). Shared by the reference op and the cached
    backends, so they add the same numbers."""
    extent = rel_logits.shape[-1]
    rel = rel_logits.float().transpose(1, 2)  # [b, n, s_q, R]
    shape = torch.broadcast_shapes((*rel.shape[:-1], distance.shape[-1]), distance.shape)
    index = distance.clamp(0, extent - 1).expand(shape)
    return rel.gather(-1, index).masked_fill((distance < 0) | (distance >= extent), 0.0)


def fp8_output(out: Tensor, out_scale: Optional[Tensor]) -> Tensor:
    """An attention output as an FP8 projection with static input scale ``out_scale`` reads it
    (``torch_quant_fp8_activation``'s numbers), or unchanged when there is no scale."""
    if out_scale is None:
        return out
    return formats.fake_quant_fp8_static(out, out_scale.float()).to(out.dtype)


@torch_attention.register_fake
def _torch_attention_fake(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                          sinks=None, sliding_window=None, logit_cap=None, alibi_slopes=None, attention_chunk=None,
                          out_scale=None, rel_logits=None):
    return q.new_empty(*q.shape[:-1], v.shape[-1])


@torch.library.custom_op("autodeploy::torch_causal_mask", mutates_args=())
def torch_causal_mask(
    batch: int,
    q_len: int,
    kv_len: int,
    sliding_window: Optional[int],
    dtype: torch.dtype,
    device: torch.device,
    attention_chunk: Optional[int] = None,
) -> Tensor:
    """The ``[batch, 1, q_len, kv_len]`` causal mask HF's mask interface would return (with a
    sliding window, or chunked-local: keys of the query's own chunk only).

    ``dtype=torch.bool`` gives SDPA's boolean mask (True = attend); a float dtype gives the
    eager additive mask (0 or the dtype's minimum), exactly like ``transformers.masking_utils``.
    """
    q_pos = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    k_pos = torch.arange(kv_len, device=device)[None, :]
    keep = k_pos <= q_pos
    if sliding_window is not None:
        keep = keep & (k_pos > q_pos - sliding_window)
    if attention_chunk is not None:
        keep = keep & (k_pos // attention_chunk == q_pos // attention_chunk)
    keep = keep.expand(batch, 1, q_len, kv_len)
    if dtype == torch.bool:
        return keep.clone()
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(keep, zero, torch.finfo(dtype).min)


@torch_causal_mask.register_fake
def _torch_causal_mask_fake(batch, q_len, kv_len, sliding_window, dtype, device, attention_chunk=None):
    return torch.empty(batch, 1, q_len, kv_len, dtype=dtype, device=device)
