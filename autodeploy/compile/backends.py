"""The compile backends and the function ``compile_model`` calls."""

import os
import time
from typing import Callable, Dict, Optional, Sequence

import torch
from torch import fx, nn

from ..cache.interface import CachedSequenceInterface
from ..utils.errors import ConfigError
from ..utils.fx import recompile_now
from ..utils.logging import get_logger
from ..utils.paths import cache_root
from .cuda_graph import DecodeGraphs, cuda_graph_capture
from .direct_kernels import direct_kernel_graph
from .piecewise import PiecewiseGraphs
from .warmup import default_buckets, shape_classes

logger = get_logger(__name__)


def default_cache_dir() -> str:
    return os.path.join(cache_root(), "inductor")


class CompiledGraph(nn.Module):
    """The module the runtime calls: the original graph (``.graph``) plus how it runs."""

    def __init__(self, graph: fx.GraphModule, runner: Callable[..., torch.Tensor], backend: str):
        super().__init__()
        self.graph = graph
        # Not a registered submodule: the runner shares the graph's parameters, and passes over
        # ``modules()`` (``graph_utils.graph_modules``, counting ops) must see the graph once.
        object.__setattr__(self, "runner", runner)
        self.backend = backend

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.runner(*args)


def _warm_up(fn: Callable[..., torch.Tensor], cache: CachedSequenceInterface, label: str) -> None:
    with torch.inference_mode():
        for name, info in shape_classes(cache).items():
            start = time.perf_counter()
            fn(*cache.graph_args(info))
            logger.info("%s: warmed up %s in %.1f s", label, name, time.perf_counter() - start)


def _torch_compile(gm: fx.GraphModule, cache: CachedSequenceInterface, cache_dir: Optional[str]) -> Callable:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", cache_dir or default_cache_dir())
    compiled = torch.compile(gm, dynamic=True, fullgraph=True)
    _warm_up(compiled, cache, "torch-compile")
    return compiled


def _require_cuda(backend: str, cache: CachedSequenceInterface) -> None:
    if cache.device.type != "cuda":
        raise ConfigError(
            f"compile backend '{backend}' captures CUDA graphs and needs device cuda; this deployment runs on "
            f"{cache.device.type} (use torch-simple or torch-compile there)"
        )


def compile_graph(
    gm: fx.GraphModule,
    cache: Optional[CachedSequenceInterface],
    backend: str,
    *,
    cuda_graph_batch_sizes: Optional[Sequence[int]] = None,
    cache_dir: Optional[str] = None,
    piecewise_enabled: bool = False,
    piecewise_num_tokens: Optional[Sequence[int]] = None,
    direct_kernels: bool = True,
) -> nn.Module:
    """Wrap ``gm`` for the runtime according to ``backend`` (see the package docstring)."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown compile backend '{backend}'; available: {', '.join(BACKENDS)}")
    gm = recompile_now(gm)  # its code made now: dynamo cannot trace into a module whose code is deferred
    if backend == "torch-simple":
        device_type = cache.device.type if cache is not None else "cpu"
        runner = _eager_runner(gm, device_type, direct_kernels)
        return CompiledGraph(gm, runner, backend) if runner is not gm else gm
    if cache is None:
        raise ConfigError(f"compile backend '{backend}' needs the cached graph (keep the cache_init transforms)")
    if piecewise_enabled and backend not in ("torch-cudagraph", "torch-opt"):
        raise ConfigError("piecewise_enabled captures CUDA graphs per token bucket; use compile backend "
                          "torch-cudagraph or torch-opt on a CUDA device")
    runner: Callable[..., torch.Tensor] = gm
    if backend in ("torch-cudagraph", "torch-opt"):
        _require_cuda(backend, cache)
    if backend == "torch-cudagraph":
        # the steps no graph replays (prefill, mixed, batches past the largest bucket) run eagerly,
        # where every layer's attention reads the batch layout on the host and so waits for the GPU:
        # the host's per-op cost is then added to each layer's time, not hidden behind the GPU's
        runner = _eager_runner(gm, cache.device.type, direct_kernels)
    if backend in ("torch-compile", "torch-opt"):
        runner = _torch_compile(gm, cache, cache_dir)
    if backend in ("torch-cudagraph", "torch-opt"):
        pool = torch.cuda.graph_pool_handle()
        if piecewise_enabled:
            buckets = piecewise_num_tokens or default_buckets(cache.max_num_tokens)[1:]
            runner = PiecewiseGraphs(runner, gm, cache, buckets, cuda_graph_capture, pool)
            _warm_up_buckets(runner, cache, buckets)
        sizes = cuda_graph_batch_sizes or default_buckets(cache.max_batch_size)
        runner = DecodeGraphs(runner, cache, sizes, capture=cuda_graph_capture)
    return CompiledGraph(gm, runner, backend)


def _eager_runner(gm: fx.GraphModule, device_type: str, direct_kernels: bool) -> fx.GraphModule:
    """What runs the graph eagerly: a sibling whose autodeploy ops skip the dispatcher
    (``direct_kernels``), or ``gm`` itself when that is off or the graph has none of our ops."""
    if not direct_kernels:
        return gm
    runner, swapped = direct_kernel_graph(gm, device_type)
    return runner if swapped else gm


def _warm_up_buckets(runner: PiecewiseGraphs, cache: CachedSequenceInterface, buckets: Sequence[int]) -> None:
    """Capture every token bucket at build time (one prefill step per bucket)."""
    from .warmup import prefill_step

    with torch.inference_mode():
        for bucket in buckets:
            runner(*cache.graph_args(prefill_step(cache, bucket - 1)))


BACKENDS: Dict[str, str] = {
    "torch-simple": "run the graph as it is (autodeploy ops called without the dispatcher, see direct_kernels)",
    "torch-compile": "torch.compile (inductor), dynamic shapes, warmed up at build, on-disk cache",
    "torch-cudagraph": "CUDA graphs for decode batch-size buckets (CUDA only)",
    "torch-opt": "torch-compile plus CUDA graphs (CUDA only)",
}
