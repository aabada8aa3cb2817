"""Small helpers over ``torch.fx`` graphs shared by the transforms."""

import weakref
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._ops import OpOverload, OpOverloadPacket
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, statically_known_true
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ..utils.fx import get_attr_value  # noqa: F401  (transforms import it from here)
from ..utils.logging import get_logger

logger = get_logger(__name__)

OpLike = Union[OpOverload, OpOverloadPacket, Callable]


def is_op(node: Any, ops: Union[OpLike, Iterable[OpLike]]) -> bool:
    """True when ``node`` calls one of ``ops``; a packet (``aten.linear``) matches any overload."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    if not isinstance(ops, (list, tuple, set, frozenset)):
        ops = (ops,)
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    for op in ops:
        if target is op or (isinstance(op, OpOverloadPacket) and packet is op):
            return True
    return False


def nodes_calling(gm: fx.GraphModule, ops: Union[OpLike, Iterable[OpLike]]) -> List[fx.Node]:
    return [n for n in gm.graph.nodes if is_op(n, ops)]


def count_op(gm: fx.GraphModule, ops: Union[OpLike, Iterable[OpLike]]) -> int:
    return len(nodes_calling(gm, ops))


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """The argument at ``index`` or keyword ``name`` (whichever the call used)."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def val(node: Any) -> Any:
    """The fake value shape propagation stored on a node (None if unknown)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def graph_modules(mod: torch.nn.Module) -> Iterator[fx.GraphModule]:
    """The model itself if it is a GraphModule, else every GraphModule submodule."""
    if isinstance(mod, fx.GraphModule):
        yield mod
        return
    for sub in mod.modules():
        if isinstance(sub, fx.GraphModule):
            yield sub


def is_impure(node: fx.Node) -> bool:
    """FX's notion, except that random ops without mutation (dropout in an inference graph)
    are pure: a dead one only advances the RNG."""
    target = node.target
    if node.op == "call_function" and isinstance(target, OpOverload):
        if torch.Tag.nondeterministic_seeded in target.tags and not target._schema.is_mutable:
            return False
    return node.is_impure()


# Where a node came from, as export records it. A transform's new nodes take it from the node they
# replace: cached attention names a layer in its errors and finds an FP8 checkpoint's per-layer
# KV-cache scales by the attention node's ``nn_module_stack`` (insert_cached_attention), and
# ``export_to_gm.stack_traces`` is only useful to whoever debugs a graph if rewritten nodes keep theirs.
SOURCE_META = ("nn_module_stack", "source_fn_stack", "stack_trace")


def inherit_source_meta(new: fx.Node, old: fx.Node) -> None:
    """Give ``new`` the source metadata of ``old`` (what it lacks of ``SOURCE_META``)."""
    for key in SOURCE_META:
        if key in old.meta and key not in new.meta:
            new.meta[key] = old.meta[key]


@contextmanager
def nodes_created(graph: fx.Graph) -> Iterator[List[fx.Node]]:
    """The nodes ``graph`` gets inside the block, in creation order. Through the owning module's
    create-node hook (no walk of the graph, which per match made a pattern pass quadratic in its
    size); a graph without one is compared before and after instead."""
    created: List[fx.Node] = []
    module = graph.owning_module
    if module is not None and hasattr(module, "_register_create_node_hook"):
        hook = created.append
        module._register_create_node_hook(hook)
        try:
            yield created
        finally:
            module._unregister_create_node_hook(hook)
        return
    before = set(graph.nodes)
    yield created
    created.extend(n for n in graph.nodes if n not in before)


def eliminate_dead_code(gm: fx.GraphModule) -> None:
    gm.graph.eliminate_dead_code(is_impure_node=is_impure)


def canonicalize_graph(gm: fx.GraphModule) -> None:
    """Dead-code elimination, lint and recompile: the state every transform may assume."""
    eliminate_dead_code(gm)
    _delete_unused_get_attrs(gm)
    gm.graph.lint()
    gm.recompile()


def _delete_unused_get_attrs(gm: fx.GraphModule) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:
            gm.graph.erase_node(node)


_PROP_MEMO = "autodeploy_shape_prop"  # node.meta key: (inputs as last propagated, result)
_LITERALS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _same_inputs(a: Any, b: Any) -> bool:
    """Equal node inputs: tensors and symbolic values must be the very same objects (comparing
    SymInts with == would add guards), Python literals equal values."""
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_inputs(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same_inputs(a[k], b[k]) for k in a)
    if a is b:
        return True
    return type(a) is type(b) and isinstance(a, _LITERALS) and a == b


def _same_symbolic(a: Any, b: Any) -> bool:
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr  # structural, no guards
    return type(a) is type(b) and isinstance(a, int) and a == b


def _same_value_meta(a: Any, b: Any) -> bool:
    """Two fake results that no later node could tell apart (shape, strides, offset, dtype,
    device; symbolic sizes compared as expressions)."""
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_value_meta(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or (a.dtype, a.device, a.dim(), a.layout) != (b.dtype, b.device, b.dim(),
                                                                                            b.layout):
            return False
        sizes = zip((*a.shape, *a.stride(), a.storage_offset()), (*b.shape, *b.stride(), b.storage_offset()))
        return all(_same_symbolic(x, y) for x, y in sizes)
    if isinstance(a, (torch.SymInt, int)) and not isinstance(a, bool):
        return _same_symbolic(a, b)
    return False


def _fake_of(fake: Any, real: torch.Tensor) -> bool:
    """``fake`` stands for ``real`` as well as a new fake of it would (static shapes: a weight)."""
    return (isinstance(fake, torch.Tensor) and not isinstance(real, torch._subclasses.FakeTensor)
            and (fake.dtype, fake.device, fake.layout, fake.requires_grad) == (real.dtype, real.device, real.layout,
                                                                                 real.requires_grad)
            and all(isinstance(d, int) for d in (*fake.shape, *fake.stride(), fake.storage_offset()))
            and (tuple(fake.shape), fake.stride(), fake.storage_offset()) == (tuple(real.shape), real.stride(),
                                                                             real.storage_offset()))


class _FakePropWithRealAttrs(FakeTensorProp):
    """FakeTensorProp that also accepts loaded (real) parameters and buffers, and is
    incremental: a node whose target and inputs are the objects of its last propagation keeps
    its value, and a recomputed node whose new value is indistinguishable from its old one keeps
    the old object, so a local rewrite does not re-propagate everything downstream of it.

    Why: each full propagation of the 12-layer ``small`` graph took 0.5-1 s (fake dispatch
    with symbolic shapes, ~1.5 ms per node) and a build ran seven of them.
    """

    def __init__(self, module: fx.GraphModule, mode: Any, incremental: bool = True):
        super().__init__(module, mode=mode)
        self.incremental = incremental

    def run_node(self, n: fx.Node) -> Any:
        if n.op == "get_attr":
            value = get_attr_value(self.module, n)
            if isinstance(value, torch.Tensor):
                memo = n.meta.get(_PROP_MEMO)
                # a weak reference: the memo must not keep a replaced weight alive
                if self.incremental and memo is not None and memo[0]() is value:
                    return memo[1]
                if self.incremental and memo is not None and _fake_of(memo[1], value):
                    # a loaded weight in place of the meta one it was traced with: same value
                    n.meta[_PROP_MEMO] = (weakref.ref(value), memo[1])
                    return memo[1]
                result = self._mode.from_tensor(value, static_shapes=True)
                n.meta["val"] = result
                n.meta[_PROP_MEMO] = (weakref.ref(value), result)
                return result
        if n.op == "placeholder" and self.incremental:
            # the input is the placeholder's own stored value; FakeTensorProp would store a fresh
            # snapshot of it, and every node reading it would then look changed next time
            return fx.Interpreter.run_node(self, n)
        if n.op not in ("call_function", "call_method") or not self.incremental:
            return super().run_node(n)
        inputs = (n.target, fx.node.map_arg((n.args, n.kwargs), lambda x: self.env[x]))
        memo = n.meta.get(_PROP_MEMO)
        if memo is not None and "val" in n.meta and _same_inputs(memo[0], inputs):
            return memo[1]
        old_val = n.meta.get("val")
        result = super().run_node(n)
        if memo is not None and old_val is not None and _same_value_meta(memo[1], result):
            n.meta["val"] = old_val
            result = memo[1]
        n.meta[_PROP_MEMO] = (inputs, result)
        return result


def adopt_traced_values(gm: fx.GraphModule) -> int:
    """Record the values a tracer left in ``meta['val']`` as if a propagation had computed them, so
    the first incremental ``run_shape_prop`` recomputes only the nodes changed since the trace.

    Why: ``torch.export`` already ran every node under the graph's fake mode; without this the
    first propagation after the export cleanups recomputed all of them (3.9 s of a 48-layer
    build, ~4 ms per node with symbolic shapes). A node is adopted only when its own value and
    those of all its inputs are present and fake tensors of the placeholders' fake mode (or
    plain Python values); a parameter's value is adopted for the very tensor now behind its
    ``get_attr``, so a replaced weight is propagated again. Returns the number of nodes adopted.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode([n.meta.get("val") for n in placeholders])
    if mode is None:
        return 0

    def own(value: Any) -> bool:
        if isinstance(value, (list, tuple)):
            return all(own(v) for v in value)
        if isinstance(value, torch.Tensor):
            return getattr(value, "fake_mode", None) is mode
        return value is None or isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool, *_LITERALS))

    adopted = 0
    for n in gm.graph.nodes:
        value = n.meta.get("val")
        if n.op == "get_attr":
            attr = get_attr_value(gm, n)
            if isinstance(attr, torch.Tensor) and isinstance(value, torch.Tensor) and own(value) \
                    and (value.shape, value.dtype) == (attr.shape, attr.dtype):
                n.meta[_PROP_MEMO] = (weakref.ref(attr), value)
                adopted += 1
            continue
        if n.op not in ("call_function", "call_method") or "val" not in n.meta or not own(value):
            continue
        inputs = n.all_input_nodes
        if any("val" not in i.meta or not own(i.meta["val"]) for i in inputs):
            continue
        n.meta[_PROP_MEMO] = (n.target, fx.node.map_arg((n.args, n.kwargs), lambda x: x.meta["val"])), value
        adopted += 1
    return adopted


def run_shape_prop(gm: fx.GraphModule, incremental: bool = True) -> None:
    """Recompute ``meta['val']`` for every node, keeping the graph's symbolic input shapes.

    The fake mode (and its symbolic dims) comes from the placeholders' stored values, so a
    graph exported with dynamic batch/sequence keeps them through any number of rewrites.
    ``incremental`` reuses the values of nodes whose inputs did not change since the last
    propagation (see ``_FakePropWithRealAttrs``); ``False`` recomputes every node.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = [n.meta.get("val") for n in placeholders]
    if any(v is None for v in inputs):
        missing = [n.name for n, v in zip(placeholders, inputs) if v is None]
        raise RuntimeError(f"shape propagation needs example values for inputs {missing}")
    fake_mode = detect_fake_mode(inputs)
    if fake_mode is None:
        raise RuntimeError("shape propagation found no fake mode on the graph inputs")
    # The Python dispatcher runs composite ops through their Python decompositions, as torch.export
    # and dynamo do under symbolic shapes. Without it, torch 2.11's C++ ``aten.matmul`` (also behind
    # ``aten.linear``) of an N-d by a 2-d tensor reads concrete sizes: it raised "Cannot call numel()
    # on tensor with symbolic sizes/strides" (Falcon: every later transform skipped) or silently
    # specialised the sequence dim to the export's example length (Llama: a graph for 8 tokens).
    with fake_mode, enable_python_dispatcher():
        _FakePropWithRealAttrs(gm, fake_mode, incremental).propagate_dont_convert_inputs(*inputs)


def replace_node_with(node: fx.Node, new: fx.Node, erase: bool = True) -> None:
    node.replace_all_uses_with(new)
    if erase:
        node.graph.erase_node(node)


def unique_users(node: fx.Node) -> Sequence[fx.Node]:
    return list(node.users)


def single_user(node: fx.Node) -> Optional[fx.Node]:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def move_graph_to_device(gm: fx.GraphModule, device: torch.device) -> int:
    """Point device arguments baked in at export (``device='meta'`` in ``arange`` etc.) and the
    graph inputs' example values at ``device``. Returns the number of nodes changed."""
    device = torch.device(device)

    def fix(value: Any) -> Any:
        if isinstance(value, torch.device) and value != device:
            return device
        if isinstance(value, (list, tuple)):
            return type(value)(fix(v) for v in value)
        return value

    changed = 0
    for node in gm.graph.nodes:
        new_args, new_kwargs = fix(node.args), {k: fix(v) for k, v in node.kwargs.items()}
        if new_args != node.args or new_kwargs != node.kwargs:
            node.args, node.kwargs = new_args, new_kwargs
            changed += 1
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([n.meta.get("val") for n in placeholders])
    if fake_mode is not None:
        _move_values(gm, fake_mode, device)
    gm.recompile()
    return changed


def _move_values(gm: fx.GraphModule, fake_mode: Any, device: torch.device) -> None:
    """Every node's fake value (and its propagation memo) on ``device``: the same symbolic shape,
    strides and offset on the new device, one new object per old one, so values shared between
    nodes stay shared.

    Why not propagate again: moving the graph to the device of its loaded weights changes the
    device of every value and nothing else, and a propagation that recomputes all nodes costs
    ~1.5 ms a node with symbolic shapes (2 s of a 48-layer build). With the values moved, the
    next incremental propagation recomputes only what the post-load fusions changed (the loaded
    weights match their moved values: ``_fake_of``)."""
    moved: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}  # id(old) -> (old, new): old kept alive

    def move(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return type(v)(move(x) for x in v)
        if isinstance(v, dict):
            return {k: move(x) for k, x in v.items()}
        if not (isinstance(v, torch.Tensor) and getattr(v, "fake_mode", None) is fake_mode and v.device != device):
            return v
        if id(v) not in moved:
            moved[id(v)] = (v, _fake_on(v, device))
        return moved[id(v)][1]

    try:  # every new value first: a graph either moves whole or not at all
        with fake_mode:
            updates = [(n, _moved_meta(n, move)) for n in gm.graph.nodes]
    except GuardOnDataDependentSymNode as exc:  # a size no rule decides: propagate again instead
        logger.debug("values not moved to %s (%s); the next propagation recomputes them", device, exc)
        with fake_mode:
            for n in gm.graph.nodes:
                v = n.meta.get("val")
                if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.device != device:
                    n.meta["val"] = _fake_on(v, device)
        return
    for n, new in updates:
        n.meta.update(new)


def _fake_on(v: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fake tensor like ``v`` (symbolic shape, strides, offset, dtype) on ``device``."""
    new = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)
    if not statically_known_true(v.storage_offset() == 0):  # no guard on an unbacked offset (JetMoE)
        new = new.as_strided(v.shape, v.stride(), v.storage_offset())
    return new


def _moved_meta(n: fx.Node, move: Callable[[Any], Any]) -> Dict[str, Any]:
    """The node's value and propagation memo with ``move`` applied to every tensor in them."""
    new: Dict[str, Any] = {}
    if "val" in n.meta:
        new["val"] = move(n.meta["val"])
    memo = n.meta.get(_PROP_MEMO)
    if memo is not None and n.op == "get_attr":
        new[_PROP_MEMO] = (memo[0], move(memo[1]))
    elif memo is not None:
        (target, inputs), result = memo
        new[_PROP_MEMO] = ((target, move(inputs)), move(result))
    return new


def owner_of(gm: torch.nn.Module, target: str) -> Tuple[torch.nn.Module, str]:
    """(the module holding attribute ``target``, the attribute's own name)."""
    path, _, leaf = target.rpartition(".")
    return (gm.get_submodule(path) if path else gm), leaf


def add_tensor(gm: torch.nn.Module, path: str, base: str, tensor: torch.Tensor, parameter: bool = False) -> str:
    """Register ``tensor`` on the submodule at ``path`` under the first free name ``base``,
    ``base_1``, ... (a parameter without grad, or a non-persistent buffer); returns its target."""
    owner = gm.get_submodule(path) if path else gm
    name, i = base, 0
    while hasattr(owner, name):
        i += 1
        name = f"{base}_{i}"
    if parameter:
        owner.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
    else:
        owner.register_buffer(name, tensor, persistent=False)
    return f"{path}.{name}" if path else name


def weight_expression(node: Any) -> Optional[List[fx.Node]]:
    """The nodes computing ``node`` from parameters (``get_attr``) alone, in graph order; None when
    it depends on anything else (an input, a factory op)."""
    if not isinstance(node, fx.Node):
        return None
    found: Dict[fx.Node, None] = {}
    stack = [node]
    while stack:
        n = stack.pop()
        if n in found:
            continue
        if n.op not in ("get_attr", "call_function"):
            return None
        if n.op == "call_function" and not n.all_input_nodes:
            return None  # a factory op (zeros, arange): not a weight
        found[n] = None
        stack.extend(n.all_input_nodes)
    return sorted(found)  # fx nodes order by their position in the graph (no walk over the graph per call)
