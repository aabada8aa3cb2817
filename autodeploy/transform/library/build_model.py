"""``build_model`` (factory): the model source becomes an ``nn.Module`` on the meta device.

Before: nothing. After: the HF (or registered custom) model with parameters on ``meta`` and the
factory holding what later stages need (checkpoint, initial buffer values, tied names). A
registered custom model is preferred over the HF class; ``use_custom_model: false`` turns that off.
"""

from typing import Optional, Tuple

from pydantic import Field
from torch import nn

from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry


class BuildModelConfig(TransformConfig):
    stage: Stage = Stage.FACTORY
    run_per_gm: bool = False
    requires_clean_graph: bool = False
    use_custom_model: bool = Field(
        default=True,
        description="Build the lean custom model registered for the config class (models/custom/) when there is "
                    "one. Off: always the HF class (or the checkpoint's own code), e.g. to compare a custom model "
                    "with the exported HF one or to step around a custom model's bug.",
    )


@TransformRegistry.register("build_model")
class BuildModel(BaseTransform):
    config_class = BuildModelConfig

    def _apply_to_full_model(self, mod: Optional[nn.Module], ctx: PipelineContext) -> Tuple[nn.Module, TransformInfo]:
        if ctx.factory is None:
            raise RuntimeError("build_model needs a model factory in the pipeline context")
        cfg: BuildModelConfig = self.config  # type: ignore[assignment]
        model = ctx.factory.build_model(dtype=ctx.dtype, use_custom_model=cfg.use_custom_model)
        return model, TransformInfo(num_matches=1, is_clean=True, has_valid_shapes=True)
