"""Lean custom models, registered per HF config class.

A family whose HF implementation cannot be exported (Python loops over the sequence,
value-dependent control flow) can register a self-contained ``nn.Module`` written with the
canonical ops; the factory then builds it instead of the HF class (``build_model``'s
``use_custom_model: false`` turns that off). The class is constructed as ``cls(config)`` and must
use the checkpoint's parameter names, or provide ``load_hooks()``. ``custom.testing`` has the
checks against the HF original; ``docs/onboarding.md`` walks through one model.

The built-in custom models are the ``modeling_<type>.py`` modules of this package; each registers
itself when imported, and they are imported on the first lookup (``custom_model_for``), so
importing the factory costs nothing and a new file needs no list to be edited.
"""

import importlib
import pkgutil
from typing import Callable, Dict, Optional, Type

from torch import nn

_CUSTOM_MODELS: Dict[str, Type[nn.Module]] = {}
_builtin_loaded = False


def _load_builtin() -> None:
    """Import every ``modeling_*`` module of this package once (each registers its classes)."""
    global _builtin_loaded
    if _builtin_loaded:
        return
    _builtin_loaded = True
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("modeling_"):
            importlib.import_module(f"{__name__}.{info.name}")


def register_custom_model(config_class_name: str) -> Callable[[Type[nn.Module]], Type[nn.Module]]:
    """Decorator: build ``cls(config)`` for configs whose class is named ``config_class_name``."""

    def decorator(cls: Type[nn.Module]) -> Type[nn.Module]:
        _CUSTOM_MODELS[config_class_name] = cls
        return cls

    return decorator


def unregister_custom_model(config_class_name: str) -> None:
    _CUSTOM_MODELS.pop(config_class_name, None)


def custom_model_for(config: object) -> Optional[Type[nn.Module]]:
    """The custom model registered for ``config``'s class name, or ``None``."""
    _load_builtin()
    return _CUSTOM_MODELS.get(type(config).__name__)
