"""Tensor-parallel plans for state layers, for ``detect_sharding``: Gated DeltaNet (Qwen3.5).

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

On rank ``r``: ``W_qkv`` and the conv's channels by the same three blocks (``ColumnShard.blocks``),
the split sizes divided (``arg_fixes``), ``W_a``, ``W_b``, ``W_z`` by rows, ``A_log`` and
``dt_bias`` by head, ``W_out`` by columns and one all-reduce after; the per-head norm's weight is the
same for every head. Anything else on the way leaves the layer replicated (correct, only slower).
"""

from typing import List, Optional

import torch
from torch import fx

from ..graph_utils import get_attr_value
from ._sharding import LAYOUT_OPS, ColumnShard, HeadWeightShard, RowShard, ShardingPlan, is_linear, linear_split
from ._sharding_attention import plan_fused_blocks
from ._sharding_heads import Cut

aten = torch.ops.aten
ad = torch.ops.autodeploy

# element-wise ops computing the per-head decay and beta from their projections and parameters
_GATE_OPS = frozenset({aten.mul.Tensor, aten.add.Tensor, aten.neg.default, aten.exp.default, aten.softplus.default,
                       aten.sigmoid.default, aten._to_copy.default, aten.to.dtype})


def _through_layout(node: object) -> Optional[fx.Node]:
    """``node`` with the layout ops in front of it skipped (each of one reader)."""
    while isinstance(node, fx.Node) and node.target in LAYOUT_OPS and len(node.users) == 1:
        node = node.args[0]
    return node if isinstance(node, fx.Node) else None


def _stored(gm: fx.GraphModule, node: object) -> Optional[str]:
    """The target of a stored tensor, through a ``squeeze`` (the conv weight's ``[c, 1, k]``)."""
    if isinstance(node, fx.Node) and node.target == aten.squeeze.dim and len(node.users) == 1:
        node = node.args[0]
    if isinstance(node, fx.Node) and node.op == "get_attr" and isinstance(get_attr_value(gm, node), torch.Tensor):
        return str(node.target)
    return None


def _qkv_cuts(gm: fx.GraphModule, rule: fx.Node) -> Optional[List[Cut]]:
    """q, k and v of ``rule`` as three blocks of the short convolution over one projection."""
    cuts: List[Cut] = []
    for value in rule.args[:3]:
        item = _through_layout(value)
        if item is None or item.target.__name__ != "getitem" or len(item.users) != 1:
            return None
        split = item.args[0]
        if split.target != aten.split_with_sizes.default or split.args[2] not in (-1, 2):
            return None
        conv = split.args[0]
        if conv.target != ad.torch_causal_conv1d.default or len(conv.users) != 1 or len(split.users) != 3:
            return None
        linear = conv.args[0]
        if not is_linear(linear) or linear.target != aten.linear.default or len(linear.users) != 1:
            return None
        sizes = list(split.args[1])
        start = sum(sizes[:item.args[1]])
        cuts.append(Cut(item, split, start, start + sizes[item.args[1]], linear))
    ends = sorted(c.end for c in cuts)
    features = cuts[0].linear.meta["val"].shape[-1] if "val" in cuts[0].linear.meta else None
    if len({c.linear for c in cuts}) != 1 or sorted(c.start for c in cuts) != [0, *ends[:-1]] or ends[-1] != features:
        return None
    return cuts


def _gate_leaves(gm: fx.GraphModule, start: fx.Node, heads: int) -> Optional[List[fx.Node]]:
    """The linears and stored ``[heads]`` parameters a per-head gate (``g`` or ``beta``, ``[b, s,
    heads]``) is computed from through element-wise ops, every value ``heads`` wide; None when
    anything else is on the way."""
    leaves: List[fx.Node] = []
    stack, seen = [start], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[-1] != heads:
            return None
        if is_linear(node) or node.op == "get_attr":
            leaves.append(node)
            continue
        if node.op != "call_function" or node.target not in _GATE_OPS:
            return None
        stack.extend(a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node))
    return leaves


def _output(rule: fx.Node, dv: int) -> Optional[tuple]:
    """``(out_proj, z)``: the output projection after the per-head norm and ``silu(z)`` gate, and
    the gate's projection; None for another layout."""
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
            if not isinstance(other, fx.Node) or other.target != aten.silu.default or len(other.users) != 1:
                return None
            z = _through_layout(other.args[0])
            if z is None or not is_linear(z):
                return None
        elif user.target not in LAYOUT_OPS:
            return None
        node = user
    return None


def plan_gated_delta_rule(gm: fx.GraphModule, rule: fx.Node, plan: ShardingPlan) -> bool:
    """Split one ``torch_gated_delta_rule`` layer by heads (module docstring); False (nothing added)
    for another layout or head counts the world size does not divide."""
    q, v = rule.args[0].meta.get("val"), rule.args[2].meta.get("val")
    if q is None or v is None or q.dim() != 4:
        return False
    nk, nv, dv = int(q.shape[2]), int(v.shape[2]), int(v.shape[3])
    if nk % plan.world_size or nv % plan.world_size:
        return False
    cuts = _qkv_cuts(gm, rule)
    conv = cuts[0].split.args[0] if cuts else None
    conv_weight = _stored(gm, conv.args[1]) if conv is not None else None
    out = _output(rule, dv)
    gates = [_gate_leaves(gm, a, nv) for a in rule.args[3:5]]
    if cuts is None or conv_weight is None or out is None or any(g is None for g in gates):
        return False
    conv_bias = _stored(gm, conv.args[2]) if len(conv.args) > 2 and conv.args[2] is not None else None
    if len(conv.args) > 2 and conv.args[2] is not None and conv_bias is None:
        return False
    out_proj, z = out
    linears = [n for g in gates for n in g if is_linear(n)] + [z]  # type: ignore[union-attr]
    params = [str(n.target) for g in gates for n in g if n.op == "get_attr"]  # type: ignore[union-attr]
    splits = [linear_split(gm, n, rows=False, parts=plan.world_size) for n in linears]
    qkv_split = linear_split(gm, cuts[0].linear, rows=False, parts=plan.world_size)
    out_split = linear_split(gm, out_proj, rows=True, parts=plan.world_size)
    if qkv_split is None or qkv_split[2] or out_split is None or any(s is None for s in splits):
        return False
    blocked = [(c, plan.world_size, plan.rank) for c in cuts]
    if not plan_fused_blocks(plan, blocked, qkv_split[0], qkv_split[1]):
        return False
    blocks = plan.decisions[-1].blocks  # type: ignore[union-attr]
    plan.decisions.append(ColumnShard(conv.name, conv_weight, conv_bias, blocks=blocks))
    for linear, (weight, bias, extra) in zip(linears, splits):  # type: ignore[misc]
        plan.decisions.append(ColumnShard(linear.name, weight, bias, extra=extra))
    plan.decisions.extend(HeadWeightShard(rule.name, p) for p in dict.fromkeys(params))
    plan.decisions.append(RowShard(out_proj.name, *out_split))
    return True
