"""``torch.fx`` helpers for more than the transforms: the compile backends use them too, and they
must not import the transform package (which imports them), so they live here."""

from typing import Any

from torch import fx


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A second GraphModule over the same parameters with its own copy of the graph."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    return copy


def get_attr_value(gm: fx.GraphModule, node: fx.Node) -> Any:
    """The tensor (or module) a ``get_attr`` node refers to."""
    obj: Any = gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part)
    return obj
