"""Run the server: build the model, start the engine thread, serve HTTP until a signal.

Shutdown is graceful: on SIGINT/SIGTERM new API requests get a 503, requests in flight finish
(up to ``shutdown_timeout`` seconds, then they are aborted), and the engine thread stops.
"""

import asyncio
import signal
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional

from ..llm import LLM
from ..utils.errors import ConfigError
from ..utils.logging import get_logger
from .app import create_app
from .async_engine import AsyncEngine
from .state import ServerState

logger = get_logger(__name__)


def build_state(llm: LLM, *, model_name: Optional[str] = None, api_key: Optional[str] = None,
                max_request_bytes: int = 1 << 20, max_tokens_limit: Optional[int] = None) -> ServerState:
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
    )


def serve(llm: LLM, *, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
          **state_kwargs: Any) -> None:
    import uvicorn

    state = build_state(llm, **state_kwargs)
    app = create_app(state)

    @asynccontextmanager
    async def lifespan(_app: Any) -> AsyncIterator[None]:
        state.engine.start()
        logger.info("serving %s on http://%s:%d/v1", state.model_name, host, port)
        yield
        state.shutting_down = True
        logger.info("shutting down: %d requests in flight", state.engine.num_in_flight)
        await asyncio.to_thread(state.engine.stop, shutdown_timeout)

    app.router.lifespan_context = lifespan

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=shutdown_timeout)
    server = uvicorn.Server(config)
    # uvicorn re-raises the signal it shut down for once it has restored the previous handler;
    # make that handler a no-op for SIGTERM so a graceful shutdown exits with status 0.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
