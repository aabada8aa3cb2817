"""The transform pipeline: contract (``interface``), runner (``optimizer``), library."""

from .interface import (  # noqa: F401
    BaseTransform,
    PipelineContext,
    Stage,
    TransformConfig,
    TransformInfo,
    TransformRegistry,
)
