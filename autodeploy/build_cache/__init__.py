"""The build cache: a build whose inputs are unchanged loads its graph and weights from disk.

``DeployConfig.build_cache: true`` (off by default). The key (``key.py``) covers the model's
files, the whole resolved config, autodeploy's version and source, torch/transformers versions,
the device and CPU, world size and rank; any change is a miss.

Where the pipeline is cut: the graph is stored as it enters ``compile_model``, i.e. after the
last transform that changes the graph (the ``cache_init`` stage and the graph rewrites of the
``compile`` stage before the backend, such as ``cleanup_identity_dtype_cast``; these must change
only the graph, which is what a transform of that stage before the backend is for). What depends
on the machine's state rather than on the inputs still runs on a load: ``initialize_cache`` and
``resize_kv_cache`` (the caches are never stored: they are allocated again and sized to the
memory free now) and ``compile_model`` with everything after it (compile backends, CUDA graphs,
warm-up). ``recompute_fallback``'s decision (the cache mode) is stored with the graph. Decisions
earlier transforms made from a measurement at build time (e.g. ``select_linear_backend``'s
``gemv_dtype: auto``) are kept as they were measured. A pipeline with any other transform
between ``initialize_cache`` and the ``compile`` stage is built without the cache (one log line
says which). A loaded graph is checked cheaply (it rebuilds and lints, every tensor it reads is
in the entry, its inputs are its cache interface's); a graph that passes these checks and then
fails in ``resize_kv_cache`` or ``compile_model`` raises as a fresh build would.

A build whose graph holds something that cannot be stored as data (see ``graph_codec``: no
pickle is ever written or read) is not cached: one log line says why and it builds as usual. An
entry that cannot be read back (a truncated weights file, malformed JSON, a missing file, a graph
that does not rebuild or whose inputs do not match its cache interface) is deleted with one
warning and the model is built again. Weight bytes themselves are checked by size, not by hash
(a hash of every byte would cost a large part of the load); entries are written atomically, so a
crash mid-write leaves no partial entry.
"""

import copy
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from torch import nn

from ..transform.interface import BaseTransform, PipelineContext, Stage, TransformRecord
from ..transform.optimizer import InferenceOptimizer, format_summary
from ..utils.logging import get_logger
from .graph_codec import Unserializable
from .key import build_key, key_inputs
from .store import builds_dir, check_cacheable, encode_cache_settings, load_entry, prune, save_entry

logger = get_logger(__name__)

# transforms between initialize_cache and the compile stage that run again on a load
REPLAYED = ("initialize_cache", "resize_kv_cache")
# ... and those whose outcome is stored with the graph (ctx.cache_mode / recompute_reason)
DECIDED = ("recompute_fallback",)
# the compile backend: it and everything after it always run
BACKEND = "compile_model"


@dataclass
class _Plan:
    before: List[BaseTransform]  # up to initialize_cache: skipped on a load
    around: List[BaseTransform]  # initialize_cache .. compile_model: REPLAYED ones run again on a load
    after: List[BaseTransform]  # compile_model and after: always run


def _plan(transforms: List[BaseTransform]) -> Tuple[Optional[_Plan], str]:
    keys = [t.get_transform_key() for t in transforms]
    if "initialize_cache" not in keys or not transforms[keys.index("initialize_cache")].config.enabled:
        return None, "the pipeline allocates no caches (initialize_cache is off)"
    start = keys.index("initialize_cache")
    end = keys.index(BACKEND) if BACKEND in keys else len(transforms)
    for t in transforms[start:end]:
        if t.config.enabled and t.get_transform_key() not in REPLAYED + DECIDED and t.config.stage != Stage.COMPILE:
            return None, (f"transform '{t.get_transform_key()}' ({t.config.stage.value}) runs after initialize_cache, "
                          "where the build cache can neither replay it nor store its outcome")
    return _Plan(transforms[:start], transforms[start:end], transforms[end:]), ""


def _run(optimizer: InferenceOptimizer, transforms: List[BaseTransform], ctx: PipelineContext,
         mod: Optional[nn.Module], show_progress: bool) -> Optional[nn.Module]:
    if not transforms:
        return mod
    part = copy.copy(optimizer)
    part.transforms = transforms
    return part(ctx, mod, log_summary=False, show_progress=show_progress)


def build_with_cache(optimizer: InferenceOptimizer, ctx: PipelineContext, config: Any, log_summary: bool = True,
                     show_progress: bool = False) -> Tuple[nn.Module, bool]:
    """Run ``optimizer``'s pipeline, through the build cache: ``(model, loaded_from_cache)``."""
    plan, why = _plan(optimizer.transforms)
    inputs: Any = None
    if plan is None:
        logger.info("build cache: not used for this build: %s", why)
    else:
        try:
            inputs = key_inputs(config, ctx.factory, ctx.world_size, ctx.rank)
        except OSError as exc:
            logger.warning("build cache: cannot fingerprint the model's files (%s); building without the cache", exc)
            plan = None
    if plan is None:
        return optimizer(ctx, log_summary=log_summary, show_progress=show_progress), False
    key = build_key(inputs)
    entry = os.path.join(builds_dir(), key)
    if os.path.isdir(entry):
        start = time.perf_counter()
        try:
            gm = load_entry(entry, ctx)
        except Exception as exc:  # noqa: BLE001 - any unreadable entry is rebuilt, never used
            logger.warning("build cache: entry %s is unusable (%s: %s); removed it, building the model again",
                           key[:12], type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            shutil.rmtree(entry, ignore_errors=True)
        else:
            elapsed = time.perf_counter() - start
            logger.info("build cache: loaded the built graph from %s in %.2f s", entry, elapsed)
            ctx.history.append(TransformRecord("build_cache", Stage.CACHE_INIT.value, "ok", num_matches=1,
                                               time_s=elapsed))
            replay = [t for t in plan.around if t.get_transform_key() in REPLAYED]
            mod = _run(optimizer, replay + plan.after, ctx, gm, show_progress)
            _log_summary(ctx, log_summary)
            return mod, True  # type: ignore[return-value]
    mod = _run(optimizer, plan.before, ctx, None, show_progress)
    settings = context = None
    try:
        settings = encode_cache_settings(ctx.cache)
        context = {"max_batch_size": ctx.max_batch_size, "max_seq_len": ctx.max_seq_len}
    except Unserializable as exc:
        logger.info("build cache: this build is not cached: %s", exc)
    mod = _run(optimizer, plan.around, ctx, mod, show_progress)
    if settings is not None:
        _store(entry, mod, settings, context, ctx, inputs)
    mod = _run(optimizer, plan.after, ctx, mod, show_progress)
    _log_summary(ctx, log_summary)
    assert mod is not None, "the pipeline produced no model: is 'build_model' enabled?"
    return mod, False


def _store(entry: str, mod: Any, settings: Any, context: Any, ctx: PipelineContext, inputs: Any) -> None:
    start = time.perf_counter()
    try:
        gm = check_cacheable(mod, ctx)
        context.update(cache_mode=ctx.cache_mode, recompute_reason=ctx.recompute_reason)
        save_entry(entry, gm, settings, context, inputs)
    except Unserializable as exc:
        logger.info("build cache: this build is not cached: %s", exc)
        return
    except OSError as exc:
        logger.warning("build cache: could not write %s: %s", entry, exc)
        return
    logger.info("build cache: stored the built graph in %s (%.2f s)", entry, time.perf_counter() - start)


def _log_summary(ctx: PipelineContext, log_summary: bool) -> None:
    if log_summary:
        logger.info("transform pipeline summary\n%s", format_summary(ctx.history))


__all__ = ["build_with_cache", "builds_dir", "prune", "REPLAYED", "DECIDED", "BACKEND"]
