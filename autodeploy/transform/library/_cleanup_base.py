"""Shared shell of the post-export cleanup transforms (each key has its own file)."""

from typing import Callable, ClassVar

from torch import fx

from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo


class CleanupConfig(TransformConfig):
    stage: Stage = Stage.POST_EXPORT
    requires_shape_prop: bool = True


class CleanupTransform(BaseTransform):
    """Runs one function of ``transform.cleanups``; removing identities keeps shapes valid."""

    config_class = CleanupConfig
    cleanup: ClassVar[Callable[[fx.GraphModule], int]]

    def _apply(self, gm: fx.GraphModule, ctx: PipelineContext) -> TransformInfo:
        count = type(self).cleanup(gm)
        return TransformInfo(num_matches=count, is_clean=count == 0, has_valid_shapes=True)
