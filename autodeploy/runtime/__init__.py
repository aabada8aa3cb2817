"""The inference runtime: engine (scheduler, paged KV cache, sampler) and the ``LLM`` API.

Depends on the IR only through the compiled graph and the cache interface.
"""

from .outputs import CompletionOutput, RequestOutput  # noqa: F401
from .sampling_params import SamplingParams  # noqa: F401
