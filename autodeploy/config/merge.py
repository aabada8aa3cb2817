"""YAML layering: deep merge and dotted overrides."""

import copy
from typing import Any, Dict, List, Mapping, Sequence

import yaml

from ..utils.errors import ConfigError


def deep_merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> Dict[str, Any]:
    """``update`` over ``base``: mappings merge key by key, anything else replaces.

    Keys keep the order of ``base`` with new keys appended, which is the order transforms run
    in within a stage.
    """
    out = copy.deepcopy(dict(base))
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        elif value is None and isinstance(out.get(key), Mapping):
            continue  # `key:` with nothing under it keeps the defaults
        else:
            out[key] = copy.deepcopy(value)
    return out


def load_yaml_file(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"YAML file '{path}' does not exist") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"YAML file '{path}' is not valid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"YAML file '{path}' must hold a mapping of settings, not a {type(data).__name__}")
    return dict(data)


def set_dotted(target: Dict[str, Any], dotted: str, value: Any) -> None:
    parts = [p.replace("-", "_") for p in dotted.split(".") if p]
    if not parts:
        raise ConfigError(f"empty override key '{dotted}'")
    node = target
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}' goes below '{part}', which is not a mapping")
        node = child
    node[parts[-1]] = value


def parse_dotted_overrides(tokens: Sequence[str]) -> Dict[str, Any]:
    """``['--a.b', '1', '--c=x']`` -> ``{'a': {'b': 1}, 'c': 'x'}``; values are parsed as YAML."""
    out: Dict[str, Any] = {}
    i = 0
    items: List[str] = list(tokens)
    while i < len(items):
        token = items[i]
        if not token.startswith("--") or len(token) <= 2:
            raise ConfigError(f"unexpected argument '{token}': overrides look like --key.sub value")
        key = token[2:]
        if "=" in key:
            key, raw = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(items) or (items[i + 1].startswith("--") and len(items[i + 1]) > 2):
                raise ConfigError(f"override '--{key}' needs a value")
            raw = items[i + 1]
            i += 2
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        set_dotted(out, key, value)
    return out
