"""What the ``multi_stream_*`` transforms share: when they apply, and how a branch of the graph is
moved onto the aux CUDA stream (``autodeploy/ops/streams.py``).

A *region* is a branch ``A`` (nodes that only feed each other and the rest of the graph through
their outputs) launched on the aux stream, while the main stream runs the nodes that follow it up
to the first reader of ``A``'s outputs::

    ... last input of A ...
    fork_to_aux([tensor inputs of A])
    A (in its order)                       # aux stream
    end_aux([outputs of A])
    M (hoisted main partner work), then the nodes that were between A's inputs and its first reader
    join_from_aux([outputs of A])
    first reader of A's outputs ...

Each rewrite only moves nodes to places where their inputs exist (see ``insert_aux_region``), so
the graph stays a valid topological order and computes the same values.
"""

from typing import Any, Dict, Iterable, List, Optional, Sequence, Set

import torch
from torch import fx

from ...cache.sequence_info import METADATA_NAMES
from ...compile.piecewise import is_cached_attention
from ...ops.streams import stream_ops
from ..graph_utils import run_shape_prop, val
from ..interface import PipelineContext, Stage, TransformConfig

aten = torch.ops.aten

FORK, END, JOIN = stream_ops()
# backends that retrace the graph: inductor orders nodes by data dependencies, and the stream ops
# act by their position, so a region would not survive
RETRACING_BACKENDS = ("torch-compile", "torch-opt")

# ops that launch no kernel (views, metadata): a branch of only these has nothing to overlap
_NO_KERNEL = {
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
    aten.select.int, aten.slice.Tensor, aten.narrow.default, aten.split_with_sizes.default, aten.split.Tensor,
    aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default, aten.expand.default, aten.t.default,
    aten.alias.default, aten.sym_size.int, aten.detach.default,
}


class MultiStreamConfig(TransformConfig):
    """Compile stage, off by default (``default.yaml``): on only where measured faster on a GPU."""

    stage: Stage = Stage.COMPILE
    enabled: bool = False


def skip_reason(ctx: PipelineContext, gm: fx.GraphModule) -> Optional[str]:
    """Why a multi-stream transform does nothing for this build, or None when it applies. Where it
    applies, shapes are propagated first (a region's inputs and outputs must be known to be
    tensors); the no-op on other devices does not spend that time."""
    device = torch.device(ctx.device).type
    if device != "cuda":
        return f"{device.upper()}: one stream"
    if ctx.compile_backend in RETRACING_BACKENDS:
        return f"compile backend {ctx.compile_backend} retraces the graph and would reorder the stream ops"
    try:
        run_shape_prop(gm)
    except Exception as exc:  # noqa: BLE001 - the graph is left as it is, and the summary says why
        return f"shape propagation failed ({type(exc).__name__})"
    return None


def launches_kernel(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target not in _NO_KERNEL and not is_getitem(node)


def is_getitem(node: Any) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and getattr(node.target, "__name__", "") == "getitem")


def exclusive_branch(roots: Sequence[fx.Node], consumer: Optional[fx.Node],
                     stop: Iterable[fx.Node] = ()) -> List[fx.Node]:
    """The nodes computing ``roots`` that nothing else reads: walking up from ``roots``, a node
    belongs to the branch when every user of it is in the branch (or is ``consumer``). Graph
    inputs, weights, ``stop`` nodes and getitems of a node outside the branch (their tensor is
    the branch's input) end the walk. Sorted in graph order."""
    order = {n: i for i, n in enumerate(roots[0].graph.nodes)}
    stop = set(stop)
    branch: Set[fx.Node] = set()
    candidates = set(roots)
    frontier = list(roots)
    while frontier:  # ancestors of the roots, up to the stop nodes
        node = frontier.pop()
        for inp in node.all_input_nodes:
            if inp not in candidates and inp.op == "call_function" and inp not in stop:
                candidates.add(inp)
                frontier.append(inp)
    allowed = {consumer} if consumer is not None else set()
    for node in sorted(candidates, key=order.__getitem__, reverse=True):  # users before their inputs
        if node in roots or all(u in branch or u in allowed for u in node.users):
            branch.add(node)
    # a getitem whose tuple is produced outside the branch reads a main-stream tensor: an input
    for node in [n for n in branch if is_getitem(n) and n.args[0] not in branch]:
        if node not in roots:
            branch.discard(node)
    return sorted(branch, key=order.__getitem__)


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(val(node), torch.Tensor)


def _holds_tensors(node: fx.Node) -> bool:
    v = val(node)
    return isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v)


def _eager_kinds(gm: fx.GraphModule) -> Dict[fx.Node, bool]:
    """Piecewise CUDA graphs (``compile.piecewise.split_at_attention``) cut the graph where this
    changes and at every cached attention op; a region must sit inside one piece."""
    tainted = {n for n in gm.graph.nodes if n.op == "placeholder" and n.name in METADATA_NAMES}
    kinds: Dict[fx.Node, bool] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if is_cached_attention(node):
            kinds[node] = True
            continue
        kinds[node] = any(inp in tainted for inp in node.all_input_nodes)
        if kinds[node]:
            tainted.add(node)
    return kinds


def _is_barrier(node: fx.Node) -> bool:
    """A node a region may not span: a stream op of another region, a cached attention op (a piece
    boundary of piecewise CUDA graphs)."""
    return node.op == "call_function" and (node.target in (FORK, END, JOIN) or is_cached_attention(node))


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and schema.is_mutable


def _root(node: fx.Node) -> fx.Node:
    """The tensor ``node`` is a view of (through view-like ops and getitems)."""
    while node.op == "call_function" and not launches_kernel(node) and node.all_input_nodes:
        node = node.args[0] if isinstance(node.args[0], fx.Node) else node.all_input_nodes[0]
    return node


def _races(branch: Set[fx.Node], inputs: List[fx.Node], span: List[fx.Node]) -> bool:
    """The branch writes in place, or a main-stream node of the span writes (a view of) a tensor
    the branch reads: the two streams would race on it."""
    if any(_mutates(n) for n in branch):
        return True
    read = {_root(i) for i in inputs if i.op != "get_attr"}
    return any(_root(a) in read for n in span if n not in branch and _mutates(n) for a in n.all_input_nodes)


def insert_aux_region(gm: fx.GraphModule, aux: Sequence[fx.Node], main: Sequence[fx.Node] = ()) -> bool:
    """Run the branch ``aux`` on the aux stream and hoist ``main`` (its partner work) right after it;
    returns False, leaving the graph as it was, where the region cannot be made:

    * an output or input of the branch is not known to be a tensor (no shape propagation), or an
      input is a tuple of tensors;
    * the branch's inputs are not all computed before the first reader of its outputs;
    * a ``main`` node reads the branch or an input computed after the branch's last input;
    * the span from fork to join would hold a barrier (``_is_barrier``) or cross a piecewise
      boundary (``_eager_kinds``).
    """
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    branch = set(aux)
    if not branch or any(n.op != "call_function" for n in branch) or branch & set(main):
        return False
    outputs = [n for n in sorted(branch, key=order.__getitem__) if any(u not in branch for u in n.users)]
    if not outputs or not all(_is_tensor(o) for o in outputs):
        return False
    inputs = sorted({i for n in branch for i in n.all_input_nodes if i not in branch}, key=order.__getitem__)
    if any(_holds_tensors(i) for i in inputs):
        return False
    computed = [i for i in inputs if i.op != "get_attr"]
    if not computed:
        return False
    anchor = computed[-1]
    if anchor.op == "placeholder":  # the fork goes after every graph input
        anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]
    readers = [u for o in outputs for u in o.users if u not in branch]
    first_reader = min(readers, key=order.__getitem__)
    if order[anchor] >= order[first_reader]:
        return False
    hoisted = sorted((m for m in main if order[m] > order[anchor]), key=order.__getitem__)
    hoisted_set = set(hoisted)
    for m in hoisted:
        if m in readers:
            return False
        for inp in m.all_input_nodes:
            if inp.op != "get_attr" and inp not in hoisted_set and order[inp] > order[anchor]:
                return False
    # the span after the rewrite: the branch, the hoisted nodes and what lies between anchor and reader
    span = [n for n in graph.nodes if order[anchor] < order[n] < order[first_reader] and n.op != "get_attr"]
    span += list(branch) + hoisted
    kinds = _eager_kinds(gm)
    pieces = {kinds[n] for n in span if n in kinds} | {kinds.get(anchor, False)}
    if _races(branch, inputs, span) or any(_is_barrier(n) for n in span) or len(pieces) > 1:
        return False
    _rewrite(graph, anchor, sorted(branch, key=order.__getitem__), outputs, hoisted, first_reader,
             [i for i in computed if _is_tensor(i)], order)
    return True


def _rewrite(graph: fx.Graph, anchor: fx.Node, branch: List[fx.Node], outputs: List[fx.Node],
             hoisted: List[fx.Node], first_reader: fx.Node, tensor_inputs: List[fx.Node],
             order: Dict[fx.Node, int]) -> None:
    with graph.inserting_after(anchor):
        fork = graph.call_function(FORK, (tensor_inputs,))
    cursor = fork
    for node in branch + hoisted:
        for w in node.all_input_nodes:  # weights read after the anchor move before the fork
            if w.op == "get_attr" and order[w] > order[anchor]:
                fork.prepend(w)
    for node in branch:
        cursor.append(node)
        cursor = node
    with graph.inserting_after(cursor):
        end = graph.call_function(END, (list(outputs),))
    cursor = end
    for node in hoisted:
        cursor.append(node)
        cursor = node
    with graph.inserting_before(first_reader):
        join = graph.call_function(JOIN, (list(outputs),))
    for node in (fork, end, join):
        node.meta["val"] = None


def count_regions(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is FORK)
