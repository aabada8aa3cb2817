"""Helpers shared by the attention matchers: layouts, masks and emitting ``torch_attention``."""

from typing import Any, Optional, Tuple

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..graph_utils import arg, inherit_source_meta, is_op

aten = torch.ops.aten


def is_transpose_12(node: Any) -> bool:
    """``transpose(x, 1, 2)`` (either order) on a 4-D tensor: bnsd <-> bsnd."""
    if not is_op(node, aten.transpose.int):
        return False
    v = node.meta.get("val")
    rank = v.dim() if v is not None else 4
    dims = {arg(node, 1, "dim0") % rank, arg(node, 2, "dim1") % rank}
    return rank == 4 and dims == {1, 2}


def all_rank4(*nodes: Any) -> bool:
    """q/k/v in ``[b, heads, s, d]``: the only layout the matchers rewrite."""
    for n in nodes:
        v = n.meta.get("val") if isinstance(n, fx.Node) else None
        if not isinstance(v, torch.Tensor) or v.dim() != 4:
            return False
    return True


def same_seq_len(q: fx.Node, k: fx.Node) -> bool:
    """Query and key lengths provably equal (bnsd), so top-left and bottom-right causal agree."""
    return statically_known_true(q.meta["val"].shape[2] == k.meta["val"].shape[2])


def swap_12(graph: fx.Graph, node: fx.Node) -> fx.Node:
    """A node with dims 1 and 2 swapped; reuses the source of an existing swap."""
    if is_transpose_12(node):
        return node.args[0]
    with graph.inserting_after(node):
        return graph.call_function(aten.transpose.int, (node, 1, 2))


def read_mask(mask: Any) -> Tuple[Optional[fx.Node], bool, Optional[int]]:
    """``(explicit_mask, is_causal, sliding_window)`` for an attention's mask input.

    A ``torch_causal_mask`` node (emitted by the export route) becomes ``is_causal`` plus its
    window, and so does HF's index-built causal mask over an all-ones padding mask
    (``hf_index_mask_is_causal``); any other mask stays explicit.
    """
    if mask is None:
        return None, False, None
    if is_op(mask, torch.ops.autodeploy.torch_causal_mask):
        if arg(mask, 6, "attention_chunk") is not None:  # chunked-local: only the autodeploy route reads it
            return mask, False, None
        return None, True, arg(mask, 3, "sliding_window")
    if hf_index_mask_is_causal(mask):
        return None, True, None
    return mask, False, None


_AND = (aten.__and__.Tensor, aten.bitwise_and.Tensor, aten.logical_and)


def _and_leaves(node: Any) -> list:
    if is_op(node, _AND):
        return _and_leaves(node.args[0]) + _and_leaves(node.args[1])
    return [node]


def _index_ramp(node: Any, dim: int) -> Optional[Any]:
    """The end of ``arange(end)`` laid along ``dim`` of a 4-D index tensor (all other dims 1)."""
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    if v is None or v.dim() != 4 or any(not statically_known_true(v.shape[i] == 1) for i in range(4) if i != dim % 4):
        return None
    x = node
    while is_op(x, aten.unsqueeze):
        x = x.args[0]
    if is_op(x, aten.arange.default):
        return x.args[0]
    return None


def _all_true(node: Any) -> bool:
    """A boolean tensor that is true everywhere by construction: ``new_ones(..., dtype=bool)``,
    or an index into a boolean cast of ``ones(...)`` (HF's padding mask when the model made
    ``attention_mask = torch.ones(...)`` itself, as BioGPT does)."""
    if is_op(node, (aten.new_ones, aten.ones)):
        return node.kwargs.get("dtype") == torch.bool
    if is_op(node, aten.index.Tensor):
        src = node.args[0]
        while is_op(src, (aten.to, aten._to_copy)):
            src = src.args[0]
        return is_op(src, (aten.ones, aten.new_ones))
    return False


def hf_index_mask_is_causal(mask: Any) -> bool:
    """HF ``sdpa_mask`` built without vmap for ``causal & padding`` with a padding mask of ones:
    ``new_ones(()) & (kv_idx <= q_idx) & ones(b, s).bool()[batch_idx, kv_idx]``, where
    ``kv_idx = arange(s)[None, None, None, :]`` and ``q_idx = arange(s)[None, None, :, None]``
    with the same ``s`` (square, so top-left and bottom-right causal agree). Exactly one causal
    comparison, every other factor true everywhere; anything else is not read as causal."""
    leaves = _and_leaves(mask)
    if len(leaves) < 2:
        return False
    causal = 0
    for leaf in leaves:
        if is_op(leaf, (aten.le.Tensor, aten.ge.Tensor)):
            kv, q = leaf.args if is_op(leaf, aten.le.Tensor) else leaf.args[::-1]
            kv_end, q_end = _index_ramp(kv, 3), _index_ramp(q, 2)
            if kv_end is None or kv_end is not q_end:
                return False
            causal += 1
        elif not _all_true(leaf):
            return False
    return causal == 1


def emit_attention_bnsd(
    graph: fx.Graph,
    replaced: fx.Node,
    q: fx.Node,
    k: fx.Node,
    v: fx.Node,
    *,
    mask: Optional[fx.Node],
    is_causal: bool,
    scale: Optional[float],
    sliding_window: Optional[int] = None,
    logit_cap: Optional[float] = None,
    alibi_slopes: Optional[fx.Node] = None,
) -> fx.Node:
    """Replace ``replaced`` (an attention computed on bnsd q/k/v with bnsd output) by
    ``torch_attention`` in bsnd. Layout swaps cancel against the model's own transposes.
    ``alibi_slopes`` (a ``[heads]`` float32 node) goes in as a keyword: only ALiBi models carry it."""
    with graph.inserting_before(replaced):
        q_s, k_s, v_s = (swap_12(graph, x) for x in (q, k, v))
    with graph.inserting_before(replaced):
        attn = graph.call_function(
            torch.ops.autodeploy.torch_attention.default,
            (q_s, k_s, v_s, mask, 0.0, is_causal, scale, None, sliding_window, logit_cap),
            {"alibi_slopes": alibi_slopes} if alibi_slopes is not None else {},
        )
    for new in (q_s, k_s, v_s, attn):
        inherit_source_meta(new, replaced)
    # Users that transpose the bnsd output back to bsnd can take the op's output directly.
    for user in list(replaced.users):
        if is_transpose_12(user):
            user.replace_all_uses_with(attn)
    if replaced.users:
        with graph.inserting_after(attn):
            back = graph.call_function(aten.transpose.int, (attn, 1, 2))
        inherit_source_meta(back, replaced)
        replaced.replace_all_uses_with(back)
    return attn
