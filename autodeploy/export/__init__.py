"""Export: HF model -> ``torch.fx.GraphModule`` with dynamic batch/sequence dims."""

# a patch registers itself when its module is imported: all of them are imported here, so every
# patch is in the registry once anything under autodeploy.export has been imported
from . import family_patches, hf_dsa, hf_inkling, hf_lightning, hf_mla, hf_qsa  # noqa: F401
from . import hf_rg_lru, hf_rwkv, hf_zaya, patches  # noqa: F401
from . import state_kernels  # noqa: F401
from .exporter import export_causal_lm  # noqa: F401
from .patch_registry import ExportPatch, apply_export_patches, export_patches, register_export_patch  # noqa: F401
