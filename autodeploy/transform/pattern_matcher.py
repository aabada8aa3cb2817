"""Patterns written as plain Python functions, matched with inductor's pattern matcher.

``torch._inductor.pattern_matcher`` traces a search function into a pattern graph and finds it
in a target graph. Our target graphs are ``torch.export`` IR (``aten.linear``, ``aten.matmul``,
``aten.scaled_dot_product_attention``...), not inductor's decomposed IR, so patterns are
traced the same way the model was: ``torch.export`` with dynamic dims, then the same cleanups
(``cleanups.cleanup_for_matching``). Replacements are traced with ``fwd_only`` without
decompositions, so a call to a canonical op stays one node.

Inductor treats int/float/dtype/device literals in patterns as wildcards (except a few ints
it keeps, such as ``pow`` exponents); checks the pattern cannot express go in ``extra_check``.
"""

import inspect
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch import fx
from torch._inductor import pattern_matcher as ipm
from torch.export import Dim

from .cleanups import cleanup_for_matching
from .graph_utils import eliminate_dead_code

Match = ipm.Match


def _pattern_dynamic_shapes(args: Sequence[Any], static_last_dim: bool, static_inputs: Sequence[int] = ()) -> tuple:
    shapes = []
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor) and i in static_inputs:
            shapes.append(None)
        elif isinstance(a, torch.Tensor):
            dims = a.dim() - 1 if static_last_dim else a.dim()
            shapes.append({i: Dim.DYNAMIC for i in range(dims)})
        else:
            shapes.append(None)
    return (tuple(shapes),)


def make_trace_fn(static_last_dim: bool = True, static_inputs: Sequence[int] = ()) -> Callable:
    """A ``trace_fn`` for ``register_replacement``: export for patterns, fwd_only otherwise."""

    def trace(fn: Callable, args: Sequence[Any], **kwargs: Any) -> fx.GraphModule:
        symbolic = (torch._subclasses.FakeTensor, torch.SymInt, torch.SymFloat, torch.SymBool)
        if any(isinstance(a, symbolic) for a in args):
            # Tracing on a match's fake values (replacements, and inductor's re-trace of the
            # search function with the matched scalars): pre-dispatch IR, like export's.
            from torch.fx.experimental.proxy_tensor import make_fx

            gm = make_fx(fn, pre_dispatch=True)(*args)
            cleanup_for_matching(gm)
            return gm

        class _Pattern(torch.nn.Module):
            def forward(self, *inputs: Any) -> Any:
                return fn(*inputs)

        with torch.no_grad():
            ep = torch.export.export(
                _Pattern(), tuple(args), dynamic_shapes=_pattern_dynamic_shapes(args, static_last_dim, static_inputs),
                strict=False,
            )
        gm = ep.module()
        graph = gm.graph
        for node in list(graph.nodes):
            if node.op == "call_module":
                graph.erase_node(node)
        graph._codegen = fx.graph.CodeGen()
        _concretize_shape_lists(gm)
        cleanup_for_matching(gm)
        return gm

    return trace


def _concretize_shape_lists(gm: fx.GraphModule) -> None:
    """Replace symbolic sizes inside list arguments (``reshape(x, [sym_size(y, 0), ...])``) by
    their example values. Which input export takes a size symbol from is arbitrary, so a pattern
    must not depend on it; lists of ints are wildcards to inductor, and a pattern that cares
    about the shapes checks them in ``extra_check``."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        new_args = []
        for a in node.args:
            nodes = [x for x in a if isinstance(x, fx.Node)] if isinstance(a, (list, tuple)) else []
            if nodes and all(isinstance(x.meta.get("val"), (int, torch.SymInt)) for x in nodes):
                a = type(a)(_hint(x.meta["val"]) if isinstance(x, fx.Node) else x for x in a)
            new_args.append(a)
        node.args = tuple(new_args)


def _hint(value: Any) -> int:
    if isinstance(value, torch.SymInt):
        return int(value.node.hint)
    return int(value)


@contextmanager
def _match_any_device() -> Iterator[None]:
    """Inductor skips nodes on devices it cannot generate code for (meta, and CPU when C++
    codegen is off). We never hand these graphs to inductor's codegen, and before weights load
    every value is on meta, so the check does not apply."""
    original = ipm.fallback_node_due_to_unsupported_type
    ipm.fallback_node_due_to_unsupported_type = lambda node, allow_cpu_inputs=True: False
    try:
        yield
    finally:
        ipm.fallback_node_due_to_unsupported_type = original


Handler = Callable[..., None]


class PatternSet:
    """A named set of patterns, registered once and applied to many graphs.

    A pattern is a search function plus either a replacement function (traced and spliced in
    by inductor) or a handler ``handler(match, graph, **inputs)`` that edits the graph itself,
    for replacements that need facts from the match (e.g. a dim the pattern treats as wildcard).
    """

    def __init__(self, name: str):
        self.name = name
        self._pass: Optional[ipm.PatternMatcherPass] = None
        self._registrations: List[Callable[[ipm.PatternMatcherPass], None]] = []
        self._seen: set = set()

    def add(
        self,
        search_fn: Callable,
        example_inputs: Sequence[Any],
        *,
        replace_fn: Optional[Callable] = None,
        handler: Optional[Handler] = None,
        scalar_workaround: Optional[Dict[str, Any]] = None,
        extra_check: Callable[[Match], bool] = lambda m: True,
        static_last_dim: bool = True,
        static_inputs: Sequence[int] = (),
    ) -> None:
        """Register a pattern. ``scalar_workaround`` names float args of ``search_fn`` (with an
        example value) that become match variables instead of literals. Inputs listed in
        ``static_inputs`` (weights) keep static shapes; the others get dynamic leading dims.
        Patterns that trace to the same graph as an earlier one are skipped."""
        assert (replace_fn is None) != (handler is None), "give exactly one of replace_fn / handler"
        trace_fn = make_trace_fn(static_last_dim, static_inputs)
        workaround = dict(scalar_workaround or {})
        if replace_fn is not None:
            assert list(inspect.signature(search_fn).parameters) == list(
                inspect.signature(replace_fn).parameters
            ), f"{self.name}: search and replace functions must take the same arguments"

            def register(pass_: ipm.PatternMatcherPass) -> None:
                ipm.register_replacement(
                    search_fn, replace_fn, list(example_inputs), trace_fn, [pass_],
                    extra_check=extra_check, scalar_workaround=workaround, skip_duplicates=True,
                )

        else:

            def register(pass_: ipm.PatternMatcherPass) -> None:
                pattern = ipm.gen_pattern(search_fn, list(example_inputs), trace_fn, workaround)
                key = ipm.PatternPrettyPrinter.run(pattern)
                if key in self._seen:
                    return
                self._seen.add(key)

                def run_handler(match: Match, *args: Any, **kwargs: Any) -> None:
                    handler(match, match.graph, **kwargs)

                ipm.register_graph_pattern(pattern, extra_check=extra_check, pass_dict=pass_)(run_handler)

        self._registrations.append(register)

    def apply(self, gm: fx.GraphModule) -> int:
        """Rewrite every match in ``gm``; returns the number of replacements."""
        if self._pass is None:
            self._pass = ipm.PatternMatcherPass(pass_name=self.name)
            for register in self._registrations:
                register(self._pass)
        with _match_any_device():
            count = self._pass.apply(gm.graph)
        if count:
            ipm.stable_topological_sort(gm.graph)
            eliminate_dead_code(gm)
            gm.recompile()
        return count
