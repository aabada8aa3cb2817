"""pytest plugin for the no-op mutation check: make named transforms find nothing.

Usage (from the repository root; ``tests/`` must be importable when pytest loads ``-p`` plugins,
which happens before any conftest puts it on ``sys.path``)::

    AUTODEPLOY_NOOP_TRANSFORM=match_rope_pattern PYTHONPATH=tests \\
        .venv/bin/python -m pytest -p noop_mutation tests/transforms/test_match_rope_pattern.py

Each transform class registered under one of the comma-separated keys in
``AUTODEPLOY_NOOP_TRANSFORM`` gets a ``_run`` that returns the model untouched with
``TransformInfo(num_matches=0)``: the transform still runs through ``BaseTransform.__call__``
(history, cleanup, timing), it just never matches. A test of that transform that still passes
cannot tell a working transform from one that does nothing, so it must be a near miss (asserts
zero matches / the graph left alone), a config or op test, or a defect.

Why a plugin and not a fixture: the transforms run in every build a test makes, module-scoped
fixtures included, so the patch must be in place before collection. Test subprocesses (the
fuse_gemms memory test runs one) inherit ``_AUTODEPLOY_NOOP_ACTIVE``, which ``tests/conftest.py``
reads to install the same patch there; only this plugin sets it, so a stray
``AUTODEPLOY_NOOP_TRANSFORM`` in a developer's shell does nothing without ``-p noop_mutation``.
"""

import os
from typing import List, Optional, Tuple

import pytest
from torch import nn

ENV = "AUTODEPLOY_NOOP_TRANSFORM"
ACTIVE_ENV = "_AUTODEPLOY_NOOP_ACTIVE"
_STASH = pytest.StashKey[List[str]]()


def parse_keys(raw: Optional[str]) -> List[str]:
    """``"a, b,"`` -> ``["a", "b"]``."""
    return [k.strip() for k in (raw or "").split(",") if k.strip()]


def install(keys: List[str]) -> List[str]:
    """Patch the transforms registered under ``keys``; returns the keys patched (idempotent)."""
    import autodeploy.transform.library  # noqa: F401  (importing registers every transform)
    from autodeploy.transform.interface import PipelineContext, TransformInfo, TransformRegistry

    unknown = [k for k in keys if not TransformRegistry.has(k)]
    if unknown:
        raise pytest.UsageError(f"{ENV}: no transform registered under {unknown}; known: {TransformRegistry.keys()}")
    for key in keys:
        cls = TransformRegistry.get(key)
        if getattr(cls._run, "_noop_key", None) == key:
            continue
        original = cls._run

        def _run(self, mod: Optional[nn.Module], ctx: PipelineContext, _original=original, _key=key
                 ) -> Tuple[Optional[nn.Module], TransformInfo]:
            # a registered subclass that inherits this _run keeps its own behaviour
            if type(self).get_transform_key() != _key:
                return _original(self, mod, ctx)
            return mod, TransformInfo(num_matches=0)

        _run._noop_key = key  # type: ignore[attr-defined]
        cls._run = _run  # type: ignore[method-assign]
    return keys


def pytest_configure(config: pytest.Config) -> None:
    keys = parse_keys(os.environ.get(ENV))
    if not keys:
        return
    install(keys)
    os.environ[ACTIVE_ENV] = ",".join(keys)
    config.stash[_STASH] = keys


def pytest_report_header(config: pytest.Config) -> Optional[str]:
    keys = config.stash.get(_STASH, None)
    return f"noop_mutation: transforms made no-ops: {', '.join(keys)}" if keys else None

