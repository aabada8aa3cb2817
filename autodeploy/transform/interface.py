"""The transform contract: stages, configs, the base class and the registry.

A transform is a class registered under a key; the optimizer builds it from a pydantic config
(common fields below plus its own), sorts the pipeline by stage and calls it on the model.
The base class owns everything a transform should not have to think about: skipping when
disabled, lazy graph cleanup and shape propagation, error handling, timing, memory accounting,
history and visualisation. Subclasses implement ``_apply`` (per GraphModule) or
``_apply_to_full_model`` (the whole model, for stages that create or replace it).
"""

import os
import time
import weakref
from abc import ABC
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Iterator, List, Literal, Optional, Tuple, Type

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import fx, nn

from ..utils.logging import get_logger
from .graph_utils import canonicalize_graph, graph_modules, run_shape_prop

if TYPE_CHECKING:  # the plan types live with the sharding transforms
    from .library._sharding import ShardingPlan, WeightShard

logger = get_logger(__name__)


class Stage(str, Enum):
    """Pipeline stages in the order they run."""

    FACTORY = "factory"
    EXPORT = "export"
    POST_EXPORT = "post_export"
    PATTERN_MATCHER = "pattern_matcher"
    SHARDING = "sharding"
    WEIGHT_LOAD = "weight_load"
    POST_LOAD_FUSION = "post_load_fusion"
    CACHE_INIT = "cache_init"
    VISUALIZE = "visualize"
    COMPILE = "compile"

    @property
    def order(self) -> int:
        return list(Stage).index(self)

    def __lt__(self, other: "Stage") -> bool:  # type: ignore[override]
        return self.order < other.order


class TransformConfig(BaseModel):
    """Fields every transform has. Unknown fields are rejected so typos in YAML surface."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    stage: Stage = Field(description="Pipeline stage the transform runs in.")
    enabled: bool = Field(default=True, description="Run this transform.")
    skip_on_error: bool = Field(
        default=False, description="Log and continue when the transform raises, instead of failing."
    )
    run_graph_cleanup: bool = Field(
        default=True, description="Dead-code-eliminate and recompile after the transform if it dirtied the graph."
    )
    run_shape_prop: bool = Field(
        default=False, description="Re-run shape propagation after the transform if it invalidated shapes."
    )
    requires_clean_graph: bool = Field(
        default=True, description="Clean up the graph first if an earlier transform left it dirty."
    )
    requires_shape_prop: bool = Field(
        default=False, description="Propagate shapes first if an earlier transform left them stale."
    )
    debug_visualize_dir: Optional[str] = Field(
        default=None, description="Write the graph after this transform as DOT + text into this directory."
    )
    expect_mem_change: bool = Field(
        default=False, description="The transform is meant to change model memory (no warning when it does)."
    )
    run_per_gm: bool = Field(
        default=True, description="Apply to each GraphModule of the model rather than to the model as a whole."
    )


@dataclass
class TransformInfo:
    """What a transform reports about one application.

    ``is_clean`` / ``has_valid_shapes`` say whether the transform left the graph clean and its
    shapes valid *given that they were before*; the base class combines them with the graph's
    previous state, so a transform that changes no shapes may report ``True`` safely.
    """

    skipped: bool = False
    num_matches: int = 0
    is_clean: bool = False
    has_valid_shapes: bool = False
    reason: Optional[str] = None  # why it was skipped: shown in the pipeline summary

    def merge(self, other: "TransformInfo") -> "TransformInfo":
        """Combine the infos of several GraphModules of one model."""
        return TransformInfo(
            skipped=self.skipped and other.skipped,
            reason=self.reason or other.reason,
            num_matches=self.num_matches + other.num_matches,
            is_clean=self.is_clean and other.is_clean,
            has_valid_shapes=self.has_valid_shapes and other.has_valid_shapes,
        )


@dataclass
class TransformRecord:
    """One row of the pipeline history (kept in ``gm.meta['autodeploy_history']``)."""

    key: str
    stage: str
    status: str  # "ok" | "skipped" | "disabled" | "failed"
    num_matches: int = 0
    time_s: float = 0.0
    mem_delta_mb: float = 0.0
    error: Optional[str] = None  # why it failed, or why it was skipped


CacheMode = Literal["paged_kv", "state", "paged_kv+state", "recompute"]


@dataclass
class PipelineContext:
    """What transforms share besides the model: where it comes from, the deployment limits, and
    the state one transform leaves for a later one (every such field is declared here, with
    who writes and who reads it).

    The factory object is kept untyped here so the IR never imports model-loading code paths
    it does not need; the factory transforms know its interface.
    """

    factory: Any = None
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    max_batch_size: int = 8
    max_seq_len: int = 512
    max_num_tokens: int = 2048
    page_size: int = 16
    # The user left max_batch_size unset: max_batch_size above is only an upper bound for building
    # the graph; resize_kv_cache (or initialize_cache for a fixed pool) chooses the value from the pool.
    auto_batch_size: bool = False
    # The user left max_seq_len unset: it is the model's own limit, which resize_kv_cache may lower
    # to what the page pool can hold (a user's value is never lowered: too large is an error).
    auto_seq_len: bool = False
    # State copies the runtime keeps beside the running slots of a model with state caches
    # (prefix caching; ``cache.limits.snapshot_capacity``: None its default, 0 none), set by
    # ``autodeploy.pipeline``; resize_kv_cache takes their memory out of the cache budget.
    state_snapshots: Optional[int] = 0
    # The cache interface (``autodeploy.cache.CachedSequenceInterface``) once cache_init made one.
    cache: Any = None
    history: List[TransformRecord] = field(default_factory=list)
    # The compile_model backend the build will use (set by ``autodeploy.pipeline`` from the
    # config), so that earlier transforms choose kernels it can compile (select_linear_backend).
    compile_backend: str = "torch-simple"
    # insert_cached_attention -> recompute_fallback: the graph as it was before the cached ops
    # went in (recompute_fallback's way back; it drops it once it has decided) ...
    uncached_graph: Optional[fx.GraphModule] = None  # (transformers mode: the HF module behind the same interface)
    # ... or, when insert_cached_attention left the graph uncached, why.
    uncached_reason: Optional[str] = None
    # recompute_fallback's decision: the cached graph serves the model with a paged KV cache
    # ("paged_kv"), per-sequence state caches ("state": SSM / conv / delta-rule states) or both
    # ("paged_kv+state"); or "recompute" (every step recomputes each sequence's history; see
    # autodeploy.cache.recompute). None until it ran. Read by compile_model and the coverage check.
    cache_mode: Optional[CacheMode] = None
    # Why the model runs in recompute mode (set with cache_mode == "recompute").
    recompute_reason: Optional[str] = None
    # Tensor parallelism: this process's rank of world_size (set by ``autodeploy.pipeline`` from
    # the process group; 1 and 0 without one).
    world_size: int = 1
    rank: int = 0
    # detect_hf_attn_layers -> transformers_replace_cached_attn (the "transformers" mode): the HF
    # model's attention layers (``autodeploy.models.transformers_mode.HFAttentionLayer``).
    hf_attention_layers: Optional[List[Any]] = None
    # detect_sharding -> sharding_transform_executor: the plan (``library._sharding.ShardingPlan``).
    sharding_plan: Optional["ShardingPlan"] = None
    # sharding_transform_executor -> load_weights: parameter name -> the slice of its checkpoint
    # tensor this rank loads (``library._sharding.WeightShard``).
    weight_shards: Dict[str, "WeightShard"] = field(default_factory=dict)
    # The transform driver: (a weak reference to the model a transform returned, its tensor bytes),
    # so that the next transform's "before" count is not a second walk over the same unchanged model.
    last_tensor_bytes: Optional[Tuple["weakref.ref[nn.Module]", int]] = None


_META_LAST_INFO = "autodeploy_last_info"
_META_HISTORY = "autodeploy_history"


def model_tensor_bytes(mod: Optional[nn.Module]) -> int:
    """Bytes held by the model's real (non-meta) parameters and buffers, each storage once."""
    if mod is None:
        return 0
    seen, total = set(), 0
    for t in _own_tensors(mod):
        if t.is_meta:
            continue
        if t.is_mkldnn:  # opaque packed weights have no storage to share
            total += t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def _own_tensors(mod: nn.Module) -> Iterator[torch.Tensor]:
    """Every parameter and buffer of ``mod`` and its submodules (duplicates included).

    Why not ``parameters()``/``buffers()``: the driver counts the model's bytes before and after
    every transform, and their ``named_modules`` walk (prefix strings, a memo per call) took 19 s
    of a 16-layer, 128-expert build (6,300 weight modules, 152 counts); this walks the module
    dicts directly."""
    stack, seen = [mod], set()
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        yield from (t for t in m._parameters.values() if t is not None)
        yield from (t for t in m._buffers.values() if t is not None)
        stack.extend(c for c in m._modules.values() if c is not None)


class ShapePropError(RuntimeError):
    """Shape propagation could not run on the graph (an op whose fake kernel needs concrete sizes)."""


class BaseTransform(ABC):
    """Base class of all transforms (see module docstring).

    Class attributes a subclass may set:
      ``config_class``: its pydantic config (default: ``TransformConfig``).
      ``requires``: keys that must be enabled and run before this one.
      ``run_after``: keys that, when enabled, must run before this one.
    """

    config_class: ClassVar[Type[TransformConfig]] = TransformConfig
    requires: ClassVar[Tuple[str, ...]] = ()
    run_after: ClassVar[Tuple[str, ...]] = ()
    _key: ClassVar[str] = ""

    def __init__(self, config: TransformConfig):
        self.config = config

    @classmethod
    def get_transform_key(cls) -> str:
        return cls._key

    @classmethod
    def get_config_class(cls) -> Type[TransformConfig]:
        return cls.config_class

    # ---- what subclasses implement -------------------------------------------------------
    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        raise NotImplementedError(f"{self._key} implements neither _apply nor _apply_to_full_model")

    def _apply_to_full_model(
        self, mod: Optional[nn.Module], ctx: PipelineContext
    ) -> Tuple[nn.Module, TransformInfo]:
        raise NotImplementedError(f"{self._key} sets run_per_gm=False but has no _apply_to_full_model")

    def _run(self, mod: Optional[nn.Module], ctx: PipelineContext) -> Tuple[Optional[nn.Module], TransformInfo]:
        if not self.config.run_per_gm:
            return self._apply_to_full_model(mod, ctx)
        gms = list(graph_modules(mod)) if mod is not None else []
        if not gms:
            raise RuntimeError(
                f"transform '{self._key}' needs an exported graph but the model has none; "
                "is 'export_to_gm' enabled and before it?"
            )
        info: Optional[TransformInfo] = None
        for gm in gms:
            gm_info = self._apply(gm, ctx)
            info = gm_info if info is None else info.merge(gm_info)
        assert info is not None
        return mod, info

    # ---- the driver ----------------------------------------------------------------------
    def __call__(self, mod: Optional[nn.Module], ctx: PipelineContext) -> Optional[nn.Module]:
        cfg = self.config
        if not cfg.enabled:
            ctx.history.append(TransformRecord(self._key, cfg.stage.value, "disabled"))
            return mod
        # the lazy cleanup / shape propagation this transform asks for is part of its time
        start = time.perf_counter()
        if mod is not None:
            try:
                self._prepare(mod)
            except ShapePropError as err:
                # Every transform is an optimisation of a graph that already computes the right thing
                # (insert_cached_attention included: recompute_fallback serves an uncached graph), so a
                # graph that cannot be analysed is left as it is rather than failing the build.
                logger.warning("transform %s skipped: %s", self._key, err)
                ctx.history.append(TransformRecord(self._key, cfg.stage.value, "skipped", error=str(err)[:200]))
                return mod
        last = ctx.last_tensor_bytes
        mem_before = last[1] if last is not None and last[0]() is mod else model_tensor_bytes(mod)
        try:
            mod, info = self._run(mod, ctx)
        except Exception as exc:  # noqa: BLE001 - re-raised unless skip_on_error
            if not cfg.skip_on_error:
                raise
            elapsed = time.perf_counter() - start
            ctx.last_tensor_bytes = None  # it may have changed tensors before failing
            logger.warning("transform %s failed and was skipped (skip_on_error): %s", self._key, exc)
            ctx.history.append(
                TransformRecord(self._key, cfg.stage.value, "failed", time_s=elapsed, error=str(exc).splitlines()[0])
            )
            return mod
        if mod is not None:
            self._finish(mod, info)
        elapsed = time.perf_counter() - start
        mem_after = model_tensor_bytes(mod)
        ctx.last_tensor_bytes = (weakref.ref(mod), mem_after) if mod is not None else None
        mem_delta = mem_after - mem_before
        self._check_memory(mem_delta)
        record = TransformRecord(
            self._key,
            cfg.stage.value,
            "skipped" if info.skipped else "ok",
            num_matches=info.num_matches,
            time_s=elapsed,
            mem_delta_mb=mem_delta / 2**20,
            error=info.reason if info.skipped else None,
        )
        ctx.history.append(record)
        for gm in graph_modules(mod) if mod is not None else []:
            gm.meta.setdefault(_META_HISTORY, []).append(record)
        if cfg.debug_visualize_dir and mod is not None:
            from .visualize import write_graph

            for i, gm in enumerate(graph_modules(mod)):
                suffix = f"_{i}" if i else ""
                write_graph(gm, os.path.join(cfg.debug_visualize_dir, f"{self._key}{suffix}"))
        return mod

    def _prepare(self, mod: nn.Module) -> None:
        """Lazy cleanup / shape propagation before the transform, only where stale."""
        for gm in graph_modules(mod):
            last: Optional[TransformInfo] = gm.meta.get(_META_LAST_INFO)
            clean = last is None or last.is_clean
            shapes_ok = last is not None and last.has_valid_shapes
            if self.config.requires_clean_graph and not clean:
                canonicalize_graph(gm)
                clean = True
            if self.config.requires_shape_prop and not shapes_ok:
                try:
                    run_shape_prop(gm)
                except Exception as exc:  # noqa: BLE001 - reported as one line by __call__
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    raise ShapePropError(f"shape propagation failed ({type(exc).__name__}: {first})") from exc
                shapes_ok = True
            gm.meta[_META_LAST_INFO] = TransformInfo(is_clean=clean, has_valid_shapes=shapes_ok)

    def _finish(self, mod: nn.Module, info: TransformInfo) -> None:
        """Lazy cleanup / shape propagation after the transform, as configured."""
        for gm in graph_modules(mod):
            prev: Optional[TransformInfo] = gm.meta.get(_META_LAST_INFO)
            if prev is None:  # a graph this transform created
                clean, shapes_ok = info.is_clean, info.has_valid_shapes
            elif info.skipped or info.num_matches == 0:
                # the graph is as the transform found it: so is its state
                clean, shapes_ok = prev.is_clean, prev.has_valid_shapes
            else:
                # a transform's flags say what it did not break, not what was already broken
                clean = prev.is_clean and info.is_clean
                shapes_ok = prev.has_valid_shapes and info.has_valid_shapes
            if self.config.run_graph_cleanup and not clean:
                canonicalize_graph(gm)
                clean = True
            if self.config.run_shape_prop and not shapes_ok:
                run_shape_prop(gm)
                shapes_ok = True
            gm.meta[_META_LAST_INFO] = TransformInfo(is_clean=clean, has_valid_shapes=shapes_ok)

    def _check_memory(self, delta_bytes: int) -> None:
        threshold = 1 << 20
        if abs(delta_bytes) > threshold and not self.config.expect_mem_change:
            logger.warning(
                "transform %s changed model memory by %+.1f MiB without expect_mem_change; "
                "a fusion may be keeping two copies of its weights",
                self._key,
                delta_bytes / 2**20,
            )


class TransformRegistry:
    """Key -> transform class. Transforms register with ``@TransformRegistry.register(key)``."""

    _registry: ClassVar[Dict[str, Type[BaseTransform]]] = {}

    @classmethod
    def register(cls, key: str):
        def decorator(transform_cls: Type[BaseTransform]) -> Type[BaseTransform]:
            if key in cls._registry and cls._registry[key] is not transform_cls:
                raise ValueError(f"transform key '{key}' is registered twice")
            transform_cls._key = key
            cls._registry[key] = transform_cls
            return transform_cls

        return decorator

    @classmethod
    def get(cls, key: str) -> Type[BaseTransform]:
        return cls._registry[key]

    @classmethod
    def has(cls, key: str) -> bool:
        return key in cls._registry

    @classmethod
    def keys(cls) -> List[str]:
        return sorted(cls._registry)

    @classmethod
    def items(cls) -> List[Tuple[str, Type[BaseTransform]]]:
        return sorted(cls._registry.items())
