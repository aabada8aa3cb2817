"""Export patches: context managers that make HF modelling code exportable or canonical.

Each patch is registered under a name, says in one line what quirk it handles, and can be
switched off from YAML (``transforms.export_to_gm.patches.<name>: false``). They only live for
the duration of one export, so HF eager runs in the same process are never affected.
"""

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Callable, ContextManager, Dict, Iterator, List, Mapping, Optional, Tuple

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


def _is_int_list(obj: object) -> bool:
    return isinstance(obj, list) and bool(obj) and all(isinstance(v, (int, bool)) for v in obj)


@register_export_patch(
    "list_index_constants",
    "index with a CPU tensor where the code indexes with a Python list (x[..., [-2], :]): on the meta device "
    "the list becomes a meta constant whose values are lost",
)
@contextmanager
def _list_index_constants(model: nn.Module) -> Iterator[None]:
    from torch.overrides import TorchFunctionMode

    def as_tensor(index: object) -> object:
        return torch.tensor(index) if _is_int_list(index) else index

    class ListIndexAsTensor(TorchFunctionMode):
        """Only ``tensor[...list...]`` is rewritten; every other call passes through untouched
        (replacing ``Tensor.__getitem__`` itself would change how export traces every slice)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func is torch.Tensor.__getitem__ and len(args) == 2:
                index = args[1]
                if isinstance(index, tuple) and any(_is_int_list(i) for i in index):
                    args = (args[0], tuple(as_tensor(i) for i in index))
                elif _is_int_list(index):
                    args = (args[0], as_tensor(index))
            return func(*args, **(kwargs or {}))

    with ListIndexAsTensor():
        yield


# torch.tensor(...) results created on the meta device during the current export: id -> (meta, cpu value)
_META_CONSTANTS: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}


def real_value_of_meta_constant(tensor: torch.Tensor) -> Optional[torch.Tensor]:
    """The CPU value of a constant the model built with ``torch.tensor(data, device=<meta>)``
    during this export (``None`` when it was not one)."""
    entry = _META_CONSTANTS.get(id(tensor))
    return entry[1] if entry is not None and entry[0] is tensor else None


@register_export_patch(
    "meta_tensor_constants",
    "remember the values of torch.tensor(data, device=...) constants a forward builds on the meta device "
    "(masks' fill values, index lists), which the meta tensor itself cannot hold",
)
@contextmanager
def _meta_tensor_constants(model: nn.Module) -> Iterator[None]:
    original = torch.tensor

    def tensor(data: object, *args: object, **kwargs: object) -> torch.Tensor:
        out = original(data, *args, **kwargs)
        if out.is_meta and not isinstance(data, torch.Tensor):
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():  # export traces under a fake mode: make a real tensor
                value = original(data, *args, **{**kwargs, "device": "cpu"})
            _META_CONSTANTS[id(out)] = (out, value)
        return out

    torch.tensor = tensor  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.tensor = original  # type: ignore[assignment]
        _META_CONSTANTS.clear()


from . import family_patches  # noqa: E402,F401  (registers the per-family patches)
