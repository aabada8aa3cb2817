"""The model registry: named, tested deployments of known models.

The entries and their YAML fragments are data under ``autodeploy/models/registry/`` (beside
the presets); this module, in ``config`` because composing an entry is part of building a
deployment config, reads and checks them.

An entry names a model (a preset, a checkpoint directory or a hub id), the YAML fragments under
``configs/`` that deploy it well (composed in order), and the ranks it needs. It exists so that
a deployment someone worked out once (which experts to keep quantized, which compile backend,
which KV-cache dtype) is one name to type, not a set of YAML files to copy around:
``autodeploy run --model NAME --use-registry``. ``load_deploy_config(registry=NAME)`` composes
an entry (default.yaml, then the entry, then the user's own files and settings); this module only
reads and checks the registry itself.
"""

import difflib
import functools
import os
import re
from typing import Dict, List, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..utils.errors import ConfigError

REGISTRY_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models", "registry")
REGISTRY_YAML = os.path.join(REGISTRY_DIR, "models.yaml")
CONFIGS_DIR = os.path.join(REGISTRY_DIR, "configs")
# The most ranks one process runs on its own. An entry that needs more is deployed by the CLI,
# which starts its ranks (``autodeploy run|serve|export --world-size``, ``autodeploy.distributed.launcher``),
# or inside a torch.distributed group of that size (torchrun, then LLM(registry=...) in each rank).
SUPPORTED_WORLD_SIZE = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class RegistryEntry(BaseModel):
    """One named deployment of ``models.yaml``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(description="What --model takes; no '/', so a name is never mistaken for a hub id.")
    model: str = Field(description="Preset name, checkpoint directory or hub id (org/name).")
    yaml: List[str] = Field(default_factory=list,
                            description="Fragment files under configs/, composed in order (later ones win).")
    world_size: int = Field(default=1, ge=1, description="Ranks the deployment needs.")
    description: str = Field(default="", description="One line for 'autodeploy models'.")

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(f"'{value}' is not an entry name: use letters, digits, '.', '_' and '-' (no '/')")
        return value

    @field_validator("yaml")
    @classmethod
    def _check_fragments(cls, value: List[str]) -> List[str]:
        for fragment in value:
            if os.path.isabs(fragment) or os.path.normpath(fragment).startswith(".."):
                raise ValueError(f"fragment '{fragment}' must be a file name under configs/")
        return value


class _RegistryFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    models: List[RegistryEntry] = Field(default_factory=list)


@functools.lru_cache(maxsize=None)
def _load(path: str) -> Dict[str, RegistryEntry]:
    from .merge import load_yaml_file

    data = load_yaml_file(path)
    try:
        parsed = _RegistryFile.model_validate(data)
    except ValidationError as err:
        problems = []
        for e in err.errors():
            loc = list(e["loc"])
            where = "'" + ".".join(str(p) for p in loc) + "'"
            if len(loc) >= 2 and loc[0] == "models" and isinstance(loc[1], int):
                raw = (data.get("models") or [])[loc[1]]
                name = raw.get("name") if isinstance(raw, dict) else None
                where = f"entry {name!r}" if name else f"entry #{loc[1] + 1}"
                where += f", field '{'.'.join(str(p) for p in loc[2:])}'" if loc[2:] else ""
            problems.append(f"{where}: {e['msg']}")
        raise ConfigError(f"model registry '{path}' is invalid: {'; '.join(problems)}") from None
    entries: Dict[str, RegistryEntry] = {}
    for entry in parsed.models:
        if entry.name in entries:
            raise ConfigError(f"model registry '{path}' names entry '{entry.name}' twice; names must be unique")
        entries[entry.name] = entry
    return entries


def load_registry(path: Optional[str] = None) -> Dict[str, RegistryEntry]:
    """Every entry by name, in file order (``path``: default ``REGISTRY_YAML``, the built-in
    one); each file is read once per process."""
    return dict(_load(os.path.abspath(path or REGISTRY_YAML)))


def registry_suggestions(name: str, path: Optional[str] = None) -> str:
    """`` (did you mean: ...?)`` with close spellings and the entries that contain what was typed
    (``qwen3`` -> ``qwen3-30b-a3b-fp8``), or ``""`` when none is close."""
    names = list(load_registry(path))
    found = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    found += [n for n in names if name.lower() in n.lower() and n not in found]
    return f" (did you mean: {', '.join(found[:3])}?)" if found else ""


def registry_entry(name: str, path: Optional[str] = None) -> RegistryEntry:
    """The entry called ``name``; an unknown name is an error listing the close ones."""
    entries = load_registry(path)
    if name not in entries:
        raise ConfigError(f"unknown registry entry '{name}'{registry_suggestions(name, path)}; "
                          f"'autodeploy models' lists the {len(entries)} entries")
    return entries[name]


def entry_yaml_files(entry: RegistryEntry, configs_dir: Optional[str] = None) -> List[str]:
    """The entry's fragments as absolute paths (under ``configs_dir``, default ``CONFIGS_DIR``), in
    composition order; a missing one is an error naming the entry and the file, before anything
    is read."""
    configs_dir = os.path.abspath(configs_dir or CONFIGS_DIR)
    paths = []
    for fragment in entry.yaml:
        path = os.path.join(configs_dir, fragment)
        if not os.path.isfile(path):
            raise ConfigError(f"registry entry '{entry.name}' names fragment '{fragment}', which does not exist in "
                              f"{configs_dir}; add the file or fix the entry's yaml list")
        paths.append(path)
    return paths


def is_registry_name(name: Optional[str], path: Optional[str] = None) -> bool:
    return name is not None and name in load_registry(path)


def check_world_size(entry: RegistryEntry, world_size: int, launching: bool = False) -> None:
    """A deployment of ``entry`` at ``world_size`` ranks can run here: one rank, a caller that
    starts the ranks itself (``launching``: the CLI), or a torch.distributed group of that size
    around this process (torchrun). Called with the composed value, so a user who sets world_size 1
    over an entry still gets to try it on one rank."""
    from ..distributed import process_group

    if world_size <= SUPPORTED_WORLD_SIZE or world_size != entry.world_size or launching:
        return
    if process_group.is_initialized() and process_group.world_size() == world_size:
        return
    raise ConfigError(
        f"registry entry '{entry.name}' needs {entry.world_size} ranks (world_size {entry.world_size}), but this "
        f"process is not one of a torch.distributed group of {entry.world_size}: deploy it with the CLI, which "
        f"starts the ranks ('autodeploy serve --model {entry.name} --use-registry'), or run it under torchrun "
        f"(each rank calling autodeploy.distributed.initialize() and LLM(registry='{entry.name}')), or set "
        f"world_size {SUPPORTED_WORLD_SIZE} to try it on one rank"
    )
