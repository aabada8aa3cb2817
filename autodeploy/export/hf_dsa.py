"""How HF's DeepSeek Sparse Attention indexer reaches the IR as ``torch_dsa_indexer``.

The DSA families (DeepSeek-V3.2, GLM-MoE-DSA, AXK2, Dots3) compute, per layer, an indexer that
returns ``topk(min(index_topk, T))`` key indices: a width that follows the sequence length, so
``torch.export`` specialises it (the graph then refuses one-token steps and the model ran in
recompute mode). The ``dsa_indexer`` export patch replaces the indexer's forward, for one
export on the ``autodeploy`` attention route (any implementation but eager/sdpa, for which HF's
attention code scatters the indices into a mask), by the same computation ending in the fixed-width
canonical op (``autodeploy.ops.dsa``); the attention route then hands the indices to
``torch_mla`` as ``topk_indices`` (``hf_attention``), and ``insert_cached_mla_attention`` gives
the indexer keys a paged cache of their own.

The indexers of the families differ in their RoPE (half-split for DeepSeek-V3.2, AXK2 and HY-V4,
interleaved for GLM-MoE-DSA and Dots3): the patched forward calls the function the family's own
forward calls, found in its module. HY-V4 also lays the roped part last in each vector (the
others first) and applies the softmax scale to the head weights instead of the scores (the
same ranking up to rounding, so its order is kept: the op then gets scale 1.0, an exact
multiplication). Both are read from the forward's own code (``indexer_layout``); a forward whose code
says neither plainly is not patched (it then exports with HF's own code, in recompute mode).
On the eager/sdpa routes (the exporter's retry, HF eager runs) the original forward runs.
"""

import ast
import functools
import inspect
import sys
import textwrap
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional

import torch
from torch import nn

from .patch_registry import register_export_patch, replaced_forwards

_ROPE_FUNCTIONS = ("apply_rotary_pos_emb_interleave", "apply_rotary_pos_emb")
_LINEARS = ("wq_b", "wk", "weights_proj")
_SIZES = ("n_heads", "head_dim", "qk_rope_head_dim", "index_topk")

# attention implementations for which HF's DSA code scatters the indices into a mask
_MASKING_IMPLS = ("eager", "sdpa")
# id(indices torch_dsa_indexer returned) -> the tensor, for the current export
_INDICES: Dict[int, torch.Tensor] = {}


def _rope_function(module: nn.Module) -> Optional[Callable]:
    """The RoPE function the indexer's own forward calls (``None`` when it calls neither)."""
    names = inspect.unwrap(type(module).forward).__code__.co_names  # HF's forward is wrapped in no_grad
    family = sys.modules.get(type(module).__module__)
    for name in _ROPE_FUNCTIONS:  # the interleaved one first: its name contains the other's
        if name in names and callable(getattr(family, name, None)):
            return getattr(family, name)
    return None


@dataclass(frozen=True)
class IndexerLayout:
    """Where a family's indexer puts the roped part of each vector and its softmax scale."""

    rope_first: bool  # [rope, pass] (DeepSeek-V3.2) or [pass, rope] (HY-V4)
    scale_on_weights: bool  # softmax_scale multiplies the head weights (HY-V4), not the scores


def _is_split_of(call: ast.AST, name: str) -> bool:
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "split"
            and bool(call.args) and isinstance(call.args[0], ast.Name) and call.args[0].id == name)


@functools.lru_cache(maxsize=None)
def indexer_layout(cls: type) -> Optional[IndexerLayout]:
    """The layout the indexer class's forward code states: how it splits ``q`` into the roped and the
    plain part, and which of ``scores`` / ``weights`` takes ``softmax_scale``; None when the code
    does not say it in those terms."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward))))
    except (OSError, TypeError, SyntaxError):
        return None
    split: Optional[tuple] = None
    scaled = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign) or len(node.targets) != 1:
            continue
        target = node.targets[0]
        if isinstance(target, ast.Tuple) and _is_split_of(node.value, "q"):
            split = tuple(getattr(e, "id", None) for e in target.elts)
        elif isinstance(target, ast.Name) and target.id in ("scores", "weights") and "softmax_scale" in ast.dump(
                node.value):
            scaled.add(target.id)
    if split not in (("q_rot", "q_pass"), ("q_pass", "q_rot")) or len(scaled) != 1:
        return None
    return IndexerLayout(rope_first=split[0] == "q_rot", scale_on_weights=scaled == {"weights"})


def is_dsa_indexer(module: nn.Module) -> bool:
    return (all(type(getattr(module, n, None)) is nn.Linear for n in _LINEARS)
            and isinstance(getattr(module, "k_norm", None), nn.Module)
            and all(isinstance(getattr(module, n, None), int) for n in _SIZES)
            and isinstance(getattr(module, "softmax_scale", None), float) and _rope_function(module) is not None
            and indexer_layout(type(module)) is not None)


def _halves(x: torch.Tensor, rope: int, layout: IndexerLayout):
    """``(rope part, plain part)`` of ``x``'s last dimension."""
    if layout.rope_first:
        return torch.split(x, [rope, x.shape[-1] - rope], dim=-1)
    plain, roped = torch.split(x, [x.shape[-1] - rope, rope], dim=-1)
    return roped, plain


def _joined(roped: torch.Tensor, plain: torch.Tensor, layout: IndexerLayout) -> torch.Tensor:
    return torch.cat([roped, plain] if layout.rope_first else [plain, roped], dim=-1)


def _indexer_forward(original: Callable, rope_function: Callable, layout: IndexerLayout) -> Callable:
    def forward(self: nn.Module, hidden_states: torch.Tensor, q_resid: torch.Tensor, position_embeddings,
                attention_mask: torch.Tensor, position_ids: Optional[torch.Tensor] = None, past_key_values=None,
                **kwargs) -> torch.Tensor:
        # HF's attention code turns the indices into a mask for eager/sdpa (the exporter's retry
        # route, eager runs): only the other implementations (our route) get them as indices
        if getattr(self.config, "_attn_implementation", None) in _MASKING_IMPLS or past_key_values is not None:
            return original(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids,
                            past_key_values=past_key_values, **kwargs)
        batch, seq, _ = hidden_states.shape
        rope = self.qk_rope_head_dim
        cos, sin = position_embeddings
        q = self.wq_b(q_resid).view(batch, seq, self.n_heads, self.head_dim)
        q_rot, q_pass = _halves(q, rope, layout)
        # the norm in its own weights' dtype (HY-V4 keeps it in float32; a no-op where they match)
        k = self.k_norm(self.wk(hidden_states).to(self.k_norm.weight.dtype)).to(hidden_states.dtype).unsqueeze(2)
        k_rot, k_pass = _halves(k, rope, layout)
        q_rot, k_rot = rope_function(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
        q = _joined(q_rot, q_pass, layout)
        k = _joined(k_rot, k_pass, layout).squeeze(2)
        weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * (self.n_heads ** -0.5)
        scale = float(self.softmax_scale)
        if layout.scale_on_weights:
            weights, scale = weights * scale, 1.0
        indices = torch.ops.autodeploy.torch_dsa_indexer(q, k, weights, scale, int(self.index_topk))
        _INDICES[id(indices)] = indices
        return indices

    return forward


@register_export_patch(
    "dsa_indexer",
    "DeepSeek Sparse Attention indexers (DeepSeek-V3.2, GLM-MoE-DSA, AXK2, Dots3, HY-V4) export as torch_dsa_indexer: "
    "fixed-width top-k indices instead of a width that follows the sequence length",
)
@contextmanager
def _dsa_indexer(model: nn.Module) -> Iterator[None]:
    classes = {type(m) for m in model.modules() if is_dsa_indexer(m)}
    ropes = {cls: _rope_function(next(m for m in model.modules() if type(m) is cls)) for cls in classes}
    try:
        with replaced_forwards({cls: _indexer_forward(cls.forward, ropes[cls], indexer_layout(cls))
                                for cls in classes}):
            yield
    finally:
        _INDICES.clear()


def claimed_indices(indices: object) -> Optional[torch.Tensor]:
    """``indices`` when it is a ``torch_dsa_indexer`` result of the current export."""
    if isinstance(indices, torch.Tensor) and _INDICES.get(id(indices)) is indices:
        return indices
    return None
