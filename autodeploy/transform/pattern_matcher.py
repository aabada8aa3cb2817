"""Patterns written as plain Python functions, matched with inductor's pattern matcher.

``torch._inductor.pattern_matcher`` traces a search function into a pattern graph and finds it
in a target graph. Our target graphs are ``torch.export`` IR (``aten.linear``, ``aten.matmul``,
``aten.scaled_dot_product_attention``...), not inductor's decomposed IR, so patterns are
traced the same way the model was: ``torch.export`` with dynamic dims, then the same cleanups
(``cleanups.cleanup_for_matching``). Replacements are traced with ``fwd_only`` without
decompositions, so a call to a canonical op stays one node.

Inductor treats int/float/dtype/device literals in patterns as wildcards (except a few ints
it keeps, such as ``pow`` exponents); checks the pattern cannot express go in ``extra_check``.

Tracing a search function with ``torch.export`` takes 0.1-0.5 s, and the RoPE, RMSNorm, L2Norm
and SwiGLU sets trace 29 variants for ``demo``: 4-6.5 s of its first build in a process
(measured with the build ~5 s faster from a warm cache). So traced search
patterns are kept on disk (``$AUTODEPLOY_CACHE/patterns``) as Python source in inductor's
pattern syntax (the form inductor ships its own serialized patterns in). The key covers
the torch version, the source of every module under ``autodeploy/transform`` and
``autodeploy/ops``, the search function and its example inputs, so any code change retraces.
``AUTODEPLOY_PATTERN_CACHE=0`` turns the cache off.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
import operator
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch import fx
from torch.export import Dim

from ..utils.logging import get_logger
from ..utils.paths import cache_root
from .cleanups import cleanup_for_matching
from .graph_utils import eliminate_dead_code, inherit_source_meta, nodes_created

if TYPE_CHECKING:
    from torch._inductor import pattern_matcher as ipm
else:
    class _ImportedOnFirstUse:
        """``torch._inductor.pattern_matcher``, imported when first used: the import brings
        torch._dynamo and inductor with it (2.1 s of the 4.5-5.1 s an ``import autodeploy.llm``
        took here), which code that matches no pattern never needs (``import autodeploy``, a build
        from the build cache). Attributes are read from and written to the module itself
        (``_match_any_device`` replaces one of its functions)."""

        @staticmethod
        def _module() -> Any:
            from torch._inductor import pattern_matcher

            return pattern_matcher

        def __getattr__(self, name: str) -> Any:
            return getattr(self._module(), name)

        def __setattr__(self, name: str, value: Any) -> None:
            setattr(self._module(), name, value)

    ipm = _ImportedOnFirstUse()
logger = get_logger(__name__)


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


def pattern_cache_dir() -> Optional[str]:
    """Where traced patterns are kept, or None when ``AUTODEPLOY_PATTERN_CACHE`` is 0/off."""
    if os.environ.get("AUTODEPLOY_PATTERN_CACHE", "1").lower() in ("0", "off", "false", "no"):
        return None
    return os.path.join(cache_root(), "patterns")


@functools.lru_cache(maxsize=1)
def _code_fingerprint() -> str:
    """torch's version and the source of everything a traced pattern depends on here."""
    h = hashlib.sha256(torch.__version__.encode())
    package = Path(__file__).resolve().parent.parent
    for folder in ("transform", "ops"):
        for path in sorted((package / folder).rglob("*.py")):
            h.update(str(path.relative_to(package)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{value.dtype}{value.device.type}"
    return repr(value)


def _pattern_key(set_name: str, search_fn: Callable, example_inputs: Sequence[Any], options: Sequence[Any]) -> str:
    parts = [_code_fingerprint(), set_name, search_fn.__module__, search_fn.__qualname__]
    parts += [_describe(a) for a in example_inputs] + [repr(o) for o in options]
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:32]


_PATTERN_NAMES = ("Arg", "CallFunction", "CallMethod", "ExclusiveKeywordArg", "Ignored", "KeywordArg", "ListOf",
                  "MultiOutputPattern", "MULTIPLE")


class _Unserializable(Exception):
    pass


def _target_source(fn: Any) -> str:
    if isinstance(fn, torch._ops.OpOverload):
        namespace, name = fn._schema.name.split("::")
        return f"{namespace}.{name}.{fn._overloadname}"
    if fn is operator.getitem:
        return "operator.getitem"
    raise _Unserializable(f"target {fn!r}")


def _pattern_source(root: ipm.PatternExpr) -> str:
    """Python source that rebuilds ``root``, one variable per pattern node, so shared
    sub-patterns stay shared. (Inductor's pretty-printer writes sub-patterns inside a list
    argument, such as ``cat([...])``, by repr: copies instead of shared nodes, and ``*`` for
    ``Ignored()``, which does not parse.) Raises ``_Unserializable`` for anything else."""
    names: Dict[int, str] = {}
    lines: List[str] = []

    def literal(value: Any) -> str:
        if isinstance(value, float) and not math.isfinite(value):
            raise _Unserializable(f"literal {value!r}")  # repr 'inf' does not load back
        if value is None or isinstance(value, (bool, int, float, str)):
            return repr(value)
        if isinstance(value, torch.dtype):
            return str(value)
        raise _Unserializable(f"literal {value!r}")

    def expr(p: Any) -> str:
        if isinstance(p, (list, tuple)):
            inner = ", ".join(expr(x) for x in p)
            return f"[{inner}]" if isinstance(p, list) else f"({inner}{',' if len(p) == 1 else ''})"
        if not isinstance(p, ipm.PatternExpr):
            return literal(p)
        if id(p) in names:
            return names[id(p)]
        kind = type(p)
        if kind in (ipm.KeywordArg, ipm.ExclusiveKeywordArg):
            code = f"{kind.__name__}({p.name!r})"
        elif kind in (ipm.Ignored, ipm.Arg):
            code = f"{kind.__name__}()"
        elif kind in (ipm.CallFunction, ipm.CallMethod):
            parts = ["[" + ", ".join(_target_source(f) for f in p.fns) + "]"]
            parts += [expr(a) for a in p.args]
            parts += [f"{k}={expr(v)}" for k, v in p.kwargs.items()]
            users = "MULTIPLE" if p.users is ipm.MULTIPLE else literal(p.users)
            code = f"{kind.__name__}({', '.join(parts)}, _users={users})"
        elif kind is ipm.MultiOutputPattern:
            code = f"MultiOutputPattern({expr(list(p.outputs))})"
        elif kind is ipm.ListOf:
            code = f"ListOf({expr(p.pattern)}, partial={p.partial!r})"
        else:
            raise _Unserializable(f"pattern node {kind.__name__}")
        names[id(p)] = f"p{len(names)}"
        lines.append(f"{names[id(p)]} = {code}")
        return names[id(p)]

    lines.append(f"output = {expr(root)}")
    return "\n".join(lines) + "\n"


def _load_pattern(path: str) -> Optional[ipm.PatternExpr]:
    """A cached pattern, or None when it is missing or does not print back to its own source."""
    try:
        with open(path) as f:
            source = f.read()
        namespace: Dict[str, Any] = {n: getattr(ipm, n) for n in _PATTERN_NAMES}
        namespace.update(torch=torch, operator=operator, aten=torch.ops.aten, prims=torch.ops.prims,
                         autodeploy=torch.ops.autodeploy)
        exec(compile(source, path, "exec"), namespace)  # our own cache: inductor's pattern syntax only
        pattern = namespace["output"]
        if _pattern_source(pattern) != source:
            logger.debug("pattern cache entry %s does not round-trip; retracing", path)
            return None
        return pattern
    except FileNotFoundError:
        return None
    except Exception as exc:  # a stale or damaged entry is retraced, never fatal
        logger.debug("pattern cache entry %s unreadable (%s); retracing", path, exc)
        return None


def _store_pattern(path: str, pattern: ipm.PatternExpr) -> None:
    try:
        source = _pattern_source(pattern)
    except _Unserializable as exc:  # traced again next time; never approximated
        logger.debug("pattern not cached (%s)", exc)
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home only costs the trace next time
        logger.debug("could not write pattern cache entry %s: %s", path, exc)


def traced_pattern(set_name: str, search_fn: Callable, example_inputs: Sequence[Any], trace_fn: Callable,
                   scalar_workaround: Dict[str, Any], options: Sequence[Any],
                   on_trace: Callable[[], None] = lambda: None) -> ipm.PatternExpr:
    """``ipm.gen_pattern`` through the on-disk cache (see the module docstring); ``on_trace`` is
    called before a pattern is actually traced (a cache miss, the slow case)."""
    folder = pattern_cache_dir()
    path = None
    if folder is not None:
        key = _pattern_key(set_name, search_fn, example_inputs, [sorted(scalar_workaround.items()), *options])
        path = os.path.join(folder, f"{key}.py")
        cached = _load_pattern(path)
        if cached is not None:
            return cached
    on_trace()
    pattern = ipm.gen_pattern(search_fn, list(example_inputs), trace_fn, scalar_workaround)
    if path is not None:
        _store_pattern(path, pattern)
    return pattern


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
        self._traced = 0  # patterns traced (not read from the disk cache) by the current registration

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
        options = (static_last_dim, tuple(static_inputs))
        workaround = dict(scalar_workaround or {})
        if replace_fn is not None:
            assert list(inspect.signature(search_fn).parameters) == list(
                inspect.signature(replace_fn).parameters
            ), f"{self.name}: search and replace functions must take the same arguments"

            def register(pass_: ipm.PatternMatcherPass) -> None:
                pattern = traced_pattern(self.name, search_fn, example_inputs, trace_fn, workaround, options,
                                         self._note_trace)
                ipm.register_replacement(
                    search_fn, replace_fn, list(example_inputs), trace_fn, [pass_],
                    extra_check=extra_check, scalar_workaround=workaround, skip_duplicates=True,
                    search_fn_pattern=pattern,
                )

        else:

            def register(pass_: ipm.PatternMatcherPass) -> None:
                pattern = traced_pattern(self.name, search_fn, example_inputs, trace_fn, workaround, options,
                                         self._note_trace)
                key = ipm.PatternPrettyPrinter.run(pattern)
                if key in self._seen:
                    return
                self._seen.add(key)

                def run_handler(match: Match, *args: Any, **kwargs: Any) -> None:
                    with nodes_created(match.graph) as created:
                        handler(match, match.graph, **kwargs)
                    # the handler's nodes come from the matched output's module (inductor's own
                    # replacements copy it; a handler builds its nodes itself)
                    source = match.output_node()
                    for node in created:
                        inherit_source_meta(node, source)

                ipm.register_graph_pattern(pattern, extra_check=extra_check, pass_dict=pass_)(run_handler)

        self._registrations.append(register)

    def apply(self, gm: fx.GraphModule) -> int:
        """Rewrite every match in ``gm``; returns the number of replacements."""
        if self._pass is None:
            self._pass = self._register_all()
        with _match_any_device():
            count = self._pass.apply(gm.graph)
        if count:
            ipm.stable_topological_sort(gm.graph)
            eliminate_dead_code(gm)
            gm.recompile()
        return count

    def _register_all(self) -> ipm.PatternMatcherPass:
        """Register every pattern into a new pass, with a sign of life.

        Why: each pattern missing from the disk cache is traced with ``torch.export`` (0.1-0.5 s;
        ~40 across the sets, seconds of a first build), silently. A progress bar counts the
        patterns (on a terminal, once registering takes over half a second), a line says when
        tracing starts, and one gives the count and time after.
        """
        from tqdm import tqdm

        pass_ = ipm.PatternMatcherPass(pass_name=self.name)
        self._traced, start = 0, time.perf_counter()
        with tqdm(total=len(self._registrations), desc=f"patterns {self.name}", unit="pattern", leave=False,
                  delay=0.5, disable=None) as progress:
            for register in self._registrations:
                register(pass_)
                progress.update(1)
        if self._traced:
            logger.info("pattern set %s: traced %d of %d patterns in %.1f s (%s)", self.name, self._traced,
                        len(self._registrations), time.perf_counter() - start,
                        f"kept in {pattern_cache_dir()} for later builds" if pattern_cache_dir() else "cache off")
        return pass_

    def _note_trace(self) -> None:
        """The first cache miss of a registration says that tracing, the slow part, starts."""
        if self._traced == 0:
            logger.info("pattern set %s: tracing the patterns not in the pattern cache yet (0.1-0.5 s each) ...",
                        self.name)
        self._traced += 1
