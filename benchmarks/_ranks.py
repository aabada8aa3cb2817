"""Start a benchmark's ranks on this machine and collect what each reports (shared by the
multi-process benchmarks: ``bench_allreduce_norm.py``, ``bench_tp_memory.py``).

``target(rank, port, *args, queue)`` runs in a spawned process per rank (loopback rendezvous on
``port``) and puts ``(rank, value)`` on the queue: a string value means that rank failed.
"""

import socket
import time
from typing import Any, Callable, Dict, Sequence

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target: Callable[..., None], world: int, args: Sequence[Any], timeout_s: float = 1800) -> Dict[int, Any]:
    """Every rank's value; ``SystemExit`` naming the failed ranks when one failed or none reported."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, value = queue.get(timeout=1)
            results[rank] = value
        except Exception:  # noqa: BLE001 - queue.Empty: stop waiting once every rank is gone
            if all(not p.is_alive() for p in procs):
                break
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    failed = {r: v for r, v in results.items() if isinstance(v, str)}
    if failed or len(results) < world:
        raise SystemExit(f"benchmark failed at world size {world}: {failed or 'a rank reported nothing'}")
    return results
