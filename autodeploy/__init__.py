"""autodeploy: compile an off-the-shelf HuggingFace causal LM into a fast inference engine.

Importing the package registers the canonical ops (``torch.ops.autodeploy.*``) and every
transform of the library, so that a YAML pipeline can name them.
"""

from . import ops as _ops  # noqa: F401  (registers torch.ops.autodeploy.*)

from ._version import __version__  # noqa: E402

__all__ = ["LLM", "SamplingParams", "InvalidRequestError", "__version__"]


def __getattr__(name: str):
    # Lazy: importing the package (e.g. for the ops) does not build the runtime.
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "SamplingParams":
        from .runtime.sampling_params import SamplingParams

        return SamplingParams
    if name == "InvalidRequestError":
        from .runtime.sampling_params import InvalidRequestError

        return InvalidRequestError
    raise AttributeError(f"module 'autodeploy' has no attribute '{name}'")
