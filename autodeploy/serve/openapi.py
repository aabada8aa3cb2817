"""The published OpenAPI schema (``GET /openapi.json``): what the server really answers.

The handlers build their JSON bodies by hand (no response validation on the hot path), so the
response shapes are declared here, once, as pydantic models that exist only for the schema; the
Schemathesis suite (``tests/serve/test_openapi.py``) keeps them true against the live server.

What differs from what FastAPI would publish on its own:

- every API error is ``{"error": {"message", "type", "param", "code"}}`` (``ErrorResponse``)
  with the statuses the server really sends (400 for any invalid body, never FastAPI's 422;
  401 only with ``--api-key``; 404 for an unknown model; 413 over ``--max-request-bytes``; 503
  while shutting down);
- streamed responses are ``text/event-stream`` beside the JSON body;
- parameters the server rejects on purpose are listed in each operation's description.
"""

from typing import Any, Dict, List, Literal, Optional, Type, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field

FinishReason = Optional[Literal["stop", "length", "abort"]]
# "tool_calls": the model ended its turn with calls (tool_choice 'auto' or 'required')
ChatFinishReason = Optional[Literal["stop", "length", "abort", "tool_calls"]]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str]
    code: Optional[str]


class ErrorResponse(BaseModel):
    """Every error the API sends, in OpenAI's shape."""

    error: ErrorBody


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Per token; with ``echo`` the prompt's tokens come first, the first one's entries null
    (nothing precedes it to score it by)."""

    tokens: List[str]
    token_logprobs: List[Optional[float]]
    top_logprobs: List[Optional[Dict[str, float]]]
    text_offset: List[int]


class PromptTokenLogprob(BaseModel):
    """vLLM's: a token's log-probability at a prompt position, its rank (1: the most likely) and text."""

    logprob: float
    rank: int
    decoded_token: str


# per prompt token (the first null), keyed by token id: the prompt's token, then the most likely ones
PromptLogprobs = Optional[List[Optional[Dict[str, PromptTokenLogprob]]]]
_PROMPT_LOGPROBS = "Only when the request asks for 'prompt_logprobs' (vLLM's)."
# vLLM's: the stop_token_ids token or stop string that ended the choice (null: it ended otherwise)
StopReason = Union[int, str, None]
_TOKEN_IDS = "Only with 'return_token_ids' (vLLM's)."
TokenIds = Optional[List[int]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: FinishReason
    stop_reason: StopReason
    prompt_logprobs: PromptLogprobs = Field(default=None, description=_PROMPT_LOGPROBS)
    prompt_token_ids: TokenIds = Field(default=None, description=_TOKEN_IDS)
    token_ids: TokenIds = Field(default=None, description=_TOKEN_IDS)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: List[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: List[int]


class TokenLogprob(TopLogprob):
    top_logprobs: List[TopLogprob]


class ChatLogprobs(BaseModel):
    content: List[TokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: Optional[str]  # null when the answer is only tool calls
    tool_calls: Optional[List[ToolCallOut]] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: ChatFinishReason
    stop_reason: StopReason
    token_ids: TokenIds = Field(default=None, description=_TOKEN_IDS)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: List[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs = Field(default=None, description=_PROMPT_LOGPROBS)
    prompt_token_ids: TokenIds = Field(default=None, description=_TOKEN_IDS)


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: FinishReason
    stop_reason: StopReason
    prompt_token_ids: TokenIds = Field(default=None, description=_TOKEN_IDS + " In the choice's first chunk.")
    token_ids: TokenIds = Field(default=None, description=_TOKEN_IDS + " The chunk's new tokens.")


class CompletionChunk(BaseModel):
    """One event of a streamed completion; the last one (only with ``stream_options.include_usage``)
    has no choices and the usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: List[CompletionChunkChoice]
    usage: Optional[Usage] = None


class FunctionCallDelta(BaseModel):
    name: Optional[str] = None  # in a call's first piece
    arguments: str  # more of the arguments' text


class ToolCallDeltaOut(BaseModel):
    """A piece of a call: the first has ``id``, ``type`` and the function's name."""

    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[List[ToolCallDeltaOut]] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs]
    finish_reason: ChatFinishReason
    stop_reason: StopReason
    token_ids: TokenIds = Field(default=None, description=_TOKEN_IDS + " The chunk's new tokens.")


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion (as ``CompletionChunk``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: List[ChatChunkChoice]
    usage: Optional[Usage] = None
    prompt_token_ids: TokenIds = Field(default=None, description=_TOKEN_IDS + " In the first chunk.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: List[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "shutting_down"]
    in_flight: int


DESCRIPTION = (
    "An OpenAI-compatible API (completions and chat completions, whole or streamed) over an autodeploy "
    "engine. Request types are strict: a wrong JSON type is a 400, not coerced. Parameters the engine does "
    "not implement are rejected with a 400 naming them (suffix, best_of other than n, "
    "vLLM's beam search and guided_grammar), never ignored. Structured output: response_format json_object "
    "or json_schema, or vLLM's guided_json, guided_regex, guided_choice, structured_outputs (one per request). "
    "Function calling: tools with tool_choice 'required' or a named function (the output is constrained to "
    "calls), 'auto' (with the server's --tool-call-parser) or 'none'. One "
    "request may ask for at most --max-choices-per-request choices (prompts x n)."
)

_ERRORS = {
    400: "The request is invalid: malformed JSON, a wrong type, a value out of range, a parameter this "
         "server does not support, or a prompt that does not fit the context.",
    401: "The server runs with --api-key and the request has no valid 'Authorization: Bearer <key>'.",
    404: "The 'model' is not the one this server serves.",
    413: "The request body exceeds --max-request-bytes.",
    503: "The server is shutting down (retry elsewhere).",
}


def _error(description: str) -> Dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


def _event_schema(chunk: Type[BaseModel]) -> Dict[str, Any]:
    """One server-sent event (OpenAPI 3.1: a text/event-stream ``schema`` describes each event):
    its ``data`` is a JSON ``chunk``, an ``ErrorResponse``, or the final ``[DONE]``."""
    return {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "description": f"JSON: a {chunk.__name__}, or an ErrorResponse (an error after the stream began; "
                               "then [DONE] follows); the last event's data is the text [DONE].",
                "anyOf": [
                    {"const": "[DONE]"},
                    {"type": "string", "contentMediaType": "application/json",
                     "contentSchema": {"anyOf": [{"$ref": f"#/components/schemas/{chunk.__name__}"},
                                                 {"$ref": "#/components/schemas/ErrorResponse"}]}},
                ],
            },
        },
    }


def api_responses(ok: Type[BaseModel], chunk: Type[BaseModel]) -> Dict[int | str, Dict[str, Any]]:
    """The ``responses`` of a /v1 POST operation: ``ok`` as JSON, or with ``"stream": true`` an
    event stream of ``chunk``s, and the API errors."""
    success: Dict[str, Any] = {
        "model": ok,
        "description": "The whole response, or with \"stream\": true a server-sent event stream of chunks ending "
                       "with 'data: [DONE]'.",
        "content": {"text/event-stream": {"schema": _event_schema(chunk)}},
    }
    return {200: success, **{status: _error(text) for status, text in _ERRORS.items()}}


def post_responses(ok: Type[BaseModel]) -> Dict[int | str, Dict[str, Any]]:
    """The ``responses`` of a guarded POST operation that answers with JSON only: ``ok`` and the API errors."""
    return {200: {"model": ok, "description": "OK"}, **{status: _error(text) for status, text in _ERRORS.items()}}


def get_responses(ok: Type[BaseModel], *, guarded: bool) -> Dict[int | str, Dict[str, Any]]:
    """The ``responses`` of a GET operation (``guarded``: under /v1, so the API key and shutdown apply)."""
    responses: Dict[int | str, Dict[str, Any]] = {200: {"model": ok, "description": "OK"}}
    if guarded:
        responses.update({s: _error(_ERRORS[s]) for s in (401, 503)})
    return responses


HEALTH_RESPONSES: Dict[int | str, Dict[str, Any]] = {
    200: {"model": Health, "description": "Serving."},
    503: {"model": Health, "description": "Shutting down: requests in flight drain, new API requests get 503."},
}
METRICS_RESPONSES: Dict[int | str, Dict[str, Any]] = {
    200: {"description": "Prometheus text format.", "content": {"text/plain": {"schema": {"type": "string"}}}},
}


def _examples(model_name: str) -> Dict[str, Dict[str, Any]]:
    """A request each POST operation accepts, with the served model's name (a client's first
    try, and where a fuzzer starts from)."""
    return {
        "/v1/completions": {"model": model_name, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0},
        "/v1/chat/completions": {"model": model_name, "messages": [{"role": "user", "content": "Hello"}],
                                 "max_tokens": 8, "temperature": 0},
        "/tokenize": {"model": model_name, "prompt": "Once upon a time"},
        "/detokenize": {"model": model_name, "tokens": [1, 2, 3]},
    }


def _add_component(components: Dict[str, Any], model: Type[BaseModel]) -> None:
    """``model``'s JSON schema (and the models it uses) as components, referenced the OpenAPI way."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
    for name, definition in schema.pop("$defs", {}).items():
        components.setdefault(name, definition)
    components[model.__name__] = schema


def install(app: FastAPI, model_name: str) -> None:
    """Publish the schema at /openapi.json, without FastAPI's 422 responses (this server answers
    an invalid body with a 400, declared on each operation), with an example request per POST."""

    def openapi() -> Dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            examples = _examples(model_name)
            for route, path in schema.get("paths", {}).items():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
                    body = operation.get("requestBody", {}).get("content", {}).get("application/json")
                    if body is not None and route in examples:
                        body["example"] = examples[route]
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for chunk in (CompletionChunk, ChatCompletionChunk):  # referenced by hand in _event_schema
                _add_component(components, chunk)
            components.pop("HTTPValidationError", None)
            components.pop("ValidationError", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
