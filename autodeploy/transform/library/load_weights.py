"""``load_weights`` (weight_load): checkpoint tensors into the graph's parameters.

Before: parameters and buffers on ``meta``, device arguments ``device='meta'``.
After: every parameter loaded (memory-mapped safetensors, cast to the deployment dtype) on the
target device, non-persistent buffers restored, constants the forward built on the meta device
given the values export recorded, device arguments pointing at the target.
"""

from typing import Optional, Tuple

import torch
from pydantic import Field
from torch import fx, nn

from ...export.exporter import CONSTANT_VALUES, WEIGHT_CONVERSIONS
from ...export.hf_names import checkpoint_name, reverted_renamings
from ...models.conversion_hooks import conversion_hooks
from ...models.weight_loader import load_into_module
from ...utils.logging import get_logger
from ..graph_utils import graph_modules, move_graph_to_device
from ._quant_from_config import GRAPH_IGNORED_TENSORS, GRAPH_LOAD_HOOKS
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

logger = get_logger(__name__)


class LoadWeightsConfig(TransformConfig):
    stage: Stage = Stage.WEIGHT_LOAD
    run_per_gm: bool = False
    expect_mem_change: bool = True
    show_progress: Optional[bool] = Field(
        default=None, description="Progress bar while loading; default: only for checkpoints above the threshold."
    )
    progress_threshold_mb: int = Field(default=256, description="Checkpoint size above which the bar is shown.")


@TransformRegistry.register("load_weights")
class LoadWeights(BaseTransform):
    config_class = LoadWeightsConfig
    requires = ("export_to_gm",)

    def _apply_to_full_model(self, mod: Optional[nn.Module], ctx: PipelineContext) -> Tuple[nn.Module, TransformInfo]:
        assert mod is not None
        cfg: LoadWeightsConfig = self.config  # type: ignore[assignment]
        factory = ctx.factory
        index = factory.checkpoint_index()
        size_mb = index.total_bytes() / 2**20
        show = cfg.show_progress if cfg.show_progress is not None else size_mb > cfg.progress_threshold_mb
        device = torch.device(ctx.device)
        total = 0
        for gm in graph_modules(mod):
            converters = gm.meta.get(WEIGHT_CONVERSIONS) or []
            renamings = reverted_renamings(converters) if converters else []
            hooks = list(factory.load_hooks) + list(gm.meta.get(GRAPH_LOAD_HOOKS, [])) + conversion_hooks(
                converters, set(index.weight_map), lambda name: checkpoint_name(name, renamings), factory.config
            )
            report = load_into_module(
                gm, index, device=device, dtype=ctx.dtype, hooks=hooks,
                tied=factory.tied_parameters, initial_buffers=factory.initial_buffers,
                base_prefixes=(factory.base_model_prefix,), show_progress=show,
                accounted=gm.meta.get(GRAPH_IGNORED_TENSORS, ()), shards=ctx.weight_shards,
            )
            restored = _restore_constants(gm, device)
            move_graph_to_device(gm, device)
            total += report.loaded + report.tied
            logger.info(
                "loaded %d tensors (%.1f MiB, %d via hooks, %d tied, %d initial buffers, %d constants) onto %s as %s",
                report.loaded, report.bytes / 2**20, report.from_hooks, report.tied, report.from_initial, restored,
                device, str(ctx.dtype).replace("torch.", ""),
            )
        return mod, TransformInfo(num_matches=total, is_clean=True, has_valid_shapes=False)


def _restore_constants(gm: fx.GraphModule, device: torch.device) -> int:
    """Constants recorded by export (``torch.tensor(data, device=<meta>)`` in a forward)."""
    restored = 0
    for path, value in gm.meta.pop(CONSTANT_VALUES, {}).items():
        owner_path, _, name = path.rpartition(".")
        try:
            owner = gm.get_submodule(owner_path) if owner_path else gm
        except AttributeError:
            continue  # a transform removed its only user
        if isinstance(getattr(owner, name, None), torch.Tensor):
            setattr(owner, name, value.to(device))
            restored += 1
    return restored
