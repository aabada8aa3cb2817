"""From a ``DeployConfig`` to an optimized ``GraphModule``: the factory plus the transform pipeline."""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import fx

from .cache.limits import MAX_BATCH_SIZE_CAP
from .config import DeployConfig
from .models.factory import ModelFactory
from .models.limits import ContextLimit, DEFAULT_WHEN_UNKNOWN, model_context_limit
from .transform.library.compile_model import resolve_backend
from .transform.interface import PipelineContext
from .transform.optimizer import InferenceOptimizer, format_summary
from .utils.errors import ConfigError
from .utils.logging import get_logger

logger = get_logger(__name__)


@dataclass
class BuildResult:
    graph: torch.nn.Module  # what the runtime calls: a GraphModule, or a compile backend's CompiledGraph
    context: PipelineContext
    factory: ModelFactory
    config: DeployConfig
    from_cache: bool = False  # the graph was loaded from the build cache (``DeployConfig.build_cache``)

    @property
    def graph_module(self) -> fx.GraphModule:
        """The transformed graph itself (inside a compile backend's wrapper, if there is one)."""
        inner = getattr(self.graph, "graph", None)
        return inner if isinstance(inner, fx.GraphModule) else self.graph  # type: ignore[return-value]

    @property
    def cache(self):
        """The cache interface (``None`` when the pipeline stops before cache_init)."""
        return self.context.cache

    @property
    def summary(self) -> str:
        return format_summary(self.context.history)


def make_factory(config: DeployConfig) -> ModelFactory:
    return ModelFactory(
        config.model,
        revision=config.revision,
        trust_remote_code=config.trust_remote_code,
        allow_pickle=config.allow_pickle,
        model_kwargs=config.model_kwargs,
        tokenizer=config.tokenizer,
    )


def resolve_max_seq_len(requested: Optional[int], limit: ContextLimit) -> int:
    """The user's ``max_seq_len`` if the model can take it, else an error naming both numbers;
    unset: the model's own limit (``DEFAULT_WHEN_UNKNOWN`` when its config names none)."""
    if requested is not None:
        if limit.tokens is not None and requested > limit.tokens:
            raise ConfigError(
                f"max_seq_len {requested} is larger than the model's limit of {limit.describe()}; set "
                f"max_seq_len to at most {limit.tokens}, or leave it unset to use {limit.tokens}"
            )
        return requested
    if limit.tokens is None:
        logger.info("max_seq_len %d: the model's config names no sequence limit (set max_seq_len to change it)",
                    DEFAULT_WHEN_UNKNOWN)
        return DEFAULT_WHEN_UNKNOWN
    logger.info("max_seq_len %d: the model's limit (%s)", limit.tokens, limit.source)
    return limit.tokens


def _check_world_size(config: DeployConfig) -> int:
    """This process's rank for a build at ``config.world_size`` ranks.

    More than one rank needs a torch.distributed group of that size around the build (each rank
    builds its own shard: ``autodeploy.distributed.initialize``, or the process was started by
    torchrun or by the CLI's launcher, ``autodeploy run|serve|export --world-size N``).
    """
    from .distributed import process_group

    if config.world_size == 1:
        return 0
    if not process_group.is_initialized():
        raise ConfigError(
            f"world_size {config.world_size} needs a torch.distributed group of {config.world_size} processes "
            "around the build: let the CLI start them ('autodeploy run|serve|export --world-size "
            f"{config.world_size}'), start them with torchrun, or call "
            "autodeploy.distributed.initialize(rank, world_size) in each process before building")
    if process_group.world_size() != config.world_size:
        raise ConfigError(f"world_size {config.world_size} asked for, but this process's group has "
                          f"{process_group.world_size()} ranks")
    return process_group.rank()


def build_graph(
    config: DeployConfig, factory: Optional[ModelFactory] = None, log_summary: bool = True,
    show_progress: bool = False,
) -> BuildResult:
    """Validate the pipeline, then build the model and run every transform on it."""
    rank = _check_world_size(config)
    if torch.device(config.device).type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device '{config.device}' asked for, but torch sees no CUDA GPU; use device: cpu")
    optimizer = InferenceOptimizer(config.transforms)
    factory = factory or make_factory(config)
    checkpoint_dtype = getattr(factory.config, "dtype", None)
    ctx = PipelineContext(
        factory=factory,
        device=config.device,
        dtype=config.torch_dtype(checkpoint_dtype if isinstance(checkpoint_dtype, torch.dtype) else None),
        max_batch_size=config.max_batch_size or MAX_BATCH_SIZE_CAP,
        max_seq_len=resolve_max_seq_len(config.max_seq_len, model_context_limit(factory.config)),
        max_num_tokens=config.max_num_tokens,
        page_size=config.page_size,
        auto_batch_size=config.max_batch_size is None,
        auto_seq_len=config.max_seq_len is None,
        state_snapshots=config.prefix_state_snapshots if config.enable_prefix_caching else 0,
        world_size=config.world_size,
        rank=rank,
    )
    # transforms before compile_model choose kernels it must be able to compile
    ctx.compile_backend = resolve_backend((config.transforms.get("compile_model") or {}).get("backend", "auto"),
                                          config.device)
    if config.build_cache:
        from .build_cache import build_with_cache

        gm, loaded = build_with_cache(optimizer, ctx, config, log_summary=log_summary, show_progress=show_progress)
        return BuildResult(gm, ctx, factory, config, from_cache=loaded)  # type: ignore[arg-type]
    gm = optimizer(ctx, log_summary=log_summary, show_progress=show_progress)
    return BuildResult(gm, ctx, factory, config)  # type: ignore[arg-type]
