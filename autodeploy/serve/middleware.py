"""The ASGI middlewares in front of the API (``BodyLimit``, ``Guard``) and ``error_response``,
the one way every failure becomes an HTTP response (OpenAI's ``{"error": {...}}`` body).

Both middlewares are pure ASGI (not Starlette's ``BaseHTTPMiddleware``) so that handlers still
see a client's disconnect.
"""

from typing import Any, Dict, Mapping, Optional

from fastapi.responses import JSONResponse

from .protocol import APIError
from .state import ServerState


def error_response(exc: APIError, headers: Optional[Mapping[str, str]] = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


class BodyLimit:
    """ASGI middleware: reads a request body up to the limit before the app sees it; a larger
    one gets a 413 whether or not it announced its length (chunked uploads are counted as they
    arrive). The app then receives the buffered body, and later messages (disconnects) pass."""

    def __init__(self, app: Any, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.limit:
                response = error_response(APIError(413, f"request body exceeds the limit of {self.limit} bytes"))
                return await response(scope, receive, send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        buffered = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        delivered = False

        async def replay() -> Dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return buffered
            return await receive()

        await self.app(scope, replay, send)


# outside /v1 but the model's too (vLLM's paths): the same key, shutdown and size rules
GUARDED_PATHS = ("/tokenize", "/detokenize")


class Guard:
    """ASGI middleware for /v1 (and ``GUARDED_PATHS``): API key, shutdown, announced body size."""

    def __init__(self, app: Any, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not (scope["path"].startswith("/v1/") or scope["path"] in GUARDED_PATHS):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        error = None
        if self.state.api_key is not None and headers.get("authorization", "") != f"Bearer {self.state.api_key}":
            error = APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", code="invalid_api_key")
        elif self.state.shutting_down:
            error = APIError(503, "the server is shutting down")
        else:
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.state.max_request_bytes:
                error = APIError(413, f"request body of {length} bytes exceeds the limit of "
                                      f"{self.state.max_request_bytes} bytes")
        if error is not None:
            self.state.engine.metrics.on_rejected()
            return await error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)
