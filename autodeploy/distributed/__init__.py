"""Running one model across several processes with ``torch.distributed``.

``process_group`` sets up the group (gloo on CPU, NCCL on CUDA) from explicit arguments or from
the environment ``torchrun`` leaves; the collective ops themselves are canonical ops in
``autodeploy.ops.collectives`` so that they survive export and shape propagation like any other.
``launcher`` starts the ranks for the CLI (``--world-size``) and watches them. How rank 0 drives
the others (each engine step's inputs broadcast, the followers' loop) is runtime:
``autodeploy.runtime.step_broadcast`` and ``autodeploy.runtime.follower``, which may import the
cache while this package, imported by the collective ops, must not.
"""

from .process_group import DistEnv, backend_for, environment, initialize, is_initialized, rank, shutdown, world_size

__all__ = ["DistEnv", "backend_for", "environment", "initialize", "is_initialized", "rank", "shutdown", "world_size"]
