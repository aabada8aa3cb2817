"""``torch.fx`` helpers for more than the transforms: the compile backends use them too, and they
must not import the transform package (which imports them), so they live here."""

from contextlib import contextmanager
from typing import Any, Iterator, Optional

from torch import fx

from .logging import get_logger

logger = get_logger(__name__)


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A second GraphModule over the same parameters with its own copy of the graph."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    lazy = _lazy_class()
    # a copy of a deferring module defers too (constructing a GraphModule generates its code)
    copy = (lazy if lazy is not None and isinstance(gm, lazy) else fx.GraphModule)(gm, graph)
    copy.meta.update(gm.meta)
    return copy


def get_attr_value(gm: fx.GraphModule, node: fx.Node) -> Any:
    """The tensor (or module) a ``get_attr`` node refers to."""
    obj: Any = gm
    for part in str(node.target).split("."):
        obj = getattr(obj, part)
    return obj


def defer_recompile(gm: fx.GraphModule) -> fx.GraphModule:
    """Make ``gm.recompile()`` only mark the module's Python code stale; the code is generated when
    the module is next called or its code read (torch's ``_LazyGraphModule``, which inductor uses
    for the same reason). The same object is returned, its attributes untouched; undo it with
    :func:`recompile_now` before ``torch.compile`` (dynamo does not trace into a stale module).

    Why: every transform ends with a recompile, and each generates the whole graph's code again
    (~60 ms for a 48-layer graph, ~40 of them a build, 2-3 s) although the pipeline rarely runs
    the graph between transforms. Where torch lacks the class the module is returned as it is."""
    lazy = _lazy_class()
    if lazy is None:  # pragma: no cover - every torch autodeploy supports has it (2.3+)
        logger.debug("torch has no _LazyGraphModule; every recompile generates code at once")
        return gm
    if not isinstance(gm, lazy):
        _set_class(gm, lazy)
        gm.recompile()
    return gm


def recompile_now(gm: Any) -> Any:
    """Undo :func:`defer_recompile`: ``gm`` a plain GraphModule again with its code generated now
    (anything else is returned as it is)."""
    lazy = _lazy_class()
    if lazy is not None and isinstance(gm, lazy):
        _set_class(gm, fx.GraphModule)
        gm.recompile()
    return gm


def _set_class(gm: fx.GraphModule, base: type) -> None:
    # GraphModule gives each instance its own class (recompile sets forward on it); so does this,
    # named as torch names them so that a deepcopy makes its copy's class from ``base``
    gm.__class__ = type("GraphModuleImpl", (base,), {"__module__": base.__module__})


def _lazy_class() -> Optional[type]:
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover
        return None
    return _LazyGraphModule


@contextmanager
def lazy_graph_modules() -> Iterator[None]:
    """GraphModules that torch makes inside (``torch.export``'s traces) defer their recompiles like
    :func:`defer_recompile` (export recompiles its whole graph in several of its passes)."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:  # pragma: no cover
        yield
        return
    with _use_lazy_graph_module(True):
        yield
