"""The generic export patches, for quirks of HF modelling code in any family (the per-family ones
are in ``family_patches``); both register in ``patch_registry``, which says what a patch is.
"""

from contextlib import contextmanager
from typing import Callable, ContextManager, Dict, Iterator, Optional, Tuple

import torch
from torch import nn

from .patch_registry import register_export_patch


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

    try:
        with _torch_function_replaced("tensor", tensor):
            yield
    finally:
        _META_CONSTANTS.clear()


@contextmanager
def _torch_function_replaced(name: str, replacement: Callable) -> Iterator[None]:
    """``torch.<name>`` is ``replacement`` for the duration (the original is restored on exit)."""
    original = getattr(torch, name)
    setattr(torch, name, replacement)
    try:
        yield
    finally:
        setattr(torch, name, original)


@register_export_patch(
    "histc_float_input",
    "transformers' grouped_mm experts count tokens per expert with torch.histc on int ids except on CPU; traced on "
    "the meta device it takes the int path, which CPU kernels lack: count on float ids (exact below 2**24) everywhere",
)
@contextmanager
def _histc_float_input(model: nn.Module) -> Iterator[None]:
    original = torch.histc

    def histc(input: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return original(input if input.is_floating_point() else input.float(), *args, **kwargs)

    with _torch_function_replaced("histc", histc):
        yield
