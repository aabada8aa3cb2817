"""Checks of a deployment's settings that need no model, run before anything is built: a value a
transform would only reject halfway through the build, settings that contradict each other, and
what this machine can run.

A message about one setting starts with that setting's name as the user set it, then ``:`` --
the top-level shortcut (``attn_backend``) when they used it, else the transform field
(``transforms.insert_cached_attention.backend``) -- and says what is allowed. The CLI turns that
leading name into the flag the user typed (``--attn_backend``).
"""

from typing import Any, Dict, Mapping, Optional

import torch

from ..utils.errors import ConfigError

# compile backends that capture CUDA graphs
CUDA_GRAPH_BACKENDS = ("torch-cudagraph", "torch-opt")


def setting_name(user: Mapping[str, Any], shortcut: Optional[str], key: str, field: str) -> str:
    """How the user named a transform field: by its shortcut if they set that, else its full path."""
    if shortcut is not None and user.get(shortcut) is not None:
        return shortcut
    return f"transforms.{key}.{field}"


def _field_info(key: str, field: str) -> Any:
    import autodeploy.transform.library  # noqa: F401  (registers transforms)
    from ..transform.interface import TransformRegistry

    if not TransformRegistry.has(key):
        return None
    return TransformRegistry.get(key).get_config_class().model_fields.get(field)


def transform_default(key: str, field: str) -> Any:
    """The default of a transform's config field (``None`` for an unknown key or field)."""
    info = _field_info(key, field)
    return None if info is None else info.get_default(call_default_factory=True)


def check_shortcut_value(setting: str, value: Any, key: str, field: str) -> None:
    """A shortcut's value checked against the type of the transform field it sets, so that the
    error names the shortcut the user wrote rather than the field behind it."""
    from pydantic import TypeAdapter, ValidationError

    info = _field_info(key, field)
    if info is None:
        return
    try:
        TypeAdapter(info.annotation).validate_python(value)
    except ValidationError as err:
        msg = err.errors()[0]["msg"]
        raise ConfigError(f"{setting}: {msg} (got {value!r}; default {info.default!r})") from None


def _active(transforms: Mapping[str, Any], key: str) -> Optional[Dict[str, Any]]:
    """The fields of a transform that will run, or ``None`` when it is absent or disabled."""
    if key not in transforms:
        return None
    fields = dict(transforms[key] or {})
    return None if fields.get("enabled", True) is False else fields


def check_attention_backend(transforms: Mapping[str, Any], device: str, user: Mapping[str, Any]) -> None:
    """The KV-cached attention backend exists and runs on ``device``."""
    fields = _active(transforms, "insert_cached_attention")
    if fields is None:
        return
    from ..cache.attention_backends import attention_backends

    name = setting_name(user, "attn_backend", "insert_cached_attention", "backend")
    backend = fields.get("backend", transform_default("insert_cached_attention", "backend"))
    backends = attention_backends()
    if backend not in backends:
        default = transform_default("insert_cached_attention", "backend")
        raise ConfigError(f"{name}: {backend!r} is not an attention backend; choose one of: "
                          f"{', '.join(sorted(backends))} (default {default})")
    device_type = torch.device(device).type
    if device_type not in backends[backend].devices:
        able = sorted(n for n, b in backends.items() if device_type in b.devices)
        raise ConfigError(f"{name}: attention backend {backend!r} does not run on {device_type}; choose one of: "
                          f"{', '.join(able)}")


def check_compile_backend(transforms: Mapping[str, Any], device: str, user: Mapping[str, Any]) -> None:
    """CUDA-graph backends need a CUDA device; piecewise graphs need a CUDA-graph backend."""
    fields = _active(transforms, "compile_model")
    if fields is None:
        return
    name = setting_name(user, "compile_backend", "compile_model", "backend")
    backend = fields.get("backend", transform_default("compile_model", "backend"))
    if backend == "auto":  # torch-cudagraph on CUDA, torch-simple elsewhere (compile_model.resolve_backend)
        backend = "torch-cudagraph" if torch.device(device).type == "cuda" else "torch-simple"
    device_type = torch.device(device).type
    if backend in CUDA_GRAPH_BACKENDS and device_type != "cuda":
        raise ConfigError(f"{name}: {backend!r} captures CUDA graphs and needs device cuda, but the device is "
                          f"{device_type}; on {device_type} use auto (the default), torch-simple or torch-compile")
    if fields.get("piecewise_enabled") and backend not in CUDA_GRAPH_BACKENDS:
        raise ConfigError(f"transforms.compile_model.piecewise_enabled: piecewise CUDA graphs need compile backend "
                          f"{' or '.join(CUDA_GRAPH_BACKENDS)} on a CUDA device, not {backend!r}; set it to false")


def check_settings(config: Any, user: Mapping[str, Any]) -> None:
    """Every check that needs only the settings (``user``: what the user set over the defaults)."""
    check_attention_backend(config.transforms, config.device, user)
    check_compile_backend(config.transforms, config.device, user)


def check_device_available(device: str, setting: str = "device") -> None:
    """The machine has the device asked for. Not part of loading a config (a config may describe a
    deployment for another machine); the CLI runs it before building, ``build_graph`` again."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"{setting}: {device!r} needs a CUDA GPU, but torch {torch.__version__} sees none on this "
                          "machine; use cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ConfigError(f"{setting}: {device!r} asks for GPU {dev.index}, but this machine has {count} "
                          f"(cuda:0 to cuda:{count - 1})")
