"""``build_and_load_factory_model`` (factory; the "transformers" mode): the HF model, loaded.

Before: nothing. After: the factory's HF model (never a custom model: this mode keeps HF's own
module) with every weight loaded on the target device, in eval mode. The graph pipeline loads
weights into the exported graph in ``weight_load``; this mode has no graph, so the module is
loaded where it is built, by the same loader (memory-mapped safetensors, the checkpoint's dtypes
checked, transformers' weight conversions replayed, tied and initial buffers restored).
"""

import re
from typing import List, Optional, Tuple

import torch
from pydantic import Field
from torch import nn

from ...export.hf_names import checkpoint_name, conversions, reverted_renamings
from ...models.conversion_hooks import conversion_hooks
from ...models.load_hooks import LoadHook, rename
from ...models.weight_loader import load_into_module
from ...utils.errors import ConfigError
from ...utils.logging import get_logger
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

logger = get_logger(__name__)


class BuildAndLoadFactoryModelConfig(TransformConfig):
    stage: Stage = Stage.FACTORY
    run_per_gm: bool = False
    requires_clean_graph: bool = False
    expect_mem_change: bool = True
    show_progress: Optional[bool] = Field(
        default=None, description="Progress bar while loading; default: only for checkpoints above the threshold."
    )
    progress_threshold_mb: int = Field(default=256, description="Checkpoint size above which the bar is shown.")


def renaming_hooks(model: nn.Module, renamings: List, keys: set) -> List[LoadHook]:
    """One hook per parameter whose checkpoint name differs from its module name (transformers'
    renamings, e.g. a moved prefix), when the renamed tensor is in the checkpoint."""
    hooks = []
    for name, _ in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers()):
        stored = checkpoint_name(name, renamings)
        if stored != name and stored in keys:
            hooks.append(rename(re.escape(name), stored))
    return hooks


@TransformRegistry.register("build_and_load_factory_model")
class BuildAndLoadFactoryModel(BaseTransform):
    config_class = BuildAndLoadFactoryModelConfig

    def _apply_to_full_model(self, mod: Optional[nn.Module], ctx: PipelineContext) -> Tuple[nn.Module, TransformInfo]:
        if ctx.factory is None:
            raise RuntimeError("build_and_load_factory_model needs a model factory in the pipeline context")
        if ctx.world_size > 1:
            raise ConfigError("mode 'transformers' runs on one rank; use the default mode (graph) for world_size "
                              f"{ctx.world_size}")
        cfg: BuildAndLoadFactoryModelConfig = self.config  # type: ignore[assignment]
        factory = ctx.factory
        model = factory.build_model(dtype=ctx.dtype, use_custom_model=False)
        index = factory.checkpoint_index()
        keys = set(index.weight_map)
        converters = conversions(model)
        renamings = reverted_renamings(converters) if converters else []
        hooks = list(factory.load_hooks) + renaming_hooks(model, renamings, keys) + conversion_hooks(
            converters, keys, lambda name: checkpoint_name(name, renamings), factory.config)
        size_mb = index.total_bytes() / 2**20
        show = cfg.show_progress if cfg.show_progress is not None else size_mb > cfg.progress_threshold_mb
        report = load_into_module(
            model, index, device=torch.device(ctx.device), dtype=ctx.dtype, hooks=hooks,
            tied=factory.tied_parameters, initial_buffers=factory.initial_buffers,
            base_prefixes=(factory.base_model_prefix,), show_progress=show,
        )
        model.eval()
        logger.info("HF model %s loaded eagerly (mode transformers): %d tensors, %.1f MiB on %s as %s",
                    type(model).__name__, report.loaded, report.bytes / 2**20, ctx.device,
                    str(ctx.dtype).replace("torch.", ""))
        return model, TransformInfo(num_matches=report.loaded + report.tied, is_clean=True, has_valid_shapes=True)
