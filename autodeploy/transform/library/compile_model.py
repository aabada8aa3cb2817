"""``compile_model`` (compile): hand the cached graph to a compile backend.

Before: the cached ``GraphModule``. After: the module the runtime calls. Backends:
``torch-simple`` runs the graph as it is (no compilation).
"""

from typing import Literal, Optional, Tuple

from pydantic import Field
from torch import nn

from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry


class CompileModelConfig(TransformConfig):
    stage: Stage = Stage.COMPILE
    run_per_gm: bool = False
    backend: Literal["torch-simple"] = Field(default="torch-simple", description="Compile backend.")


@TransformRegistry.register("compile_model")
class CompileModel(BaseTransform):
    config_class = CompileModelConfig

    def _apply_to_full_model(self, mod: Optional[nn.Module], ctx: PipelineContext) -> Tuple[nn.Module, TransformInfo]:
        assert mod is not None
        return mod, TransformInfo(num_matches=0, skipped=True, is_clean=True, has_valid_shapes=True)
