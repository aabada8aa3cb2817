"""Stream ops: run a branch of the graph on an auxiliary CUDA stream, concurrently with the main one.

The ``multi_stream_*`` transforms (compile stage) bracket an independent branch of the graph with
three ops; every node between ``fork_to_aux`` and ``end_aux`` is launched on the aux stream, the
nodes after ``end_aux`` on the main stream, and ``join_from_aux`` makes the main stream wait for
the branch before the first node that reads its outputs::

    autodeploy.fork_to_aux([x])          # event on the main stream (x is ready); aux waits on it;
                                          # the aux stream becomes the current stream
    s = <shared expert / small GEMM / kv latent projection>(x)     # launched on aux
    autodeploy.end_aux([s])              # event on aux; the main stream is current again
    r = <routed experts / large GEMM / q projection>(x)            # launched on main, concurrently
    autodeploy.join_from_aux([s])        # the main stream waits on aux's event
    y = r + s

Why ops with no outputs: a custom op may not return (an alias of) its input, so the ops cannot
thread ``x`` through; they act by their position in the graph. That is exact for backends that run
the graph node by node in its order (``torch-simple``, and ``torch-cudagraph``, which captures such
a run), which is why the transforms leave graphs for ``torch-compile`` / ``torch-opt`` alone
(inductor orders nodes by data dependencies only). The ops are registered as side-effectful so
dead-code elimination keeps them.

Safety:

* **CUDA graph capture.** Event record/wait between streams is how a capture forks onto another
  stream and joins it back (``cudaStreamBeginCapture`` follows the dependency onto the aux
  stream); every region is joined before the graph ends, so the capture is balanced. The events
  are reused per thread and device: ``wait_event`` waits on the record made just before it, which
  is also what a capture records.
* **Caching allocator.** A block belongs to the stream it was allocated on, and is reused as soon
  as its last Python reference goes, with no regard to other streams. So ``fork_to_aux`` marks
  every main-stream tensor the branch reads with ``record_stream(aux)`` (the branch may be the
  last reader), and ``end_aux`` marks every tensor the branch hands back with
  ``record_stream(main)``: their blocks are not reused until the other stream has passed that
  point. During a capture the allocator defers those events to the end of the capture.
* **Errors.** A graph run that raised inside a region leaves the aux stream current; the next
  ``fork_to_aux`` on that thread notices, restores the main stream and logs a warning.

On tensors of any other device (CPU) all three ops do nothing: one stream, and the graph computes
the same numbers.
"""

import threading
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor
from torch.fx.node import has_side_effect

from ..utils.logging import get_logger

logger = get_logger(__name__)

_STREAMS: Dict[int, "torch.cuda.Stream"] = {}
_STREAMS_LOCK = threading.Lock()


def aux_stream(device: torch.device) -> "torch.cuda.Stream":
    """The auxiliary stream of a CUDA device: one per device for the process (created on first use),
    so every region and every captured graph uses the same second stream."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _STREAMS_LOCK:
        stream = _STREAMS.get(index)
        if stream is None:
            stream = torch.cuda.Stream(device=torch.device("cuda", index))
            _STREAMS[index] = stream
    return stream


class _ThreadState(threading.local):
    """Per thread: the open region (device, main stream), the join event waiting to be waited on,
    the reused events, and how many regions ran on CUDA (the GPU tests read it)."""

    def __init__(self) -> None:
        self.open: Optional[Tuple[torch.device, "torch.cuda.Stream"]] = None
        self.pending: Optional["torch.cuda.Event"] = None
        self.events: Dict[Tuple[int, str], "torch.cuda.Event"] = {}
        self.regions = 0

    def event(self, device: torch.device, kind: str) -> "torch.cuda.Event":
        key = (device.index if device.index is not None else torch.cuda.current_device(), kind)
        ev = self.events.get(key)
        if ev is None:
            ev = self.events[key] = torch.cuda.Event()
        return ev


_STATE = _ThreadState()


def regions_run() -> int:
    """How many branches this thread has run on an aux stream (CUDA only; the GPU tests use it)."""
    return _STATE.regions


def _cuda_device(tensors: List[Tensor]) -> Optional[torch.device]:
    for t in tensors:
        if t.is_cuda:
            return t.device
    return None


def _recover() -> None:
    """A region left open by a run that raised: make its main stream current again."""
    if _STATE.open is not None:
        _, main = _STATE.open
        logger.warning("multi-stream: a region was left open (an earlier graph run raised inside it); "
                       "restoring the main stream")
        torch.cuda.set_stream(main)
    _STATE.open, _STATE.pending = None, None


@torch.library.custom_op("autodeploy::fork_to_aux", mutates_args=())
def fork_to_aux(inputs: List[Tensor]) -> None:
    """Start a branch on the aux stream: it waits for the main stream's work so far (``inputs``, the
    main-stream tensors the branch reads, are ready), and becomes the current stream. No-op on CPU."""
    device = _cuda_device(inputs)
    if device is None:
        return
    if _STATE.open is not None or _STATE.pending is not None:
        _recover()
    main = torch.cuda.current_stream(device)
    aux = aux_stream(device)
    if aux == main:  # someone runs the whole graph on the aux stream: one stream, nothing to do
        return
    ready = _STATE.event(device, "fork")
    ready.record(main)
    aux.wait_event(ready)
    for t in inputs:
        if t.is_cuda:
            t.record_stream(aux)  # the branch may be its last reader: keep its block until aux is done
    _STATE.open = (device, main)
    torch.cuda.set_stream(aux)


@fork_to_aux.register_fake
def _fork_to_aux_fake(inputs: List[Tensor]) -> None:
    return None


@torch.library.custom_op("autodeploy::end_aux", mutates_args=())
def end_aux(outputs: List[Tensor]) -> None:
    """End the branch: record its completion on the aux stream and make the main stream current
    again (what follows runs concurrently with the branch). ``outputs``: what the branch hands
    to the main stream. No-op when no region is open (CPU)."""
    if _STATE.open is None:
        return
    device, main = _STATE.open
    aux = torch.cuda.current_stream(device)
    done = _STATE.event(device, "join")
    done.record(aux)
    for t in outputs:
        if t.is_cuda:
            t.record_stream(main)  # read on main after the join: keep the block until main passes it
    _STATE.open, _STATE.pending = None, done
    _STATE.regions += 1
    torch.cuda.set_stream(main)


@end_aux.register_fake
def _end_aux_fake(outputs: List[Tensor]) -> None:
    return None


@torch.library.custom_op("autodeploy::join_from_aux", mutates_args=())
def join_from_aux(outputs: List[Tensor]) -> None:
    """Make the main (current) stream wait for the branch, before the first node that reads its
    ``outputs``. No-op when no branch is pending (CPU)."""
    done = _STATE.pending
    if done is None:
        return
    _STATE.pending = None
    torch.cuda.current_stream().wait_event(done)


@join_from_aux.register_fake
def _join_from_aux_fake(outputs: List[Tensor]) -> None:
    return None


# The ops act by their place in the graph and return nothing: dead-code elimination must keep them.
for _op in (torch.ops.autodeploy.fork_to_aux, torch.ops.autodeploy.end_aux, torch.ops.autodeploy.join_from_aux):
    has_side_effect(_op)
    has_side_effect(_op.default)


def stream_ops() -> Tuple[object, ...]:
    """The three ops (``.default`` overloads, as graphs hold them): fork, end, join."""
    ad = torch.ops.autodeploy
    return ad.fork_to_aux.default, ad.end_aux.default, ad.join_from_aux.default
