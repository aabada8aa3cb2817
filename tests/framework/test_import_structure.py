"""Import structure of the package, read statically (``ast``, nothing is imported): every
``import`` of every module under ``autodeploy/`` (those inside functions included, relative ones
resolved) makes the module import graph, which must have no cycles, neither between modules nor
between the subpackages (``autodeploy.transform`` <-> ``autodeploy.compile``: importing one
submodule runs its package's ``__init__``), and the IR side must never import the serving side."""

import ast
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2] / "autodeploy"

# the IR: graph capture, ops, transforms, cache, compile backends
IR_PACKAGES = ("autodeploy.ops", "autodeploy.export", "autodeploy.transform", "autodeploy.compile",
               "autodeploy.cache")
# what runs or serves a built model; the IR never needs them
SERVING_SIDE = ("autodeploy.runtime", "autodeploy.serve", "autodeploy.cli", "autodeploy.bench", "autodeploy.llm")

# imports the source makes without an import statement
DYNAMIC_IMPORTS = {
    # transform/library/__init__.py imports every module of the package not starting with "_"
    "autodeploy.transform.library": sorted(
        f"autodeploy.transform.library.{p.stem}" for p in (ROOT / "transform" / "library").glob("*.py")
        if not p.stem.startswith("_")
    ),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


MODULES = _modules()


def _is_ours(name: str) -> bool:
    return name == "autodeploy" or name.startswith("autodeploy.")


def _imported(module: str, path: Path) -> Iterator[Tuple[str, int]]:
    """``(autodeploy module, line)`` for every import in the module's source (a module that does
    not exist, such as one a rule forbids before anyone writes it, keeps its dotted name)."""
    base = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_ours(alias.name):
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = base.split(".")
                package = package[: len(package) - (node.level - 1)]
                source = ".".join(package + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not _is_ours(source):
                continue
            for alias in node.names:
                # `from pkg import submodule` imports the submodule; `from mod import name`, the module
                submodule = f"{source}.{alias.name}"
                yield (submodule if submodule in MODULES else source), node.lineno


def _graph() -> Dict[str, Dict[str, int]]:
    """module -> {imported module: first line}."""
    graph: Dict[str, Dict[str, int]] = {}
    for module, path in MODULES.items():
        edges = graph.setdefault(module, {})
        for target, line in _imported(module, path):
            if target != module:
                edges.setdefault(target, line)
        for target in DYNAMIC_IMPORTS.get(module, ()):
            edges.setdefault(target, 0)
    return graph


GRAPH = _graph()


def _cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def _describe(component: List[str], graph: Dict[str, Dict[str, int]]) -> str:
    members = set(component)
    edges = [f"  {a} -> {b}" + (f" (line {line})" if line else " (dynamic)")
             for a in component for b, line in sorted(graph.get(a, {}).items()) if b in members]
    return "\n".join([" <-> ".join(component)] + edges)


def _subpackage(module: str) -> str:
    """``autodeploy.transform.library.x`` -> ``autodeploy.transform``; top-level modules stay."""
    return ".".join(module.split(".")[:2])


def _package_graph() -> Dict[str, Dict[str, int]]:
    graph: Dict[str, Dict[str, int]] = {}
    for module, edges in GRAPH.items():
        src = _subpackage(module)
        for target, line in edges.items():
            dst = _subpackage(target)
            if dst not in (src, "autodeploy"):
                graph.setdefault(src, {}).setdefault(dst, line)
        graph.setdefault(src, {})
    return graph


def _within(module: str, packages: Tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_graph_sees_the_package():
    """A sanity check of the parser itself: known imports, relative ones and ones inside functions."""
    assert "autodeploy.transform.interface" in GRAPH["autodeploy.transform"]  # from .interface import (...)
    assert "autodeploy.transform.graph_utils" in GRAPH["autodeploy.transform.interface"]
    assert "autodeploy.ops" in GRAPH["autodeploy.cache.attention_backends"]  # import inside a function
    assert "autodeploy.transform.library.compile_model" in GRAPH["autodeploy.transform.library"]
    assert len(MODULES) > 50


def test_no_import_cycles_between_modules():
    cycles = _cycles({m: set(edges) for m, edges in GRAPH.items()})
    assert not cycles, "import cycles:\n" + "\n".join(_describe(c, GRAPH) for c in cycles)


def test_no_import_cycles_between_subpackages():
    """Importing any submodule of a package runs the package's ``__init__`` first, so two
    subpackages importing each other form a cycle even when no two modules do."""
    graph = _package_graph()
    cycles = _cycles({m: set(edges) for m, edges in graph.items()})
    detail = []
    for component in cycles:
        members = set(component)
        detail.append(" <-> ".join(component))
        for module, edges in sorted(GRAPH.items()):
            for target, line in sorted(edges.items()):
                src, dst = _subpackage(module), _subpackage(target)
                if src != dst and src in members and dst in members:
                    detail.append(f"  {module} -> {target} (line {line})")
    assert not cycles, "subpackage import cycles:\n" + "\n".join(detail)


@pytest.mark.parametrize("a, b", [
    ("autodeploy.transform", "autodeploy.compile"),
    ("autodeploy.export.patches", "autodeploy.export.family_patches"),
])
def test_named_pairs_do_not_import_each_other(a, b):
    """The two cycles this test was written for, named so that a regression says which."""
    def reaches(src: str, dst: str) -> bool:
        seen, todo = set(), [m for m in MODULES if _within(m, (src,))]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            if _within(m, (dst,)):
                return True
            todo.extend(GRAPH.get(m, ()))
        return False

    assert not (reaches(a, b) and reaches(b, a)), f"{a} and {b} import each other"


def test_ir_never_imports_the_serving_side():
    bad = [f"{module} -> {target} (line {line})"
           for module, edges in sorted(GRAPH.items()) if _within(module, IR_PACKAGES)
           for target, line in sorted(edges.items()) if _within(target, SERVING_SIDE)]
    assert not bad, "the IR imports the serving side:\n" + "\n".join(bad)


def test_compile_and_cache_never_import_the_transforms():
    """The compile backends and the cache run the graph the transforms produce; helpers both sides
    need live outside the transform package (``autodeploy.utils.fx``)."""
    bad = [f"{module} -> {target} (line {line})"
           for module, edges in sorted(GRAPH.items()) if _within(module, ("autodeploy.compile", "autodeploy.cache"))
           for target, line in sorted(edges.items()) if _within(target, ("autodeploy.transform",))]
    assert not bad, "\n".join(bad)


def test_importing_the_package_leaves_dynamo_and_inductor_unimported():
    """``import autodeploy`` and its entry points (``LLM``, the pipeline, the CLI, the server) do not
    import ``torch._inductor`` / ``torch._dynamo`` (2.1 s of ``import autodeploy.llm`` here): the
    pattern matcher imports inductor's on first use. A fresh interpreter: this process imported
    them long ago."""
    import subprocess
    import sys

    code = ("import sys, autodeploy, autodeploy.llm, autodeploy.pipeline, autodeploy.cli, autodeploy.serve, "
            "autodeploy.transform.library; "
            "print(sorted(m for m in sys.modules if m.startswith(('torch._inductor', 'torch._dynamo'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT.parent, check=True)
    assert out.stdout.strip() == "[]", out.stdout[:500]
