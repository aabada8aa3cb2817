"""How Qwen4-Exp's QSA (query-sparse attention) indexer reaches the IR as ``torch_qsa_indexer``.

Qwen4-Exp's indexed-attention layers let each query attend only to a token selection that an
indexer computes from the hidden states::

    blocks  = the query's complete blocks of ``compress_ratio`` visible tokens (0..C-1, C..2C-1, ...)
    key[j]  = rope(k_layernorm(mean of block j's raw index keys), position of the block's first token)
    score[j] = sum_h relu(q_h . key[j]) / sqrt(d)                          (q: layer-normed, roped)
    keep    = the tokens of the topk(min(budget // C, #blocks)) best blocks + the incomplete tail block

HF writes this as a Python loop over batch rows and queries with ``nonzero`` and a top-k whose
width follows the query position, which ``torch.export`` cannot trace (it fails guarding on
``u0 // C > 0``). The ``qsa_indexer`` export patch replaces the indexer's forward, for one
export, by the same projections in traced code and one custom op that runs HF's loop in its
kernel: the op returns HF's fixed-width index list (``int32 [b, s, budget + C - 1]``, ``-1``
padded) and the patched forward scatters it into the boolean mask HF's forward returns, with the
same ``scatter``. So the selection -- the top-k's width and which blocks win, ties included --
is HF's by construction: the kernel calls ``topk`` on the same row of scores HF builds. (A
fixed-width top-k over a ``-inf``-padded row, as ``torch_dsa_indexer`` does, would not be: ties
are common here, ``relu`` zeroes whole blocks, and ``topk`` breaks them differently with the row
length -- on CPU ``zeros(7).topk(2)`` gives ``[5, 4]`` but ``zeros(3).topk(2)`` gives ``[0, 1]``.)

The attention that consumes the mask is HF's own (it ANDs / fills the mask into the causal one),
so the exported attention carries an explicit mask: the pipeline serves the model in recompute
mode (the whole history rerun each step, exact). A paged-KV route would need a cached indexer
with its own key cache and a cached attention that takes the selection.

Only used during export (no HF cache): an HF cache (``past_key_values``) runs HF's forward.
"""

import inspect
import math
import sys
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional

import torch
from torch import Tensor, nn

from ..ops.dsa import topk_keep_mask
from .patch_registry import register_export_patch, replaced_forwards

_SIZES = ("index_n_heads", "index_kv_heads", "index_head_dim", "token_budget", "compress_ratio", "block_topk")


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_partial(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's ``apply_rotary_pos_emb`` on the first ``cos.shape[-1]`` dims of ``x`` (rest passes)."""
    rot = cos.shape[-1]
    x_rope, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([x_rope * cos + _rotate_half(x_rope) * sin, x_pass], dim=-1)


def _rms_norm_one_plus(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen4-Exp's RMSNorm: float32 normalisation, scaled by ``1 + weight``, back to ``x``'s dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).type_as(x)


def _query_selection(q: Tensor, raw_keys: Tensor, cos: Tensor, sin: Tensor, k_norm_weight: Tensor, eps: float,
                     visible: int, budget_blocks: int, ratio: int) -> Tensor:
    """The token positions one query keeps (HF's order): its best blocks' tokens, then the tail.

    ``q [H, d]``; ``raw_keys [t, d]``, ``cos``/``sin [t, rot]`` of one batch row; the query sees
    tokens ``0 .. visible-1``. Every op and shape is HF's, so the scores and the ``topk`` (and the
    way it breaks ties) are HF's."""
    device = raw_keys.device
    visible_idx = torch.arange(visible, device=device)
    num_blocks = visible // ratio
    tail = visible_idx[num_blocks * ratio:]
    if num_blocks == 0:
        return tail.to(torch.int32)
    block_tokens = visible_idx[: num_blocks * ratio].view(num_blocks, ratio)
    groups = raw_keys.index_select(0, block_tokens.flatten()).view(num_blocks, ratio, -1)
    pooled = _rms_norm_one_plus(groups.float().mean(dim=1).to(raw_keys.dtype), k_norm_weight, eps)
    starts = block_tokens[:, 0]
    keys = _rope_partial(pooled.unsqueeze(1), cos.index_select(0, starts).unsqueeze(1),
                         sin.index_select(0, starts).unsqueeze(1)).squeeze(1)
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)).transpose(-1, -2)
    scores = torch.relu(scores).sum(dim=-1) / math.sqrt(q.shape[-1])
    best = scores.topk(min(budget_blocks, num_blocks), dim=0).indices
    return torch.cat([block_tokens.index_select(0, best).flatten(), tail]).to(torch.int32)


@torch.library.custom_op("autodeploy::torch_qsa_indexer", mutates_args=())
def torch_qsa_indexer(q: Tensor, raw_keys: Tensor, cos: Tensor, sin: Tensor, k_norm_weight: Tensor, eps: float,
                      budget: int, ratio: int) -> Tensor:
    """QSA token selection, causal, one sequence per batch row (module docstring).

    ``q [b, s, H, d]`` (normed, roped) are the queries of the last ``s`` of ``t`` tokens;
    ``raw_keys [b, t, d]`` the un-normed index keys; ``cos``/``sin [b, t, rot]`` the RoPE of all
    ``t`` positions. Returns ``int32 [b, s, budget + ratio - 1]``: each query's kept token
    positions, ``-1`` padded."""
    b, s = q.shape[0], q.shape[1]
    t = raw_keys.shape[1]
    out = torch.full((b, s, budget + ratio - 1), -1, dtype=torch.int32, device=q.device)
    for row in range(b):
        for i in range(s):
            picked = _query_selection(q[row, i], raw_keys[row], cos[row], sin[row], k_norm_weight, eps,
                                      t - s + i + 1, budget // ratio, ratio)
            out[row, i, : picked.numel()] = picked
    return out


@torch_qsa_indexer.register_fake
def _torch_qsa_indexer_fake(q, raw_keys, cos, sin, k_norm_weight, eps, budget, ratio):
    return q.new_empty(q.shape[0], q.shape[1], budget + ratio - 1, dtype=torch.int32)


def _rope_function(module: nn.Module) -> Optional[Callable]:
    """The ``apply_rotary_pos_emb`` of the indexer's own modelling module (``None`` if absent)."""
    names = inspect.unwrap(type(module).forward).__code__.co_names
    fn = getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)
    return fn if "apply_rotary_pos_emb" in names and callable(fn) else None


def is_qsa_indexer(module: nn.Module) -> bool:
    """A Qwen4-Exp-style QSA indexer: the fused q/k projection, the two norms and the sizes."""
    return (type(getattr(module, "index_qk_proj", None)) is nn.Linear
            and all(isinstance(getattr(getattr(module, n, None), "weight", None), Tensor)
                    for n in ("q_layernorm", "k_layernorm"))
            and all(isinstance(getattr(module, n, None), int) for n in _SIZES)
            and module.index_kv_heads == 1 and _rope_function(module) is not None)


def _indexer_forward(original: Callable, rope_function: Callable) -> Callable:
    def forward(self: nn.Module, hidden_states: Tensor, position_embeddings, attention_mask: Tensor,
                past_key_values=None) -> Tensor:
        if past_key_values is not None:  # HF's cache keeps the index keys: HF's own forward
            return original(self, hidden_states, position_embeddings, attention_mask, past_key_values)
        batch, seq, _ = hidden_states.shape
        d = self.index_head_dim
        full_cos, full_sin = position_embeddings
        q, raw_keys = torch.split(self.index_qk_proj(hidden_states), [self.index_n_heads * d, d], dim=-1)
        q = self.q_layernorm(q.reshape(batch, seq, -1, d))
        q = rope_function(q, cos=full_cos[:, -seq:, :], sin=full_sin[:, -seq:, :], unsqueeze_dim=2)
        indices = torch.ops.autodeploy.torch_qsa_indexer(
            q, raw_keys.reshape(batch, seq, d), full_cos, full_sin, self.k_layernorm.weight,
            float(self.k_layernorm.eps), int(self.token_budget), int(self.compress_ratio))
        return topk_keep_mask(indices, attention_mask.shape[-1]).unsqueeze(1)

    return forward


@register_export_patch(
    "qsa_indexer",
    "Qwen4-Exp QSA indexers (a per-query Python loop with a position-dependent top-k) export as torch_qsa_indexer: "
    "HF's selection in one op, scattered into HF's mask",
)
@contextmanager
def _qsa_indexer(model: nn.Module) -> Iterator[None]:
    found = {}
    for m in model.modules():
        if type(m) not in found and is_qsa_indexer(m):
            found[type(m)] = _rope_function(m)
    with replaced_forwards({cls: _indexer_forward(cls.forward, rope) for cls, rope in found.items()}):
        yield


__all__: List[str] = ["is_qsa_indexer", "torch_qsa_indexer"]
