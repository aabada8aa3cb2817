"""The registry of export patches: context managers that make HF modelling code exportable or
canonical, each registered under a name with a one-line description of the quirk it handles.

Every patch can be switched off from YAML (``transforms.export_to_gm.patches.<name>: false``) and
only lives for the duration of one export, so HF eager runs in the same process are never affected.
This module imports no patch: the generic ones (``patches``) and the per-family ones
(``family_patches``) register here, and ``autodeploy/export/__init__.py`` imports both, so they
are registered as soon as anything under ``autodeploy.export`` is imported.
"""

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, Iterator, List, Mapping

from torch import nn


@dataclass(frozen=True)
class ExportPatch:
    name: str
    description: str
    factory: Callable[[nn.Module], ContextManager]


_PATCHES: Dict[str, ExportPatch] = {}


def register_export_patch(name: str, description: str):
    def decorator(fn: Callable[[nn.Module], ContextManager]) -> Callable[[nn.Module], ContextManager]:
        _PATCHES[name] = ExportPatch(name, description, fn)
        return fn

    return decorator


def export_patches() -> List[ExportPatch]:
    return [_PATCHES[k] for k in sorted(_PATCHES)]


@contextmanager
def apply_export_patches(model: nn.Module, enabled: Mapping[str, bool]) -> Iterator[None]:
    unknown = sorted(set(enabled) - set(_PATCHES))
    if unknown:
        raise ValueError(f"unknown export patch(es) {unknown}; known: {sorted(_PATCHES)}")
    with ExitStack() as stack:
        for patch in export_patches():
            if enabled.get(patch.name, True):
                stack.enter_context(patch.factory(model))
        yield


@contextmanager
def replaced_forwards(forwards: Mapping[type, Callable]) -> Iterator[None]:
    """Each class's ``forward`` replaced for the block and restored after (also when the class
    only inherited it: the override is then deleted again) — what a patch that rewrites one
    module type's forward for the export needs."""
    originals = {cls: cls.__dict__.get("forward") for cls in forwards}
    for cls, forward in forwards.items():
        cls.forward = forward
    try:
        yield
    finally:
        for cls, original in originals.items():
            if original is None:
                del cls.forward
            else:
                cls.forward = original


@contextmanager
def replaced_attribute(obj: object, name: str, value: object) -> Iterator[None]:
    """``obj.name = value`` for the block, then as before: the old value put back, or the attribute
    deleted again when ``obj`` did not hold it itself (an instance's ``forward`` override, a
    class's method that it inherited) -- for patches that swap one function or flag."""
    had, old = name in vars(obj), vars(obj).get(name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if had:
            setattr(obj, name, old)
        else:
            delattr(obj, name)
