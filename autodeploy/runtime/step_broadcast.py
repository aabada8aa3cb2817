"""Rank 0 tells the other ranks what to run: one message per engine step.

Under tensor parallelism only rank 0 has a scheduler, a sampler and a tokenizer. Each step it
broadcasts the step's graph inputs, the ``SequenceInfo`` (tokens, positions and the cache
metadata; every rank holds its own cache tensors), and every rank then calls its shard of the
graph with them, meeting the others in the graph's all-reduces. The logits are the same on every
rank (the LM head is whole, or its vocabulary slices are all-gathered); only rank 0 samples from them.

Wire format, two broadcasts from rank 0 over the default group:

1. a header: ``int64[6] = [kind, T, B, P, R, C]`` (``kind`` a ``MessageKind``; ``T`` tokens, ``B``
   sequences, ``P`` page-table columns, ``R`` logits rows, ``C`` state copies of a step, zeros
   otherwise);
2. for a step only: every ``SequenceInfo`` field flattened into one ``int64`` tensor, in
   ``FIELDS`` order (the sizes follow from the header; each field is cast back to its dtype),
   then the ``C`` copies (``state_snapshots.Copy``: kind, row, slot) that each rank makes before
   the step runs (prefix caching: state copies of a model with state caches, tail-page copies).

A rank waiting for a message is inside a collective, which fails after the group's timeout
(``process_group.timeout_s``). So rank 0 sends a keep-alive whenever it has been quiet for a
quarter of it (an idle server), and a rank that dies or hangs is an error on every other rank
within that timeout, never a wait forever. A step (the message and the graph call with its
collectives) holds a lock, so a keep-alive never falls between a step's collectives.
"""

import enum
import threading
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..cache.sequence_info import METADATA_NAMES, SequenceInfo
from ..utils.errors import RankFailure
from ..utils.logging import get_logger
from ..distributed import process_group
from .state_snapshots import Copy

if TYPE_CHECKING:
    from ..cache.interface import CachedSequenceInterface

logger = get_logger(__name__)

HEADER_LEN = 6


class MessageKind(enum.IntEnum):
    STEP = 1  # a step's graph inputs follow
    KEEPALIVE = 2  # nothing to run; rank 0 is alive
    STOP = 3  # rank 0 is done: leave the loop


# name -> (shape from (T, B, P, R), dtype): every SequenceInfo field, in wire order
_Shape = Callable[[int, int, int, int], Tuple[int, ...]]
FIELDS: Dict[str, Tuple[_Shape, torch.dtype]] = {
    "input_ids": (lambda t, b, p, r: (1, t), torch.long),
    "position_ids": (lambda t, b, p, r: (1, t), torch.long),
    "batch_info": (lambda t, b, p, r: (3,), torch.int32),
    "seq_len": (lambda t, b, p, r: (b,), torch.int32),
    "input_pos": (lambda t, b, p, r: (b,), torch.int32),
    "cu_seqlen": (lambda t, b, p, r: (b + 1,), torch.int32),
    "page_table": (lambda t, b, p, r: (b, p), torch.int32),
    "slot_idx": (lambda t, b, p, r: (b,), torch.int32),
    "use_initial_state": (lambda t, b, p, r: (b,), torch.bool),
    "logits_index": (lambda t, b, p, r: (r,), torch.int32),
}
assert tuple(FIELDS) == ("input_ids", "position_ids", *METADATA_NAMES), "a SequenceInfo field has no wire format"


def pack(info: SequenceInfo, copies: Sequence[Copy] = ()) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(header, payload)`` of one step and the state copies made before it, on the info's device."""
    inputs = info.as_inputs()
    device = info.input_ids.device
    sizes = [info.num_tokens, info.num_sequences, int(info.page_table.shape[1]), int(info.logits_index.numel()),
             len(copies)]
    header = torch.tensor([int(MessageKind.STEP), *sizes], dtype=torch.long, device=device)
    parts = [inputs[name].reshape(-1).to(torch.long) for name in FIELDS]
    if copies:
        parts.append(torch.tensor([list(c) for c in copies], dtype=torch.long, device=device).reshape(-1))
    return header, torch.cat(parts)


def payload_numel(header: List[int]) -> int:
    _, t, b, p, r, c = header
    return sum(int(torch.Size(shape(t, b, p, r)).numel()) for shape, _ in FIELDS.values()) + 3 * c


def state_copies(header: List[int], payload: torch.Tensor) -> List[Copy]:
    """The state copies at the end of a step's payload, in the order rank 0 made them."""
    count = header[5]
    if not count:
        return []
    return [Copy(*row) for row in payload[payload.numel() - 3 * count:].reshape(count, 3).tolist()]


def unpack(header: List[int], payload: torch.Tensor) -> SequenceInfo:
    """The ``SequenceInfo`` a header and payload describe (views into ``payload`` cast back)."""
    _, t, b, p, r, c = header
    fields, offset = {}, 0
    for name, (shape_of, dtype) in FIELDS.items():
        shape = shape_of(t, b, p, r)
        n = int(torch.Size(shape).numel())
        fields[name] = payload[offset:offset + n].reshape(shape).to(dtype)
        offset += n
    if offset + 3 * c != payload.numel():
        raise RankFailure(f"a step message from rank 0 has {payload.numel()} values, its header says {offset + 3 * c}; "
                          "are all ranks running the same autodeploy version?")
    return SequenceInfo(**fields)


class StepSender:
    """Rank 0's end: ``with sender.step(info): <run the graph>`` for each step, ``stop()`` at the end.

    A keep-alive thread covers idle time. The first failure (a collective that raised, a rank
    the launcher saw die: ``fail``) is kept: every later step raises ``RankFailure`` with it at
    once, and ``on_failure`` callbacks hear it (the server shuts down on it).
    """

    def __init__(self, device: torch.device, keepalive_s: Optional[float] = None):
        self.device = torch.device(device)
        self.keepalive_s = keepalive_s if keepalive_s is not None else max(0.5, min(30.0, process_group.timeout_s() / 4))
        self.failure: Optional[str] = None
        self.on_failure: List[Callable[[str], None]] = []
        self.steps = 0
        self._lock = threading.Lock()
        self._stopped = False
        self._last_sent = time.monotonic()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._keepalive, name="autodeploy-keepalive", daemon=True)
        self._thread.start()

    # ---- messages ------------------------------------------------------------------------------
    def _send_header(self, kind: MessageKind) -> None:
        header = torch.zeros(HEADER_LEN, dtype=torch.long, device=self.device)
        header[0] = int(kind)
        dist.broadcast(header, src=0)
        self._last_sent = time.monotonic()

    @contextmanager
    def step(self, info: SequenceInfo, copies: Sequence[Copy] = ()) -> Iterator[None]:
        """Send ``info`` (and the state ``copies`` each rank makes first) to every rank; the body
        runs rank 0's graph call. Any error inside (a
        rank gone, a collective timed out, a bug, Ctrl-C) leaves the ranks out of step: it is
        kept as the group's failure, and the step raises ``RankFailure`` naming it."""
        with self._lock:
            self._check()
            try:
                header, payload = pack(info, copies)
                dist.broadcast(header, src=0)
                dist.broadcast(payload, src=0)
                self._last_sent = time.monotonic()
                yield
                self.steps += 1
                self._last_sent = time.monotonic()  # the step's collectives were contact too
            except BaseException as exc:
                reason = self.failure or f"step {self.steps} failed on rank 0: {type(exc).__name__}: {exc}"
                self.fail(reason, log=isinstance(exc, Exception))  # Ctrl-C is no failure to report
                if isinstance(exc, Exception):
                    raise RankFailure(self._message()) from exc
                raise

    def _check(self) -> None:
        if self._stopped:
            raise RankFailure("the other ranks were already told to stop (LLM.shutdown); build a new LLM")
        if self.failure is not None:
            raise RankFailure(self._message())

    def _message(self) -> str:
        return (f"tensor parallelism across {process_group.world_size()} ranks failed: {self.failure}. Every rank "
                "stops; check the other ranks' logs for their error, then start the deployment again")

    def fail(self, reason: str, log: bool = True) -> None:
        """Record the group's failure (the first one wins) and tell the listeners."""
        if self.failure is not None:
            return
        self.failure = reason
        if log:
            logger.error("tensor parallelism failed: %s", reason)
        for callback in list(self.on_failure):
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - a listener's bug must not hide the failure
                logger.exception("an on_failure callback raised")
        self._wake.set()

    def stop(self) -> bool:
        """Tell every rank to leave its loop (once). Not after a failure: the others may be inside
        a collective of a step that never finished, and would read the message as part of it;
        they leave on the failure instead. Returns whether the message was sent."""
        with self._lock:
            if self._stopped:
                return False
            self._stopped = True
            self._wake.set()
            if self.failure is not None:
                return False
            try:
                self._send_header(MessageKind.STOP)
            except Exception as exc:  # noqa: BLE001 - a rank already gone: nothing left to stop
                logger.warning("could not tell the other ranks to stop: %s", exc)
                return False
        logger.info("told the other ranks to stop after %d steps", self.steps)
        return True

    def _keepalive(self) -> None:
        while True:
            self._wake.wait(self.keepalive_s / 2)
            if self._stopped or self.failure is not None:
                return
            if time.monotonic() - self._last_sent < self.keepalive_s or not self._lock.acquire(timeout=0.1):
                continue  # a step is running (or just ran): that is a message too
            try:
                if self._stopped or self.failure is not None:
                    return
                self._send_header(MessageKind.KEEPALIVE)
            except Exception as exc:  # noqa: BLE001 - a rank is gone while idle
                self.fail(f"a rank stopped answering while idle: {type(exc).__name__}: {exc}")
                return
            finally:
                self._lock.release()


class ReceivedStep(NamedTuple):
    info: SequenceInfo
    copies: List[Copy]  # state copies to make before the step runs (``StateReplica.apply``)


class StepReceiver:
    """The other ranks' end: ``receive()`` is the next step (its inputs and the state copies that
    go before it), or None when rank 0 says stop."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def receive(self) -> Optional[ReceivedStep]:
        while True:
            header_t = torch.empty(HEADER_LEN, dtype=torch.long, device=self.device)
            try:
                dist.broadcast(header_t, src=0)
            except Exception as exc:
                raise RankFailure(f"rank {process_group.rank()} lost rank 0 while waiting for the next step "
                                  f"({type(exc).__name__}: {exc}); rank 0 stopped or hung, see its log") from exc
            header = header_t.tolist()
            kind = header[0]
            if kind == MessageKind.KEEPALIVE:
                continue
            if kind == MessageKind.STOP:
                return None
            if kind != MessageKind.STEP:
                raise RankFailure(f"rank {process_group.rank()} got an unknown message kind {kind} from rank 0")
            payload = torch.empty(payload_numel(header), dtype=torch.long, device=self.device)
            dist.broadcast(payload, src=0)
            return ReceivedStep(unpack(header, payload), state_copies(header, payload))


def agree_on_capacity(cache: "CachedSequenceInterface") -> Tuple[int, int]:
    """``(pages, sequences)`` every rank's cache holds: the smallest over the ranks, which is
    what rank 0 may schedule (each rank sized its own KV pool from its own free memory). Every
    rank must call it, after its build."""
    mine = torch.tensor([cache.allocatable_pages, cache.max_batch_size], dtype=torch.long, device=cache.device)
    agreed = mine.clone()
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    pages, sequences = (int(v) for v in agreed.tolist())
    if (pages, sequences) != tuple(int(v) for v in mine.tolist()):
        logger.info("rank %d holds %d pages and %d sequences; the group schedules within %d and %d (the smallest "
                    "rank's)", process_group.rank(), cache.allocatable_pages, cache.max_batch_size, pages, sequences)
    return pages, sequences
