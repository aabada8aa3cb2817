"""The engine behind the HTTP server: one background thread steps it; asyncio handlers talk to
it through an inbox and per-request queues.

Why a thread and an inbox: a step runs the model (milliseconds to seconds). Handlers must never
wait for it, and the engine must never be touched by two threads at once. So handlers only post
commands (add, abort) to a thread-safe inbox; the engine thread applies them between steps and
hands each request's outputs back to its event loop. A request whose client went away is
aborted at the next step boundary, which frees its pages.

On shutdown the server cuts what is still running when its timeout runs out (``cut_in_flight``):
each cut request's ``generate`` raises ``ServerShuttingDown``, a 503 ``APIError``, so that every
endpoint reports it the way it reports any API error (a stream: an error event, then ``[DONE]``)
without knowing about shutdown.
"""

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Dict, List, Optional, Tuple

from ..runtime.engine import Engine
from ..runtime.outputs import RequestOutput
from ..runtime.request_processor import PreparedRequest, RequestProcessor
from ..runtime.sampling_params import InvalidRequestError
from ..utils.errors import RankFailure
from ..utils.logging import get_logger
from .metrics import Metrics
from .protocol import APIError

logger = get_logger(__name__)

CUT_MESSAGE = "the server shut down before this request finished; retry it"


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: "asyncio.Queue[object]"
    prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    tokens_seen: int = 0


class EngineError(RuntimeError):
    """The engine failed while serving this request (the server keeps running)."""


class ServerShuttingDown(APIError):
    """The server shut down before this request finished (its shutdown timeout ran out), or it
    arrived after the requests in flight were cut. An ``APIError`` (503), not an ``EngineError``:
    nothing failed, and the client should retry elsewhere."""

    def __init__(self, message: str = "the server is shutting down"):
        super().__init__(503, message)


class AsyncEngine:
    """What the server talks to: the request processor (``processor``) to turn a request into
    ``PreparedRequest``s, and ``generate`` to run one. The engine itself is private to the
    engine thread."""

    def __init__(self, engine: Engine, processor: RequestProcessor, metrics: Optional[Metrics] = None):
        self._engine = engine
        self.processor = processor
        self.metrics = metrics or Metrics()
        self._inbox: "queue.Queue[Tuple[str, tuple]]" = queue.Queue()
        self._streams: Dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autodeploy-engine", daemon=True)
        self._ids = 0
        self._ids_lock = threading.Lock()
        # Set by cut_in_flight: the message every later request is refused with.
        self._closed: Optional[str] = None

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, drain_timeout: float = 0.0) -> None:
        """Stop the engine thread, first letting in-flight requests finish for up to
        ``drain_timeout`` seconds; whatever is left is cut (``cut_in_flight``), so that no caller
        waits forever on a thread that is gone."""
        deadline = time.monotonic() + drain_timeout
        while self._streams and time.monotonic() < deadline:
            time.sleep(0.05)
        self.cut_in_flight(self._closed or CUT_MESSAGE)
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def cut_in_flight(self, message: str = CUT_MESSAGE) -> int:
        """End every request in flight now: its ``generate`` raises ``ServerShuttingDown(message)``
        (after the outputs already delivered) and its sequence is aborted, freeing its pages.
        Requests that arrive later are refused the same way. Returns how many were cut.

        Thread-safe: it only posts to the streams' event loops and to the engine's inbox."""
        self._closed = message
        streams = list(self._streams.items())
        for request_id, stream in streams:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, ServerShuttingDown(message))
            self.abort(request_id)
        return len(streams)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def new_request_id(self, prefix: str) -> str:
        with self._ids_lock:
            self._ids += 1
            return f"{prefix}-{self._ids}"

    # ---- handler side --------------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> List[int]:
        """The model's end-of-sequence ids (fixed when the engine was made: safe to read here)."""
        return sorted(self._engine.eos_token_ids)

    @property
    def max_seq_len(self) -> int:
        return self.processor.max_seq_len

    async def generate(self, request_id: str, request: PreparedRequest) -> AsyncIterator[RequestOutput]:
        """Outputs of one prepared request as they grow; aborts the request if the caller stops
        early. Raises ``ServerShuttingDown`` if the request is cut by a shutdown (or comes after
        one began cutting)."""
        if self._closed is not None:
            raise ServerShuttingDown(self._closed)
        num_prompt = len(request.prompt_token_ids)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), num_prompt)
        self._streams[request_id] = stream
        self.metrics.on_request_start(num_prompt)
        self._post("add", (request_id, request))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, ServerShuttingDown):
                    raise item
                if isinstance(item, InvalidRequestError):
                    raise item  # the request's fault (e.g. its guided decoding cannot be served): a 400
                if isinstance(item, BaseException):
                    raise EngineError(str(item)) from item
                out: RequestOutput = item
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)
            self.metrics.on_request_end("completed" if finished else "aborted")

    def abort(self, request_id: str) -> None:
        self._post("abort", (request_id,))

    def _post(self, command: str, args: tuple) -> None:
        self._inbox.put((command, args))
        self._wake.set()

    # ---- engine thread ---------------------------------------------------------------------------
    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        now = time.monotonic()
        produced = sum(len(c.token_ids) for c in out.outputs)
        new = produced - stream.tokens_seen
        if new > 0:
            if stream.first_token is None:
                stream.first_token = now
                self.metrics.observe_ttft(now - stream.arrival)
            elif stream.last_token is not None:
                self.metrics.observe_itl((now - stream.last_token) / new)
            stream.last_token = now
            stream.tokens_seen = produced
            self.metrics.on_tokens(new)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _apply_inbox(self) -> None:
        while True:
            try:
                command, args = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                request_id, request = args
                if request_id not in self._streams:
                    continue  # the client left before its request started
                try:
                    self._engine.add_request(request, request_id=request_id, on_update=self._deliver)
                except Exception as exc:  # noqa: BLE001 - reported to this request only
                    self._fail(request_id, exc)
            elif command == "abort":
                self._engine.abort(args[0])

    def _fail(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._apply_inbox()
            if not self._engine.has_unfinished():
                self._update_gauges()
                self._wake.wait(timeout=0.1)
                self._wake.clear()
                continue
            try:
                self._engine.step()  # outputs reach their streams through on_update (_deliver)
            except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the server
                if isinstance(exc, RankFailure):  # a rank is gone: said once, the server then shuts down
                    logger.error("engine step failed (%s); failing the requests in flight", exc)
                else:
                    logger.exception("engine step failed; failing the requests in flight")
                for request_id in list(self._streams):
                    self._fail(request_id, exc)  # first: the abort below also reports to the stream
                    self._engine.abort(request_id)
                continue
            self._update_gauges()

    def _update_gauges(self) -> None:
        pool = self._engine.pool
        self.metrics.set_gauges(
            running=self._engine.num_running, waiting=self._engine.num_waiting,
            pages_used=pool.num_used, pages_free=pool.num_free,
        )
        self.metrics.set_preemptions(self._engine.num_preemptions)
        scheduler = self._engine.scheduler
        store = self._engine.snapshots
        self.metrics.set_prefix_cache(scheduler.prefix_query_tokens, scheduler.prefix_hit_tokens,
                                      store.num_saved if store else 0, store.num_restored if store else 0,
                                      pool.num_tail_hits)
