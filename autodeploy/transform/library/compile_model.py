"""``compile_model`` (compile): hand the cached graph to a compile backend.

Before: the cached ``GraphModule``. After: the module the runtime calls (see
``autodeploy.compile``): ``torch-simple`` (the graph as it is, its autodeploy ops called as
plain Python functions: ``compile.direct_kernels``), ``torch-compile`` (inductor,
warmed up for every step shape class at build time, on-disk cache), ``torch-cudagraph`` and
``torch-opt`` (CUDA graphs for decode batch-size buckets, and with ``piecewise_enabled`` for
prefill/mixed steps per token bucket, split at the cached attention ops; CUDA only, a clear
error elsewhere).

``auto`` (the default) is ``torch-cudagraph`` on a CUDA device and ``torch-simple`` elsewhere,
and ``torch-simple`` for a model in recompute mode (no KV-cached graph to capture) or whose graph
cannot be captured (an op that reads values back to the host during a decode step: a warning
names the error). Why CUDA
graphs by default on a GPU: a decode step of a small model is launch-bound there. Measured on an
H100 (2026-11-26, the ``large`` preset, ~1.1B Llama in bfloat16, ``autodeploy bench``):
batch-1 decode 42 tok/s with ``torch-simple`` (23.8 ms per step: one Python launch per op),
against HF eager's 19.8; the CUDA-graph numbers are in ``benchmarks/RESULTS.md``.
"""

import time
from typing import List, Literal, Optional, Tuple

import torch
from pydantic import Field
from torch import nn

from ...compile import compile_graph
from ...utils.errors import ConfigError
from ...utils.logging import get_logger
from ..graph_utils import graph_modules
from ..interface import BaseTransform, PipelineContext, Stage, TransformConfig, TransformInfo, TransformRegistry

logger = get_logger(__name__)
# what the slow backends spend their build time on, said before it starts
_SLOW_WORK = {
    "torch-compile": "inductor compiles and warms up every step shape class (seconds; a later build of the same "
                     "graph reads the on-disk cache)",
    "torch-cudagraph": "capturing CUDA graphs for the decode batch sizes",
    "torch-opt": "compiling and capturing CUDA graphs",
}


def resolve_backend(backend: str, device: str) -> str:
    """The backend ``auto`` stands for on ``device`` (any other name stands for itself)."""
    if backend != "auto":
        return backend
    return "torch-cudagraph" if torch.device(device).type == "cuda" else "torch-simple"


class CompileModelConfig(TransformConfig):
    stage: Stage = Stage.COMPILE
    run_per_gm: bool = False
    backend: Literal["auto", "torch-simple", "torch-compile", "torch-cudagraph", "torch-opt"] = Field(
        default="auto", description="Compile backend (also the top-level compile_backend setting); auto: "
        "torch-cudagraph on a CUDA device, torch-simple elsewhere and for a model in recompute mode."
    )
    cuda_graph_batch_sizes: Optional[List[int]] = Field(
        default=None, description="Decode batch sizes to capture; default 1, 2, 4, ... up to max_batch_size."
    )
    cache_dir: Optional[str] = Field(
        default=None, description="Inductor's on-disk compile cache; default $AUTODEPLOY_CACHE/inductor."
    )
    piecewise_enabled: bool = Field(
        default=False, description="CUDA graphs for prefill/mixed steps too, split at the cached attention ops."
    )
    piecewise_num_tokens: Optional[List[int]] = Field(
        default=None, description="Token buckets for piecewise graphs; default 2, 4, ... up to max_num_tokens."
    )
    direct_kernels: bool = Field(
        default=True,
        description="torch-simple, and torch-cudagraph's steps no graph replays (prefill, mixed): run "
        "autodeploy's ops as direct Python calls, skipping the dispatcher's per-call layers (~9-150 us per "
        "call on CPU); the graph itself keeps the ops.",
    )


@TransformRegistry.register("compile_model")
class CompileModel(BaseTransform):
    config_class = CompileModelConfig

    def _apply_to_full_model(self, mod: Optional[nn.Module], ctx: PipelineContext) -> Tuple[nn.Module, TransformInfo]:
        assert mod is not None
        cfg: CompileModelConfig = self.config  # type: ignore[assignment]
        (gm,) = list(graph_modules(mod))
        automatic = cfg.backend == "auto"
        if automatic:
            backend = "torch-simple" if "autodeploy_recompute" in gm.meta else resolve_backend("auto", ctx.device)
            cfg = cfg.model_copy(update={"backend": backend})
            logger.info("compile_model: backend auto -> %s", backend)
            if backend != "torch-simple":
                try:
                    return self._compile(gm, cfg, ctx)
                except RuntimeError as exc:
                    # an op that reads values back to the host (a MoE's routing counts, say) cannot
                    # be captured: auto must still give a working engine, so it runs uncaptured
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                    logger.warning("compile_model: auto: capturing CUDA graphs failed (%s); this model runs with "
                                   "torch-simple (set compile_backend explicitly to see the error)", first)
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    cfg = cfg.model_copy(update={"backend": "torch-simple"})
        if cfg.backend == "torch-simple":
            compiled = compile_graph(gm, ctx.cache, cfg.backend, direct_kernels=cfg.direct_kernels)
            if compiled is gm:
                return mod, TransformInfo(skipped=True, is_clean=True, has_valid_shapes=True,
                                          reason="torch-simple: the graph runs as it is")
            return compiled, TransformInfo(num_matches=1, is_clean=True, has_valid_shapes=True)
        if "autodeploy_recompute" in gm.meta:
            raise ConfigError(
                f"compile backend '{cfg.backend}' needs the KV-cached graph, but this model runs in recompute mode "
                f"({ctx.recompute_reason or 'see the warning above'}); use compile_backend: torch-simple"
            )
        return self._compile(gm, cfg, ctx)

    def _compile(self, gm: nn.Module, cfg: CompileModelConfig, ctx: PipelineContext) -> Tuple[nn.Module, TransformInfo]:
        # the one step of a build that can take many seconds without a sign of life: say so
        logger.info("compile_model: %s: %s ...", cfg.backend, _SLOW_WORK[cfg.backend])
        start = time.perf_counter()
        compiled = compile_graph(
            gm, ctx.cache, cfg.backend, cuda_graph_batch_sizes=cfg.cuda_graph_batch_sizes, cache_dir=cfg.cache_dir,
            piecewise_enabled=cfg.piecewise_enabled, piecewise_num_tokens=cfg.piecewise_num_tokens,
        )
        logger.info("compile_model: %s done in %.1f s", cfg.backend, time.perf_counter() - start)
        return compiled, TransformInfo(num_matches=1, is_clean=True, has_valid_shapes=True)
