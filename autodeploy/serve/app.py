"""The OpenAI-compatible HTTP API on top of ``AsyncEngine``: ``create_app`` wires it together.

``POST /v1/completions`` (``completions``), ``POST /v1/chat/completions`` (``chat``), both with
``stream`` (``streaming``); here: ``GET /v1/models``, ``GET /health``, ``GET /metrics``, the
middlewares (``middleware``) and the exception handlers. Every error is a JSON body in
OpenAI's shape with a 4xx status for bad input; nothing a client sends can stop the server.
"""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..utils.logging import get_logger
from . import chat, completions
from .middleware import BodyLimit, Guard, error_response
from .protocol import APIError
from .state import ServerState

__all__ = ["ServerState", "create_app"]

logger = get_logger(__name__)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="autodeploy", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ad = state
    app.add_middleware(BodyLimit, limit=state.max_request_bytes)
    app.add_middleware(Guard, state=state)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        state.engine.metrics.on_rejected()
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        state.engine.metrics.on_rejected()
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", []) if p != "body"]
        # the field a client sent, not pydantic's union branch ("prompt.str" -> "prompt")
        loc = loc[:1] + [p for p in loc[1:] if p.isdigit()]
        if first.get("type") == "json_invalid":
            return error_response(APIError(400, "the request body is not valid JSON"))
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
        return error_response(APIError(400, message, ".".join(loc) or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail), err_type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "in_flight": state.engine.num_in_flight}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(state.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "autodeploy", "max_model_len": state.max_seq_len}]}

    app.include_router(completions.router(state))
    app.include_router(chat.router(state))
    return app
