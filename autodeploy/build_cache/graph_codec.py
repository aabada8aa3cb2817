"""An FX graph as JSON data, and back: no pickle, no code from the file is ever run.

Each node is ``{"op", "name", "target", "args", "kwargs"}``. Targets of ``call_function`` nodes
are named, never stored as objects: an operator by its qualified name
(``torch.ops.<ns>.<op>.<overload>``, looked up again in the op registry, only in the namespaces
of ``OP_NAMESPACES``) or one of the Python builtins in ``BUILTINS``. Arguments are JSON values;
what JSON cannot tell apart is tagged: ``{"n": name}`` a node, ``{"t": [...]}`` a tuple,
``{"l": [...]}`` a list, ``{"dtype": "float32"}``, ``{"device": "cpu"}`` and so on.

Anything else in a graph (a ``call_module`` node, a higher-order op with subgraphs, an argument
of another type) raises ``Unserializable``: the build cache then does not store that build.
Node metadata is not stored (the compile stage and the runtime do not read it), except each
placeholder's example shape, dtype and device: from them the loader makes the placeholders' fake
values again, so a transform that needs shapes after a load re-propagates them (the loaded graph
is marked as having stale shapes, see ``autodeploy.build_cache.store``).
"""

import operator
from typing import Any, Dict, List

import torch
from torch import fx
from torch._ops import OpOverload

# Namespaces whose operators a cached graph may call.
OP_NAMESPACES = ("aten", "autodeploy", "mkldnn", "prims", "_c10d_functional", "c10d", "quantized", "onednn")
# Python callables a graph may call, by the name stored for them.
BUILTINS: Dict[str, Any] = {f"operator.{name}": getattr(operator, name) for name in (
    "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "neg", "pow", "eq", "ne", "lt", "le", "gt", "ge",
    "and_", "or_", "not_")}
BUILTINS.update({"torch.sym_int": torch.sym_int, "torch.sym_float": torch.sym_float, "torch.sym_max": torch.sym_max,
                 "torch.sym_min": torch.sym_min, "torch._assert": torch._assert})
_BUILTIN_NAMES = {id(fn): name for name, fn in BUILTINS.items()}
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_LAYOUTS = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_MEMORY_FORMATS = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.memory_format)}


class Unserializable(Exception):
    """The graph holds something the build cache cannot store as data."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype '{name}'")
    return _DTYPES[name]


# ---- targets -----------------------------------------------------------------------------------
def encode_target(target: Any) -> str:
    if isinstance(target, OpOverload):
        ns = target.namespace
        if ns not in OP_NAMESPACES:
            raise Unserializable(f"operator {target} is in namespace '{ns}', not one a cached graph may call")
        packet = target.overloadpacket.__name__.split(".")[-1]
        return f"torch.ops.{ns}.{packet}.{target._overloadname}"
    name = _BUILTIN_NAMES.get(id(target))
    if name is None:
        raise Unserializable(f"call of {getattr(target, '__qualname__', target)!r} (not an operator or a known builtin)")
    return name


def decode_target(name: str) -> Any:
    if name in BUILTINS:
        return BUILTINS[name]
    parts = name.split(".")
    if len(parts) != 5 or parts[:2] != ["torch", "ops"] or parts[2] not in OP_NAMESPACES:
        raise ValueError(f"target '{name}' is neither a known builtin nor torch.ops.<ns>.<op>.<overload>")
    op = getattr(getattr(getattr(torch.ops, parts[2]), parts[3]), parts[4])
    if not isinstance(op, OpOverload):
        raise ValueError(f"target '{name}' is not an operator overload")
    return op


# ---- arguments ---------------------------------------------------------------------------------
def encode_arg(value: Any) -> Any:
    if isinstance(value, fx.Node):
        return {"n": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else {"f": repr(value)}
    if isinstance(value, tuple):
        return {"t": [encode_arg(v) for v in value]}
    if isinstance(value, list):
        return {"l": [encode_arg(v) for v in value]}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise Unserializable("a dict argument with non-string keys")
        return {"d": {k: encode_arg(v) for k, v in value.items()}}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value).removeprefix("torch.")}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).removeprefix("torch.")}
    if isinstance(value, slice):
        return {"slice": [encode_arg(value.start), encode_arg(value.stop), encode_arg(value.step)]}
    raise Unserializable(f"an argument of type {type(value).__name__}")


def decode_arg(value: Any, nodes: Dict[str, fx.Node]) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if not isinstance(value, dict) or len(value) != 1:
        raise ValueError(f"malformed argument {value!r}")
    (tag, body), = value.items()
    if tag == "n":
        return nodes[body]
    if tag == "t":
        return tuple(decode_arg(v, nodes) for v in body)
    if tag == "l":
        return [decode_arg(v, nodes) for v in body]
    if tag == "d":
        return {k: decode_arg(v, nodes) for k, v in body.items()}
    if tag == "f":
        return float(body)
    if tag == "dtype":
        return dtype_from_name(body)
    if tag == "device":
        return torch.device(body)
    if tag == "layout":
        return _LAYOUTS[body]
    if tag == "memory_format":
        return _MEMORY_FORMATS[body]
    if tag == "slice":
        return slice(*(decode_arg(v, nodes) for v in body))
    raise ValueError(f"unknown argument tag '{tag}'")


# ---- graphs ------------------------------------------------------------------------------------
def encode_graph(graph: fx.Graph) -> List[Dict[str, Any]]:
    if type(graph._codegen) is not fx.graph.CodeGen:
        raise Unserializable(f"the graph has a custom code generator ({type(graph._codegen).__name__})")
    out = []
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            target = node.target
        elif node.op == "call_function":
            target = encode_target(node.target)
        else:
            raise Unserializable(f"a {node.op} node ({node.name})")
        entry = {"op": node.op, "name": node.name, "target": target,
                 "args": encode_arg(tuple(node.args)), "kwargs": encode_arg(dict(node.kwargs))}
        if node.op == "placeholder":
            entry["example"] = _example(node.meta.get("val"))
        out.append(entry)
    return out


def _example(value: Any) -> Any:
    """A placeholder's fake value as its concrete shape hint, dtype and device (None if unknown)."""
    if not isinstance(value, torch.Tensor):
        return None
    hints = []
    for size in value.shape:
        hint = size.node.hint if isinstance(size, torch.SymInt) else size
        if not isinstance(hint, int):
            return None
        hints.append(hint)
    return {"shape": hints, "dtype": dtype_name(value.dtype), "device": str(value.device)}


def _placeholder_values(graph: fx.Graph, examples: Dict[str, Any]) -> None:
    """Fake values for the placeholders, dynamic in every dimension above 1 as the pipeline made
    them (``fake_mode.from_tensor`` of an example), so that shape propagation can run again."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    if not examples or any(e is None for e in examples.values()):
        return
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    for node in graph.nodes:
        if node.op == "placeholder":
            e = examples[node.name]
            example = torch.empty(e["shape"], dtype=dtype_from_name(e["dtype"]), device=e["device"])
            node.meta["val"] = fake_mode.from_tensor(example)


def decode_graph(data: List[Dict[str, Any]]) -> fx.Graph:
    """The graph ``encode_graph`` described; any malformed entry raises (ValueError, KeyError)."""
    graph = fx.Graph()
    nodes: Dict[str, fx.Node] = {}
    examples: Dict[str, Any] = {}
    for entry in data:
        op, name = entry["op"], entry["name"]
        args = decode_arg(entry["args"], nodes)
        kwargs = decode_arg(entry["kwargs"], nodes)
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise ValueError(f"node {name}: malformed args/kwargs")
        if op == "output":
            node = graph.output(args[0])
        elif op in ("placeholder", "get_attr"):
            if not isinstance(entry["target"], str):
                raise ValueError(f"node {name}: target must be a string")
            node = graph.create_node(op, entry["target"], args, kwargs, name=name)
            if op == "placeholder":
                examples[name] = entry.get("example")
        elif op == "call_function":
            node = graph.create_node(op, decode_target(entry["target"]), args, kwargs, name=name)
        else:
            raise ValueError(f"node {name}: op '{op}' cannot be loaded")
        if node.name != name:
            raise ValueError(f"node name {name} is not unique")
        nodes[name] = node
    graph.lint()
    _placeholder_values(graph, examples)
    return graph
