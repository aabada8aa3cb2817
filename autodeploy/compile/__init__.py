"""Compile backends: how the final cached graph runs.

* ``torch-simple``: the graph as it is, with autodeploy's ops called as plain Python functions
  (``direct_kernels``: the dispatcher's per-call layers skipped; the graph keeps the ops).
* ``torch-compile``: ``torch.compile`` (inductor) with dynamic shapes, an on-disk cache, and
  every shape class warmed up at build time so serving never compiles.
* ``torch-cudagraph``: decode steps replayed from CUDA graphs captured per batch-size bucket
  (CUDA only); other steps run the graph eagerly, or piecewise per token bucket.
* ``torch-opt``: ``torch-compile`` plus CUDA graphs.
"""

from .backends import BACKENDS, compile_graph  # noqa: F401
