"""How the norm fusions (``fuse_rmsnorm``, ``fuse_l2norm``) choose between the reference op and
autodeploy's CPU kernel: one rule, so the two cannot drift apart."""

import torch

from ...ops import native
from ...utils.logging import get_logger
from ..interface import PipelineContext

logger = get_logger(__name__)

# why a norm fusion leaves the reference ops (backend torch, chosen or resolved from auto)
TORCH_REASON = ("backend torch (auto picks native on CPU when autodeploy's C kernels build and torch-compile does "
                "not compile the graph)")


def resolve_native_backend(backend: str, ctx: PipelineContext, key: str) -> str:
    """``auto`` -> ``native`` on CPU when the C kernels build (and ``torch-compile`` does not
    compile the graph), else ``torch``; ``native`` off CPU falls back to ``torch`` with a warning."""
    on_cpu = torch.device(ctx.device).type == "cpu"
    if backend == "auto":
        usable = on_cpu and ctx.compile_backend != "torch-compile" and native.available()
        return "native" if usable else "torch"
    if backend == "native" and not on_cpu:
        logger.warning("%s backend 'native' is CPU-only; device %s keeps the reference ops", key, ctx.device)
        return "torch"
    return backend
