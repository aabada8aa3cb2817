"""Graph cleanups that make export IR canonical enough to pattern-match.

Each function rewrites a graph in place and returns how many nodes it removed. They are the
bodies of the post-export cleanup transforms and are also applied to traced pattern graphs,
so a pattern and the model graph it should match look the same.

All of them only remove a node when its output is provably the same tensor value as one of its
inputs (same shape, same dtype, no mutation of either), using the shapes from ``meta['val']``.
"""

from typing import Any, Optional

import torch
from torch import fx
from torch._prims_common import is_contiguous_or_false as definitely_contiguous
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .graph_utils import arg, eliminate_dead_code, is_op, val

aten = torch.ops.aten

INT64_MAX = 2**63 - 1


def _same_meta(a: Any, b: Any) -> bool:
    """Same dtype, device, shape and strides (a later ``view`` may depend on the layout)."""
    va, vb = val(a), val(b)
    if not isinstance(va, torch.Tensor) or not isinstance(vb, torch.Tensor):
        return False
    if va.dtype != vb.dtype or va.device != vb.device or va.dim() != vb.dim():
        return False
    if not all(statically_known_true(x == y) for x, y in zip(va.shape, vb.shape)):
        return False
    # strides only matter along dims longer than one
    return all(
        statically_known_true(size == 1) or statically_known_true(x == y)
        for size, x, y in zip(va.shape, va.stride(), vb.stride())
    )


def _view_base(node: Any) -> Any:
    """The node whose storage ``node`` aliases (itself unless it is a view op's output)."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.arguments or schema.arguments[0].alias_info is None:
            break
        if schema.arguments[0].alias_info.is_write:
            break
        node = node.args[0]
    return node


def _mutated_bases(graph: fx.Graph) -> set:
    """Storages some op writes into (in-place or ``out=``), as their base nodes."""
    bases = set()
    for user in graph.nodes:
        schema = getattr(user.target, "_schema", None) if user.op == "call_function" else None
        if schema is None or not schema.is_mutable:
            continue
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                value = user.args[i] if i < len(user.args) else user.kwargs.get(a.name)
                if isinstance(value, fx.Node):
                    bases.add(_view_base(value))
    return bases


def _replace_if_identity(node: fx.Node, source: Any) -> bool:
    if not isinstance(source, fx.Node) or not _same_meta(node, source):
        return False
    mutated = _mutated_bases(node.graph)
    if mutated and (_view_base(node) in mutated or _view_base(source) in mutated):
        return False
    node.replace_all_uses_with(source)
    node.graph.erase_node(node)
    return True


def remove_assert_metadata(gm: fx.GraphModule) -> int:
    """Drop ``aten._assert_tensor_metadata``: export's dtype checks, which block matching."""
    count = 0
    for node in list(gm.graph.nodes):
        if is_op(node, aten._assert_tensor_metadata):
            gm.graph.erase_node(node)
            count += 1
    return count


CAST_OPS = (aten.to, aten._to_copy, torch.ops.prims.convert_element_type)
_CAST_KEEP_KWARGS = ("dtype", "layout", "device", "pin_memory", "non_blocking", "memory_format", "copy")


def remove_identity_casts(gm: fx.GraphModule) -> int:
    """Drop casts to the dtype the tensor already has that change nothing else either."""
    count = 0
    for node in list(gm.graph.nodes):
        if not is_op(node, CAST_OPS):
            continue
        if node.kwargs.get("copy", False) or (node.kwargs.get("memory_format") not in (None, torch.preserve_format)):
            continue
        if is_op(node, aten.to) and any(isinstance(a, bool) and a for a in node.args[2:]):
            continue  # positional non_blocking/copy flags
        if _replace_if_identity(node, node.args[0]):
            count += 1
    for node in list(gm.graph.nodes):
        # type_as(x, other) is a cast to other's dtype
        if is_op(node, aten.type_as) and _replace_if_identity(node, node.args[0]):
            count += 1
    return count


def remove_noop_slices(gm: fx.GraphModule) -> int:
    """``x[..., 0:end]`` covering the whole dim (incl. ``end = INT64_MAX``) is ``x``."""
    count = 0
    for node in list(gm.graph.nodes):
        if not is_op(node, aten.slice.Tensor):
            continue
        start, step = arg(node, 2, "start", 0), arg(node, 4, "step", 1)
        if start not in (0, None) or step != 1:
            continue
        if _replace_if_identity(node, node.args[0]):
            count += 1
    return count


def _is_scalar(x: Any, value: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == value


def remove_noop_arithmetic(gm: fx.GraphModule, ops: str = "add") -> int:
    """``x + 0``, ``x - 0`` (``ops='add'``) or ``x * 1``, ``x / 1`` (``ops='mul'``) is ``x``
    when the result keeps x's dtype and shape (so ``int + 0.0`` stays)."""
    targets = (aten.add, aten.sub) if ops == "add" else (aten.mul, aten.div)
    neutral = 0 if ops == "add" else 1
    count = 0
    for node in list(gm.graph.nodes):
        if not is_op(node, targets) or len(node.args) < 2:
            continue
        if node.kwargs.get("alpha", 1) != 1 or node.kwargs.get("rounding_mode") is not None:
            continue
        lhs, rhs = node.args[0], node.args[1]
        source: Optional[Any] = None
        if _is_scalar(rhs, neutral):
            source = lhs
        elif is_op(node, (aten.add, aten.mul)) and _is_scalar(lhs, neutral):
            source = rhs
        if source is not None and _replace_if_identity(node, source):
            count += 1
    return count


VIEW_OPS = (aten.view, aten.reshape, aten._unsafe_view, aten.alias, aten.expand)


def remove_noop_views(gm: fx.GraphModule) -> int:
    """View-like ops whose result has the input's shape and dtype (``alias``, ``view``/
    ``reshape``/``expand`` to the same shape, a transpose undone by the same transpose), and
    ``contiguous`` of a tensor that already is (a later ``view`` may rely on the layout, so
    only a provably contiguous input qualifies)."""
    count = 0
    for node in list(gm.graph.nodes):
        if is_op(node, aten.contiguous):
            source_val = val(node.args[0])
            if not isinstance(source_val, torch.Tensor) or not definitely_contiguous(source_val):
                continue
        elif is_op(node, aten.transpose.int) and is_op(node.args[0], aten.transpose.int):
            # transpose(transpose(x, a, b), a, b) is x
            inner = node.args[0]
            rank = inner.args[0].meta["val"].dim() if "val" in inner.args[0].meta else None
            if rank is None:
                continue
            dims = lambda n: {n.args[1] % rank, n.args[2] % rank}  # noqa: E731
            if dims(node) != dims(inner) or not _replace_if_identity(node, inner.args[0]):
                continue
            count += 1
            continue
        elif not is_op(node, VIEW_OPS):
            continue
        if _replace_if_identity(node, node.args[0]):
            count += 1
    return count


def remove_add_zero(gm: fx.GraphModule) -> int:
    return remove_noop_arithmetic(gm, "add")


def remove_mul_one(gm: fx.GraphModule) -> int:
    return remove_noop_arithmetic(gm, "mul")


def cleanup_for_matching(gm: fx.GraphModule) -> int:
    """Every cleanup above, in an order where each enables the next; then dead-code removal."""
    total = remove_assert_metadata(gm)
    total += remove_identity_casts(gm)
    total += remove_noop_slices(gm)
    total += remove_add_zero(gm)
    total += remove_mul_one(gm)
    total += remove_noop_views(gm)
    eliminate_dead_code(gm)
    gm.recompile()
    return total
