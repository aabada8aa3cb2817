"""Load hooks: how a model parameter is produced from checkpoint tensors when the names differ.

The loader first looks a parameter up by its own name; when that fails it asks each hook in
turn. A hook either renames (one checkpoint tensor) or combines several (concatenate along a
dim, or stack a new leading dim, e.g. per-expert weights into one 3-D tensor: ``StackExperts``
names its sources one by one and can read just an expert-parallel rank's part).
"""

import re
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class LoadHook:
    """``pattern`` matches a parameter name; ``sources`` are ``re`` replacement templates for
    the checkpoint names; ``combine`` turns the source tensors into the parameter."""

    pattern: str
    sources: Sequence[str]
    combine: Callable[[List[torch.Tensor]], torch.Tensor]
    description: str = ""
    # the sources are quantized data that ``combine`` decodes (packed int32 codes into a uint8 or
    # float buffer): the loader does not hold their dtypes against the parameter's
    decodes: bool = False

    def source_names(self, param_name: str) -> Optional[List[str]]:
        m = re.fullmatch(self.pattern, param_name)
        if m is None:
            return None
        return [m.expand(s) for s in self.sources]

    def resolve(self, param_name: str) -> Optional[Tuple[List[str], Callable[[List[torch.Tensor]], torch.Tensor]]]:
        """The checkpoint keys for ``param_name`` and how to combine them (the loader's interface;
        ``conversion_hooks.ConversionHook`` has the same, and both may have ``decodes``)."""
        keys = self.source_names(param_name)
        return (keys, self.combine) if keys is not None else None


def rename(pattern: str, source: str) -> LoadHook:
    return LoadHook(pattern, [source], lambda ts: ts[0], f"rename {source} -> {pattern}")


def concat(pattern: str, sources: Sequence[str], dim: int = 0) -> LoadHook:
    return LoadHook(pattern, list(sources), lambda ts: torch.cat(ts, dim=dim), f"cat({', '.join(sources)})")


def stack(pattern: str, sources: Sequence[str], dim: int = 0) -> LoadHook:
    return LoadHook(pattern, list(sources), lambda ts: torch.stack(ts, dim=dim), f"stack({', '.join(sources)})")


@dataclass(frozen=True)
class StackExperts:
    """One ``[E, ...]`` tensor of stacked experts made of one checkpoint tensor per expert (a
    quantized format's weights or scales: ``quantize_*_moe_from_config``), cast to ``dtype``
    (scales stored in bfloat16 become the float32 the op reads; quantized data keeps its own).

    ``resolve_rows`` gives an expert-parallel rank only its experts' tensors (the loader's
    ``find_rows``), as ``conversion_hooks.ConversionHook.resolve_rows`` does for float experts."""

    name: str
    keys: Tuple[str, ...]  # expert e's checkpoint tensor is keys[e]
    dtype: torch.dtype
    description: str = ""

    def _combine(self, tensors: List[torch.Tensor]) -> torch.Tensor:
        return torch.stack(tensors).to(self.dtype)

    def resolve(self, param_name: str) -> Optional[Tuple[List[str], Callable[[List[torch.Tensor]], torch.Tensor]]]:
        return (list(self.keys), self._combine) if param_name == self.name else None

    def resolve_rows(self, param_name: str, index: int, parts: int) -> Optional[Tuple[List[str], List[str], Callable[
            [List[torch.Tensor]], torch.Tensor]]]:
        """(keys of part ``index`` of ``parts`` equal blocks of experts, the other keys, combine)."""
        if param_name != self.name or len(self.keys) % parts:
            return None
        step = len(self.keys) // parts
        start, end = index * step, (index + 1) * step
        return list(self.keys[start:end]), list(self.keys[:start] + self.keys[end:]), self._combine
