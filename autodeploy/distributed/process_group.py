"""The process group: which rank this process is, of how many, over which backend.

Two ways in, one result: ``initialize(rank=..., world_size=...)`` for ranks autodeploy starts
itself, and ``initialize()`` with no arguments under ``torchrun`` (or any launcher that sets
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``), which works across machines too. The
backend follows the device: gloo for CPU tensors, NCCL for CUDA ones. A group is created with a
timeout, so a rank that dies or hangs makes the others fail with an error instead of waiting
forever.

Everything here answers sensibly without a group: ``world_size()`` is 1 and ``rank()`` 0, which
is what the collective ops' single-process identity relies on.
"""

import datetime
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..utils.errors import ConfigError
from ..utils.logging import get_logger

logger = get_logger(__name__)

DEFAULT_TIMEOUT_S = 120.0
# The timeout of the group this process joined through ``initialize`` (None: not joined here).
_timeout_s: Optional[float] = None


@dataclass(frozen=True)
class DistEnv:
    """A rank's place in a group, as a launcher describes it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def environment() -> Optional[DistEnv]:
    """The group a launcher (``torchrun``) described in the environment, or None when there is
    none. A partial or contradictory description is an error naming the variable."""
    if "WORLD_SIZE" not in os.environ and "RANK" not in os.environ:
        return None
    values = {}
    for name in ("RANK", "WORLD_SIZE"):
        raw = os.environ.get(name)
        if raw is None or not raw.strip().isdigit():
            raise ConfigError(f"the environment describes a torch.distributed group but {name} is "
                              f"{'missing' if raw is None else repr(raw)}: set RANK and WORLD_SIZE (torchrun does)")
        values[name] = int(raw)
    rank_, size = values["RANK"], values["WORLD_SIZE"]
    if size < 1 or not 0 <= rank_ < size:
        raise ConfigError(f"RANK {rank_} is not a rank of WORLD_SIZE {size}: ranks are 0..WORLD_SIZE-1")
    port = os.environ.get("MASTER_PORT", "29500")
    if not port.isdigit():
        raise ConfigError(f"MASTER_PORT must be a port number, not {port!r}")
    return DistEnv(rank=rank_, world_size=size, local_rank=int(os.environ.get("LOCAL_RANK", rank_)),
                   master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"), master_port=int(port))


def backend_for(device: torch.device) -> str:
    """gloo for CPU tensors, NCCL for CUDA ones (gloo's CUDA all-reduce copies through the host)."""
    return "nccl" if device.type == "cuda" else "gloo"


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def initialize(rank: Optional[int] = None, world_size: Optional[int] = None, device: str = "cpu",
               master_addr: Optional[str] = None, master_port: Optional[int] = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> DistEnv:
    """Join (or create) the default process group and return this rank's place in it.

    Without ``rank``/``world_size`` the environment must describe the group (``torchrun``). With
    them, the rendezvous is ``tcp://master_addr:master_port`` (default 127.0.0.1 and
    ``MASTER_PORT`` or 29500). Calling it again with the same group is a no-op; a different one
    is an error, since one process holds one default group.
    """
    if rank is None and world_size is None:
        env = environment()
        if env is None:
            raise ConfigError("no torch.distributed group to join: pass rank and world_size, or start under "
                              "torchrun (which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)")
    else:
        if rank is None or world_size is None:
            raise ConfigError("pass both rank and world_size (or neither, under torchrun)")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not a rank of world_size {world_size}: ranks are 0..world_size-1")
        env = DistEnv(rank=rank, world_size=world_size, local_rank=rank,
                      master_addr=master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1"),
                      master_port=int(master_port or os.environ.get("MASTER_PORT", 29500)))
    if is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
            raise ConfigError(f"this process already belongs to a group as rank {dist.get_rank()} of "
                              f"{dist.get_world_size()}; it cannot also be rank {env.rank} of {env.world_size}")
        return env
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available() or torch.cuda.device_count() <= env.local_rank:
            raise ConfigError(f"rank {env.rank} needs CUDA device {env.local_rank}, but this machine has "
                              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
        torch.cuda.set_device(env.local_rank)
    backend = backend_for(dev)
    global _timeout_s
    _timeout_s = timeout_s
    dist.init_process_group(backend=backend, init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    logger.info("rank %d of %d joined the %s group at %s:%d", env.rank, env.world_size, backend, env.master_addr,
                env.master_port)
    return env


def timeout_s() -> float:
    """Seconds a collective of this process's group waits for the other ranks before it fails:
    what ``initialize`` was given (``DEFAULT_TIMEOUT_S`` for a group made elsewhere). Idle ranks
    must hear from rank 0 more often than this (``autodeploy.runtime.step_broadcast`` sends keep-alives)."""
    return _timeout_s if _timeout_s is not None else DEFAULT_TIMEOUT_S


def shutdown() -> None:
    """Leave the default group (if any)."""
    if is_initialized():
        dist.destroy_process_group()
