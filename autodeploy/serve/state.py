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
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False

    @property
    def max_seq_len(self) -> int:
        """Prompt and generated tokens together, per request."""
        return self.engine.max_seq_len

    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer (the server is only built for a model that has one)."""
        return self.engine.processor.tokenizer.tokenizer
