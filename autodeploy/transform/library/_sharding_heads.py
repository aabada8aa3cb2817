"""Following per-head values between an attention op and its projections, for ``detect_sharding``.

A split by heads is right only when every op between a projection and the attention (and between
the attention and its output projection) keeps each head's values to that head: then rank ``r``
computing heads ``[r*n/w, (r+1)*n/w)`` from its slice of the projection gets exactly those heads'
values. These functions walk the graph from the attention's inputs back to the one linear they come
from (``head_source``, ``producing_linear``) and forward from its output to the output projection
(``consuming_linear``, with per-head output gates), and refuse (None) anything they cannot prove
head-local. What they accept:

* layout ops (views, transposes, permutes): literal head counts in views are divided later;
* slices, splits, chunks, concatenations and stacks of a ``[b, s, heads, d]`` value's per-head
  feature dim (partial RoPE, MLA's nope/rope parts, RoPE written out as ``rotate_half``; GPT-NeoX's
  q, k and v chunked out of each head of one projection), and a ``select`` after the heads dim of a
  ``[b, s, heads, 3, d]`` view (Persimmon's);
* RoPE ops (q through their first output, k through their second) and per-head norms;
* per-head norms written out (a reduction over each head's features), per-head LayerNorms;
* element-wise ops whose other operands are the same for every head (RoPE's cos/sin tables, a
  per-position query scale, a scalar): ``aten.mul(q, cos)`` is head-local, ``aten.mul(q, w)`` with a
  per-head ``w`` is not (it would need ``w`` split too);
* norms over all heads' features (OLMo-2's q/k norms) when the caller collects them (``norms``):
  their weight splits with the heads and their mean of squares becomes a sum over the ranks
  (``torch_dist_rmsnorm``);
* blocks cut out of a fused projection's flat features (``[q | k | v]``, ``[gate | up]``) when the
  caller collects them (``cuts``, ``block_cut``): the projection then splits block by block;
* after the attention: per-head output gates (``o * sigmoid(g(x))``, one value per head
  ``o * act(g(x))[..., None]``) and norms over all heads before the output projection.

A 4-D value on the way whose dims do not include the head count (CodeGen's ``mp_num`` groups) ends
the walk: its middle dim is not the heads, so a split along it would not follow them.
"""

import operator
from dataclasses import dataclass
from typing import Collection, List, Optional, Sequence, Tuple, Union

import torch
from torch import fx

from ._sharding import ELEMENTWISE, LAYOUT_OPS, ROPE_OPS, _arg, is_linear

aten = torch.ops.aten
ad = torch.ops.autodeploy


def producing_linear(node: fx.Node, path: List[fx.Node]) -> Optional[fx.Node]:
    """The linear (``aten.linear`` or quantized) an attention input comes from, through layout ops, per-head norms and
    RoPE (whose q output comes from its first input and k output from its second); ``path`` collects the
    layout nodes passed. None when the chain is anything else, or when a node on it has another
    reader (that reader would get this rank's slice instead of the whole tensor)."""
    while isinstance(node, fx.Node):
        if len(node.users) != 1 and (is_linear(node) or node.target in LAYOUT_OPS):
            return None  # another reader would see this rank's slice only: leave the projection whole
        if is_linear(node):
            return node
        if node.target in LAYOUT_OPS:
            path.append(node)
            node = node.args[0]
            continue
        if node.target == ad.torch_rmsnorm.default and _per_head(node):  # Qwen3's q/k norms
            node = node.args[0]
            continue
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            rope = node.args[0]
            if rope.op == "call_function" and rope.target in ROPE_OPS and node.args[1] in (0, 1):
                node = rope.args[node.args[1]]
                continue
        return None
    return None


# Ops that cut the last (per-head feature) dim into parts, read through getitem: their dim argument's index
_SPLITS = {aten.split_with_sizes.default: 2, aten.split.Tensor: 2, aten.chunk.default: 2}

# Reductions (-> the position of their dims argument) that are per head when they run over the
# last dim of a ``[b, s, heads, d]`` value: a norm written out (``q * rsqrt(mean(q * q, -1) + eps)``)
_REDUCTIONS = {aten.mean.dim: 1, aten.sum.dim_IntList: 1, aten.amax.default: 1, aten.linalg_vector_norm.default: 2}
# Ops that only reinterpret the last dim (complex RoPE: pairs of features as complex numbers)
_COMPLEX_VIEWS = (aten.view_as_real.default, aten.view_as_complex.default)


@dataclass
class Cut:
    """Where a walk from an attention input met a block cut out of a fused projection's flat
    features (Phi-3's ``qkv_proj`` sliced into ``[q | k | v]``): the cutting node (a slice, or a
    getitem of a split), the split, the block's ``[start, end)`` of the projection's features, and the
    projection."""

    node: fx.Node
    split: Optional[fx.Node]
    start: int
    end: int
    linear: fx.Node


def head_source(starts: Sequence[fx.Node], sink: Union[fx.Node, Collection[fx.Node]], heads: Optional[int] = None,
                norms: Optional[List[fx.Node]] = None, cuts: Optional[List[Cut]] = None
                ) -> Optional[Tuple[fx.Node, List[fx.Node]]]:
    """The one linear that the per-head inputs ``starts`` of ``sink`` (one node, or several: an
    attention and the activation of an output gate computed from the same projection) are computed
    from, through ops that keep each head's values to that head (the module docstring's list; the
    element-wise ones only when ``heads``, the starts' head count, is given; norms over all heads
    only when ``norms`` collects them), and the layout nodes on the way. MLA's query takes this shape:
    ``q_b_proj`` -> heads -> split into a nope and a rope part -> RoPE on one -> concatenated ->
    sliced again into ``q_nope`` and ``q_pe``; Qwen3-Next's query and output gate are the two halves
    of each head of ``q_proj``. None when anything else is on the way, when the inputs come from
    several linears, or when a value on the way has a reader outside it (which would see this rank's
    heads only: also how an element-wise operand computed from the projection itself is refused).
    With ``cuts``, a block cut out of a projection's flat features ends the walk there (collected;
    ``cuts_cover`` checks that the blocks make up the projection)."""
    sinks = {sink} if isinstance(sink, fx.Node) else set(sink)
    visited: set = set()
    passthrough: set = set()  # multi-output ops entered through one output (RoPE: q or k)
    linears: List[fx.Node] = []
    found_norms: List[fx.Node] = []
    stack = list(starts)
    while stack:
        node = stack.pop()
        if not isinstance(node, fx.Node):
            return None
        if node in visited:
            continue
        visited.add(node)
        if is_linear(node):
            linears.append(node)
            continue
        if norms is not None and all_features_norm(node):
            found_norms.append(node)
            stack.append(node.args[0])
            continue
        cut = block_cut(node) if cuts is not None else None
        if cut is not None:
            cuts.append(cut)  # type: ignore[union-attr]
            linears.append(cut.linear)
            continue
        inputs = _head_inputs(node, heads, passthrough, visited)
        if inputs is None:
            return None
        stack.extend(inputs)
    if len(set(linears)) != 1:
        return None
    if any(u not in visited and u not in sinks and u not in passthrough for n in visited for u in n.users):
        return None
    if norms is not None:
        norms.extend(found_norms)
    return linears[0], [n for n in visited if n.target in LAYOUT_OPS]


def block_cut(node: fx.Node) -> Optional[Cut]:
    """The block ``node`` cuts out of a linear's output features (through a clamp or a cast, DBRX
    clamps its fused ``Wqkv``, or an unsqueeze before the features, GPT-BigCode's): a slice of the
    last dim, or a getitem of a split or chunk of it; None for anything else (a view on the way, into
    heads or otherwise, ends it: then the last dim is not the projection's features)."""
    split = None
    if node.target == aten.slice.Tensor and _arg(node, 4, 1) == 1:
        source, dim, start, end = node.args[0], _arg(node, 1, 0), _arg(node, 2, 0), _arg(node, 3, None)
    elif node.target is operator.getitem and getattr(node.args[0], "target", None) in _SPLITS:
        split = node.args[0]
        source, dim = split.args[0], _arg(split, _SPLITS[split.target], 0)
        start = end = None
    else:
        return None
    value = source.meta.get("val") if isinstance(source, fx.Node) else None
    if not _last_dim(source, dim) or not isinstance(value, torch.Tensor):
        return None
    features = value.shape[-1]
    if type(features) is not int:
        return None
    if split is not None:
        sizes = _split_sizes(split, features)
        if sizes is None:
            return None
        index = node.args[1]
        start, end = sum(sizes[:index]), sum(sizes[:index + 1])
    if not isinstance(start, int) or not isinstance(end, (int, type(None))):
        return None
    end = features if end is None else min(end, features)
    linear = source
    while not is_linear(linear):  # ops of one input between the projection and the cut, features kept last
        if linear.target not in _CUT_PASSTHROUGH or len(linear.users) != 1 or (
                linear.target == aten.unsqueeze.default and _arg(linear, 1, 0) in (-1, linear.meta["val"].dim() - 1)):
            return None
        linear = linear.args[0]
    out = linear.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.shape[-1] != features:
        return None
    return Cut(node, split, start, end, linear) if 0 <= start < end else None


def cuts_cover(cuts: List[Cut]) -> bool:
    """``cuts`` are blocks of one float linear's output (through the same value), nothing else reads
    that value, and together they cover its features exactly once."""
    linear = cuts[0].linear
    if any(c.linear is not linear for c in cuts) or linear.target != aten.linear.default:
        return False
    cutters = {c.split if c.split is not None else c.node for c in cuts}
    sources = {n.args[0] for n in cutters}  # the value cut (the linear's output, or a clamp of it)
    ordered = sorted(cuts, key=lambda c: c.start)
    features = linear.meta["val"].shape[-1] if "val" in linear.meta else None
    if len(sources) != 1 or set(next(iter(sources)).users) != cutters:
        return False
    return (ordered[0].start == 0 and ordered[-1].end == features
            and all(a.end == b.start for a, b in zip(ordered, ordered[1:])))


# one-input element-wise ops allowed between a fused projection and its cuts
_CUT_PASSTHROUGH = (aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten._to_copy.default,
                    aten.unsqueeze.default)


def _split_sizes(split: fx.Node, features: int) -> Optional[List[int]]:
    """The block sizes a split or chunk of ``features`` produces."""
    if split.target == aten.split_with_sizes.default:
        return list(split.args[1])
    size = split.args[1] if split.target == aten.split.Tensor else -(-features // split.args[1])
    if not isinstance(size, int) or size <= 0:
        return None
    return [min(size, features - i) for i in range(0, features, size)]


def _head_inputs(node: fx.Node, heads: Optional[int], passthrough: set, visited: set) -> Optional[List[object]]:
    """The inputs of ``node`` that carry per-head values when ``node`` keeps each head's values to
    that head (RoPE entered through one output goes to ``passthrough``, a split read through a
    getitem to ``visited``); None when it does not."""
    value = node.meta.get("val")
    if heads is not None and isinstance(value, torch.Tensor) and value.dim() >= 4 and not any(
            type(d) is int and d == heads for d in value.shape[:-1]):
        return None  # a per-group view that is not the heads (CodeGen's ``mp_num`` blocks): not followed
    target = node.target
    if target in LAYOUT_OPS or target in _COMPLEX_VIEWS:
        return [node.args[0]]
    if target == ad.torch_rmsnorm.default and _per_head(node):
        return [node.args[0]]
    if target == aten.layer_norm.default and _per_head_layer_norm(node):
        return [node.args[0]]
    if target in _REDUCTIONS and _reduces_head_features(node):
        return [node.args[0]]
    if target == aten.slice.Tensor and _head_features(node.args[0], node.args[1]):
        return [node.args[0]]
    if target == aten.cat.default and _head_features(node.args[0][0], _arg(node, 1, 0)):
        return list(node.args[0])
    if target == aten.stack.default and _stacks_features(node):
        return list(node.args[0])
    if target == aten.select.int and heads is not None and _selects_inside_heads(node, heads):
        return [node.args[0]]
    if target is operator.getitem and isinstance(node.args[0], fx.Node):
        source, index = node.args
        if source.target in ROPE_OPS and index in (0, 1):
            passthrough.add(source)
            return [source.args[index]]
        if source.target in _SPLITS and _head_features(source.args[0], _arg(source, _SPLITS[source.target], 0)):
            visited.add(source)
            return [source.args[0]]
        return None
    if target in ELEMENTWISE and heads is not None:
        operands = [a for a in (*node.args, *node.kwargs.values()) if isinstance(a, fx.Node)]
        per_head = [a for a in operands if not _same_for_every_head(a, node, heads)]
        return per_head or None
    return None


def _same_for_every_head(operand: fx.Node, out: fx.Node, heads: int) -> bool:
    """``operand`` of an element-wise op with output ``out`` broadcasts over the heads: in ``out``'s
    ``[b, s, heads, d]``-like value its size is 1 (or absent) wherever ``out`` has ``heads`` elements,
    and in a flat ``[b, s, heads * d]`` value on the last dim. A dim that only happens to equal the
    head count (the head size) counts too: refusing is the safe side."""
    value, other = out.meta.get("val"), operand.meta.get("val")
    if not isinstance(value, torch.Tensor) or not isinstance(other, torch.Tensor) or other.dim() > value.dim():
        return False
    if value.dim() == 3:
        return other.dim() == 0 or other.shape[-1] == 1
    if value.dim() != 4:
        return False
    for i in range(1, value.dim() + 1):
        size = other.shape[-i] if i <= other.dim() else 1
        if type(value.shape[-i]) is int and value.shape[-i] == heads and size != 1:
            return False
    return True


def _per_head_layer_norm(node: fx.Node) -> bool:
    """A LayerNorm over each head's features of a ``[b, s, heads, d]`` value (Persimmon's q/k norms):
    its weight and bias, ``[d]``, are the same for every head."""
    value = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    return (isinstance(value, torch.Tensor) and value.dim() == 4 and list(node.args[1]) == [value.shape[-1]]
            and len(node.users) == 1)


def _reduces_head_features(node: fx.Node) -> bool:
    """A reduction over the last dim alone of a ``[b, s, heads, d]`` value."""
    dims = _arg(node, _REDUCTIONS[node.target], None)
    dims = [dims] if isinstance(dims, int) else dims
    return isinstance(dims, (list, tuple)) and len(dims) == 1 and _head_features(node.args[0], dims[0])


def _selects_inside_heads(node: fx.Node, heads: int) -> bool:
    """``select`` on a dim after the heads dim of a ``[b, s, heads, 3, d]`` value (Persimmon's fused
    projection viewed head by head, then q, k and v selected): each head keeps its own values."""
    value = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() != 5 or not isinstance(node.args[1], int):
        return False
    dim = node.args[1] % 5
    sizes = list(value.shape)
    return sizes[dim] != heads and any(type(d) is int and d == heads for d in sizes[1:dim])


def _stacks_features(node: fx.Node) -> bool:
    """``stack`` of ``[b, s, heads, d]`` values on a new last dim (interleaved RoPE's
    ``stack([-x2, x1], -1)``): each head's values stay with it."""
    values = node.args[0]
    dim = _arg(node, 1, 0)
    first = values[0].meta.get("val") if values and isinstance(values[0], fx.Node) else None
    return first is not None and first.dim() == 4 and dim in (-1, 4)


def all_features_norm(node: fx.Node) -> bool:
    """An RMSNorm over all the features of a flat ``[b, s, features]`` (or ``[tokens, features]``)
    value with a stored weight (OLMo-2's q/k norms over all heads, BitNet's norms before a row-split
    projection): splits with the features as a norm whose mean of squares is summed over ranks."""
    if node.target != ad.torch_rmsnorm.default or len(node.users) != 1:
        return False
    value, weight = node.args[0].meta.get("val"), node.args[1]
    return (isinstance(value, torch.Tensor) and value.dim() in (2, 3) and isinstance(weight, fx.Node)
            and weight.op == "get_attr")


def _last_dim(value: object, dim: object) -> bool:
    """``dim`` names the last dim of ``value``'s tensor (the per-head features)."""
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return isinstance(dim, int) and val is not None and dim in (-1, val.dim() - 1)


def _head_features(value: object, dim: object) -> bool:
    """``dim`` is the per-head feature dim of a ``[b, s, heads, d]`` (or ``[b, heads, s, d]``) value: a
    cut there keeps each head's values to its head. On ``[b, s, heads * d]`` it would not: a fused
    ``[q | gate]`` projection chunked before its view into heads has all of q in its first half of
    features, which a split by ranks would hand to the first ranks alone."""
    val = value.meta.get("val") if isinstance(value, fx.Node) else None
    return _last_dim(value, dim) and val is not None and val.dim() == 4


def _per_head(norm: fx.Node) -> bool:
    """A norm over each head's features alone (input ``[b, s, heads, head_dim]``): it commutes with a
    split by heads. A norm over all heads' features (OLMo-2's q/k norms) does not."""
    val = norm.args[0].meta.get("val") if isinstance(norm.args[0], fx.Node) else None
    return val is not None and val.dim() == 4 and len(norm.users) == 1


# Gate activations of a per-head attention output gate (HY-V4: ``o * sigmoid(gate_proj(x))``;
# Laguna's per-head scalar gate: ``o * softplus(g_proj(x))[..., None]``)
GATE_ACTIVATIONS = (aten.sigmoid.default, aten.softplus.default)


def _static_dims(node: fx.Node, first: int) -> Optional[Tuple[int, ...]]:
    """The dims of ``node``'s value from ``first`` on, when all of them are plain ints."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() <= first:
        return None
    dims = tuple(value.shape[first:])
    return dims if all(type(d) is int for d in dims) else None


@dataclass
class OutputGate:
    """A per-head output gate on the way from an attention op to its output projection: its
    activation, the activation's input, and the gate's own linear (split by output features with
    the heads) with the layout nodes between them; ``linear`` None when the gate is not a linear's
    output through layout ops alone (Qwen3-Next's: a half of each head of the query projection,
    which ``head_source`` follows together with the query)."""

    activation: fx.Node
    start: fx.Node
    linear: Optional[fx.Node]
    chain: List[fx.Node]


def output_gate(node: fx.Node, mul: fx.Node) -> Optional[OutputGate]:
    """The gate when ``mul`` multiplies ``node`` (an attention output, ``[b, s, heads, d]`` or
    ``[b, s, heads * d]``) by ``sigmoid(...)`` of the same shape, or a ``[b, s, heads, d]`` output by
    one value per head, ``act(linear(x))[..., None]`` (Laguna, LFM3, Bailing: the gate projection
    has one output per head): each head's output by its own head's gate values. None for anything
    else (a gate broadcast over the heads is not split with them)."""
    if mul.target != aten.mul.Tensor or len(mul.args) != 2 or mul.kwargs:
        return None
    other = mul.args[1] if mul.args[0] is node else mul.args[0] if mul.args[1] is node else None
    heads = _static_dims(node, 2)
    per_head_value = (isinstance(other, fx.Node) and other.target == aten.unsqueeze.default
                      and _arg(other, 1, None) in (-1, 3) and len(other.users) == 1)
    if per_head_value:
        if heads is None or len(heads) != 2 or _static_dims(other.args[0], 2) != heads[:1]:
            return None
        other = other.args[0]
    if not isinstance(other, fx.Node) or other is node or other.target not in GATE_ACTIVATIONS:
        return None
    if per_head_value:
        shape_ok = _static_dims(mul, 2) == heads
    else:
        shape_ok = heads is not None and _static_dims(other, 2) == heads and _static_dims(mul, 2) == heads
    if len(other.users) != 1 or not shape_ok:
        return None
    chain: List[fx.Node] = []
    linear = producing_linear(other.args[0], chain)
    if linear is None and per_head_value:
        return None  # one value per head computed some other way: not followed
    return OutputGate(other, other.args[0], linear, chain if linear is not None else [])


def consuming_linear(node: fx.Node, path: List[fx.Node], gates: Optional[List[OutputGate]] = None,
                     norms: Optional[List[fx.Node]] = None) -> Optional[fx.Node]:
    """The linear the attention output feeds, through single-user layout ops (and, when ``gates``
    collects them, per-head output gates: ``output_gate``; when ``norms`` does, norms over all heads'
    features: BitNet's ``attn_sub_norm``)."""
    while len(node.users) == 1:
        (user,) = node.users
        if is_linear(user) and user.args[0] is node:
            return user
        gate = output_gate(node, user) if gates is not None else None
        if gate is not None:
            gates.append(gate)  # type: ignore[union-attr]
            node = user
            continue
        if norms is not None and user.args[0] is node and all_features_norm(user):
            norms.append(user)
            node = user
            continue
        if user.target not in LAYOUT_OPS:
            return None
        path.append(user)
        node = user
    return None
