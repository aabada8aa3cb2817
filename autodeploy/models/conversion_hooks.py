"""Load hooks derived from transformers' own weight conversions.

transformers 5 builds some parameters from several checkpoint tensors while loading: per-expert
weights stacked into one tensor (``MergeModulelist``), q/k/v convolutions concatenated into one
(``Concatenate``), a fused projection split in parts (``Chunk``). Where our export keeps
transformers' module layout, the graph has the converted parameter and the checkpoint only the
sources. Rather than writing a hook per model, each converter of the model becomes a hook that
finds the sources for a parameter name and applies the same operations. Converters with other
operations (transposes, permutations, quantisation) are not translated, so such a parameter
stays missing and the loader says which.
"""

import re
from dataclasses import dataclass
from typing import Any, Callable, Collection, List, Optional, Sequence, Tuple

import torch

from ..utils.logging import get_logger

logger = get_logger(__name__)

_SUPPORTED_OPS = ("MergeModulelist", "Concatenate", "Chunk")


def _pattern(text: str) -> str:
    """A converter pattern as a regex: ``*`` is an expert/layer index."""
    return text.replace("*", r"(\d+)")


def _index_of(match: "re.Match[str]") -> Tuple[int, ...]:
    return tuple(int(g) for g in match.groups() if g is not None and g.isdigit())


@dataclass
class ConversionHook:
    """One converter (sources -> targets, operations) applied to the checkpoint's key list."""

    sources: Sequence[str]
    targets: Sequence[str]
    operations: Sequence[Tuple[str, int]]  # (op name, dim)
    keys: Collection[str]
    to_checkpoint_name: Callable[[str], str] = lambda name: name

    @property
    def description(self) -> str:
        ops = ", ".join(f"{op}({dim})" for op, dim in self.operations)
        return f"{' + '.join(self.sources)} -> {' | '.join(self.targets)} via {ops}"

    def resolve(self, name: str) -> Optional[Tuple[List[str], Callable[[List[torch.Tensor]], torch.Tensor]]]:
        """The checkpoint keys that make parameter ``name`` and how to combine them, or None."""
        ckpt = self.to_checkpoint_name(name)
        for target_index, target in enumerate(self.targets):
            for match in re.finditer(_pattern(target), ckpt):
                if match.end() != len(ckpt) and not ckpt[match.end()] == ".":
                    continue
                groups = self._source_groups(ckpt[: match.start()], ckpt[match.end():])
                if groups is not None:
                    return [k for g in groups for k in g], self._combiner([len(g) for g in groups], target_index)
        return None

    def _source_groups(self, prefix: str, suffix: str) -> Optional[List[List[str]]]:
        groups = []
        for source in self.sources:
            rx = re.compile(re.escape(prefix) + _pattern(source.lstrip("^")) + re.escape(suffix) + "$")
            found = sorted(((m, k) for k in self.keys if (m := rx.match(k))), key=lambda mk: _index_of(mk[0]))
            if not found:
                return None
            if "*" not in source and len(found) != 1:
                return None
            groups.append([k for _, k in found])
        return groups

    def _combiner(self, sizes: List[int], target_index: int) -> Callable[[List[torch.Tensor]], torch.Tensor]:
        def combine(tensors: List[torch.Tensor]) -> torch.Tensor:
            groups, start = [], 0
            for n in sizes:
                groups.append(tensors[start:start + n])
                start += n
            values: List[Any] = groups
            for op, dim in self.operations:
                if op == "MergeModulelist":
                    values = [torch.stack(g, dim=dim) for g in values]
                else:
                    flat = [v if isinstance(v, torch.Tensor) else v[0] for v in values]
                    if op == "Concatenate":
                        values = [torch.cat(flat, dim=dim)]
                    else:  # Chunk: one source into one part per target
                        values = [torch.chunk(flat[0], len(self.targets), dim=dim)[target_index]]
            out = values[0]
            return out if isinstance(out, torch.Tensor) else out[0]

        return combine


def conversion_hooks(converters: Sequence[Any], keys: Collection[str],
                     to_checkpoint_name: Callable[[str], str]) -> List[ConversionHook]:
    """Hooks for the converters whose operations we can replay."""
    hooks = []
    for conv in converters:
        ops = getattr(conv, "operations", None)
        if not ops:
            continue  # a renaming
        names = [type(op).__name__ for op in ops]
        if any(n not in _SUPPORTED_OPS for n in names):
            logger.debug("weight converter with operations %s is not replayed", names)
            continue
        hooks.append(ConversionHook(
            sources=list(getattr(conv, "_original_source_patterns", conv.source_patterns)),
            targets=list(getattr(conv, "_original_target_patterns", conv.target_patterns)),
            operations=[(type(op).__name__, int(getattr(op, "dim", 0))) for op in ops],
            keys=keys, to_checkpoint_name=to_checkpoint_name,
        ))
    return hooks
