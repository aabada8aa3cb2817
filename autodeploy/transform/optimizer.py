"""Runs a pipeline of transforms: validate everything first, then run in stage order."""

import difflib
from typing import Any, Dict, List, Mapping, Optional, Tuple

from pydantic import ValidationError
from torch import nn

from ..utils.errors import ConfigError
from ..utils.fx import recompile_now
from ..utils.logging import get_logger
from .interface import BaseTransform, PipelineContext, TransformConfig, TransformRecord, TransformRegistry

logger = get_logger(__name__)


def close_matches(word: str, candidates: List[str]) -> str:
    found = difflib.get_close_matches(word, candidates, n=3, cutoff=0.6)
    return f" (did you mean: {', '.join(found)}?)" if found else ""


def _format_validation_error(key: str, cls: type, err: ValidationError) -> str:
    fields = list(cls.get_config_class().model_fields)
    problems = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<config>"
        hint = close_matches(loc, fields) if e["type"] == "extra_forbidden" else ""
        value = f" (got {e['input']!r})" if "input" in e and e["type"] != "extra_forbidden" else ""
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        problems.append(f"transforms.{key}.{loc}: {msg}{value}{hint}")
    return "; ".join(problems)


def build_transform(key: str, raw: Optional[Mapping[str, Any]]) -> BaseTransform:
    """One transform from its YAML entry; errors name the key and the close matches."""
    if not TransformRegistry.has(key):
        raise ConfigError(f"unknown transform '{key}'{close_matches(key, TransformRegistry.keys())}")
    cls = TransformRegistry.get(key)
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(f"transforms.{key} must be a mapping of fields, got {type(raw).__name__}")
    try:
        config = cls.get_config_class().model_validate(dict(raw or {}))
    except ValidationError as err:
        raise ConfigError(_format_validation_error(key, cls, err)) from None
    return cls(config)


class InferenceOptimizer:
    """Validates a ``{key: config}`` pipeline, orders it by stage and runs it."""

    def __init__(self, transforms: Mapping[str, Optional[Mapping[str, Any]]]):
        built = [build_transform(key, raw) for key, raw in transforms.items()]
        # Stable sort: within a stage, the order of the YAML (defaults first, then additions).
        self.transforms: List[BaseTransform] = sorted(built, key=lambda t: t.config.stage.order)
        self._check_ordering()

    def _check_ordering(self) -> None:
        position = {t.get_transform_key(): i for i, t in enumerate(self.transforms) if t.config.enabled}
        for i, t in enumerate(self.transforms):
            if not t.config.enabled:
                continue
            key = t.get_transform_key()
            for dep in t.requires:  # "a|b": either of them
                if not any(alt in position for alt in dep.split("|")):
                    shown = " or ".join(f"'{alt}'" for alt in dep.split("|"))
                    raise ConfigError(f"transform '{key}' requires {shown} to be enabled")
            for dep in (alt for d in (*t.requires, *t.run_after) for alt in d.split("|")):
                if dep in position and position[dep] > i:
                    dep_stage = self.transforms[position[dep]].config.stage.value
                    raise ConfigError(
                        f"transform '{key}' (stage {t.config.stage.value}) must run after '{dep}' "
                        f"(stage {dep_stage}); move '{dep}' to an earlier stage or '{key}' to a later one"
                    )

    def __call__(
        self, ctx: PipelineContext, mod: Optional[nn.Module] = None, log_summary: bool = True,
        show_progress: bool = False,
    ) -> nn.Module:
        progress = None
        if show_progress:
            from tqdm import tqdm

            progress = tqdm(total=len(self.transforms), desc="building", unit="transform", leave=False)
        try:
            for transform in self.transforms:
                logger.debug("running transform %s", transform.get_transform_key())
                if progress is not None:
                    progress.set_postfix_str(transform.get_transform_key())
                mod = transform(mod, ctx)
                if progress is not None:
                    progress.update(1)
        finally:
            if progress is not None:
                progress.close()
        if log_summary:
            logger.info("transform pipeline summary\n%s", format_summary(ctx.history))
        assert mod is not None, "the pipeline produced no model: is 'build_model' enabled?"
        return recompile_now(mod)  # a plain GraphModule again (export_to_gm deferred its code generation)


def format_summary(history: List[TransformRecord]) -> str:
    """One table: key, stage, matches, time, status."""
    rows: List[Tuple[str, ...]] = [("transform", "stage", "matches", "time [s]", "mem [MiB]", "status")]
    for r in history:
        status = r.status if r.error is None else f"{r.status}: {r.error}"
        mem = f"{r.mem_delta_mb:+.1f}" if r.status in ("ok", "skipped") and abs(r.mem_delta_mb) >= 0.05 else ""
        time_s = f"{r.time_s:.3f}" if r.status != "disabled" else ""
        matches = str(r.num_matches) if r.status in ("ok", "skipped") else ""
        rows.append((r.key, r.stage, matches, time_s, mem, status))
    total = sum(r.time_s for r in history)
    rows.append(("total", "", "", f"{total:.3f}", "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if j == 0 or j == len(rows) - 2:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


__all__ = ["InferenceOptimizer", "build_transform", "format_summary", "TransformConfig", "close_matches"]
