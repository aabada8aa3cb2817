"""The OpenAI-compatible HTTP API on top of ``AsyncEngine``.

``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``), ``GET
/v1/models``, ``GET /health``, ``GET /metrics``. Every error is a JSON body in OpenAI's shape
with a 4xx status for bad input; nothing a client sends can stop the server.
"""

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Dict, List, Optional, Sequence, Tuple, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..runtime.outputs import RequestOutput
from ..runtime.sampling_params import InvalidRequestError, SamplingParams
from ..utils.logging import get_logger
from .async_engine import AsyncEngine, EngineError
from .protocol import APIError, ChatCompletionRequest, CompletionRequest

logger = get_logger(__name__)


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any
    model_name: str
    max_seq_len: int
    api_key: Optional[str] = None
    max_request_bytes: int = 1 << 20
    max_tokens_limit: Optional[int] = None
    created: int = field(default_factory=lambda: int(time.time()))
    shutting_down: bool = False


# ---- text streaming ----------------------------------------------------------------------------
class IncrementalText:
    """Turns the growing output text into deltas that never need taking back: text that could
    still become a stop string, and an incomplete UTF-8 character (``\\ufffd``), wait."""

    def __init__(self, stop: Sequence[str]):
        self.stop = list(stop)
        self.sent = 0

    def delta(self, text: str, finished: bool) -> str:
        end = len(text)
        if not finished:
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
            for s in self.stop:
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if text[:end].endswith(s[:k]):
                        end -= k
                        break
        out = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out


# ---- helpers -----------------------------------------------------------------------------------
def _sampling_params(req: Union[CompletionRequest, ChatCompletionRequest], max_tokens: int,
                     logprobs: Optional[int]) -> SamplingParams:
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            seed=req.seed,
            stop=req.stop,
            n=req.n,
            logprobs=logprobs,
        )
    except InvalidRequestError as exc:
        raise APIError(400, str(exc)) from None


def _max_tokens(state: ServerState, requested: Optional[int], prompt_len: int, default: Optional[int]) -> int:
    room = state.max_seq_len - prompt_len
    if room < 1:
        raise APIError(
            400, f"the prompt has {prompt_len} tokens; this model's context is {state.max_seq_len} tokens "
            "(prompt and completion together)", "messages" if default is None else "prompt", "context_length_exceeded",
        )
    if requested is None:  # the server's default never errors: it fits what is left
        return min(default, room) if default is not None else room
    value = requested
    limit = state.max_tokens_limit
    if limit is not None and value > limit:
        raise APIError(400, f"max_tokens is {value}; this server allows at most {limit}", "max_tokens")
    if value > room:
        raise APIError(
            400, f"max_tokens ({value}) plus the prompt ({prompt_len} tokens) exceeds the context of "
            f"{state.max_seq_len} tokens", "max_tokens", "context_length_exceeded",
        )
    return value


def _usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _completion_logprobs(tokenizer: Any, steps: List[Dict[int, float]], offset: int) -> Dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for step in steps:
        chosen, lp = next(iter(step.items()))
        text = _token_text(tokenizer, chosen)
        tokens.append(text)
        token_lps.append(lp)
        tops.append({_token_text(tokenizer, t): v for t, v in step.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(tokenizer: Any, steps: List[Dict[int, float]], top: int) -> Dict[str, Any]:
    content = []
    for step in steps:
        items = list(step.items())
        chosen, lp = items[0]
        text = _token_text(tokenizer, chosen)
        alts = sorted(items, key=lambda kv: -kv[1])[:top]
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": _token_text(tokenizer, t), "logprob": v,
                                          "bytes": list(_token_text(tokenizer, t).encode())} for t, v in alts]})
    return {"content": content}


async def _run_prompt(state: ServerState, request_id: str, prompt_ids: List[int],
                      params: SamplingParams) -> AsyncIterator[RequestOutput]:
    try:
        async for out in state.engine.generate(request_id, prompt_ids, params):
            yield out
    except InvalidRequestError as exc:
        raise APIError(400, str(exc)) from None
    except EngineError as exc:
        raise APIError(500, f"the engine failed while serving this request: {exc}") from None


# ---- the app -----------------------------------------------------------------------------------
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
                response = _error(APIError(413, f"request body exceeds the limit of {self.limit} bytes"))
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


class Guard:
    """ASGI middleware for /v1: API key, shutdown, announced body size. Pure ASGI (not
    Starlette's BaseHTTPMiddleware) so handlers still see a client's disconnect."""

    def __init__(self, app: Any, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
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
            return await _error(error)(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="autodeploy", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ad = state
    app.add_middleware(BodyLimit, limit=state.max_request_bytes)
    app.add_middleware(Guard, state=state)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        state.engine.metrics.on_rejected()
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        state.engine.metrics.on_rejected()
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", []) if p != "body"]
        # the field a client sent, not pydantic's union branch ("prompt.str" -> "prompt")
        loc = loc[:1] + [p for p in loc[1:] if p.isdigit()]
        if first.get("type") == "json_invalid":
            return _error(APIError(400, "the request body is not valid JSON"))
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
        return _error(APIError(400, message, ".".join(loc) or None))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return _error(APIError(exc.status_code, str(exc.detail), err_type="invalid_request_error"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        return _error(APIError(500, f"internal error: {type(exc).__name__}"))

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

    def check_model(name: str) -> None:
        if name != state.model_name:
            raise APIError(404, f"the model '{name}' does not exist; this server serves '{state.model_name}'",
                           "model", "model_not_found")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        req.check_supported()
        prompts: List[Tuple[str, List[int]]] = []
        for p in req.prompts():
            if isinstance(p, str):
                ids = state.tokenizer(p)["input_ids"]
                prompts.append((p, ids))
            elif isinstance(p, list) and all(isinstance(t, int) for t in p):
                vocab = state.engine.engine.vocab_size
                if vocab is not None and any(not 0 <= t < vocab for t in p):
                    raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
                prompts.append((state.tokenizer.decode(p), list(p)))
            else:
                raise APIError(400, "'prompt' must be a string, a list of strings, or token ids", "prompt")
        for _, ids in prompts:
            if not ids:
                raise APIError(400, "a prompt is empty", "prompt")
        plans = []
        for text, ids in prompts:
            max_tokens = _max_tokens(state, req.max_tokens, len(ids), 16)
            plans.append((text, ids, _sampling_params(req, max_tokens, req.logprobs)))
        for _, ids, params in plans:
            try:
                state.engine.engine.validate_request(ids, params)
            except InvalidRequestError as exc:
                raise APIError(400, str(exc), "prompt") from None
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        if req.stream:
            return StreamingResponse(_stream_completion(state, req, rid, plans), media_type="text/event-stream")
        return await _complete(state, request, req, rid, plans)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        check_model(req.model)
        req.check_supported()
        if getattr(state.tokenizer, "chat_template", None) is None:
            raise APIError(400, "this model has no chat template; use /v1/completions", "messages")
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in req.messages]
        text = state.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = state.tokenizer(text, add_special_tokens=False)["input_ids"]
        max_tokens = _max_tokens(state, req.max_completion_tokens or req.max_tokens, len(ids), None)
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = _sampling_params(req, max_tokens, top)
        try:
            state.engine.engine.validate_request(ids, params)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), "messages") from None
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if req.stream:
            return StreamingResponse(_stream_chat(state, req, rid, ids, params), media_type="text/event-stream")
        return await _chat_complete(state, request, req, rid, ids, params)

    return app


def _error(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


# ---- completions -------------------------------------------------------------------------------
async def _final_output(state: ServerState, request_id: str, ids: List[int], params: SamplingParams) -> RequestOutput:
    final: Optional[RequestOutput] = None
    async for out in _run_prompt(state, request_id, ids, params):
        final = out
    assert final is not None
    return final


async def _unless_disconnected(request: Request, work: "asyncio.Future[Any]") -> Any:
    """Await ``work``; if the client goes away first, cancel it (which aborts its requests and
    frees their pages) instead of generating for nobody."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            raise APIError(499, "the client closed the connection")


async def _complete(state: ServerState, request: Request, req: CompletionRequest, rid: str, plans) -> JSONResponse:
    choices, prompt_tokens, completion_tokens = [], 0, 0
    finals = await _unless_disconnected(request, asyncio.gather(
        *[_final_output(state, f"{rid}-{i}", ids, params) for i, (_, ids, params) in enumerate(plans)]))
    for i, ((text, ids, params), final) in enumerate(zip(plans, finals)):
        prompt_tokens += len(ids)
        for c in final.outputs:
            completion_tokens += len(c.token_ids)
            body = (text if req.echo else "") + c.text
            logprobs = None
            if req.logprobs is not None and c.logprobs is not None:
                logprobs = _completion_logprobs(state.tokenizer, c.logprobs, len(text) if req.echo else 0)
            choices.append({"index": i * req.n + c.index, "text": body, "logprobs": logprobs,
                            "finish_reason": c.finish_reason})
    return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
                         "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)})


async def _stream_completion(state: ServerState, req: CompletionRequest, rid: str, plans) -> AsyncIterator[str]:
    created = int(time.time())
    prompt_tokens = completion_tokens = 0

    def chunk(index: int, text: str, finish: Optional[str], logprobs=None) -> str:
        return _sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                     "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]})

    try:
        for i, (text, ids, params) in enumerate(plans):
            prompt_tokens += len(ids)
            streamers = [IncrementalText(params.stop_strings) for _ in range(params.n)]
            sent_tokens = [0] * params.n
            finished = [False] * params.n
            base = len(text) if req.echo else 0  # text_offset counts from the start of the choice's text
            if req.echo:
                for j in range(params.n):
                    yield chunk(i * req.n + j, text, None)
            async for out in _run_prompt(state, f"{rid}-{i}", ids, params):
                for c in out.outputs:
                    if finished[c.index]:
                        continue  # its last chunk went out already
                    offset = base + streamers[c.index].sent
                    delta = streamers[c.index].delta(c.text, c.finish_reason is not None)
                    new_lps = c.logprobs[sent_tokens[c.index]:] if (req.logprobs is not None and c.logprobs) else None
                    if delta or c.finish_reason is not None:
                        lps = _completion_logprobs(state.tokenizer, new_lps, offset) if new_lps else None
                        sent_tokens[c.index] = len(c.token_ids)
                        finished[c.index] = c.finish_reason is not None
                        yield chunk(i * req.n + c.index, delta, c.finish_reason, lps)
                if out.finished:
                    completion_tokens += sum(len(c.token_ids) for c in out.outputs)
        yield _sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                    "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
        yield "data: [DONE]\n\n"
    except APIError as exc:  # after the headers went out, errors travel in the stream
        yield _sse(exc.body())
        yield "data: [DONE]\n\n"


# ---- chat --------------------------------------------------------------------------------------
async def _chat_complete(state: ServerState, request: Request, req: ChatCompletionRequest, rid: str,
                         ids: List[int], params: SamplingParams) -> JSONResponse:
    final = await _unless_disconnected(request, _final_output(state, rid, ids, params))
    choices = []
    for c in final.outputs:
        logprobs = _chat_logprobs(state.tokenizer, c.logprobs or [], req.top_logprobs or 0) if req.logprobs else None
        choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs, "finish_reason": c.finish_reason})
    completion = sum(len(c.token_ids) for c in final.outputs)
    return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                         "model": state.model_name, "choices": choices, "usage": _usage(len(ids), completion)})


async def _stream_chat(state: ServerState, req: ChatCompletionRequest, rid: str, ids: List[int],
                       params: SamplingParams) -> AsyncIterator[str]:
    created = int(time.time())

    def chunk(index: int, delta: Dict[str, Any], finish: Optional[str], logprobs=None) -> str:
        return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                     "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})

    try:
        for j in range(params.n):
            yield chunk(j, {"role": "assistant", "content": ""}, None)
        streamers = [IncrementalText(params.stop_strings) for _ in range(params.n)]
        sent_tokens = [0] * params.n
        finished = [False] * params.n
        completion = 0
        async for out in _run_prompt(state, rid, ids, params):
            for c in out.outputs:
                if finished[c.index]:
                    continue  # its last chunk went out already
                delta = streamers[c.index].delta(c.text, c.finish_reason is not None)
                if delta or c.finish_reason is not None:
                    finished[c.index] = c.finish_reason is not None
                    lps = None
                    if req.logprobs and c.logprobs:
                        lps = _chat_logprobs(state.tokenizer, c.logprobs[sent_tokens[c.index]:], req.top_logprobs or 0)
                    sent_tokens[c.index] = len(c.token_ids)
                    yield chunk(c.index, {"content": delta} if delta else {}, c.finish_reason, lps)
            if out.finished:
                completion = sum(len(c.token_ids) for c in out.outputs)
        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name,
                    "choices": [], "usage": _usage(len(ids), completion)})
        yield "data: [DONE]\n\n"
    except APIError as exc:
        yield _sse(exc.body())
        yield "data: [DONE]\n\n"
