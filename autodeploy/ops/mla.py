"""Multi-head latent attention (MLA): the canonical ``torch_mla`` op and its paged-cache ops.

DeepSeek-V2/V3-style attention compresses a token's keys and values into one latent vector
``c_kv`` (``kv_lora_rank`` values, normalised) plus one shared, roped key part ``k_pe``
(``qk_rope_head_dim`` values). Per head, the key is ``[W_uk c_kv, k_pe]`` and the value
``W_uv c_kv``, where ``W_uk`` / ``W_uv`` are the row blocks of ``kv_b_proj``'s weight
``[heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]``. HF expands the latent into
per-head K and V before attending; a cache of those holds ``heads * (d_nope + d_rope + d_v)``
values per token and layer, where the latent needs ``kv_lora_rank + d_rope``.

``torch_mla`` (layout ``bsnd``) keeps the latent form in the graph::

    torch_mla(q_nope [b, s, n, d_nope], q_pe [b, s, n, d_rope], compressed_kv [b, s, L],
              kpe [b, s, 1, d_rope], kv_b_proj_weight [n * (d_nope + d_v), L], is_causal, scale)
        -> [b, s, n, d_v]

Its reference expands the latent and runs ``torch_attention``'s math (the computation HF does).
``q_pe`` and ``kpe`` arrive roped. Two optional inputs: ``topk_indices`` (DeepSeek Sparse
Attention's per-query selection, ``autodeploy.ops.dsa``) and ``sinks`` (one learned logit per head
that joins the softmax denominator and is dropped, as ``torch_attention``'s: HY-V4).

The cached ops keep one page pool entry per token and layer: ``[c_kv, k_pe]`` in one
``[num_pages, page_size, 1, L + d_rope]`` cache (a single "head", so the KV page-pool arithmetic
applies unchanged). Two implementations with one signature:

* ``torch_cached_mla_with_cache``: the reference; one sequence at a time, the cached latent
  expanded into per-head K/V and attended with ``torch_attention``'s math.
* ``sdpa_cached_mla_with_cache``: prefills expand (a fresh prefill only its own tokens, with
  causal SDPA); decodes use weight absorption and never build per-head K/V: the query's nope
  part is projected into the latent space (``q_lat = q_nope W_uk``), scores are
  ``q_lat . c_kv + q_pe . k_pe`` over the cached rows, and the attended latent leaves through
  ``W_uv``. All decodes of a step run as one SDPA over their gathered pages, with the heads as
  the query rows of a single shared key/value head (MQA-shaped: every head reads the same
  latent rows). SDPA has no sinks: a layer's sinks join it as one extra all-zero key/value row
  whose additive mask entry is the head's sink (its score is then exactly ``sink``, and its zero
  value adds nothing: HF's concatenate-softmax-drop).

With ``fuse_rope_into_trtllm_mla`` the cached ops also take the layer's RoPE: ``q_pe`` and
``kpe`` arrive unroped with the step's ``rope_cos`` / ``rope_sin`` rows and the ``rope_style``
of the RoPE op they replace, and are roped inside before anything else (``kpe`` as it is written
to the cache).
"""

import math
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import attention  # noqa: F401  (torch_attention, the math of the reference paths)
from .rope import ROPE_NONE, apply_rope
from .cached_attention import gather_sequence
from .dsa import topk_keep_mask
from .host_reads import host_lists


def _expand(compressed_kv: Tensor, kpe: Tensor, weight: Tensor, d_nope: int, d_v: int) -> Tuple[Tensor, Tensor]:
    """Per-head keys ``[..., s, n, d_nope + d_rope]`` and values ``[..., s, n, d_v]`` of latent rows
    ``compressed_kv [..., s, L]`` with their shared roped key part ``kpe [..., s, 1 or -, d_rope]``."""
    kv = F.linear(compressed_kv, weight)
    kv = kv.view(*kv.shape[:-1], -1, d_nope + d_v)
    k_nope, v = kv.split([d_nope, d_v], dim=-1)
    kpe = kpe.reshape(*kpe.shape[: compressed_kv.dim() - 1], 1, kpe.shape[-1]).expand(*k_nope.shape[:-1], -1)
    return torch.cat([k_nope, kpe.to(k_nope.dtype)], dim=-1), v


def _check_shapes(q_nope: Tensor, q_pe: Tensor, compressed_kv: Tensor, kpe: Tensor, weight: Tensor) -> Tuple[int, int]:
    """``(d_nope, d_v)`` from the shapes; an error naming the mismatch otherwise."""
    n, d_nope = q_nope.shape[-2], q_nope.shape[-1]
    lora = compressed_kv.shape[-1]
    if weight.shape[-1] != lora or weight.shape[0] % n:
        raise ValueError(f"torch_mla: kv_b_proj weight {list(weight.shape)} does not map a {lora}-wide latent to "
                         f"{n} heads")
    if q_pe.shape[-1] != kpe.shape[-1]:
        raise ValueError(f"torch_mla: q_pe has {q_pe.shape[-1]} rope dims, kpe {kpe.shape[-1]}")
    d_v = weight.shape[0] // n - d_nope
    if d_v <= 0:
        raise ValueError(f"torch_mla: kv_b_proj weight {list(weight.shape)} has no value rows for {n} heads of "
                         f"{d_nope} key dims")
    return d_nope, d_v


@torch.library.custom_op("autodeploy::torch_mla", mutates_args=())
def torch_mla(
    q_nope: Tensor,
    q_pe: Tensor,
    compressed_kv: Tensor,
    kpe: Tensor,
    kv_b_proj_weight: Tensor,
    is_causal: bool = True,
    scale: Optional[float] = None,
    topk_indices: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Reference MLA in ``bsnd``: expand the latent into per-head K/V and attend (fp32 math, the
    output in q's dtype). ``scale`` defaults to ``1/sqrt(d_nope + d_rope)``. ``topk_indices``
    (``int32 [b, s, topk]``, DSA: ``autodeploy.ops.dsa``) restricts each query to those key positions;
    ``sinks`` (``[n]``) are per-head softmax sinks."""
    d_nope, d_v = _check_shapes(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight)
    k, v = _expand(compressed_kv, kpe, kv_b_proj_weight, d_nope, d_v)
    q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1)
    mask = None if topk_indices is None else topk_keep_mask(topk_indices, k.shape[1]).unsqueeze(1)
    return torch.ops.autodeploy.torch_attention(q, k, v, mask, 0.0, is_causal, scale, sinks, None, None)


@torch_mla.register_fake
def _torch_mla_fake(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, is_causal=True, scale=None, topk_indices=None,
                    sinks=None):
    d_v = kv_b_proj_weight.shape[0] // q_nope.shape[-2] - q_nope.shape[-1]
    return q_nope.new_empty(*q_nope.shape[:-1], d_v)


# ---- the paged latent cache -----------------------------------------------------------------


def _write_latent(compressed_kv: Tensor, kpe: Tensor, slots: Tensor, cache: Tensor) -> Tensor:
    """Store the step's ``[c_kv, k_pe]`` rows at ``slots``; returns those rows ``[T, L + d_rope]``."""
    width = cache.shape[-1]
    rows = torch.cat([compressed_kv.reshape(-1, compressed_kv.shape[-1]),
                      kpe.reshape(-1, kpe.shape[-1]).to(compressed_kv.dtype)], dim=-1)
    cache.view(-1, width).index_copy_(0, slots, rows.to(cache.dtype))
    return rows


def _attend_expanded(q_nope: Tensor, q_pe: Tensor, latent: Tensor, weight: Tensor, d_nope: int, d_v: int,
                     scale: Optional[float], keep: Optional[Tensor] = None, sinks: Optional[Tensor] = None) -> Tensor:
    """``[n_q, n, d_v]``: one sequence's last ``n_q`` queries against its latent rows ``[total, L + d_rope]``,
    expanded, with ``torch_attention``'s math (bottom-right causal; ``keep [n_q, total]``: DSA's selection)."""
    lora = weight.shape[-1]
    lat = latent.to(q_nope.dtype)
    k, v = _expand(lat[:, :lora], lat[:, lora:], weight, d_nope, d_v)
    q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1)
    mask = None if keep is None else keep[None, None]
    return torch.ops.autodeploy.torch_attention(q[None], k[None], v[None], mask, 0.0, True, scale, sinks, None,
                                                None)[0]


@torch.library.custom_op("autodeploy::torch_cached_mla_with_cache", mutates_args=("mla_cache",))
def torch_cached_mla_with_cache(
    q_nope: Tensor,
    q_pe: Tensor,
    compressed_kv: Tensor,
    kpe: Tensor,
    kv_b_proj_weight: Tensor,
    batch_info: Tensor,
    seq_len: Tensor,
    input_pos: Tensor,
    cu_seqlen: Tensor,
    page_table: Tensor,
    slot_mapping: Tensor,
    mla_cache: Tensor,
    scale: Optional[float] = None,
    rope_cos: Optional[Tensor] = None,
    rope_sin: Optional[Tensor] = None,
    rope_style: int = ROPE_NONE,
    topk_indices: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Reference: write the step's latent rows, then each sequence's queries against its whole
    cached latent, expanded (``[1, T, n, d_v]``)."""
    q_pe, kpe = apply_rope(q_pe, kpe, rope_cos, rope_sin, rope_style)
    d_nope, d_v = _check_shapes(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight)
    _write_latent(compressed_kv, kpe, slot_mapping, mla_cache)
    out = q_nope.new_empty(*q_nope.shape[:-1], d_v)
    lengths, starts, offsets = host_lists(seq_len, input_pos, cu_seqlen)
    for i, (n, start) in enumerate(zip(lengths, starts)):
        rows = slice(offsets[i], offsets[i] + n)
        latent = gather_sequence(mla_cache, page_table[i], start + n)[:, 0]
        keep = None if topk_indices is None else topk_keep_mask(topk_indices[0, rows], start + n)
        out[0, rows] = _attend_expanded(q_nope[0, rows], q_pe[0, rows], latent, kv_b_proj_weight, d_nope, d_v, scale,
                                        keep, sinks)
    return out


@torch_cached_mla_with_cache.register_fake
def _torch_cached_mla_fake(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, batch_info, seq_len, input_pos,
                           cu_seqlen, page_table, slot_mapping, mla_cache, scale=None, rope_cos=None, rope_sin=None,
                           rope_style=-1, topk_indices=None, sinks=None):
    d_v = kv_b_proj_weight.shape[0] // q_nope.shape[-2] - q_nope.shape[-1]
    return q_nope.new_empty(*q_nope.shape[:-1], d_v)


def absorbed_decode(q_nope: Tensor, q_pe: Tensor, mla_cache: Tensor, page_table: Tensor, input_pos: Tensor,
                    seq_len: Tensor, weight: Tensor, scale: float, topk_indices: Optional[Tensor] = None,
                    sinks: Optional[Tensor] = None) -> Tensor:
    """One new query per sequence (``q_nope [B, n, d_nope]``, ``q_pe [B, n, d_rope]``) against its
    cached latent rows, without expanding them: ``[B, n, d_v]``.

    ``q_lat = q_nope W_uk`` (per head, ``[B, n, L]``) joins ``q_pe`` so one product with the cached
    ``[c_kv, k_pe]`` rows gives ``q_nope . k_nope + q_pe . k_pe``; the attended latent goes out through
    ``W_uv``. The scores are the expanded path's up to the summation order. ``topk_indices
    [B, topk]``: DSA's selected key positions of each query (the others are masked); ``sinks [n]``:
    one all-zero row more, scored at each head's sink (module docstring)."""
    batch, heads, d_nope = q_nope.shape
    lora = weight.shape[-1]
    w = weight.view(heads, -1, lora)  # [n, d_nope + d_v, L]
    w_uk, w_uv = w[:, :d_nope], w[:, d_nope:]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk.to(q_nope.dtype)).transpose(0, 1)  # [B, n, L]
    query = torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1)  # [B, n, L + d_rope]
    pages = page_table.reshape(-1).long()
    width = mla_cache.shape[-1]
    latent = mla_cache.index_select(0, pages).view(batch, -1, width).to(query.dtype)  # [B, P * page, L + d_rope]
    totals = (input_pos + seq_len).long()[:, None, None, None]
    kpos = torch.arange(latent.shape[1], device=query.device)[None, None, None, :]
    drop = kpos >= totals
    if topk_indices is not None:
        drop |= ~topk_keep_mask(topk_indices, latent.shape[1])[:, None, None, :]
    mask = torch.zeros(batch, 1, 1, latent.shape[1], dtype=query.dtype, device=query.device).masked_fill_(
        drop, float("-inf"))
    if sinks is not None:
        latent = torch.cat([latent, latent.new_zeros(batch, 1, width)], dim=1)
        mask = torch.cat([mask.expand(batch, 1, heads, -1), sink_column(sinks, mask.dtype).expand(batch, 1, -1, 1)],
                         dim=-1)
    # heads are the query rows of one shared key/value "head": [B, 1, n, L + d_rope] x [B, 1, keys, ...]
    attended = F.scaled_dot_product_attention(query[:, None], latent[:, None], latent[:, None, :, :lora],
                                              attn_mask=mask, scale=scale)[:, 0]  # [B, n, L]
    return torch.bmm(attended.transpose(0, 1), w_uv.transpose(1, 2).to(attended.dtype)).transpose(0, 1)


@torch.library.custom_op("autodeploy::sdpa_cached_mla_with_cache", mutates_args=("mla_cache",))
def sdpa_cached_mla_with_cache(
    q_nope: Tensor,
    q_pe: Tensor,
    compressed_kv: Tensor,
    kpe: Tensor,
    kv_b_proj_weight: Tensor,
    batch_info: Tensor,
    seq_len: Tensor,
    input_pos: Tensor,
    cu_seqlen: Tensor,
    page_table: Tensor,
    slot_mapping: Tensor,
    mla_cache: Tensor,
    scale: Optional[float] = None,
    rope_cos: Optional[Tensor] = None,
    rope_sin: Optional[Tensor] = None,
    rope_style: int = ROPE_NONE,
    topk_indices: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
) -> Tensor:
    """Batched: prefills expand (causal SDPA on a fresh prefill's own rows, a masked SDPA over the
    gathered rows for a continued chunk); all decodes in one absorbed SDPA (module docstring)."""
    q_pe, kpe = apply_rope(q_pe, kpe, rope_cos, rope_sin, rope_style)
    d_nope, d_v = _check_shapes(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight)
    scale = 1.0 / math.sqrt(d_nope + q_pe.shape[-1]) if scale is None else scale
    rows = _write_latent(compressed_kv, kpe, slot_mapping, mla_cache)
    out = q_nope.new_empty(*q_nope.shape[:-1], d_v)
    (num_prefill, _, num_decode), lengths, starts, offsets = host_lists(batch_info, seq_len, input_pos, cu_seqlen)
    if num_prefill:
        _prefill(q_nope[0], q_pe[0], rows, out[0], num_prefill, lengths, starts, offsets,
                 page_table, mla_cache, kv_b_proj_weight, d_nope, d_v, scale,
                 None if topk_indices is None else topk_indices[0], sinks)
    if num_decode:
        dec = slice(num_prefill, num_prefill + num_decode)
        tokens = slice(offsets[num_prefill], offsets[num_prefill] + num_decode)
        totals = input_pos[dec] + seq_len[dec]
        width = -(-int(totals.max()) // mla_cache.shape[1])  # only the pages in use
        out[0, tokens] = absorbed_decode(q_nope[0, tokens], q_pe[0, tokens], mla_cache, page_table[dec, :width],
                                         input_pos[dec], seq_len[dec], kv_b_proj_weight, scale,
                                         None if topk_indices is None else topk_indices[0, tokens], sinks).to(out.dtype)
    return out


def _prefill(q_nope: Tensor, q_pe: Tensor, rows: Tensor, out: Tensor, num_prefill: int, lengths: List[int],
             starts: List[int], offsets: List[int], page_table: Tensor, cache: Tensor, weight: Tensor, d_nope: int,
             d_v: int, scale: float, topk_indices: Optional[Tensor] = None, sinks: Optional[Tensor] = None) -> None:
    """The first ``num_prefill`` sequences into ``out [T, n, d_v]``, expanded: a fresh prefill from the
    step's own latent ``rows``, a continued chunk from its gathered pages (``topk_indices [T, topk]``:
    DSA's selection, as a mask; ``sinks [n]``: per-head sinks, as one zero key more)."""
    lora = weight.shape[-1]
    for i in range(num_prefill):
        n, start = lengths[i], starts[i]
        toks = slice(offsets[i], offsets[i] + n)
        latent = rows[toks] if start == 0 else gather_sequence(cache, page_table[i], start + n)[:, 0]
        latent = latent.to(q_nope.dtype)
        k, v = _expand(latent[:, :lora], latent[:, lora:], weight, d_nope, d_v)  # [total, n, d]
        q = torch.cat([q_nope[toks], q_pe[toks].to(q_nope.dtype)], dim=-1)
        qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if start == 0 and topk_indices is None and sinks is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        else:
            total = start + n
            keep = torch.arange(total, device=q.device)[None, :] <= torch.arange(start, total, device=q.device)[:, None]
            if topk_indices is not None:
                keep &= topk_keep_mask(topk_indices[toks], total)
            o = _sdpa_with_sinks(qh, kh, vh, keep, scale, sinks)
        out[toks] = o[0].transpose(0, 1).to(out.dtype)


def sink_column(sinks: Tensor, dtype: torch.dtype) -> Tensor:
    """``[1, 1, n, 1]``: the additive mask entries that score the zero key row at each head's sink."""
    return sinks.to(dtype).reshape(1, 1, -1, 1)


def _sdpa_with_sinks(qh: Tensor, kh: Tensor, vh: Tensor, keep: Tensor, scale: float,
                     sinks: Optional[Tensor]) -> Tensor:
    """SDPA of ``qh [1, n, rows, d]`` over ``kh`` / ``vh [1, n, total, .]`` where ``keep [rows, total]``,
    with ``sinks [n]`` (or none) as one zero key/value more scored at the sink."""
    if sinks is None:
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=keep, scale=scale)
    mask = torch.zeros(keep.shape, dtype=qh.dtype, device=qh.device).masked_fill_(~keep, float("-inf"))
    heads = qh.shape[1]
    mask = torch.cat([mask.expand(1, heads, -1, -1),
                      sink_column(sinks, qh.dtype).transpose(1, 2).expand(1, heads, mask.shape[0], 1)], dim=-1)
    kh = torch.cat([kh, kh.new_zeros(*kh.shape[:2], 1, kh.shape[-1])], dim=2)
    vh = torch.cat([vh, vh.new_zeros(*vh.shape[:2], 1, vh.shape[-1])], dim=2)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)


@sdpa_cached_mla_with_cache.register_fake
def _sdpa_cached_mla_fake(q_nope, q_pe, compressed_kv, kpe, kv_b_proj_weight, batch_info, seq_len, input_pos,
                          cu_seqlen, page_table, slot_mapping, mla_cache, scale=None, rope_cos=None, rope_sin=None,
                          rope_style=-1, topk_indices=None, sinks=None):
    d_v = kv_b_proj_weight.shape[0] // q_nope.shape[-2] - q_nope.shape[-1]
    return q_nope.new_empty(*q_nope.shape[:-1], d_v)


__all__: List[str] = [
    "absorbed_decode",
    "sdpa_cached_mla_with_cache",
    "torch_cached_mla_with_cache",
    "torch_mla",
]
