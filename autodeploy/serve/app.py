"""The OpenAI-compatible HTTP API on top of ``AsyncEngine``: ``create_app`` wires it together.

``POST /v1/completions`` (``completions``), ``POST /v1/chat/completions`` (``chat``), both with
``stream`` (``streaming``), vLLM's ``POST /tokenize`` and ``/detokenize`` (``tokenize``); here:
``GET /v1/models``, ``GET /health``, ``GET /metrics``, the middlewares (``middleware``) and the
exception handlers. Every error is a JSON body in
OpenAI's shape with a 4xx status for bad input; nothing a client sends can stop the server.
"""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..utils.logging import get_logger
from . import chat, completions, openapi, tokenize
from .middleware import BodyLimit, Guard, error_response
from .protocol import CLIENT_CLOSED, APIError
from .state import ServerState

__all__ = ["ServerState", "create_app"]

logger = get_logger(__name__)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="autodeploy", version=__version__, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json", description=openapi.DESCRIPTION)
    app.state.ad = state
    app.add_middleware(BodyLimit, limit=state.max_request_bytes)
    app.add_middleware(Guard, state=state)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        if exc.status != CLIENT_CLOSED:  # a disconnect was counted once already, as aborted
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
        # headers kept: a 405 must say which methods are allowed (Allow)
        return error_response(APIError(exc.status_code, str(exc.detail), err_type="invalid_request_error"),
                              headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"))

    @app.get("/health", responses=openapi.HEALTH_RESPONSES)
    async def health():
        """200 while serving; 503 once shutdown began (a load balancer then stops sending)."""
        if state.shutting_down:
            return JSONResponse({"status": "shutting_down", "in_flight": state.engine.num_in_flight}, status_code=503)
        return {"status": "ok", "in_flight": state.engine.num_in_flight}

    @app.get("/metrics", response_class=PlainTextResponse, responses=openapi.METRICS_RESPONSES)
    async def metrics():
        """Prometheus text format."""
        return PlainTextResponse(state.engine.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", responses=openapi.get_responses(openapi.ModelList, guarded=True))
    async def models():
        """The one model this server serves."""
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "autodeploy", "max_model_len": state.max_seq_len}]}

    app.include_router(completions.router(state))
    app.include_router(chat.router(state))
    app.include_router(tokenize.router(state))
    openapi.install(app, state.model_name)
    return app
