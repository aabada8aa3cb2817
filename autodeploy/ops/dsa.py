"""DeepSeek Sparse Attention (DSA): the indexer that picks, per query, the keys MLA attends to.

DeepSeek-V3.2, GLM-MoE-DSA, AXK2 and Dots3 score every earlier token with a small indexer::

    score[s, t] = sum_h w[s, h] * relu(scale * q[s, h] . k[t])      (q, k roped; w = weights_proj(x) / sqrt(H))

and let query ``s`` attend only to the ``index_topk`` best-scoring causal keys (all of them while
there are no more than ``index_topk``). HF returns ``topk(min(index_topk, T))`` indices, whose
width follows the sequence length, which ``torch.export`` cannot keep dynamic. The canonical op
returns a fixed width instead::

    torch_dsa_indexer(q [b, s, H, d], k [b, s, d], w [b, s, H], scale, topk) -> int32 [b, s, topk]

the selected key positions of each query, ``-1`` where fewer than ``topk`` causal keys exist.
The ranking is HF's computation on the same row (the same ops in the same order, masked keys at
``-inf``, ``torch.topk`` over the row), so ties fall the same way. ``torch_mla`` takes the
indices as ``topk_indices`` and masks every other key.

The cached op keeps each layer's indexer keys (``d`` values a token) in a paged cache of their
own, ``[num_pages, page_size, 1, d]``, and ranks each new query against all keys of its
sequence so far, as HF's cache does: positions are absolute, so the MLA cache reads them
directly.
"""

from typing import List

import torch
from torch import Tensor

from .cached_attention import gather_sequence
from .host_reads import host_lists


def index_scores(q: Tensor, k: Tensor, w: Tensor, scale: float) -> Tensor:
    """``[b, s, t]`` float32 scores of queries ``q [b, s, H, d]`` against keys ``k [b, t, d]``,
    in HF's order of operations."""
    scores = torch.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale)  # [b, s, H, t]
    return torch.matmul(w.float().unsqueeze(-2), scores).squeeze(-2)


def select_top(scores: Tensor, first_query_pos: int, topk: int) -> Tensor:
    """``int32 [b, s, topk]``: per query (the ``s`` queries at positions ``first_query_pos ..``) the
    ``topk`` best causal keys of ``scores [b, s, t]``, ``-1`` past the causal ones."""
    s, t = scores.shape[-2], scores.shape[-1]
    qpos = torch.arange(first_query_pos, first_query_pos + s, device=scores.device)[:, None]
    causal = torch.arange(t, device=scores.device)[None, :] <= qpos
    masked = scores.masked_fill(~causal, float("-inf"))
    width = min(topk, t)
    picked = masked.topk(width, dim=-1).indices
    picked = torch.where(torch.gather(causal.expand_as(masked), -1, picked), picked, -1).to(torch.int32)
    if width < topk:
        picked = torch.cat([picked, picked.new_full((*picked.shape[:-1], topk - width), -1)], dim=-1)
    return picked


@torch.library.custom_op("autodeploy::torch_dsa_indexer", mutates_args=())
def torch_dsa_indexer(q: Tensor, k: Tensor, weights: Tensor, scale: float, topk: int) -> Tensor:
    """Reference indexer over one whole sequence per batch row (module docstring)."""
    return select_top(index_scores(q, k, weights, scale), 0, topk)


@torch_dsa_indexer.register_fake
def _torch_dsa_indexer_fake(q, k, weights, scale, topk):
    return q.new_empty(q.shape[0], q.shape[1], topk, dtype=torch.int32)


def topk_keep_mask(topk_indices: Tensor, num_keys: int) -> Tensor:
    """``bool [..., s, num_keys]``: True at the selected keys (``-1`` entries select nothing)."""
    keep = torch.zeros(*topk_indices.shape[:-1], num_keys + 1, dtype=torch.bool, device=topk_indices.device)
    index = torch.where(topk_indices < 0, num_keys, topk_indices).long()
    return keep.scatter_(-1, index, True)[..., :num_keys]


@torch.library.custom_op("autodeploy::torch_cached_dsa_indexer", mutates_args=("index_cache",))
def torch_cached_dsa_indexer(
    q: Tensor,
    k: Tensor,
    weights: Tensor,
    batch_info: Tensor,
    seq_len: Tensor,
    input_pos: Tensor,
    cu_seqlen: Tensor,
    page_table: Tensor,
    slot_mapping: Tensor,
    index_cache: Tensor,
    scale: float,
    topk: int,
) -> Tensor:
    """Write the step's indexer keys, then rank each sequence's new queries against all of its
    keys so far: ``int32 [1, T, topk]`` absolute key positions, ``-1`` past the causal ones."""
    d = index_cache.shape[-1]
    index_cache.view(-1, d).index_copy_(0, slot_mapping, k.reshape(-1, d).to(index_cache.dtype))
    out = q.new_full((1, q.shape[1], topk), -1, dtype=torch.int32)
    lengths, starts, offsets = host_lists(seq_len, input_pos, cu_seqlen)
    for i, (n, start) in enumerate(zip(lengths, starts)):
        total = start + n
        keys = gather_sequence(index_cache, page_table[i], total)[:, 0].to(q.dtype)
        rows = slice(offsets[i], offsets[i] + n)
        scores = index_scores(q[:, rows], keys[None], weights[:, rows], scale)
        out[:, rows] = select_top(scores, start, topk)
    return out


@torch_cached_dsa_indexer.register_fake
def _torch_cached_dsa_indexer_fake(q, k, weights, batch_info, seq_len, input_pos, cu_seqlen, page_table,
                                   slot_mapping, index_cache, scale, topk):
    return q.new_empty(1, q.shape[1], topk, dtype=torch.int32)


__all__: List[str] = ["index_scores", "select_top", "topk_keep_mask", "torch_cached_dsa_indexer", "torch_dsa_indexer"]
