"""Export patches: context managers that make HF modelling code exportable or canonical.

Each patch is registered under a name, says in one line what quirk it handles, and can be
switched off from YAML (``transforms.export_to_gm.patches.<name>: false``). They only live for
the duration of one export, so HF eager runs in the same process are never affected.
"""

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, Iterator, List, Mapping

import torch
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


@register_export_patch("no_grad", "trace under torch.no_grad so HF's no_grad/autocast regions inline")
def _no_grad(model: nn.Module) -> ContextManager:
    return torch.no_grad()
