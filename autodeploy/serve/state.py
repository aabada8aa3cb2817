"""What the HTTP server knows: its engine and its settings (``ServerState``).

Its own module so that the middleware, the endpoints and ``create_app`` can all import it
without importing each other. Facts about the model (the context length, the tokenizer) are
not copied here: they are read from the engine's request processor, their one source.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from .async_engine import AsyncEngine


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    api_key: Optional[str] = None
    max_request_bytes: int = 1 << 20
    max_tokens_limit: Optional[int] = None
    # prompts x n of one request: each choice is a sequence in the engine, so one request
    # could otherwise queue unbounded work ahead of everyone else
    max_choices_per_request: int = 128
    # how the model writes tool calls, for tool_choice 'auto' (``tool_parsers.PARSERS``); None: 'auto' is a 400
    tool_call_parser: Optional[str] = None
    # the engine's (DeployConfig.scheduling_policy): a request's 'priority' other than 0 needs "priority"
    scheduling_policy: str = "fcfs"
    # run a request's own 'chat_template' (--trust-request-chat-template); else such a request is a 400
    trust_request_chat_template: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    # Set on SIGTERM/SIGINT: new API requests get a 503 while the ones in flight drain.
    shutting_down: bool = False
    # HTTP requests admitted before shutdown began and not answered yet (counted by the server's
    # outermost ASGI layer, ``server._CountRequests``): what a graceful shutdown waits for.
    requests_in_flight: int = 0

    @property
    def max_seq_len(self) -> int:
        """Prompt and generated tokens together, per request."""
        return self.engine.max_seq_len

    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer (the server is only built for a model that has one)."""
        return self.engine.processor.tokenizer.tokenizer
