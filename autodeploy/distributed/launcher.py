"""Starting the ranks of a tensor-parallel deployment from the CLI, and watching them.

``autodeploy run|serve|export|bench --world-size N`` is rank 0 itself and starts ranks 1..N-1 as
child processes of the same command line (``python -m autodeploy.cli ...``) with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` (127.0.0.1) and ``MASTER_PORT`` (a free port) set:
the environment ``torchrun`` gives its workers. A process that finds that environment already
set (a child, or any rank under ``torchrun``, on one machine or several) starts nothing and joins
the group as the rank it names; ranks above 0 then follow rank 0 (``LLM.follow``).

Failure is bounded: rank 0 watches its children, and one that exits before it was told to stop
makes rank 0 stop the others and fail with an error naming the rank and its exit status
(``RankFailure``); a rank that hangs makes every collective fail after the group's timeout. The
children run in their own session, so a Ctrl-C in the terminal reaches rank 0 only, which then
stops them; they also get SIGTERM if rank 0 itself dies (``PR_SET_PDEATHSIG`` on Linux).
"""

import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional, Sequence

from ..utils.errors import ConfigError, RankFailure
from ..utils.logging import get_logger
from . import process_group

logger = get_logger(__name__)

# After rank 0 told the others to stop: how long they get to exit before they are terminated.
EXIT_GRACE_S = 30.0
# After SIGTERM: how long before SIGKILL.
TERM_GRACE_S = 5.0
POLL_S = 0.2


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _libc() -> Optional[ctypes.CDLL]:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not Linux (glibc): the group timeout still bounds an orphan's wait
        return None


def _die_with_parent(libc: Optional[ctypes.CDLL]) -> Callable[[], None]:
    """What the child runs between fork and exec: ask for SIGTERM when its parent dies
    (``PR_SET_PDEATHSIG``). libc is loaded in the parent: nothing may be loaded after a fork."""
    def preexec() -> None:
        if libc is not None:
            libc.prctl(1, signal.SIGTERM)

    return preexec


class LocalRanks:
    """Ranks 1..N-1, started by this process (rank 0) on this machine, and a thread watching
    them. ``failure`` says which one exited unexpectedly and how; ``on_failure`` callbacks (from
    the watcher thread) hear it once."""

    def __init__(self, world_size: int, argv: Sequence[str], master_port: int):
        self.world_size = world_size
        self.failure: Optional[str] = None
        self.on_failure: List[Callable[[str], None]] = []
        self._finishing = False
        self._lock = threading.Lock()  # the watcher and the main thread may both see a failure
        self.procs: List[subprocess.Popen] = []
        preexec = _die_with_parent(_libc())
        for rank in range(1, world_size):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                       LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))
            cmd = [sys.executable, "-m", "autodeploy.cli", *argv]
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    start_new_session=True, preexec_fn=preexec)
            logger.info("started rank %d of %d (pid %d)", rank, world_size, proc.pid)
            self.procs.append(proc)
        self._watcher = threading.Thread(target=self._watch, name="autodeploy-rank-watcher", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        while not self._finishing and not self.check():
            time.sleep(POLL_S)

    def check(self) -> bool:
        """Whether a child has failed (exited with an error or a signal before ``finish``): it is
        then the recorded failure. Exit code 0 is no failure: a rank leaves with 0 only when rank 0
        told it to stop (which may come just before ``finish``)."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code not in (None, 0) and not self._finishing:
                self._fail(f"rank {rank} (pid {proc.pid}) {_exit_status(code)} while the deployment was running")
                return True
        return False

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
        logger.error("%s; stopping every rank", reason)
        self.terminate()
        for callback in list(self.on_failure):
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - a listener's bug must not hide the failure
                logger.exception("an on_failure callback raised")

    def terminate(self) -> None:
        """Stop every child now: SIGTERM, then SIGKILL for those still there after a grace."""
        self._finishing = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + TERM_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def finish(self, timeout: float = EXIT_GRACE_S) -> None:
        """Wait for the children to exit after rank 0 told them to stop; terminate stragglers."""
        self._finishing = True
        deadline = time.monotonic() + timeout
        for rank, proc in enumerate(self.procs, start=1):
            try:
                code = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("rank %d (pid %d) did not exit %g s after it was told to stop; terminating it",
                               rank, proc.pid, timeout)
                self.terminate()
                return
            if code != 0:
                logger.warning("rank %d (pid %d) %s", rank, proc.pid, _exit_status(code))


@dataclass
class Ranks:
    """This process's place in the deployment: its rank, and the ranks it started (rank 0)."""

    rank: int
    world_size: int
    children: Optional[LocalRanks] = None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def failure(self) -> Optional[str]:
        return self.children.failure if self.children is not None else None

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` when a started rank exits unexpectedly (rank 0 of a local launch)."""
        if self.children is not None:
            self.children.on_failure.append(callback)
            if self.children.failure is not None:
                callback(self.children.failure)


def driver_process() -> bool:
    """Whether this process is (or will be) rank 0: no launcher environment, or RANK 0 in it."""
    env = process_group.environment()
    return env is None or env.rank == 0


def _check_local_devices(world_size: int, device: str) -> None:
    """Every local rank of a CUDA deployment needs its own GPU (rank r uses ``cuda:r``)."""
    import torch

    if not device.startswith("cuda"):
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < world_size:
        raise ConfigError(f"--world-size {world_size} on {device} needs {world_size} GPUs on this machine (one per "
                          f"rank), but it has {count}; lower the world size, or start the ranks on several machines "
                          "with torchrun (see the README's tensor parallelism section)")


TIMEOUT_ENV = "AUTODEPLOY_DIST_TIMEOUT"


def group_timeout_s() -> float:
    """The group's timeout for launched ranks: ``AUTODEPLOY_DIST_TIMEOUT`` seconds, or
    ``process_group.DEFAULT_TIMEOUT_S``. It also bounds how long ranks wait for each other at the
    start and after the build, so raise it when one machine may build much more slowly (e.g. it
    downloads the checkpoint while the others have it)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return process_group.DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


@contextmanager
def ranks(world_size: int, argv: Sequence[str], device: str = "cpu",
          timeout_s: Optional[float] = None) -> Iterator[Ranks]:
    """Join (and, as rank 0 of a local launch, start) the ranks of a ``world_size`` deployment;
    at world size 1 nothing happens. ``argv``: this command's arguments, which the started ranks
    run too. On leaving, rank 0 waits for the ranks it started (they leave when it tells them to
    stop) or, on an error or Ctrl-C, terminates them; a rank that exited unexpectedly turns the
    error into a ``RankFailure`` naming it. Every rank leaves the process group. ``timeout_s``:
    the group's timeout (default ``group_timeout_s()``)."""
    if world_size == 1:
        yield Ranks(rank=0, world_size=1)
        return
    timeout_s = timeout_s if timeout_s is not None else group_timeout_s()
    env = process_group.environment()
    children: Optional[LocalRanks] = None
    if env is not None:  # torchrun, or a rank this launcher started: join as the rank it names
        if env.world_size != world_size:
            raise ConfigError(f"world_size {world_size} asked for, but the launcher's environment says WORLD_SIZE "
                              f"{env.world_size}; give the same number to both (or leave --world-size out under "
                              "torchrun)")
        process_group.initialize(device=device, timeout_s=timeout_s)
        here = Ranks(rank=env.rank, world_size=world_size)
    else:
        _check_local_devices(world_size, device)
        port = free_port()
        children = LocalRanks(world_size, argv, port)
        try:
            process_group.initialize(rank=0, world_size=world_size, device=device, master_addr="127.0.0.1",
                                     master_port=port, timeout_s=timeout_s)
        except BaseException as exc:
            children.terminate()
            if children.failure is not None:
                raise RankFailure(children.failure) from exc
            raise
        here = Ranks(rank=0, world_size=world_size, children=children)
    try:
        yield here
    except BaseException as exc:
        if children is not None:
            if not isinstance(exc, KeyboardInterrupt):
                children.check()  # a child that died is the cause of the error, not the error itself
            children.terminate()
            if children.failure is not None:
                raise RankFailure(f"{children.failure}; every rank was stopped") from exc
        raise
    else:
        if children is not None:
            if children.failure is not None:
                raise RankFailure(f"{children.failure}; every rank was stopped")
            children.finish()
    finally:
        process_group.shutdown()
