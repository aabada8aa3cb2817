"""OpenAI request bodies, validated, and the error shape every failure is reported in.

Structured output: OpenAI's ``response_format`` (``json_object``, ``json_schema``) and vLLM's
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` and ``structured_outputs``
(one of them per request) become ``GuidedDecodingParams``, compiled here so that a bad schema,
pattern or grammar is a 400 naming the field.

Function calling (``tools``, ``tool_choice``, ``parallel_tool_calls``) is ``tool_calls``'s.

Parameters the engine does not implement (``suffix``, ``best_of`` other than ``n``, and vLLM's
``spaces_between_special_tokens``, ``logits_processors``, ``mm_processor_kwargs`` and
``vllm_xargs``: ``_UNSUPPORTED_EXTRAS``) are rejected with a 400 naming the parameter unless their
value changes nothing, rather than silently ignored: a client that asks for them would otherwise
get answers it did not ask for. Other unknown fields are accepted and ignored (clients send vendor
extras).

Types are strict, as OpenAI's are: ``"stream": "yes"``, ``"echo": 0`` or ``"prompt": [true]``
are 400s, not coerced (a float field still takes an integer). Text that cannot be encoded (a
lone UTF-16 surrogate, which JSON's ``\ud800`` escapes can carry) is a 400 naming the field
before anything tries to tokenize it or echo it back.
"""

import json
from typing import Any, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, field_validator, model_validator

from ..runtime.guided.params import GuidedDecodingParams
from ..runtime.sampling_params import InvalidRequestError
from .tool_calls import ChatTool, MessageToolCall, ToolChoice, ToolRequestError, ToolSettings, template_tool_calls


CLIENT_CLOSED = 499  # nginx's status for a request whose client went away (never sent to anyone)


class APIError(Exception):
    """An error with an HTTP status, reported as ``{"error": {...}}`` like OpenAI's API."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 err_type: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or {
            400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 503: "server_error",
        }.get(status, "server_error")

    def body(self) -> Dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


def unencodable_text(value: Any, path: str = "") -> Optional[str]:
    """The path (``messages.0.content``) of the first string in ``value`` that UTF-8 cannot
    encode, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        bad = unencodable_text(key, path) if isinstance(key, str) else None
        bad = bad or unencodable_text(item, f"{path}.{key}" if path else str(key))
        if bad:
            return bad
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _Body(_Strict):
    """A request body: text that cannot be encoded anywhere in it is a 400 naming the field."""

    @model_validator(mode="before")
    @classmethod
    def _encodable(cls, data: Any) -> Any:
        """One walk over the whole body (here, not in the nested models, which would walk their
        parts again)."""
        bad = unencodable_text(data)
        if bad is not None:
            # raised as such (not a ValueError) so that the 400 names the field, nested or not
            raise APIError(400, f"'{bad}' holds text that is not valid Unicode (a lone UTF-16 surrogate); "
                                "send well-formed UTF-8 text", bad.split(".")[0])
        return data


# vLLM's sampling extensions this server does not implement, with the values that change nothing
# (null too, for all of them): any other value is a 400 naming it (ignored, the client would get
# answers it did not ask for). ``guided_decoding_backend`` is not here: it names an implementation
# of the same constraint, so it is ignored like any unknown field.
_UNSUPPORTED_EXTRAS: Dict[str, tuple] = {
    # what the output text or the response holds, and scheduling
    "spaces_between_special_tokens": (True,), "logits_processors": (),
    "mm_processor_kwargs": (), "vllm_xargs": (),
}
_STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# what beam search reads (besides the prompt or conversation and how it is rendered)
_BEAM_SEARCH_FIELDS = {
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "best_of", "use_beam_search",
    "length_penalty", "ignore_eos", "echo", "user", "stream", "temperature", "truncate_prompt_tokens", "cache_salt",
    "priority", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "documents", "seed",
    "chat_template",
}


def _neutral(value: Any, neutral: tuple) -> bool:
    return value is None or any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``: the schema the output must follow."""

    name: str = Field(default="response", max_length=64)
    description: Optional[str] = None
    schema_: Optional[Union[Dict[str, Any], bool]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = Field(default=None, description="With type 'json_schema'.")


class _Common(_Body):
    """Fields both endpoints share. Unknown fields are accepted and ignored (clients send
    vendor extras); known-but-unsupported ones are rejected in ``check_supported``."""

    model: str
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(default=None, ge=-1)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = None
    # vLLM's extensions: keep generating past an end-of-sequence token, up to max_tokens
    # (benchmarks); token ids that end the output like EOS does (the token is counted, its text kept)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # the output text ends with the stop string it met
    skip_special_tokens: bool = True  # false: special tokens are part of the output text
    bad_words: Optional[List[str]] = Field(default=None, max_length=256, description=(
        "Words never generated (vLLM's: as the tokenizer writes them at the start of a text and after a space)."))
    stop_token_ids: Optional[List[NonNegativeInt]] = Field(default=None, max_length=64)
    allowed_token_ids: Optional[List[NonNegativeInt]] = Field(default=None, min_length=1, description=(
        "Only these tokens can be generated (vLLM's; the end-of-sequence token too only if listed)."))
    truncate_prompt_tokens: Optional[int] = Field(default=None, ge=-1, description=(
        "A longer prompt keeps only its last that many tokens (vLLM's; -1: as many as the context leaves room for)."))
    # penalties (OpenAI's two, vLLM's repetition penalty), vLLM's min_p and min_tokens: as
    # ``SamplingParams`` defines them (unset: off)
    presence_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(default=None, gt=0.0)
    min_p: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    min_tokens: Optional[int] = Field(default=None, ge=0)
    # OpenAI's: token id (a JSON key, so a string) -> a bias added to its logit
    logit_bias: Optional[Dict[str, float]] = Field(default=None, max_length=300)
    user: Optional[str] = None
    # structured output (at most one of these; ``guided``): OpenAI's, and vLLM's
    response_format: Optional[ResponseFormat] = None
    guided_json: Optional[Union[Dict[str, Any], str]] = Field(default=None, description="A JSON Schema (vLLM).")
    guided_regex: Optional[str] = Field(default=None, description="A regular expression the output matches (vLLM).")
    guided_grammar: Optional[str] = Field(default=None, description=(
        "A GBNF grammar the output matches from its 'root' rule (vLLM's); rules may recurse, though not on the left."))
    guided_choice: Optional[List[str]] = Field(default=None, min_length=1,
                                               description="The output is one of these strings (vLLM).")
    structured_outputs: Optional[Dict[str, Any]] = Field(default=None, description=(
        "vLLM's newer form: one of 'json' (a schema), 'regex', 'choice', 'grammar' or 'json_object'."))
    guided_whitespace_pattern: Optional[str] = Field(default=None, description=(
        "With a JSON Schema: the whitespace allowed between JSON tokens, a regular expression (default: at most "
        "one space)."))
    use_beam_search: bool = Field(default=False, description=(
        "vLLM's: beam search with n beams (HF's num_beams search; the n best hypotheses are the choices). Not with "
        "stream, sampling, logprobs or output constraints."))
    length_penalty: float = Field(default=1.0, description=(
        "With use_beam_search: a finished hypothesis's log-probability is divided by its length to this power."))
    priority: int = Field(default=0, description=(
        "vLLM's: lower is served first, with the server's --scheduling_policy priority (otherwise only 0)."))
    cache_salt: Optional[str] = Field(default=None, min_length=1, max_length=1024, description=(
        "vLLM's: cached prompt prefixes are shared only with requests of the same salt (use a long random one "
        "per tenant)."))
    return_token_ids: Optional[bool] = Field(default=None, description=(
        "vLLM's: the response gives 'prompt_token_ids' and each choice's 'token_ids' (streamed: the prompt's in "
        "the first chunk, each chunk's new tokens)."))
    return_tokens_as_token_ids: Optional[bool] = Field(default=None, description=(
        "vLLM's: logprobs name each token 'token_id:<id>' instead of its text."))
    prompt_logprobs: Optional[int] = Field(default=None, ge=0, le=20, description=(
        "vLLM's: each prompt token's log-probability and rank given the tokens before it, with this many most "
        "likely alternatives, in the response's 'prompt_logprobs' (not with 'stream')."))

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: Optional[Dict[str, float]]) -> Optional[Dict[str, float]]:
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"keys are token ids (decimal integers as strings), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop(cls, value: Optional[Union[str, List[str]]]) -> Optional[Union[str, List[str]]]:
        items = [value] if isinstance(value, str) else (value or [])
        if len(items) > 8:
            raise ValueError("at most 8 stop sequences")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return value

    def _check_beam_search(self) -> None:
        """Beam search takes only what it uses: any other field that would change the answer is a
        400 naming it rather than ignored (a client would get answers it did not ask for)."""
        if not self.use_beam_search:
            if self.length_penalty != 1.0:
                raise APIError(400, "'length_penalty' applies to beam search; set 'use_beam_search': true",
                               "length_penalty")
            return
        if self.stream:
            raise APIError(400, "beam search returns its hypotheses once it ends; set 'stream': false", "stream")
        if not 1 <= self.n <= 10:
            raise APIError(400, f"'n' is the number of beams with use_beam_search: 1 to 10, got {self.n}", "n")
        if self.temperature not in (None, 0):
            raise APIError(400, "beam search keeps the most likely hypotheses (it does not sample): drop "
                                "'temperature' or set it to 0", "temperature")
        for name in sorted(self.model_fields_set - _BEAM_SEARCH_FIELDS):
            value, default = getattr(self, name), type(self).model_fields[name].default
            if value is not None and value != default:
                raise APIError(400, f"'{name}' does not apply to beam search (use_beam_search); omit it", name)

    @property
    def include_usage(self) -> bool:
        """A streamed response ends with a usage chunk only when asked for."""
        return self.stream_options is not None and self.stream_options.include_usage

    def guided(self) -> Optional[GuidedDecodingParams]:
        """The output constraint the request asks for (None: none); a 400 naming the field when
        it is malformed, unsupported, or more than one is given."""
        asked: List[Tuple[str, Dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(400, "response_format of type 'json_schema' needs 'json_schema': {'name': ..., "
                                    "'schema': {...}}", "response_format")
            asked.append(("response_format", {"json": fmt.json_schema.schema_}))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, {key: getattr(self, name)}))
        if self.structured_outputs:
            given = {k: v for k, v in self.structured_outputs.items() if v is not None and v is not False}
            unknown = sorted(set(given) - set(_STRUCTURED_OUTPUT_KEYS))
            if unknown:
                raise APIError(400, f"structured_outputs {unknown} are not supported by this server; it takes one of "
                               f"{list(_STRUCTURED_OUTPUT_KEYS)}", "structured_outputs")
            asked += [("structured_outputs", {k: v}) for k, v in given.items()]
        if len(asked) > 1:
            raise APIError(400, "a request may constrain its output one way only; got "
                           + ", ".join(sorted({name for name, _ in asked})), asked[1][0])
        if not asked:
            if self.guided_whitespace_pattern is not None:
                raise APIError(400, "'guided_whitespace_pattern' goes with a JSON Schema", "guided_whitespace_pattern")
            return None
        name, fields = asked[0]
        if self.guided_whitespace_pattern is not None:
            if "json" not in fields:
                raise APIError(400, "'guided_whitespace_pattern' goes with a JSON Schema", "guided_whitespace_pattern")
            fields = {**fields, "whitespace_pattern": self.guided_whitespace_pattern}
        try:
            return GuidedDecodingParams(**fields)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), name) from None

    def check_supported(self) -> None:
        for name, value in (self.model_extra or {}).items():
            neutral = _UNSUPPORTED_EXTRAS.get(name)
            if neutral is not None and not _neutral(value, neutral):
                raise APIError(400, f"'{name}' (a vLLM extension) is not supported by this server; omit it"
                               + (f" or set it to {json.dumps(neutral[0])}" if neutral else ""), name)
        self._check_beam_search()
        if self.stream and self.prompt_logprobs is not None:
            raise APIError(400, "'prompt_logprobs' come with the whole response; set 'stream': false (or drop them)",
                           "prompt_logprobs")


class CompletionRequest(_Common):
    prompt: Union[str, List[str], List[int], List[List[int]]]
    max_tokens: Optional[int] = Field(default=16, ge=0, description="0 only with 'echo' or 'prompt_logprobs': "
                                      "scores the prompt without generating (its log-probabilities with 'logprobs').")
    logprobs: Optional[int] = Field(default=None, ge=0, le=5, description="With 'echo', the prompt's tokens are "
                                    "scored too: one entry per prompt token (the first null), then the generated ones.")
    echo: bool = False
    best_of: Optional[int] = Field(default=None, description="Not supported beyond n: only null or equal to n.")
    suffix: Optional[str] = Field(default=None, json_schema_extra={"maxLength": 0,
                                                                   "description": "Not supported: only '' or null."})

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError(400, "'suffix' is not supported by this server", "suffix")
        if self.best_of not in (None, self.n):
            raise APIError(400, "'best_of' must equal n (no server-side reranking)", "best_of")
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise APIError(400, "'max_tokens': 0 generates nothing; it is for scoring a prompt: set 'echo': true "
                                "(and 'logprobs' for the prompt's log-probabilities) or 'prompt_logprobs'",
                           "max_tokens")

    def prompts(self) -> List[Union[str, List[int]]]:
        """The prompt(s): one string, a list of strings, one token list, or a list of them."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "'prompt' is empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[return-value]


class ContentPart(_Strict):
    type: str
    text: Optional[str] = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, List[ContentPart], None] = None
    tool_calls: Optional[List[MessageToolCall]] = Field(default=None, description="An assistant's calls.")
    tool_call_id: Optional[str] = Field(default=None, description="A tool message: the call it answers.")
    name: Optional[str] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise APIError(400, f"message content of type '{part.type}' is not supported (text only)", "messages")
            parts.append(part.text)
        return "".join(parts)


def template_messages(messages: List[ChatMessage]) -> List[Dict[str, Any]]:
    """The messages as a chat template takes them: text content, OpenAI's ``developer`` role as
    ``system`` (the role templates know), an assistant's ``tool_calls`` and a tool message's
    ``tool_call_id`` and ``name`` as HF templates read them."""
    out: List[Dict[str, Any]] = []
    for m in messages:
        entry: Dict[str, Any] = {"role": m.role if m.role != "developer" else "system", "content": m.text()}
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(400, f"'tool_calls' in a '{m.role}' message: only assistant messages make calls",
                               "messages")
            entry["tool_calls"] = template_tool_calls(m.tool_calls)
        if m.role == "tool":
            entry.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name)) if v is not None})
        out.append(entry)
    return out


# apply_chat_template's own arguments: set by the request's fields, never through chat_template_kwargs
_RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tools", "documents", "add_generation_prompt",
                             "continue_final_message", "tokenize", "chat_template", "return_dict", "tokenizer_kwargs")


class ChatRendering(_Strict):
    """How a conversation is rendered by the chat template (vLLM's fields of a chat request)."""

    add_generation_prompt: bool = Field(default=True, description="End with the template's assistant opening.")
    continue_final_message: bool = Field(default=False, description=(
        "Leave the last (assistant) message open, for the model to continue it; needs add_generation_prompt false."))
    chat_template_kwargs: Optional[Dict[str, Any]] = Field(default=None, description=(
        "More variables for the chat template (e.g. Qwen 3's enable_thinking)."))
    documents: Optional[List[Dict[str, Any]]] = Field(default=None, max_length=64, description=(
        "Documents for templates that cite them (each a mapping, e.g. title and text)."))
    chat_template: Optional[str] = Field(default=None, min_length=1, max_length=1 << 16, description=(
        "A Jinja chat template for this request instead of the server's; only on a server started with "
        "--trust-request-chat-template (vLLM's rule), else a 400."))

    def template_options(self, trust_template: bool) -> Dict[str, Any]:
        """Keyword arguments of ``RequestProcessor.chat_prompt``; a 400 for a request's own
        ``chat_template`` unless the server trusts them (``trust_template``: a template is code the
        server runs, sandboxed but unbounded in time) or a reserved name in ``chat_template_kwargs``."""
        if self.chat_template is not None and not trust_template:
            raise APIError(400, "a request's own 'chat_template' runs only on a server started with "
                                "--trust-request-chat-template; this one renders with its tokenizer's template or "
                                "the one it was started with (--chat_template)", "chat_template")
        reserved = sorted(set(self.chat_template_kwargs or {}) & set(_RESERVED_TEMPLATE_KWARGS))
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {reserved}: they are the request's own fields",
                           "chat_template_kwargs")
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "documents": self.documents,
                "template_kwargs": self.chat_template_kwargs, "chat_template": self.chat_template}


class ChatCompletionRequest(_Common, ChatRendering):
    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(default=None, ge=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20, description="Needs 'logprobs': true when above 0.")
    tools: Optional[List[ChatTool]] = Field(default=None, max_length=128)
    tool_choice: Optional[ToolChoice] = Field(default=None, description=(
        "'auto' (the default with tools: needs the server's --tool-call-parser), 'required', 'none', or a named "
        "function; 'required' and a named function constrain the output to calls."))
    parallel_tool_calls: Optional[bool] = Field(default=None, description="false: at most one call.")
    echo: bool = Field(default=False, description=(
        "vLLM's: when the last message is the assistant's (continue_final_message), the answer starts with it."))

    def echoed(self) -> str:
        """The text the answer starts with: the last message's, with ``echo`` when it is the assistant's."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    def tool_settings(self) -> ToolSettings:
        try:
            return ToolSettings(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolRequestError as exc:
            raise APIError(400, str(exc), exc.param) from None

    def guided(self) -> Optional[GuidedDecodingParams]:
        """A forced tool choice constrains the output to calls; no other constraint may be asked then."""
        asked = super().guided()
        fields = self.tool_settings().guided()
        if fields is None:
            return asked
        if asked is not None:
            raise APIError(400, "a 'tool_choice' of 'required' or a named function constrains the output to tool "
                                "calls; it cannot be combined with response_format or guided decoding", "tool_choice")
        try:
            return GuidedDecodingParams(**fields)
        except InvalidRequestError as exc:
            raise APIError(400, f"a tool's parameters: {exc}", "tools") from None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
