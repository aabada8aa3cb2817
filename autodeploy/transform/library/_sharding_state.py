"""Tensor-parallel plans for state layers, for ``detect_sharding``: Gated DeltaNet (Qwen3.5, Qwen3-Next).

A Gated DeltaNet layer splits by heads like attention, each rank running its key heads and the value
heads that read them (value head ``h`` reads key head ``h // (nv / nk)``, so contiguous ranges of
both stay together), with its own slice of the recurrent state and of the short convolution's
channels. Qwen3.5's layout, as exported::

    qkv = linear(x, W_qkv)                                  # [b, s, q | k | v]
    c = torch_causal_conv1d(qkv, squeeze(w_conv), ...)      # per channel
    q, k, v = split_with_sizes(c, [Q, K, V], -1)  -> views into heads
    g = -exp(A_log) * softplus(linear(x, W_a) + dt_bias);  beta = sigmoid(linear(x, W_b))
    o = torch_gated_delta_rule(q, k, v, g, beta)            # [b, s, nv, dv]
    y = linear(view(rmsnorm(o, w_dv) * silu(view(linear(x, W_z)))), W_out)

Qwen3-Next's projections are grouped by key head instead: ``W_qkvz`` viewed ``[b, s, nk, f]`` and
split into each group's q, k, v and z (and ``W_ba`` into b and a), q, k and v flattened and
concatenated ``[q | k | v]`` for the convolution.

On rank ``r``: the conv's channels by the three blocks of q, k and v (``ColumnShard.blocks``), its
output's split sizes divided (``arg_fixes``); ``W_qkv`` by the same blocks, or a grouped projection
by rows (whole groups); ``W_a``, ``W_b``, ``W_z`` by rows, ``A_log`` and ``dt_bias`` by head, ``W_out``
by columns and one all-reduce after; literal head counts in the views divided. The per-head norm's
weight is the same for every head. Anything else on the way leaves the layer replicated (correct,
only slower).
"""

import operator
from typing import List, Optional, Sequence, Tuple

import torch
from torch import fx

from ..graph_utils import get_attr_value
from ._sharding import (ELEMENTWISE, LAYOUT_OPS, ColumnShard, HeadWeightShard, RowShard, ShardingPlan, is_linear,
                        linear_split, stored_target)
from ._sharding_attention import fix_layouts

aten = torch.ops.aten
ad = torch.ops.autodeploy

# why a state layer stays whole on every rank (``ShardingPlan.whole_layers``)
LAYOUT = ("the ops between its projections and its state op are not a layout the planner follows, or a value "
          "on the way is also read outside the layer")
QUANTIZED = "its projections do not split into whole blocks or groups of their quantized format at this world size"


def through_layout(node: object, chain: List[fx.Node]) -> Optional[fx.Node]:
    """``node`` with the layout ops in front of it skipped (each of one reader), collected in ``chain``."""
    while isinstance(node, fx.Node) and node.target in LAYOUT_OPS and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]
    return node if isinstance(node, fx.Node) else None


def stored_squeezed(gm: fx.GraphModule, node: object) -> Optional[str]:
    """The target of a stored tensor, through a ``squeeze`` (the conv weight's ``[c, 1, k]``)."""
    if isinstance(node, fx.Node) and node.target == aten.squeeze.dim and len(node.users) == 1:
        node = node.args[0]
    return stored_target(gm, node)


def _projection(node: object, groups: int, chain: List[fx.Node]) -> Optional[fx.Node]:
    """The linear ``node`` is (through layout ops), or of which it is one part of every group:
    the linear's output viewed ``[b, s, groups, f]`` and split on its last dim (Qwen3-Next's
    ``in_proj_qkvz``: whole groups split by rows keep each group's parts together)."""
    node = through_layout(node, chain)
    if node is not None and is_linear(node):
        return node
    if node is None or node.target is not operator.getitem or len(node.users) != 1:
        return None
    split = node.args[0]
    if split.target != aten.split_with_sizes.default or split.args[2] not in (-1, 3):
        return None
    view = split.args[0]
    value = view.meta.get("val")
    if view.target not in LAYOUT_OPS or len(view.users) != 1 or not isinstance(value, torch.Tensor):
        return None
    if value.dim() != 4 or value.shape[2] != groups or not is_linear(view.args[0]) or len(view.args[0].users) != 1:
        return None
    chain.extend([node, view])  # the part (``plan_gated_delta_rule`` checks every part is this layer's) and the view
    return view.args[0]


def conv_parts(args: Sequence[object], chains: Sequence[List[fx.Node]]) -> Optional[Tuple[fx.Node, fx.Node, List[int]]]:
    """``(conv, split, sizes)``: the three ``args`` (Gated DeltaNet's q, k and v; Mamba2's x, B and
    C), through layout ops (collected in ``chains``), as the parts 0, 1, 2 of one split of a short
    convolution's output."""
    items = [through_layout(v, chain) for v, chain in zip(args, chains)]
    if any(i is None or i.target is not operator.getitem or len(i.users) != 1 for i in items):
        return None
    split = items[0].args[0]  # type: ignore[union-attr]
    if any(i.args[0] is not split for i in items) or [i.args[1] for i in items] != [0, 1, 2]:  # type: ignore
        return None
    if split.target != aten.split_with_sizes.default or split.args[2] not in (-1, 2) or len(split.users) != 3:
        return None
    conv = _skip_position_ops(split.args[0])
    if conv is None or conv.target != ad.torch_causal_conv1d.default or len(conv.users) != 1:
        return None
    return conv, split, list(split.args[1])


def _skip_position_ops(node: fx.Node) -> Optional[fx.Node]:
    """The conv ``node`` is, through transposes and slices of the positions (OLMo-Hybrid's conv output
    cut to the last ``s``), each of one reader; None for anything else. Batch and positions are the
    symbolic dims, so a value with one static dim keeps the channels there through them."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or sum(type(d) is int for d in value.shape) != 1:
        return node if node.target == ad.torch_causal_conv1d.default else None
    while node.target != ad.torch_causal_conv1d.default:
        source = node.args[0]
        if not isinstance(source, fx.Node) or len(node.users) != 1 or "val" not in source.meta:
            return None
        sliced = node.target == aten.slice.Tensor and type(source.meta["val"].shape[node.args[1]]) is not int
        if node.target != aten.transpose.int and not sliced:
            return None
        node = source
    return node


def _per_head(value: object, heads: int, width: int) -> bool:
    """A gate value laid out by heads: one value a head (``[..., heads]``), or each head's features,
    flat (``[..., heads * d]``, ``width``) or viewed (4-D ``[b, s, heads, d]``, ``[1, 1, heads, 1]``)."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return False
    return value.shape[-1] in (heads, width) or (value.dim() == 4 and value.shape[2] == heads)


def gate_leaves(start: fx.Node, heads: int, groups: int, chain: List[fx.Node], width: int = -1
                ) -> Optional[List[fx.Node]]:
    """The projections and stored per-head parameters a per-head gate (``g`` or ``beta``: ``[b, s,
    heads]``; Kimi's per-channel ``g``: ``[b, s, heads, d]``, ``width`` = heads * d) is computed from
    through element-wise and layout ops, every value laid out by heads (``_per_head``) and read only
    inside the gate (but ``start``, by the state op); None when anything else is on the way."""
    leaves: List[fx.Node] = []
    stack, seen = [start], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if not _per_head(node.meta.get("val"), heads, width):
            return None
        if node.op == "get_attr":
            leaves.append(node)
            continue
        if node.op == "call_function" and node.target in ELEMENTWISE:
            stack.extend(a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node))
            continue
        path: List[fx.Node] = []
        linear = _projection(node, groups, path)
        if linear is not None:
            chain.extend(path)
            leaves.append(linear)
        elif node.target in LAYOUT_OPS:  # [b, s, heads * d] or a stored [heads * d] viewed [.., heads, d]
            chain.append(node)
            stack.append(node.args[0])
        else:
            return None
    if any(u not in seen for n in seen if n is not start and not is_linear(n) for u in n.users):
        return None  # a value (or parameter) read elsewhere too would be read as this rank's heads there
    return leaves


def head_dim(gm: fx.GraphModule, stored: fx.Node) -> int:
    """The dim a stored per-head tensor splits along: its first longer than 1 (``[heads]``,
    ``[heads * d]``, ``[1, 1, heads, 1]``)."""
    shape = get_attr_value(gm, stored).shape
    return next((i for i, n in enumerate(shape) if n != 1), 0)


_GATE_ACTS = (aten.silu.default, aten.sigmoid.default)


def _output(rule: fx.Node, dv: int, groups: int, chain: List[fx.Node]) -> Optional[Tuple[fx.Node, fx.Node]]:
    """``(out_proj, z)``: the output projection after the per-head norm and ``silu(z)`` gate
    (``sigmoid(z)``: Kimi's), and the gate's projection; None for another layout."""
    node, z = rule, None
    while len(node.users) == 1:
        (user,) = node.users
        if is_linear(user) and user.args[0] is node:
            return (user, z) if z is not None else None
        if user.target == ad.torch_rmsnorm.default and user.args[0] is node:
            if node.meta["val"].shape[-1] != dv:
                return None  # a norm over more than one head's features
        elif user.target == aten.mul.Tensor and z is None:
            other = user.args[1] if user.args[0] is node else user.args[0]
            if not isinstance(other, fx.Node) or other.target not in _GATE_ACTS or len(other.users) != 1:
                return None
            z = _projection(other.args[0], groups, chain)
            if z is None:
                return None
        elif user.target in LAYOUT_OPS:
            chain.append(user)
        else:
            return None
        node = user
    return None


def _qkv_source(conv_in: object, nk: int, sizes: List[int], chain: List[fx.Node]
                ) -> Optional[Tuple[Optional[fx.Node], List[fx.Node]]]:
    """Where the convolution's ``[q | k | v]`` comes from: ``(projection split by the three blocks,
    [])`` for Qwen3.5's ``in_proj_qkv``; ``(None, [projections split by rows])`` for Qwen3-Next's
    grouped projection (whole groups) or three separate ones (OLMo-Hybrid's q, k, v); None for
    another layout. Separate projections must be the split's blocks, ``sizes``, in order."""
    if is_linear(conv_in) and len(conv_in.users) == 1:  # type: ignore[union-attr]
        return conv_in, []  # type: ignore[return-value]
    if (not isinstance(conv_in, fx.Node) or conv_in.target != aten.cat.default or len(conv_in.args[0]) != 3
            or len(conv_in.users) != 1):
        return None
    parts = conv_in.args[0]
    if all(is_linear(p) and len(p.users) == 1 for p in parts) and len(set(parts)) == 3:
        widths = [int(p.meta["val"].shape[-1]) if "val" in p.meta else -1 for p in parts]
        return (None, list(parts)) if widths == sizes else None
    grouped = [_projection(p, nk, chain) for p in parts]  # Qwen3-Next: each group's q, k, v
    if grouped[0] is None or any(p is not grouped[0] for p in grouped):
        return None
    return None, [grouped[0]]


def plan_gated_delta_rule(gm: fx.GraphModule, rule: fx.Node, plan: ShardingPlan) -> Optional[str]:
    """Split one ``torch_gated_delta_rule`` layer by heads (module docstring); None when planned,
    else why it stays whole (nothing added): another layout, or head counts the world size does not
    divide."""
    q, v = rule.args[0].meta.get("val"), rule.args[2].meta.get("val")
    if q is None or v is None or q.dim() != 4:
        return LAYOUT
    nk, nv, dv = int(q.shape[2]), int(v.shape[2]), int(v.shape[3])
    if nk % plan.world_size or nv % plan.world_size:
        return f"{nk} key and {nv} value heads do not split over {plan.world_size} ranks"
    found = conv_parts(rule.args[:3], [[], [], []])
    if found is None:
        return LAYOUT
    conv, split, sizes = found
    chain: List[fx.Node] = []
    source = _qkv_source(conv.args[0], nk, sizes, chain)
    if source is None:
        return LAYOUT
    qkv, by_rows = source
    weight, out = stored_squeezed(gm, conv.args[1]), _output(rule, dv, nk, chain)
    gates = [gate_leaves(a, nv, nk, chain, width=nv * int(q.shape[3])) if isinstance(a, fx.Node) and len(a.users) == 1
             else None for a in rule.args[3:5]]  # a gate also read elsewhere would be read as this rank's heads there
    has_bias = len(conv.args) > 2 and conv.args[2] is not None
    bias = stored_squeezed(gm, conv.args[2]) if has_bias else None
    if weight is None or out is None or any(g is None for g in gates) or (has_bias and bias is None):
        return LAYOUT
    out_proj, z = out
    reached = set(chain)
    if any(u not in reached for n in chain if n.target is operator.getitem for u in n.args[0].users):
        return LAYOUT  # a part of a grouped projection read outside this layer would see this rank's groups only
    leaves = [n for g in gates for n in g]  # type: ignore[union-attr]
    params = list(dict.fromkeys(n for n in leaves if n.op == "get_attr"))
    # split by rows: a and b, z, a grouped q/k/v(/z) projection (whole groups) or separate q, k, v; Qwen3.5's
    # in_proj_qkv by blocks
    rows = list(dict.fromkeys([*(n for n in leaves if n.op != "get_attr"), z, *by_rows]))
    splits = {n: linear_split(gm, n, rows=False, parts=plan.world_size) for n in [*rows, *([qkv] if qkv else [])]}
    out_split = linear_split(gm, out_proj, rows=True, parts=plan.world_size)
    if sum(sizes) != conv.meta["val"].shape[-1]:
        return LAYOUT
    if out_split is None or any(s is None or s[2] for s in splits.values()):
        return QUANTIZED
    blocks = tuple((n, plan.world_size, plan.rank) for n in sizes)
    plan.arg_fixes[split.name] = {1: [n // plan.world_size for n in sizes]}
    plan.decisions.append(ColumnShard(conv.name, weight, bias, blocks=blocks))
    if qkv is not None:
        plan.decisions.append(ColumnShard(qkv.name, *splits[qkv][:2], blocks=blocks))  # type: ignore[index]
    for linear in rows:
        plan.decisions.append(ColumnShard(linear.name, *splits[linear][:2]))  # type: ignore[index]
    plan.decisions.extend(HeadWeightShard(rule.name, str(p.target), dim=head_dim(gm, p)) for p in params)
    plan.decisions.append(RowShard(out_proj.name, *out_split))
    fix_layouts(plan, chain, (nk, nv), plan.world_size)
    return None
