"""An FX element-wise subgraph -> an xDSL module: one ``linalg.generic`` over arith/math.

The module for ``y = x * sigmoid(x) * w + 1`` with ``w`` a ``[D]`` vector::

    func.func @kernel(%x: tensor<?x?xf32>, %w: tensor<?xf32>, %y: tensor<?x?xf32>) -> tensor<?x?xf32> {
      %r = linalg.generic {indexing_maps = [(d0, d1) -> (d0, d1), (d0, d1) -> (d1), (d0, d1) -> (d0, d1)],
                           iterator_types = ["parallel", "parallel"]} ins(%x, %w) outs(%y) {
      ^bb0(%a: f32, %b: f32, %o: f32):
        %one = arith.constant 1.0 : f32
        %n = arith.negf %a ; %e = math.exp %n ; %d = arith.addf %one, %e ; %s = arith.divf %one, %d
        %m = arith.mulf %a, %s ; %m2 = arith.mulf %m, %b ; %r = arith.addf %m2, %one
        linalg.yield %r : f32
      }
    }

The iteration space is the output viewed as ``[outer, inner]`` (inner = its last dim); each
input's indexing map says how it is read (``partition.Access``): ``(d0, d1)`` the full view,
``(d1)`` a row broadcast along leading dims, ``(d0)`` a column broadcast along the last dim,
``()`` a scalar. High-level aten ops are decomposed into the primitives the C++ emitter knows
(``cpp.PRIMITIVES``): sigmoid, silu, gelu (erf and tanh forms), relu, clamp, reciprocal, pow
by a scalar (x*x, sqrt, rsqrt, 1/x for the usual exponents), alpha of add/sub. Python scalars
become ``arith.constant`` of their float32 value, as torch rounds them for a float32 op.

Half-precision values (bfloat16/float16, Triton kernels only) are computed as aten computes
them: each input is widened (``arith.extf``) to float32, each op runs in float32 and its result
is rounded to the op's own dtype (``arith.truncf`` then ``arith.extf``), and an output leaves in
its dtype. So a fused bf16 chain rounds where the unfused graph rounds, not only at the end.
"""

import math as pymath
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
from torch import fx
from xdsl.dialects import arith, func, math
from xdsl.dialects.builtin import (DYNAMIC_INDEX, AffineMapAttr, FloatAttr, FunctionType, ModuleOp, TensorType, bf16,
                                   f16, f32, i1)
from xdsl.dialects.linalg.attrs import IteratorTypeAttr
from xdsl.dialects.linalg.ops import GenericOp, YieldOp
from xdsl.ir import Block, Operation, Region, SSAValue
from xdsl.ir.affine import AffineDimExpr, AffineExpr, AffineMap

from .partition import ELEMENTWISE, Access, Group

_D0, _D1 = AffineExpr.dimension(0), AffineExpr.dimension(1)
_MAPS = {
    Access.FULL: AffineMap(2, 0, (_D0, _D1)),
    Access.ROW: AffineMap(2, 0, (_D1,)),
    Access.COL: AffineMap(2, 0, (_D0,)),
    Access.SCALAR: AffineMap(2, 0, ()),
}
_RANK = {Access.FULL: 2, Access.ROW: 1, Access.COL: 1, Access.SCALAR: 0}


def _f32_value(x: float) -> float:
    """The float32 value torch computes with for a Python scalar in a float32 op."""
    return float(torch.tensor(float(x), dtype=torch.float32).item())


class _Body:
    """Appends primitive ops to the generic's body; values are xDSL SSA values."""

    def __init__(self) -> None:
        self.ops: List[Operation] = []
        self._consts: Dict[float, SSAValue] = {}

    def add(self, op: Operation) -> SSAValue:
        self.ops.append(op)
        return op.results[0]

    def const(self, x: float) -> SSAValue:
        x = _f32_value(x)
        key = x if not pymath.isnan(x) else "nan"
        if key not in self._consts:
            self._consts[key] = self.add(arith.ConstantOp(FloatAttr(x, f32)))
        return self._consts[key]

    def value(self, x: Any, env: Dict[fx.Node, SSAValue]) -> SSAValue:
        return env[x] if isinstance(x, fx.Node) else self.const(x)

    # primitives
    def addf(self, a: SSAValue, b: SSAValue) -> SSAValue:
        return self.add(arith.AddfOp(a, b))

    def subf(self, a: SSAValue, b: SSAValue) -> SSAValue:
        return self.add(arith.SubfOp(a, b))

    def mulf(self, a: SSAValue, b: SSAValue) -> SSAValue:
        return self.add(arith.MulfOp(a, b))

    def divf(self, a: SSAValue, b: SSAValue) -> SSAValue:
        return self.add(arith.DivfOp(a, b))

    def unary(self, op: Callable[[SSAValue], Operation], a: SSAValue) -> SSAValue:
        return self.add(op(a))

    def sigmoid(self, a: SSAValue) -> SSAValue:
        e = self.unary(math.ExpOp, self.unary(arith.NegfOp, a))
        return self.divf(self.const(1.0), self.addf(self.const(1.0), e))


def _decompose(b: _Body, name: str, vals: List[SSAValue], params: Dict[str, Any]) -> SSAValue:
    """One aten op as primitives (torch's own formulas, in its order of operations)."""
    x = vals[0]
    alpha = params.get("alpha", 1)
    if name in ("add", "sub", "rsub"):
        lhs, rhs = (vals[1], x) if name == "rsub" else (x, vals[1])
        if alpha != 1:
            rhs = b.mulf(rhs, b.const(alpha))
        return b.addf(lhs, rhs) if name == "add" else b.subf(lhs, rhs)
    if name == "mul":
        return b.mulf(x, vals[1])
    if name == "div":
        return b.divf(x, vals[1])
    if name == "maximum":
        return b.add(arith.MaximumfOp(x, vals[1]))
    if name == "minimum":
        return b.add(arith.MinimumfOp(x, vals[1]))
    if name == "where":
        return b.add(arith.SelectOp(x, vals[1], vals[2]))
    if name == "identity":
        return x
    if name == "neg":
        return b.unary(arith.NegfOp, x)
    simple = {"exp": math.ExpOp, "tanh": math.TanhOp, "rsqrt": math.RsqrtOp, "sqrt": math.SqrtOp, "erf": math.ErfOp,
              "log": math.LogOp, "abs": math.AbsFOp}
    if name in simple:
        return b.unary(simple[name], x)
    if name == "sigmoid":
        return b.sigmoid(x)
    if name == "silu":  # x / (1 + exp(-x))
        return b.divf(x, b.addf(b.const(1.0), b.unary(math.ExpOp, b.unary(arith.NegfOp, x))))
    if name == "relu":
        return b.add(arith.MaximumfOp(x, b.const(0.0)))
    if name == "reciprocal":
        return b.divf(b.const(1.0), x)
    if name == "clamp":
        if params.get("min") is not None:
            x = b.add(arith.MaximumfOp(x, b.const(params["min"])))
        if params.get("max") is not None:
            x = b.add(arith.MinimumfOp(x, b.const(params["max"])))
        return x
    if name == "pow":
        return _pow(b, x, params["exponent"])
    if name == "gelu":
        half_x = b.mulf(x, b.const(0.5))
        if params.get("approximate", "none") == "tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
            cube = b.mulf(b.mulf(x, x), x)
            inner = b.mulf(b.const(pymath.sqrt(2.0 / pymath.pi)), b.addf(x, b.mulf(b.const(0.044715), cube)))
            return b.mulf(half_x, b.addf(b.const(1.0), b.unary(math.TanhOp, inner)))
        erf = b.unary(math.ErfOp, b.mulf(x, b.const(pymath.sqrt(0.5))))
        return b.mulf(half_x, b.addf(b.const(1.0), erf))
    raise NotImplementedError(f"no decomposition for element-wise op '{name}'")


def _pow(b: _Body, x: SSAValue, e: float) -> SSAValue:
    if e == 1:
        return x
    if e == 2:
        return b.mulf(x, x)
    if e == 3:
        return b.mulf(b.mulf(x, x), x)
    if e == 0.5:
        return b.unary(math.SqrtOp, x)
    if e == -0.5:
        return b.unary(math.RsqrtOp, x)
    if e == -1:
        return b.divf(b.const(1.0), x)
    return b.add(math.PowFOp(x, b.const(e)))


_ELEMENT = {torch.float32: f32, torch.bfloat16: bf16, torch.float16: f16, torch.bool: i1}
_HALF = (torch.bfloat16, torch.float16)


def _tensor_type(access: Access, dtype: torch.dtype = torch.float32) -> TensorType:
    if dtype not in _ELEMENT:
        raise NotImplementedError(f"no kernel element type for {dtype}")
    return TensorType(_ELEMENT[dtype], [DYNAMIC_INDEX] * _RANK[access])


def _params(node: fx.Node) -> Dict[str, Any]:
    spec = ELEMENTWISE[node.target]
    out = {name: (node.args[pos] if len(node.args) > pos else node.kwargs.get(name, default))
           for name, pos, default in spec.params}
    if spec.name == "pow":
        out["exponent"] = node.args[1]
    return out


def lower_group(group: Group) -> ModuleOp:
    """The xDSL module of one fusible subgraph (inputs, then outputs, as the kernel takes them)."""
    in_dtypes = [p.meta["val"].dtype for p in group.inputs]
    out_dtypes = [n.meta["val"].dtype for n in group.outputs]
    in_types = [_tensor_type(a, d) for a, d in zip(group.access, in_dtypes)]
    out_types = [_tensor_type(Access.FULL, d) for d in out_dtypes]
    fn_block = Block(arg_types=[*in_types, *out_types])
    body_block = Block(arg_types=[t.element_type for t in [*in_types, *out_types]])
    body = _Body()
    env: Dict[fx.Node, SSAValue] = {}
    narrow: Dict[fx.Node, SSAValue] = {}  # a half-precision node's rounded value in its own type
    for p, arg, dtype in zip(group.inputs, body_block.args, in_dtypes):
        env[p] = body.add(arith.ExtFOp(arg, f32)) if dtype in _HALF else arg
    for node in group.nodes:
        spec = ELEMENTWISE[node.target]
        operands = [body.value(node.args[pos], env) if spec.name != "pow" or pos == 0 else None
                    for pos in spec.operands]
        value = _decompose(body, spec.name, [v for v in operands if v is not None], _params(node))
        dtype = node.meta["val"].dtype
        if dtype in _HALF:  # aten rounds every op's result to its dtype
            narrow[node] = body.add(arith.TruncFOp(value, _ELEMENT[dtype]))
            value = body.add(arith.ExtFOp(narrow[node], f32))
        env[node] = value
    yields = [narrow.get(n, env[n]) for n in group.outputs]
    body.ops.append(YieldOp(*yields))
    body_block.add_ops(body.ops)
    maps = [AffineMapAttr(_MAPS[a]) for a in group.access] + [AffineMapAttr(_MAPS[Access.FULL])] * len(out_types)
    generic = GenericOp(list(fn_block.args[: len(in_types)]), list(fn_block.args[len(in_types):]),
                        Region(body_block), maps, [IteratorTypeAttr.parallel()] * 2, out_types)
    fn_block.add_ops([generic, func.ReturnOp(*generic.results)])
    kernel = func.FuncOp("kernel", FunctionType.from_lists([*in_types, *out_types], out_types), Region(fn_block))
    module = ModuleOp([kernel])
    module.verify()
    return module


def map_dims(map_results: Sequence[AffineExpr]) -> Tuple[int, ...]:
    """The iteration dims an input's indexing map reads (``(0, 1)`` full, ``(1,)`` row, ``(0,)``
    column, ``()`` scalar): what the emitters index by."""
    dims = tuple(r.position for r in map_results if isinstance(r, AffineDimExpr))
    if len(map_results) != len(dims):
        raise ValueError("only dimension results are supported in the kernel's indexing maps")
    if dims not in ((), (0, 1), (1,), (0,)):
        raise ValueError(f"unsupported indexing map results {dims}")
    return dims


def generic_of(module: ModuleOp) -> GenericOp:
    """The one ``linalg.generic`` of a module made by ``lower_group``."""
    found = [op for op in module.walk() if isinstance(op, GenericOp)]
    if len(found) != 1:
        raise ValueError(f"expected one linalg.generic in the kernel module, found {len(found)}")
    return found[0]


__all__: Sequence[str] = ("lower_group", "generic_of", "map_dims")
