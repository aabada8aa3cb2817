"""Load hooks derived from transformers' own weight conversions.

transformers 5 builds some parameters from checkpoint tensors while loading: per-expert weights
stacked into one tensor (``MergeModulelist``), q/k/v convolutions concatenated into one
(``Concatenate``), a fused projection split in parts (``Chunk``), a fused gate/up projection
de-interleaved (``Interleave``), a transpose or a RoPE permutation. Where our export keeps
transformers' module layout, the graph has the converted parameter and the checkpoint only the
sources. Rather than writing a hook per model, each converter of the model becomes a hook that
finds the sources for a parameter name and runs the converter's own operation objects on them,
so the numerics are transformers' and a new model's converters work without a change here.

A rank of an expert-parallel build holds only some rows of a stacked experts parameter: for
converters that stack per-expert tensors along dim 0 first, ``resolve_rows`` names just the
experts of those rows, so the rank never reads (or stacks) the others.

Only operations whose result depends on nothing but the tensors and the config are replayed
(``REPLAYABLE_OPS``); the others (quantisation, ops that look up the live model's parameters)
are left out, so such a parameter stays missing and the loader says which.
"""

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..utils.logging import get_logger

logger = get_logger(__name__)

# transformers' ConversionOps subclasses whose ``convert`` reads only the tensors (and the config).
REPLAYABLE_OPS = (
    "MergeModulelist", "SplitModulelist", "Concatenate", "Chunk", "Interleave", "Transpose", "PermuteForRope",
)
# Of those, the ones that read the model's config (without it they would silently assume defaults,
# e.g. one attention head).
CONFIG_OPS = ("PermuteForRope",)


def _pattern(text: str) -> str:
    """A converter pattern as a regex: ``*`` is an expert/layer index."""
    return text.replace("*", r"(\d+)")


def _index_of(match: "re.Match[str]") -> Tuple[int, ...]:
    return tuple(int(g) for g in match.groups() if g is not None and g.isdigit())


def replayable(op: Any, has_config: bool) -> bool:
    """Whether ``op`` (a transformers ``ConversionOps``) can run outside transformers' loader: one
    of ``REPLAYABLE_OPS``, not a shape-checking transpose (that one asks the model for the target
    parameter's shape), and with the config where it reads one."""
    name = type(op).__name__
    needs_config = name in CONFIG_OPS or getattr(op, "num_shards_attribute", None) is not None
    return name in REPLAYABLE_OPS and not getattr(op, "check_dims", False) and (has_config or not needs_config)


@dataclass
class ConversionHook:
    """One converter applied to the checkpoint's key list: ``sources`` / ``targets`` are its
    original patterns (for finding names), ``converter`` the transformers object whose operations
    turn the source tensors into the targets."""

    converter: Any
    keys: Collection[str]
    to_checkpoint_name: Callable[[str], str] = lambda name: name
    config: Any = None
    sources: List[str] = field(init=False)
    targets: List[str] = field(init=False)

    def __post_init__(self) -> None:
        conv = self.converter
        self.sources = list(getattr(conv, "_original_source_patterns", conv.source_patterns))
        self.targets = list(getattr(conv, "_original_target_patterns", conv.target_patterns))

    @property
    def description(self) -> str:
        ops = ", ".join(repr(op) for op in self.converter.operations)
        return f"{' + '.join(self.sources)} -> {' | '.join(self.targets)} via {ops}"

    def resolve(self, name: str) -> Optional[Tuple[List[str], Callable[[List[torch.Tensor]], torch.Tensor]]]:
        """The checkpoint keys that make parameter ``name`` and how to combine them, or None."""
        for target_index, groups in self._matches(name):
            return [k for g in groups for k in g], self._combiner([len(g) for g in groups], target_index, name)
        return None

    def resolve_rows(self, name: str, index: int, parts: int) -> Optional[Tuple[List[str], List[str], Callable[
            [List[torch.Tensor]], torch.Tensor]]]:
        """Like :meth:`resolve` for part ``index`` of ``parts`` equal parts of the parameter's dim 0,
        reading only the sources that part is made of: ``(keys read, keys of the other parts,
        combine)``. Only for converters that stack per-index tensors along dim 0 first
        (``MergeModulelist(dim=0)``, then at most a ``Concatenate`` along another dim: a MoE's
        experts), whose result's rows are the stacked indices; else None (load whole, then slice).
        Why: a rank of an expert-parallel build would otherwise read and stack every expert of a
        layer to keep a few."""
        kinds = [(type(op).__name__, getattr(op, "dim", None)) for op in self.converter.operations]
        if not kinds or kinds[0] != ("MergeModulelist", 0) or any(
            kind != "Concatenate" or not dim for kind, dim in kinds[1:]
        ) or len(kinds) > 2 or not all("*" in source for source in self.sources):
            return None
        for target_index, groups in self._matches(name):
            if any(len(g) != len(groups[0]) or len(g) % parts for g in groups):
                continue
            step = len(groups[0]) // parts
            mine = [g[index * step:(index + 1) * step] for g in groups]
            others = [k for g in groups for i, k in enumerate(g) if not index * step <= i < (index + 1) * step]
            return [k for g in mine for k in g], others, self._combiner([step] * len(mine), target_index, name)
        return None

    def _matches(self, name: str) -> Iterator[Tuple[int, List[List[str]]]]:
        """(target index, the checkpoint keys of each source pattern) for every place a target
        pattern names parameter ``name`` and the checkpoint holds all the sources."""
        ckpt = self.to_checkpoint_name(name)
        for target_index, target in enumerate(self.targets):
            for match in re.finditer(_pattern(target), ckpt):
                if match.end() != len(ckpt) and not ckpt[match.end()] == ".":
                    continue
                groups = self._source_groups(ckpt[: match.start()], ckpt[match.end():])
                if groups is not None:
                    yield target_index, groups

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

    def _combiner(self, sizes: List[int], target_index: int,
                  name: str) -> Callable[[List[torch.Tensor]], torch.Tensor]:
        """Run the converter's operations the way transformers' loader does: a dict from each
        (processed) source pattern to its tensors in index order, through each op in turn; the
        result is keyed by target pattern."""
        conv = self.converter

        def combine(tensors: List[torch.Tensor]) -> torch.Tensor:
            values: Dict[str, Any] = {}
            start = 0
            for pattern, n in zip(conv.source_patterns, sizes):
                values[pattern] = list(tensors[start:start + n])
                start += n
            with torch.no_grad():
                for op in conv.operations:
                    values = op.convert(values, source_patterns=list(conv.source_patterns),
                                        target_patterns=list(conv.target_patterns), full_layer_name=name,
                                        model=None, config=self.config, missing_keys=None)
            return _pick(values, conv.target_patterns[target_index])

        return combine


def _pick(values: Dict[str, Any], target: str) -> torch.Tensor:
    """The converted tensor for ``target``: its own entry, or the only one there is."""
    out = values.get(target)
    if out is None and len(values) == 1:
        out = next(iter(values.values()))
    if out is None:
        raise KeyError(f"weight conversion produced {sorted(values)}, not {target}")
    return out if isinstance(out, torch.Tensor) else out[0]


def conversion_hooks(converters: Sequence[Any], keys: Collection[str],
                     to_checkpoint_name: Callable[[str], str], config: Any = None) -> List[ConversionHook]:
    """Hooks for the converters whose operations we can replay (``config``: the model's, which
    some operations read, e.g. the head count of a RoPE permutation)."""
    hooks = []
    for conv in converters:
        ops = getattr(conv, "operations", None)
        if not ops:
            continue  # a renaming
        if not all(replayable(op, config is not None) for op in ops):
            logger.debug("weight converter with operations %s is not replayed", ops)
            continue
        hooks.append(ConversionHook(conv, keys, to_checkpoint_name, config))
    return hooks
