"""autodeploy: compile an off-the-shelf HuggingFace causal LM into a fast inference engine.

Importing the package registers the canonical ops (``torch.ops.autodeploy.*``) and every
transform of the library, so that a YAML pipeline can name them.
"""

from . import ops as _ops  # noqa: F401  (registers torch.ops.autodeploy.*)

__version__ = "0.1.0"
