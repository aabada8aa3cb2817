"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: the served model's own tokenizer, for clients
that count tokens before a request or build prompts as token ids.

``/tokenize`` takes a ``prompt`` (tokenized as a completion's text prompt is: with the tokenizer's
special tokens unless ``add_special_tokens`` is false) or chat ``messages`` and ``tools`` (rendered
with the chat template as ``/v1/chat/completions`` renders them), so the ids are exactly those a
request with the same input runs on. ``/detokenize`` decodes ids (each below the vocabulary size). Both sit
behind the same API key as ``/v1``.
"""

from typing import Annotated, Any, List, Optional, Union

from fastapi import APIRouter
from pydantic import BaseModel, Discriminator, Field, NonNegativeInt, Tag

from ..runtime.sampling_params import InvalidRequestError
from .openapi import post_responses
from .protocol import APIError, ChatMessage, ChatRendering, _Body, template_messages
from .requests import check_model
from .state import ServerState
from .tool_calls import ChatTool, template_tools


class TokenizePromptRequest(_Body):
    model: str
    prompt: str
    add_special_tokens: bool = Field(default=True, description="Add the tokenizer's special tokens (e.g. BOS), "
                                     "as a completion of that text does.")


class TokenizeChatRequest(_Body, ChatRendering):
    model: str
    messages: List[ChatMessage] = Field(min_length=1)
    tools: Optional[List[ChatTool]] = Field(default=None, max_length=128, description="Shown by the template, "
                                            "as in a chat completion with them.")


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: List[int]


def _kind(body: Any) -> str:
    """Which request a body is: with ``messages`` (and no ``prompt``) a chat one; so a body with
    neither is told what a prompt request misses."""
    if isinstance(body, dict):
        return "messages" if "messages" in body and "prompt" not in body else "prompt"
    return "messages" if isinstance(body, TokenizeChatRequest) else "prompt"


TokenizeRequest = Annotated[Union[Annotated[TokenizePromptRequest, Tag("prompt")],
                                  Annotated[TokenizeChatRequest, Tag("messages")]], Discriminator(_kind)]


class DetokenizeRequest(_Body):
    model: str
    tokens: List[NonNegativeInt] = Field(max_length=1_000_000)


class DetokenizeResponse(BaseModel):
    prompt: str


def router(state: ServerState) -> APIRouter:
    api = APIRouter()

    @api.post("/tokenize", response_model=TokenizeResponse, responses=post_responses(TokenizeResponse))
    async def tokenize(req: TokenizeRequest):
        """The token ids of a text prompt or of a chat conversation (``messages``)."""
        check_model(state, req.model)
        processor = state.engine.processor
        chat = isinstance(req, TokenizeChatRequest)
        if "messages" in (req.model_extra or {}):
            raise APIError(400, "give one of 'prompt' and 'messages', not both", "messages")
        try:
            if isinstance(req, TokenizeChatRequest):
                prompt = processor.chat_prompt(template_messages(req.messages), tools=template_tools(req.tools),
                                               **req.template_options(state.trust_request_chat_template))
                ids = prompt["prompt_token_ids"]
            else:
                tokenizer = processor.tokenizer.require("tokenizing")
                ids = tokenizer(req.prompt, add_special_tokens=req.add_special_tokens, verbose=False)["input_ids"]
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), "messages" if chat else "prompt") from None
        return {"count": len(ids), "max_model_len": state.max_seq_len, "tokens": list(ids)}

    @api.post("/detokenize", response_model=DetokenizeResponse, responses=post_responses(DetokenizeResponse))
    async def detokenize(req: DetokenizeRequest):
        """The text of token ids."""
        check_model(state, req.model)
        processor = state.engine.processor
        vocab = processor.vocab_size
        if vocab is not None and any(t >= vocab for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", "tokens")
        try:
            tokenizer = processor.tokenizer.require("detokenizing")
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), "tokens") from None
        return {"prompt": tokenizer.decode(list(req.tokens))}

    return api
