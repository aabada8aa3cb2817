"""Which FX nodes are element-wise, and the maximal fusible subgraphs they form.

No xDSL here: this module only reads the FX graph, so the transform can decide what it would
fuse (and log it) before it needs the compiler side.

A node is a *candidate* when its target is in ``ELEMENTWISE`` (the aten ops that
``lower.py`` knows how to decompose), its output is a tensor of one of the target's float
dtypes on the target's device (``Target``: float32 for the C++ kernels; float32, bfloat16 and
float16 for Triton), every non-tensor argument is a plain Python number, and every tensor
operand is of those dtypes (bool for ``where``'s condition) with a shape that reaches the
output shape by one of the broadcasts the generated kernels index directly (``Access``):

- ``FULL``: the output's shape (the same symbolic sizes);
- ``ROW``: the output's last dim alone (``[D]``, ``[1, 1, D]``), broadcast along leading dims;
- ``COL``: the output's shape with last dim 1 (``[B, S, 1]``), broadcast along the last dim;
- ``SCALAR``: one element (a 0-d tensor, ``[1]``, ``[1, 1]``).

Anything else (``[B, 1, D]`` against ``[B, S, D]``, another dtype, a symbolic scalar argument)
leaves the node alone. A subgraph is a connected set of candidates with one output
shape (so the kernel computes each value once per element, never a broadcast intermediate
``D`` times); merging is refused when it would make a cycle (a path from the subgraph out
through another node and back in), checked over the groups formed so far.
"""

import enum
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import fx

aten = torch.ops.aten


class Access(str, enum.Enum):
    """How a kernel input is indexed over the output's ``[outer, inner]`` view."""

    FULL = "full"
    ROW = "row"
    COL = "col"
    SCALAR = "scalar"


@dataclass(frozen=True)
class OpSpec:
    """How to read one aten overload: the name ``lower.py`` decomposes, which positional args
    are values, and which extra args (``alpha``, gelu's ``approximate``...) it needs."""

    name: str
    operands: Tuple[int, ...]  # positional args that are values (tensor or number)
    params: Tuple[Tuple[str, int, Any], ...] = ()  # (name, position, default) of extra args


_BIN = (0, 1)
_ALPHA = (("alpha", 2, 1),)
ELEMENTWISE: Dict[Any, OpSpec] = {
    aten.add.Tensor: OpSpec("add", _BIN, _ALPHA),
    aten.add.Scalar: OpSpec("add", _BIN, _ALPHA),
    aten.sub.Tensor: OpSpec("sub", _BIN, _ALPHA),
    aten.sub.Scalar: OpSpec("sub", _BIN, _ALPHA),
    aten.rsub.Scalar: OpSpec("rsub", _BIN, _ALPHA),
    aten.rsub.Tensor: OpSpec("rsub", _BIN, _ALPHA),
    aten.mul.Tensor: OpSpec("mul", _BIN),
    aten.mul.Scalar: OpSpec("mul", _BIN),
    aten.div.Tensor: OpSpec("div", _BIN),
    aten.div.Scalar: OpSpec("div", _BIN),
    aten.maximum.default: OpSpec("maximum", _BIN),
    aten.minimum.default: OpSpec("minimum", _BIN),
    aten.pow.Tensor_Scalar: OpSpec("pow", _BIN),
    aten.neg.default: OpSpec("neg", (0,)),
    aten.exp.default: OpSpec("exp", (0,)),
    aten.tanh.default: OpSpec("tanh", (0,)),
    aten.sigmoid.default: OpSpec("sigmoid", (0,)),
    aten.silu.default: OpSpec("silu", (0,)),
    aten.gelu.default: OpSpec("gelu", (0,), (("approximate", 1, "none"),)),
    aten.relu.default: OpSpec("relu", (0,)),
    aten.rsqrt.default: OpSpec("rsqrt", (0,)),
    aten.sqrt.default: OpSpec("sqrt", (0,)),
    aten.reciprocal.default: OpSpec("reciprocal", (0,)),
    aten.erf.default: OpSpec("erf", (0,)),
    aten.log.default: OpSpec("log", (0,)),
    aten.abs.default: OpSpec("abs", (0,)),
    aten.clamp.default: OpSpec("clamp", (0,), (("min", 1, None), ("max", 2, None))),
    aten.where.self: OpSpec("where", (0, 1, 2)),
    # casts between the target's float dtypes (a cast to any other dtype is a boundary)
    aten._to_copy.default: OpSpec("identity", (0,)),
    aten.to.dtype: OpSpec("identity", (0,)),
}


@dataclass(frozen=True)
class Target:
    """What the generated kernels can read and write: the device type and the float dtypes."""

    device: str = "cpu"
    dtypes: Tuple[torch.dtype, ...] = (torch.float32,)


CPP_TARGET = Target("cpu", (torch.float32,))
# Triton kernels compute in float32 and round each op's result to its own dtype, as aten does; their
# device is the model's (CUDA, or CPU in Triton's interpreter)
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class Group:
    """One fusible subgraph: members in graph order, external inputs in first-use order, and
    the members whose values are used outside (the kernel's outputs)."""

    nodes: List[fx.Node]
    inputs: List[fx.Node] = field(default_factory=list)
    access: List[Access] = field(default_factory=list)
    outputs: List[fx.Node] = field(default_factory=list)


def _dims(shape: Sequence[Any]) -> Tuple[str, ...]:
    return tuple(str(d) for d in shape)


def access_of(operand_shape: Sequence[Any], out_shape: Sequence[Any]) -> Optional[Access]:
    """How an operand of ``operand_shape`` reaches ``out_shape``; None when no kernel pattern fits."""
    o, i = _dims(out_shape), _dims(operand_shape)
    if all(d == "1" for d in i):
        return Access.SCALAR
    if i == o:
        return Access.FULL
    stripped = i
    while stripped and stripped[0] == "1":
        stripped = stripped[1:]
    if o and stripped == o[-1:]:
        return Access.ROW
    padded = ("1",) * (len(o) - len(i)) + i
    if len(padded) == len(o) and o and padded[-1] == "1" and padded[:-1] == o[:-1] and o[-1] != "1":
        return Access.COL
    return None


def _tensor_val(node: Any) -> Optional[torch.Tensor]:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _arg(node: fx.Node, pos: int, name: str, default: Any) -> Any:
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default)


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Number) and not isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool))


def is_candidate(node: fx.Node, target: Target = CPP_TARGET) -> bool:
    """A supported element-wise op of ``target``'s dtypes whose operands the kernels can index."""
    spec = ELEMENTWISE.get(node.target) if node.op == "call_function" else None
    out = _tensor_val(node)
    if spec is None or out is None or out.dtype not in target.dtypes or out.device.type != target.device:
        return False
    if node.target in (aten._to_copy.default, aten.to.dtype):
        extra = set(node.kwargs) - {"dtype"}
        if extra or len(node.args) > 2:  # layout/device/memory_format changes: not a plain cast
            return False
    for name, pos, default in spec.params:
        value = _arg(node, pos, name, default)
        if value is not None and not isinstance(value, str) and not _is_number(value):
            return False
    if spec.name == "gelu" and _arg(node, 1, "approximate", "none") not in ("none", "tanh"):
        return False
    for k, pos in enumerate(spec.operands):
        if pos >= len(node.args):
            return False
        value = node.args[pos]
        if isinstance(value, fx.Node):
            v = _tensor_val(value)
            want = (torch.bool,) if (spec.name == "where" and k == 0) else target.dtypes
            if v is None or v.dtype not in want or access_of(v.shape, out.shape) is None:
                return False
        elif not _is_number(value):
            return False
    return True


def _shape_key(node: fx.Node) -> Tuple[str, ...]:
    return _dims(node.meta["val"].shape)


class _Partitioner:
    """Greedy merging in graph order with a cycle check over the group graph."""

    def __init__(self) -> None:
        self.parent: Dict[int, int] = {}
        self.group_of: Dict[fx.Node, int] = {}
        self.reach: Dict[fx.Node, Set[int]] = {}  # groups a non-member depends on
        self.deps: Dict[int, Set[int]] = {}  # groups a group depends on through outside nodes

    def find(self, g: int) -> int:
        while self.parent[g] != g:
            self.parent[g] = self.parent[self.parent[g]]
            g = self.parent[g]
        return g

    def _closure(self, seeds: Set[int]) -> Set[int]:
        seen: Set[int] = set()
        todo = [self.find(g) for g in seeds]
        while todo:
            g = todo.pop()
            if g in seen:
                continue
            seen.add(g)
            todo.extend(self.find(d) for d in self.deps[g])
        return seen

    def _operand_reach(self, p: fx.Node) -> Set[int]:
        if p in self.group_of:
            return {self.find(self.group_of[p])}
        return self.reach.get(p, set())

    def visit(self, node: fx.Node, candidate: bool) -> None:
        operands = [p for p in node.all_input_nodes]
        if not candidate:
            acc: Set[int] = set()
            for p in operands:
                acc |= self._operand_reach(p)
            self.reach[node] = acc
            return
        key = _shape_key(node)
        joinable = {self.find(self.group_of[p]) for p in operands
                    if p in self.group_of and _shape_key(p) == key}
        outside = [p for p in operands if not (p in self.group_of and self.find(self.group_of[p]) in joinable)]
        ext: Set[int] = set()
        for p in outside:
            ext |= self._operand_reach(p)
        # drop groups that a path through outside nodes (or another joined group's deps) reaches
        while joinable:
            seeds = set(ext)
            for g in joinable:
                seeds |= self.deps[g]
            bad = self._closure(seeds) & joinable
            if not bad:
                break
            joinable -= bad
            outside = [p for p in operands if not (p in self.group_of and self.find(self.group_of[p]) in joinable)]
            ext = set()
            for p in outside:
                ext |= self._operand_reach(p)
        gid = len(self.parent)
        self.parent[gid] = gid
        self.deps[gid] = set(ext)
        for g in joinable:
            self.parent[g] = gid
            self.deps[gid] |= self.deps[g]
        self.deps[gid] = {self.find(d) for d in self.deps[gid]} - {gid}
        self.group_of[node] = gid


def find_groups(graph: fx.Graph, min_ops: int = 2, target: Target = CPP_TARGET) -> List[Group]:
    """The maximal fusible subgraphs of ``graph`` with at least ``min_ops`` nodes, in graph order."""
    part = _Partitioner()
    order: List[fx.Node] = list(graph.nodes)
    for node in order:
        part.visit(node, is_candidate(node, target))
    members: Dict[int, List[fx.Node]] = {}
    for node in order:
        if node in part.group_of:
            members.setdefault(part.find(part.group_of[node]), []).append(node)
    groups = []
    for nodes in members.values():
        if len(nodes) < min_ops:
            continue
        inside = set(nodes)
        group = Group(nodes=nodes)
        out_shape = nodes[0].meta["val"].shape
        for n in nodes:
            for p in n.all_input_nodes:
                if p not in inside and p not in group.inputs:
                    group.inputs.append(p)
                    group.access.append(access_of(p.meta["val"].shape, out_shape))
            if any(u not in inside for u in n.users):
                group.outputs.append(n)
        groups.append(group)
    return groups
