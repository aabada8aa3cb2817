"""Load checkpoint tensors straight into a (graph) module's parameters and buffers.

For each parameter or buffer name the loader finds its source in this order: the checkpoint
tensor of the same name; a load hook (renamed or combined tensors); the same name with the
model's base prefix added or removed; the name it is tied to; the value the buffer had when
the model was built (RoPE tables and other non-persistent buffers). Anything left is an error
that lists the names, so a wrong checkpoint never runs on uninitialised memory.

Floating tensors are cast to the deployment dtype, but never across kinds: FP8/FP4 or integer
(packed) data for a floating parameter is an error, and so are unused tensors named like the
scales of a quantization format (a quantized checkpoint must not load as garbage; see
``quantization``). Other unused tensors are only a warning.
"""

from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set

import torch
from torch import nn

from ..utils.errors import ModelSourceError
from ..utils.logging import get_logger
from .checkpoint import CheckpointIndex, CheckpointReader
from .load_hooks import LoadHook
from .quantization import check_tensor_dtype, companions_error, quantization_companions

logger = get_logger(__name__)


@dataclass
class LoadReport:
    loaded: int = 0
    from_hooks: int = 0
    from_initial: int = 0
    tied: int = 0
    unused: List[str] = field(default_factory=list)
    bytes: int = 0


def _set_tensor(module: nn.Module, name: str, tensor: torch.Tensor, is_param: bool) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if is_param:
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[leaf] = tensor


def _prefix_variants(name: str, prefixes: Sequence[str]) -> List[str]:
    out = []
    for p in prefixes:
        if name.startswith(p + "."):
            out.append(name[len(p) + 1 :])
        else:
            out.append(f"{p}.{name}")
    return out


def load_into_module(
    module: nn.Module,
    index: CheckpointIndex,
    *,
    device: torch.device,
    dtype: torch.dtype,
    hooks: Sequence[LoadHook] = (),
    tied: Optional[Dict[str, str]] = None,
    initial_buffers: Optional[Dict[str, torch.Tensor]] = None,
    base_prefixes: Sequence[str] = ("model",),
    show_progress: bool = False,
    accounted: Iterable[str] = (),
    shards: Optional[Dict[str, Any]] = None,
) -> LoadReport:
    """Fill every parameter and buffer of ``module``; floating params are cast to ``dtype``.
    ``accounted``: checkpoint tensors a transform decided not to load (not reported as unused).
    ``shards``: parameter name -> an object whose ``take(tensor)`` returns the slice this rank
    holds (tensor parallelism); only that slice is copied out of the memory-mapped file, and for
    a parameter a hook stacks along dim 0 (``resolve_rows``: experts) only that slice's sources
    are read."""
    shards = shards or {}
    tied = tied or {}
    initial_buffers = initial_buffers or {}
    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    targets = {**{n: True for n in params}, **{n: False for n in buffers}}
    report = LoadReport()
    used: Set[str] = set()
    missing: List[str] = []
    loaded: Dict[str, torch.Tensor] = {}
    progress = None
    if show_progress:
        from tqdm import tqdm

        progress = tqdm(total=index.total_bytes(), unit="B", unit_scale=True, desc="loading weights")
    with CheckpointReader(index) as reader:

        def fetch(key: str, target: str, decoded: bool = False) -> torch.Tensor:
            used.add(key)
            t = reader.get(key)
            current = params[target] if target in params else buffers[target]
            expected = dtype if target in params and current.is_floating_point() else current.dtype
            if not decoded:  # a decoding hook reads quantized data on purpose
                check_tensor_dtype(key, t.dtype, target, expected)  # before a hook combines or we cast it
            if progress is not None:
                progress.update(t.numel() * t.element_size())
            return t

        # Tied names form groups; a checkpoint may store the shared tensor under any member.
        groups: Dict[str, List[str]] = {}
        for alias, canonical in tied.items():
            groups.setdefault(canonical, [canonical]).append(alias)
        group_of = {n: members for members in groups.values() for n in members}

        def find_rows(name: str) -> Optional[torch.Tensor]:
            """This rank's rows of a parameter a hook stacks along dim 0 (expert parallelism over
            stacked experts), read from only the checkpoint tensors those rows are made of."""
            shard = shards.get(name)
            if shard is None or getattr(shard, "dim", None) != 0:
                return None
            for hook in hooks:
                rows = getattr(hook, "resolve_rows", None)
                resolved = rows(name, shard.index, shard.parts) if rows is not None else None
                if resolved is not None and all(k in reader for k in resolved[0] + resolved[1]):
                    report.from_hooks += 1
                    used.update(resolved[1])  # the other ranks' part: accounted for, not unused
                    return resolved[2]([fetch(k, name) for k in resolved[0]])
            return None

        def find(name: str, target: str) -> Optional[torch.Tensor]:
            if name in reader:
                return fetch(name, target)
            for hook in hooks:
                resolved = hook.resolve(name)
                if resolved is not None and all(k in reader for k in resolved[0]):
                    report.from_hooks += 1
                    decoded = getattr(hook, "decodes", False)
                    return resolved[1]([fetch(k, target, decoded) for k in resolved[0]])
            alt = next((a for a in _prefix_variants(name, base_prefixes) if a in reader), None)
            return fetch(alt, target) if alt is not None else None

        for name, is_param in targets.items():
            current = params[name] if is_param else buffers[name]
            partner = next((loaded[m] for m in group_of.get(name, []) if m in loaded), None)
            if partner is not None:
                _set_tensor(module, name, partner, is_param)
                report.tied += 1
                continue
            source = find_rows(name) if name not in reader else None
            sharded = source is not None  # already this rank's rows
            if source is None:
                for candidate in [name] + [m for m in group_of.get(name, []) if m != name]:
                    source = find(candidate, name)
                    if source is not None:
                        break
            if source is None and not is_param and name in initial_buffers:
                report.from_initial += 1
                tensor = initial_buffers[name]
                if name in shards:  # a built buffer split by the sharding plan (Falcon-H1's mup_vector)
                    tensor = shards[name].take(tensor)
                tensor = tensor.to(device=device)  # buffers keep their dtype (fp32 RoPE tables)
            elif source is None:
                missing.append(name)
                continue
            else:
                if name in shards and not sharded:
                    try:
                        source = shards[name].take(source)
                    except ValueError as err:
                        raise ModelSourceError(f"checkpoint tensor for '{name}': {err}") from None
                if tuple(source.shape) != tuple(current.shape):
                    raise ModelSourceError(
                        f"checkpoint tensor for '{name}' has shape {tuple(source.shape)}, the model expects "
                        f"{tuple(current.shape)}; does the checkpoint match its config.json?"
                    )
                cast = dtype if source.is_floating_point() and is_param else source.dtype
                tensor = source.to(device=device, dtype=cast).contiguous()
            loaded[name] = tensor
            report.loaded += 1
            report.bytes += tensor.numel() * tensor.element_size()
            _set_tensor(module, name, tensor, is_param)
    if progress is not None:
        progress.close()
    report.unused = sorted(set(index.weight_map) - used - set(accounted))
    # Scales of a quantization format the model does not use: the checkpoint is quantized (its
    # weights are missing or were refused above); say so rather than only what is missing.
    companions = quantization_companions(report.unused)
    if companions:
        raise companions_error(index.directory, companions, missing)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelSourceError(f"checkpoint {index.directory} has no tensor for {shown}")
    if report.unused:
        logger.warning(
            "%d checkpoint tensors were not used (e.g. %s)", len(report.unused), ", ".join(report.unused[:3])
        )
    return report
