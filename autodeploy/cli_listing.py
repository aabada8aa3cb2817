"""``autodeploy transforms`` and ``autodeploy models``: what the pipeline and the presets hold."""

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional, Sequence

from .utils.errors import AutoDeployError

STAGES_HELP = ("only the transforms of this stage; stages in run order: factory, export, post_export, "
               "pattern_matcher, sharding, weight_load, post_load_fusion, cache_init, visualize, compile")


def stage_names() -> List[str]:
    """The pipeline's stages in the order they run."""
    from .transform.interface import Stage

    return [s.value for s in sorted(Stage, key=lambda s: s.order)]


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("transforms", parents=[common], help="list every registered transform with its config fields",
                       description="List the transforms in the order they run (stage, then pipeline order), "
                       "whether each is on by default, what it does, and its config fields.")
    p.add_argument("--stage", metavar="STAGE", help=STAGES_HELP)
    p.add_argument("--key", help="one transform, with all its fields (export_to_gm also lists the export patches)")
    p.add_argument("--json", action="store_true", help="print JSON (one object per transform) instead of text")
    p.set_defaults(func=cmd_transforms, accepts_overrides=False)

    p = sub.add_parser("models", parents=[common], help="list the built-in model presets and the model registry")
    p.add_argument("--json", action="store_true",
                   help='print JSON instead of text: {"presets": [one object per preset], "registry": [one object '
                   'per registry entry]}')
    p.set_defaults(func=cmd_models, accepts_overrides=False)


# ---- transforms --------------------------------------------------------------------------------
def transform_summary(cls: type) -> str:
    """The first paragraph of a transform module's docstring, without its ``key (stage):`` lead."""
    doc = (sys.modules[cls.__module__].__doc__ or "").strip()
    paragraph = " ".join(doc.split("\n\n")[0].split())
    head, sep, rest = paragraph.partition(": ")
    if sep and head.startswith("``") and "(" in head:  # "``key`` (stage): what it does"
        paragraph = rest
    return paragraph


def _field_rows(cfg_cls: type, yaml_fields: Dict[str, Any], all_fields: bool) -> List[Dict[str, Any]]:
    from .transform.interface import TransformConfig

    common = set(TransformConfig.model_fields) - {"stage"}
    rows = []
    for fname, finfo in cfg_cls.model_fields.items():
        if fname == "stage" or (fname in common and not all_fields and fname not in yaml_fields):
            continue
        default = yaml_fields.get(fname, finfo.get_default(call_default_factory=True))
        base = TransformConfig.model_fields.get(fname)
        description = finfo.description or (base.description if base is not None else "") or ""
        rows.append({"name": fname, "type": _type_name(finfo.annotation), "default": default,
                     "description": description})
    return rows


def _export_patches() -> List[Dict[str, str]]:
    from .export.patch_registry import export_patches

    return [{"name": p.name, "description": p.description} for p in export_patches()]


def _transform_row(name: str, cls: type, defaults: Dict[str, Any], all_fields: bool) -> Dict[str, Any]:
    cfg_cls = cls.get_config_class()
    in_default = name in defaults
    yaml_fields = defaults.get(name) or {}
    enabled = in_default and yaml_fields.get("enabled", cfg_cls.model_fields["enabled"].default)
    row = {"key": name, "stage": cfg_cls.model_fields["stage"].default.value, "default": "on" if enabled else "off",
           "in_default_pipeline": in_default, "summary": transform_summary(cls),
           "fields": _field_rows(cfg_cls, yaml_fields, all_fields),
           "requires": list(cls.requires), "run_after": list(cls.run_after)}
    if name == "export_to_gm":
        row["export_patches"] = _export_patches()
    return row


def transform_rows(stage: Optional[str], key: Optional[str]) -> List[Dict[str, Any]]:
    """One row per registered transform, in run order: by stage, then the default pipeline's order
    (transforms outside it last, by key)."""
    from .transform.interface import Stage, TransformRegistry
    from .transform.optimizer import close_matches

    stages = stage_names()
    if stage is not None and stage not in stages:  # checked before the library's slow import
        raise AutoDeployError(f"--stage: unknown stage '{stage}'{close_matches(stage, stages)}; stages in run order: "
                              f"{', '.join(stages)}")
    import autodeploy.transform.library  # noqa: F401  (registers transforms)
    from .config.deploy_config import DEFAULT_YAML
    from .config.merge import load_yaml_file

    if key is not None and not TransformRegistry.has(key):
        raise AutoDeployError(f"--key: unknown transform '{key}'{close_matches(key, TransformRegistry.keys())}; "
                              "'autodeploy transforms' lists them all")
    defaults = load_yaml_file(DEFAULT_YAML).get("transforms", {})
    position = {k: i for i, k in enumerate(defaults)}
    rows = [_transform_row(name, cls, defaults, all_fields=key is not None) for name, cls in TransformRegistry.items()
            if (key is None or name == key)]
    rows = [r for r in rows if stage is None or r["stage"] == stage]
    rows.sort(key=lambda r: (Stage(r["stage"]).order, position.get(r["key"], len(position)), r["key"]))
    return rows


def _type_name(annotation: Any) -> str:
    if getattr(annotation, "__args__", None):
        return str(annotation).replace("typing.", "")
    return getattr(annotation, "__name__", None) or str(annotation)


def _state(row: Dict[str, Any]) -> str:
    if not row["in_default_pipeline"]:
        return "off: not in the default pipeline (add it under transforms: in a --yaml file)"
    if row["default"] == "off":
        return f"off by default (switch on with --transforms.{row['key']}.enabled true)"
    return "on"


def _print_common_fields() -> None:
    from .transform.interface import TransformConfig

    print("Common fields of every transform (set per transform in YAML under transforms.<key>, or on the command "
          "line as --transforms.<key>.<field> VALUE):")
    for fname, finfo in TransformConfig.model_fields.items():
        default = "per transform" if fname == "stage" else finfo.default
        print(f"  {fname} = {default!r}: {finfo.description}")
    print()


def _print_row(r: Dict[str, Any], with_patches: bool) -> None:
    print(f"{r['key']}  [stage {r['stage']}, default {_state(r)}]")
    if r["summary"]:
        print(f"    {r['summary']}")
    if r["requires"] or r["run_after"]:
        print(f"    runs after: {', '.join(r['requires'] + r['run_after'])}")
    for f in r["fields"]:
        print(f"    {f['name']}: {f['type']} = {f['default']!r}  {f['description']}")
    patches = r.get("export_patches")
    if patches and with_patches:
        print(f"    export patches (all on; switch one off with --transforms.{r['key']}.patches.<name> false):")
        for patch in patches:
            print(f"      {patch['name']}: {patch['description']}")


def cmd_transforms(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    rows = transform_rows(args.stage, args.key)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    if args.key is None:
        _print_common_fields()
    for r in rows:
        _print_row(r, with_patches=args.key is not None)
    return 0


# ---- models ------------------------------------------------------------------------------------
def preset_rows() -> List[Dict[str, Any]]:
    from .models.presets import DEFAULT_PRESET, PRESETS
    from .utils.paths import cache_root

    rows = []
    for name, preset in sorted(PRESETS.items()):
        cached = preset.bundled_dir is not None or os.path.exists(os.path.join(cache_root(), "presets", name))
        rows.append({"name": name, "description": preset.description, "default": name == DEFAULT_PRESET,
                     "model_type": preset.config.get("model_type"), "materialised": cached})
    return rows


def registry_rows() -> List[Dict[str, Any]]:
    """One row per registry entry, in the registry file's order."""
    from .config.registry import load_registry

    return [entry.model_dump() for entry in load_registry().values()]


def _print_registry(rows: List[Dict[str, Any]]) -> None:
    header = {"name": "name", "model": "model", "yaml": "fragments", "world_size": "world_size"}
    cells = [header] + [{**r, "yaml": ", ".join(r["yaml"]) or "-", "world_size": str(r["world_size"])} for r in rows]
    widths = {k: max(len(c[k]) for c in cells) for k in header}
    print("\nModel registry (autodeploy run --model NAME --use-registry; the fragments are in "
          "autodeploy/models/registry/configs/):")
    for i, c in enumerate(cells):
        line = "  ".join(c[k].ljust(widths[k]) for k in header)
        print(f"{line}  {c.get('description', '') if i else 'description'}".rstrip())


def cmd_models(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    from .utils.paths import cache_root

    rows, registry = preset_rows(), registry_rows()
    if args.json:
        print(json.dumps({"presets": rows, "registry": registry}, indent=2))
        return 0
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        mark = " (default)" if r["default"] else ""
        print(f"{r['name'].ljust(width)}  {r['description']}{mark}")
    print(f"\nPresets are written on first use to {os.path.join(cache_root(), 'presets')} (AUTODEPLOY_CACHE).")
    _print_registry(registry)
    return 0
