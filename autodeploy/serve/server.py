"""Run the server: build the model, start the engine thread, serve HTTP until a signal.

Shutdown (SIGTERM or SIGINT) keeps the README's contract, which uvicorn's own shutdown does not:
uvicorn closes the listening socket at once (new clients would get "connection refused", not a
503) and, at its timeout, cancels the requests still running (a stream then ends in a broken
chunked read and the log shows a ``CancelledError`` traceback). So here:

1. the signal only starts draining: ``state.shutting_down`` is set and the listener stays open,
   so new API requests get a 503 (``Guard``);
2. the requests in flight run on until none is left or ``shutdown_timeout`` seconds passed; then
   the rest are cut (``AsyncEngine.cut_in_flight``): a stream ends with an error event in
   OpenAI's shape and ``[DONE]``, a plain request gets a 503 body;
3. only then does uvicorn's shutdown run (listener and idle connections closed), and the
   lifespan stops the engine thread.

A second signal cuts at once instead of waiting out the timeout. The process then exits with
status 0 for either signal: the shutdown it asked for happened.
"""

import asyncio
import errno
import socket
import time
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any, AsyncIterator, Dict, Optional

import uvicorn

from ..llm import LLM
from ..utils.errors import ConfigError
from ..utils.logging import get_logger
from .app import create_app
from .async_engine import AsyncEngine
from .state import ServerState
from .tool_parsers import PARSERS

logger = get_logger(__name__)

# After the requests in flight were cut: how long their responses get to go out (the error
# event, [DONE]) before the connections are closed anyway, and uvicorn's own wait after that.
CUT_GRACE_S = 5.0


def check_settings(*, shutdown_timeout: float = 30.0, max_request_bytes: int = 1 << 20,
                   max_tokens_limit: Optional[int] = None, max_choices_per_request: int = 128,
                   tool_call_parser: Optional[str] = None) -> None:
    """The server's own settings, checked in one place: by ``serve`` and, before the model is
    built, by the CLI (a bad flag is reported at once, not after minutes of building)."""
    if shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout {shutdown_timeout:g} is negative; give the seconds requests in "
                          "flight get to finish on shutdown (0: cut them at once)")
    if max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes {max_request_bytes} must be at least 1 (default 1 MiB)")
    if max_tokens_limit is not None and max_tokens_limit < 1:
        raise ConfigError(f"--max-tokens-limit {max_tokens_limit} must be at least 1; omit it for no limit")
    if max_choices_per_request < 1:
        raise ConfigError(f"--max-choices-per-request {max_choices_per_request} must be at least 1 (default 128)")
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ConfigError(f"--tool-call-parser {tool_call_parser!r} is not one this server has; use one of "
                          f"{list(PARSERS)} (the format the model writes tool calls in)")


def build_state(llm: LLM, *, model_name: Optional[str] = None, api_key: Optional[str] = None,
                max_request_bytes: int = 1 << 20, max_tokens_limit: Optional[int] = None,
                max_choices_per_request: int = 128, tool_call_parser: Optional[str] = None,
                trust_request_chat_template: bool = False) -> ServerState:
    check_settings(max_request_bytes=max_request_bytes, max_tokens_limit=max_tokens_limit,
                   max_choices_per_request=max_choices_per_request, tool_call_parser=tool_call_parser)
    if llm.tokenizer is None:
        raise ConfigError(
            "serving needs a tokenizer (the OpenAI API speaks text), but this model has none: "
            f"{'skip_tokenizer_init is set' if llm.config.skip_tokenizer_init else 'none could be loaded'}; "
            "pass --tokenizer <checkpoint or hub id> (or use the Python API with token-id prompts)"
        )
    engine = AsyncEngine(llm.engine, llm.processor)
    return ServerState(
        engine=engine, model_name=model_name or llm.config.model, api_key=api_key,
        max_request_bytes=max_request_bytes, max_tokens_limit=max_tokens_limit,
        max_choices_per_request=max_choices_per_request, tool_call_parser=tool_call_parser,
        scheduling_policy=llm.config.scheduling_policy, trust_request_chat_template=trust_request_chat_template,
    )


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not listening yet: until the server starts, clients are
    refused). Bound before the model is built so that a port in use or a bad host is reported at
    once, as a ``ConfigError`` naming the flag to change, not after minutes of building."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a TCP port; use 1-65535 (or 0 for any free port)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host '{host}' is not an address of this machine ({exc.strerror}); use e.g. "
                          "127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart at once over TIME_WAIT connections
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            hint = "another process listens there; pick another --port (0: any free port) or stop that process"
        elif exc.errno == errno.EACCES:
            hint = "ports below 1024 need privileges; pick a --port above 1023"
        elif exc.errno == errno.EADDRNOTAVAIL:
            hint = "the address is not one of this machine's; use 127.0.0.1 or 0.0.0.0 as --host"
        else:
            hint = "check --host and --port"
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}; {hint}") from None
    return sock


class _CountRequests:
    """ASGI wrapper: counts the HTTP requests admitted before shutdown began
    (``state.requests_in_flight``), whatever stage they are at (reading the body, tokenizing,
    generating, streaming), so that the drain waits for exactly those. Requests that arrive
    while draining are answered with a 503 at once and are not counted."""

    def __init__(self, app: Any, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self.state.shutting_down:
            return await self.app(scope, receive, send)
        self.state.requests_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.requests_in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose signal handler drains first (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float):
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self._drain_deadline: Optional[float] = None
        self._drain_logged = False
        self._cut_at: Optional[float] = None

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        # A signal handler: only flags here (no logging, no awaiting); on_tick acts on them. The
        # signal is not recorded for uvicorn to re-raise once it is done: the process exits normally.
        if self._drain_deadline is None:
            self.state.shutting_down = True
            self._drain_deadline = time.monotonic() + self.shutdown_timeout
        else:  # a second signal: stop waiting
            self._drain_deadline = time.monotonic()

    async def on_tick(self, counter: int) -> bool:
        """Every 0.1 s: uvicorn's housekeeping, then, once draining, whether it is done."""
        should_exit = await super().on_tick(counter)
        if should_exit or self._drain_deadline is None:
            return should_exit
        state = self.state
        if not self._drain_logged:
            self._drain_logged = True
            logger.info("shutting down: %d requests in flight get up to %g s to finish; new requests get 503",
                        state.requests_in_flight, self.shutdown_timeout)
        if state.requests_in_flight == 0:
            return True
        now = time.monotonic()
        if self._cut_at is None and now >= self._drain_deadline:
            self._cut_at = now
            logger.warning("shutdown timeout (%g s) reached: cutting the %d requests still in flight",
                           self.shutdown_timeout, state.requests_in_flight)
            cut = state.engine.cut_in_flight()
            logger.debug("%d engine requests cut", cut)
        if self._cut_at is not None and now >= self._cut_at + CUT_GRACE_S:
            logger.warning("%d responses still open %g s after the cut; closing their connections",
                           state.requests_in_flight, CUT_GRACE_S)
            return True
        return False


def serve(llm: LLM, *, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
          sock: Optional[socket.socket] = None, **state_kwargs: Any) -> None:
    """Serve ``llm`` until SIGTERM/SIGINT, then shut down gracefully (module docstring).
    ``sock``: a socket from ``bind_socket`` (else ``host:port`` is bound here); it is closed on return."""
    check_settings(shutdown_timeout=shutdown_timeout)
    state = build_state(llm, **state_kwargs)  # checks the limits
    if sock is None:
        sock = bind_socket(host, port)
    bound_port = sock.getsockname()[1]
    app = create_app(state)

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        state.engine.start()
        logger.info("serving %s on http://%s:%d/v1", state.model_name, host, bound_port)
        yield
        state.shutting_down = True  # also when uvicorn stops for another reason than our signal
        await asyncio.to_thread(state.engine.stop, 0.0)  # the drain already happened (DrainingServer)

    app.router.lifespan_context = lifespan
    config = uvicorn.Config(_CountRequests(app, state), log_level="warning", timeout_graceful_shutdown=CUT_GRACE_S)
    server = DrainingServer(config, state, shutdown_timeout)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
