"""Export: HF model -> ``torch.fx.GraphModule`` with dynamic batch/sequence dims."""

from .exporter import export_causal_lm  # noqa: F401
from .patches import export_patches, register_export_patch  # noqa: F401
