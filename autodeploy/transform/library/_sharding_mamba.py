"""Tensor-parallel plans for Mamba layers, for ``detect_sharding``: Mamba2 (Mamba2, Bamba, Falcon-H1,
Nemotron-H, Granite-4 hybrids, Zamba2) and Mamba (Mamba, Falcon-Mamba, Jamba).

A Mamba layer's scan runs per head (Mamba2) or per channel (Mamba) and its short convolution per
channel, so rank ``r`` can run its slice of them with its own slice of the state and the conv
window; the output projection then sums the ranks' parts (one all-reduce), as vLLM and Megatron
split these layers. Mamba2, as exported::

    zxbcdt = linear(h, W_in)                          # (* mup_vector: Falcon-H1)
    z, xBC, dt = split_with_sizes(zxbcdt, [D, D + 2GN, H], -1)
    x, B, C = split_with_sizes(torch_causal_conv1d(xBC, w_conv, b_conv, "silu"), [D, GN, GN], -1)
    y = torch_ssm(view(x, [b, s, H, P]), dt, -exp(A_log), view(B, [b, s, G, N]), view(C, ..), D_skip, dt_bias)
    g = reshape(y, [b, s, D]) * silu(z)
    g = view(g * rsqrt(mean(view(g, [b, s, G, D/G])^2, -1) + eps), [b, s, D]) * w_norm   # gated RMSNorm, if any
    out = linear(g, W_out)

On rank ``r`` of ``n``: its heads and their x channels, z and dt; the B and C of the groups those heads
read (split like the heads when ``n`` divides ``G``; when ``G`` divides ``n``, the one group its heads
read, held by ``n / G`` ranks). ``W_in`` by its five blocks, the conv by its three, the split sizes and
the views' literal head and group counts divided; ``A_log``, ``D``, ``dt_bias`` by head, ``w_norm``
by feature, ``W_out`` by columns. The norm's groups are whole on each rank when ``n`` divides ``G``;
with one group its mean of squares over all features is the ranks' means averaged
(``FeatureMeanShard``); ``1 < G < n`` with a norm is left replicated. Mamba::

    x, z = chunk(transpose(linear(h, W_in)), 2, 1)
    c = torch_causal_conv1d(transpose(x), w_conv, b_conv, "silu")          # [b, s, C]
    dt, B, C = split_with_sizes(linear(c, W_x), [R, N, N], -1)            # (a norm on each: Jamba, Falcon-Mamba)
    y = torch_ssm_mamba1(c, transpose(matmul(W_dt, transpose(dt))), -exp(A_log), B, C, D_skip, dt_bias)
    out = linear(transpose(transpose(y) * silu(z)), W_out)

On rank ``r``: its channels of both blocks of ``W_in``, of the conv, of ``W_dt`` (rows), ``A_log``,
``D``, ``dt_bias``; ``W_x`` by columns with an all-reduce after (dt, B and C whole on every rank), ``W_out``
by columns: two all-reduces a layer.

Casts on the way (bf16 models compute the scan's inputs and the norm in fp32) are followed like
layout ops. Anything else (another reader of a split value, more blocks in ``W_in``, a layout not
listed here) leaves the layer replicated on every rank: correct, only without the split.
"""

import operator
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

import torch
from torch import fx

from ..graph_utils import get_attr_value
from ._sharding import (ELEMENTWISE, LAYOUT_OPS, ColumnShard, FeatureMeanShard, HeadWeightShard, RowShard,
                        ShardingPlan, is_linear, linear_split, literal_dims)
from ._sharding_attention import fix_layouts
from ._sharding_state import LAYOUT, QUANTIZED, conv_parts

aten = torch.ops.aten
ad = torch.ops.autodeploy

Blocks = Tuple[Tuple[int, int, int], ...]
_CASTS = (aten.to.dtype, aten._to_copy.default)


def _back(node: object, chain: List[fx.Node]) -> Optional[fx.Node]:
    """``node`` with the layout ops and casts in front of it skipped (each of one reader), collected in ``chain``."""
    while isinstance(node, fx.Node) and (node.target in LAYOUT_OPS or node.target in _CASTS) and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]
    return node if isinstance(node, fx.Node) else None


def _part(node: object, chain: List[fx.Node]) -> Optional[Tuple[fx.Node, int]]:
    """``(cut, index)``: ``node`` (through layout ops and casts) as part ``index`` of one
    ``split_with_sizes`` or ``chunk``, read nowhere else."""
    node = _back(node, chain)
    if node is None or node.target is not operator.getitem or len(node.users) != 1:
        return None
    cut = node.args[0]
    if not isinstance(cut, fx.Node) or cut.target not in (aten.split_with_sizes.default, aten.chunk.default):
        return None
    return cut, int(node.args[1])


def _cut_sizes(cut: fx.Node, features: int) -> Optional[List[int]]:
    """The part sizes of a split or chunk along the dim of a value that is ``features`` wide there
    (the features: the batch and sequence dims are symbolic), None for a cut along another dim."""
    value = cut.args[0].meta.get("val") if isinstance(cut.args[0], fx.Node) else None
    dim = cut.args[2] if len(cut.args) > 2 else 0
    if not isinstance(value, torch.Tensor) or not isinstance(dim, int) or type(value.shape[dim]) is not int:
        return None
    if value.shape[dim] != features:
        return None
    if cut.target == aten.chunk.default:
        count = int(cut.args[1])
        return [features // count] * count if features % count == 0 else None
    return [int(n) for n in cut.args[1]]


def _stored(gm: fx.GraphModule, node: object, size: int, dim: int = 0) -> Optional[str]:
    """The target of a stored tensor ``size`` long in ``dim`` (with ``dim`` -1, its only dim longer
    than 1), read only here, through one-input element-wise ops (casts, ``-exp(A_log)``) and a
    ``squeeze`` (a conv weight's ``[c, 1, k]``)."""
    while (isinstance(node, fx.Node) and node.op == "call_function" and len(node.users) == 1
           and (node.target in ELEMENTWISE or node.target in _CASTS or node.target == aten.squeeze.dim)
           and len(node.all_input_nodes) == 1):
        node = node.all_input_nodes[0]
    if not isinstance(node, fx.Node) or node.op != "get_attr" or len(node.users) != 1:
        return None
    value = get_attr_value(gm, node)
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[dim] != size:
        return None
    if dim == -1 and value.numel() != size:
        return None
    return str(node.target)


def _in_projection(gm: fx.GraphModule, cut: fx.Node, chain: List[fx.Node]) -> Optional[Tuple[fx.Node, Optional[str]]]:
    """``(W_in's linear, mup_vector target or None)``: the projection a split or chunk cuts, read
    only there, optionally scaled per feature by a stored vector (Falcon-H1's, ``[1, 1, features]``)."""
    node = _back(cut.args[0], chain)
    scale = None
    if isinstance(node, fx.Node) and node.target == aten.mul.Tensor and len(node.users) == 1:
        linear, vector = node.args
        if not is_linear(vector) and is_linear(linear):
            scale = _stored(gm, vector, int(linear.meta["val"].shape[-1]), dim=-1)
        elif is_linear(vector):
            linear, scale = vector, _stored(gm, linear, int(vector.meta["val"].shape[-1]), dim=-1)
        if scale is None:
            return None
        node = linear
    if not is_linear(node) or len(node.users) != 1:
        return None
    return node, scale


def _written_norm(value: fx.Node) -> Optional[Tuple[fx.Node, fx.Node]]:
    """``(mean, out)`` of ``out = value * rsqrt(mean(value ** 2, -1, keepdim) + eps)`` written out,
    ``value``'s only two readers being its square and ``out``."""
    users = list(value.users)
    square = next((u for u in users if u.target == aten.pow.Tensor_Scalar and u.args[1] == 2), None)
    out = next((u for u in users if u.target == aten.mul.Tensor), None)
    if square is None or out is None or len(users) != 2 or len(square.users) != 1:
        return None
    (mean,) = square.users
    ndim = value.meta["val"].dim()
    if (mean.target != aten.mean.dim or [d % ndim for d in mean.args[1]] != [ndim - 1] or len(mean.args) < 3
            or mean.args[2] is not True or len(mean.users) != 1):
        return None
    (add,) = mean.users
    if (add.target not in (aten.add.Tensor, aten.add.Scalar) or not isinstance(add.args[1], float)
            or len(add.users) != 1):
        return None
    (rsqrt,) = add.users
    if rsqrt.target != aten.rsqrt.default or set(rsqrt.users) != {out} or set(out.args) != {value, rsqrt}:
        return None
    return mean, out


@dataclass
class _Mamba2Output:
    """What ``_mamba2_output`` found after the scan."""

    proj: Optional[fx.Node] = None  # W_out's linear
    gate: Optional[fx.Node] = None  # the value silu(z) is computed from
    mean: Optional[fx.Node] = None  # the gated norm's mean of squares
    groups_view: Optional[fx.Node] = None  # the view into the norm's groups
    norm_weight: Optional[fx.Node] = None
    chain: List[fx.Node] = field(default_factory=list)


def _mamba2_output(ssm: fx.Node) -> Optional[_Mamba2Output]:
    """The ops from the scan to the output projection: layouts and casts, ``* silu(z)``, then
    optionally the gated RMSNorm written out and its weight; None for anything else."""
    found, node = _Mamba2Output(), ssm
    while True:
        if found.gate is not None and found.mean is None and len(node.users) == 2 and node.target in LAYOUT_OPS:
            norm = _written_norm(node)
            if norm is None or node.meta["val"].dim() != 4:
                return None
            found.chain.remove(node)  # its literal sizes are the norm's groups: fixed on their own
            found.mean, found.groups_view, node = norm[0], node, norm[1]
            continue
        if len(node.users) != 1:
            return None
        (user,) = node.users
        if is_linear(user) and user.args[0] is node:
            found.proj = user
            return found if found.gate is not None else None
        if user.target in LAYOUT_OPS or user.target in _CASTS:
            found.chain.append(user)
        elif user.target == aten.mul.Tensor and found.gate is None:
            silu = user.args[1] if user.args[0] is node else user.args[0]
            if not isinstance(silu, fx.Node) or silu.target != aten.silu.default or len(silu.users) != 1:
                return None
            found.gate = silu.args[0]
        elif user.target == aten.mul.Tensor and found.mean is not None and found.norm_weight is None:
            found.norm_weight = user.args[1] if user.args[0] is node else user.args[0]
        else:
            return None
        node = user


def _fix_literal(plan: ShardingPlan, view: fx.Node, index: int, divisor: int) -> None:
    """Divide entry ``index`` of a view's shape by ``divisor`` on this rank, when it is a literal."""
    shape = view.args[1] if len(view.args) > 1 else None
    if isinstance(shape, (list, tuple)) and len(shape) > index and isinstance(shape[index], int) and shape[index] > 0:
        plan.layout_fixes.setdefault(view.name, {})[index] = divisor


def _reorders_only(chain: List[fx.Node]) -> bool:
    """Only casts and axis swaps on ``chain`` (no view whose sizes would need dividing)."""
    return all(c.target in _CASTS or c.target in (aten.transpose.int, aten.permute.default) for c in chain)


def _has_literals(chain: List[fx.Node], full: Tuple[int, ...]) -> bool:
    """A view on ``chain`` spells one of the ``full`` sizes out (which this planner does not fix)."""
    return any(literal_dims(node, full) for node in chain)


@dataclass
class _Mamba2Layer:
    """The pieces of one Mamba2 layer ``plan_mamba2`` splits (module docstring)."""

    in_proj: fx.Node
    mup: Optional[str]  # Falcon-H1's per-feature scale of W_in's output
    cut: fx.Node  # the split into z, xBC, dt
    conv: fx.Node
    conv_split: fx.Node  # the split of the conv's output into x, B, C
    conv_weight: str
    conv_bias: Optional[str]
    per_head: List[str]  # A_log, D, dt_bias
    norm_weight: Optional[str]
    out: _Mamba2Output
    chains: Dict[str, List[fx.Node]]  # layout ops on the way: head, group, gate, step


def _mamba2_layer(gm: fx.GraphModule, ssm: fx.Node, heads: int, width: int, gn: int) -> Optional[_Mamba2Layer]:
    """The layer around ``ssm`` when it is the layout of the module docstring, read nowhere else."""
    x, dt, A, B, C, D, dt_bias = ssm.args[:7]
    chains: Dict[str, List[fx.Node]] = {"head": [], "group": [], "xbc": [], "gate": [], "step": [], "in": []}
    found = conv_parts((x, B, C), (chains["head"], chains["group"], chains["group"]))
    out = _mamba2_output(ssm)
    if found is None or out is None or found[2] != [width, gn, gn]:
        return None
    conv, conv_split, _ = found
    parts = [_part(conv.args[0], chains["xbc"]), _part(out.gate, chains["gate"]), _part(dt, chains["step"])]
    if any(p is None for p in parts):
        return None
    cut = parts[0][0]  # type: ignore[index]
    if any(p[0] is not cut for p in parts) or [p[1] for p in parts] != [1, 0, 2] or len(cut.users) != 3:  # type: ignore
        return None
    projection = _in_projection(gm, cut, chains["in"]) if cut.target == aten.split_with_sizes.default else None
    if projection is None or not _reorders_only(chains["in"]) or _has_literals(chains["xbc"], (width + 2 * gn,)):
        return None
    if _cut_sizes(cut, int(projection[0].meta["val"].shape[-1])) != [width, width + 2 * gn, heads]:
        return None
    conv_tensors = _conv_tensors(gm, conv, width + 2 * gn)
    per_head = [_stored(gm, a, heads) for a in (A, D, dt_bias)]
    norm_weight = _stored(gm, out.norm_weight, width) if out.norm_weight is not None else None
    if conv_tensors is None or any(p is None for p in per_head) or (
            out.norm_weight is not None and norm_weight is None):
        return None
    return _Mamba2Layer(projection[0], projection[1], cut, conv, conv_split, *conv_tensors, per_head,  # type: ignore
                        norm_weight, out, chains)


def plan_mamba2(gm: fx.GraphModule, ssm: fx.Node, plan: ShardingPlan) -> Optional[str]:
    """Split one ``torch_ssm`` layer by heads (module docstring); None when planned, else why it
    stays whole (nothing added)."""
    n, rank = plan.world_size, plan.rank
    xv, bv = (a.meta.get("val") if isinstance(a, fx.Node) else None for a in (ssm.args[0], ssm.args[3]))
    if not isinstance(xv, torch.Tensor) or not isinstance(bv, torch.Tensor) or xv.dim() != 4 or bv.dim() != 4:
        return LAYOUT
    heads, head_dim, groups, state = (int(d) for d in (xv.shape[2], xv.shape[3], bv.shape[2], bv.shape[3]))
    if heads % n or (groups % n and n % groups):
        return f"{heads} heads in {groups} groups do not split over {n} ranks"
    layer = _mamba2_layer(gm, ssm, heads, heads * head_dim, groups * state)
    if layer is None:
        return LAYOUT
    if layer.out.mean is not None and groups % n and groups != 1:
        return f"its gated norm's {groups} groups would straddle ranks at world size {n}"
    split = linear_split(gm, layer.in_proj, rows=False, parts=n)
    out_split = linear_split(gm, layer.out.proj, rows=True, parts=n)  # type: ignore[arg-type]
    if split is None or split[2] or out_split is None:
        return QUANTIZED
    width, gn, group_parts = heads * head_dim, groups * state, min(groups, n)
    mine, theirs = (width, n, rank), (gn, group_parts, rank * group_parts // n)
    conv_blocks: Blocks = (mine, theirs, theirs)
    in_blocks: Blocks = (mine, *conv_blocks, (heads, n, rank))
    plan.decisions.append(ColumnShard(layer.in_proj.name, split[0], split[1], blocks=in_blocks))
    if layer.mup is not None:
        plan.decisions.append(HeadWeightShard(ssm.name, layer.mup, dim=-1, blocks=in_blocks))
    plan.decisions.append(ColumnShard(layer.conv.name, layer.conv_weight, layer.conv_bias, blocks=conv_blocks))
    plan.decisions.extend(HeadWeightShard(ssm.name, p) for p in layer.per_head)
    if layer.norm_weight is not None:
        plan.decisions.append(HeadWeightShard(ssm.name, layer.norm_weight))
    if layer.out.mean is not None and groups % n:  # one group over all features: the ranks' means averaged
        plan.decisions.append(FeatureMeanShard(layer.out.mean.name))
    if layer.out.groups_view is not None:
        _fix_literal(plan, layer.out.groups_view, 2 if groups % n == 0 else 3, n)
    plan.decisions.append(RowShard(layer.out.proj.name, *out_split))  # type: ignore[union-attr]
    local = [width // n, gn // group_parts, gn // group_parts]
    plan.arg_fixes[layer.conv_split.name] = {1: local}
    plan.arg_fixes[layer.cut.name] = {1: [width // n, sum(local), heads // n]}
    fix_layouts(plan, layer.chains["head"] + layer.chains["step"], (heads,), n)
    if group_parts > 1:  # else each rank holds all groups' B and C (the one group)
        fix_layouts(plan, layer.chains["group"], (groups,), group_parts)
    fix_layouts(plan, layer.chains["gate"] + layer.out.chain, (width,), n)
    return None


def _channel_count(node: object, n: int) -> Union[int, str]:
    """The channels of a ``[b, s, c]`` value (a Mamba scan's input, a short conv's output) when ``n``
    ranks split them evenly, else why the layer stays whole."""
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 3:
        return LAYOUT
    channels = int(value.shape[-1])
    return f"{channels} channels do not split over {n} ranks" if channels % n else channels


def _conv_tensors(gm: fx.GraphModule, conv: fx.Node, channels: int) -> Optional[Tuple[str, Optional[str]]]:
    """``(weight, bias or None)`` targets of a short convolution over ``channels``, stored and read
    only by it; None when computed."""
    weight = _stored(gm, conv.args[1], channels)
    has_bias = len(conv.args) > 2 and conv.args[2] is not None
    bias = _stored(gm, conv.args[2], channels) if has_bias else None
    return None if weight is None or (has_bias and bias is None) else (weight, bias)


def _mamba_x_proj(conv: fx.Node, x_chain: List[fx.Node], ssm: fx.Node) -> Optional[fx.Node]:
    """``W_x``'s linear: the conv output's one reader besides the scan."""
    readers = [u for u in conv.users if u is not (x_chain[-1] if x_chain else ssm)]
    if len(readers) != 1 or not is_linear(readers[0]) or readers[0].args[0] is not conv:
        return None
    return readers[0]


def plan_mamba(gm: fx.GraphModule, ssm: fx.Node, plan: ShardingPlan) -> Optional[str]:
    """Split one ``torch_ssm_mamba1`` layer by channels (module docstring); None when planned, else
    why it stays whole (nothing added)."""
    n, rank = plan.world_size, plan.rank
    x, dt, A, B, C, D, dt_bias = ssm.args[:7]
    channels = _channel_count(x, n)
    if isinstance(channels, str):
        return channels
    x_chain: List[fx.Node] = []
    step_chain: List[fx.Node] = []
    in_chain: List[fx.Node] = []
    conv, out, matmul = _back(x, x_chain), _mamba2_output(ssm), _back(dt, step_chain)
    if conv is None or conv.target != ad.torch_causal_conv1d.default or out is None or out.mean is not None:
        return LAYOUT
    x_proj = _mamba_x_proj(conv, x_chain, ssm)  # dt, B and C: whole on every rank after its all-reduce
    parts = [_part(conv.args[0], x_chain), _part(out.gate, out.chain)]
    if x_proj is None or any(p is None for p in parts) or parts[0][0] is not parts[1][0] or [
            p[1] for p in parts] != [0, 1] or len(parts[0][0].users) != 2:  # type: ignore[index]
        return LAYOUT
    cut = parts[0][0]  # type: ignore[index]
    projection = _in_projection(gm, cut, in_chain)
    if projection is None or projection[1] is not None or not _reorders_only(in_chain) or _cut_sizes(
            cut, int(projection[0].meta["val"].shape[-1])) != [channels, channels]:
        return LAYOUT
    dt_weight = (_stored(gm, matmul.args[0], channels) if matmul is not None and matmul.target == aten.matmul.default
                 and len(matmul.users) == 1 else None)
    per_channel = [_stored(gm, a, channels) for a in (A, D, dt_bias)]
    conv_tensors = _conv_tensors(gm, conv, channels)
    if dt_weight is None or any(p is None for p in per_channel) or conv_tensors is None:
        return LAYOUT
    splits = [linear_split(gm, projection[0], rows=False, parts=n), linear_split(gm, x_proj, rows=True, parts=n),
              linear_split(gm, out.proj, rows=True, parts=n)]  # type: ignore[arg-type]
    if any(s is None for s in splits) or splits[0][2]:  # type: ignore[index]
        return QUANTIZED
    (in_weight, in_bias, _), x_split, out_split = splits  # type: ignore[misc]
    plan.decisions.append(ColumnShard(projection[0].name, in_weight, in_bias, blocks=((channels, n, rank),) * 2))
    plan.decisions.append(ColumnShard(conv.name, *conv_tensors))
    plan.decisions.append(RowShard(x_proj.name, *x_split))
    plan.decisions.extend(HeadWeightShard(ssm.name, p) for p in [dt_weight, *per_channel])  # type: ignore[misc]
    plan.decisions.append(RowShard(out.proj.name, *out_split))  # type: ignore[union-attr]
    fix_layouts(plan, x_chain + out.chain + step_chain, (channels,), n)
    return None


def plan_short_conv(gm: fx.GraphModule, conv: fx.Node, plan: ShardingPlan) -> Optional[str]:
    """LFM2's gated short convolution, split by channels::

        Bg, Cg, x = chunk(transpose(linear(h, W_in)), 3, -2)
        y = Cg * transpose(torch_causal_conv1d(transpose(Bg * x), w_conv))
        out = linear(transpose(y), W_out)

    ``W_in`` by its three blocks, the conv (and its state) by channels, ``W_out`` by columns: one
    all-reduce. None when planned, else why not (nothing added): another layout, such as the
    convolutions of Mamba and Gated DeltaNet, which their layers' planners split."""
    n, rank = plan.world_size, plan.rank
    channels = _channel_count(conv, n)
    if isinstance(channels, str):
        return channels
    chain: List[fx.Node] = []
    product = _back(conv.args[0], chain)
    if product is None or product.target != aten.mul.Tensor or len(product.users) != 1:
        return LAYOUT
    parts = [_part(a, chain) for a in product.args]
    node, gate = conv, None
    while len(node.users) == 1 and gate is None:  # forward to the gate: layouts, then ``Cg * ...``
        (user,) = node.users
        if user.target == aten.mul.Tensor:
            gate = _part(user.args[1] if user.args[0] is node else user.args[0], chain)
        elif user.target not in LAYOUT_OPS and user.target not in _CASTS:
            return LAYOUT
        else:
            chain.append(user)
        node = user
    out_proj = _forward_to_linear(node, chain) if gate is not None else None
    if any(p is None for p in parts) or gate is None or out_proj is None:
        return LAYOUT
    cut = gate[0]
    if sorted(p[1] for p in [*parts, gate]) != [0, 1, 2] or any(p[0] is not cut for p in parts):  # type: ignore
        return LAYOUT
    in_chain: List[fx.Node] = []
    projection = _in_projection(gm, cut, in_chain) if len(cut.users) == 3 else None
    conv_tensors = _conv_tensors(gm, conv, channels)
    if projection is None or projection[1] is not None or not _reorders_only(in_chain) or conv_tensors is None:
        return LAYOUT
    if _cut_sizes(cut, int(projection[0].meta["val"].shape[-1])) != [channels] * 3:
        return LAYOUT
    split = linear_split(gm, projection[0], rows=False, parts=n)
    out_split = linear_split(gm, out_proj, rows=True, parts=n)
    if split is None or split[2] or out_split is None:
        return QUANTIZED
    plan.decisions.append(ColumnShard(projection[0].name, split[0], split[1], blocks=((channels, n, rank),) * 3))
    plan.decisions.append(ColumnShard(conv.name, *conv_tensors))
    plan.decisions.append(RowShard(out_proj.name, *out_split))
    fix_layouts(plan, chain, (channels,), n)
    return None


def _forward_to_linear(node: fx.Node, chain: List[fx.Node]) -> Optional[fx.Node]:
    """The linear ``node`` feeds through layout ops and casts (each of one reader), as its input."""
    while len(node.users) == 1:
        (user,) = node.users
        if is_linear(user) and user.args[0] is node:
            return user
        if user.target not in LAYOUT_OPS and user.target not in _CASTS:
            return None
        chain.append(user)
        node = user
    return None
