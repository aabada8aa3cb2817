"""Helpers shared by the attention matchers: layouts, masks and emitting ``torch_attention``."""

from typing import Any, Optional, Tuple

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..graph_utils import arg, is_op

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
    window; any other mask stays explicit.
    """
    if mask is None:
        return None, False, None
    if is_op(mask, torch.ops.autodeploy.torch_causal_mask):
        return None, True, arg(mask, 3, "sliding_window")
    return mask, False, None


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
) -> fx.Node:
    """Replace ``replaced`` (an attention computed on bnsd q/k/v with bnsd output) by
    ``torch_attention`` in bsnd. Layout swaps cancel against the model's own transposes."""
    with graph.inserting_before(replaced):
        q_s, k_s, v_s = (swap_12(graph, x) for x in (q, k, v))
    with graph.inserting_before(replaced):
        attn = graph.call_function(
            torch.ops.autodeploy.torch_attention.default,
            (q_s, k_s, v_s, mask, 0.0, is_causal, scale, None, sliding_window, logit_cap),
        )
    # Users that transpose the bnsd output back to bsnd can take the op's output directly.
    for user in list(replaced.users):
        if is_transpose_12(user):
            user.replace_all_uses_with(attn)
    if replaced.users:
        with graph.inserting_after(attn):
            back = graph.call_function(aten.transpose.int, (attn, 1, 2))
        replaced.replace_all_uses_with(back)
    return attn
