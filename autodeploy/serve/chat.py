"""``POST /v1/chat/completions``: a conversation in (rendered with the tokenizer's chat
template), assistant messages out, whole or streamed, with the chat logprobs format
(``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``). With ``tools`` the answer's
calls come back as ``tool_calls`` (``tool_calls`` and ``tool_parsers`` say how).
"""

import dataclasses
import time
import uuid
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..runtime.beam_search import BeamSearchParams
from ..runtime.request_processor import CheckedPrompt, PreparedRequest
from ..runtime.sampling_params import InvalidRequestError
from .beam_search import beam_params, completion_tokens, run_beam_search
from .openapi import ChatCompletionChunk, ChatCompletionResponse, api_responses
from .protocol import APIError, ChatCompletionRequest, template_messages
from .requests import (check_choices, check_model, check_priority, check_prompt, final_output, prepare_request,
                       resolve_max_tokens, scored_prompt, to_sampling_params, token_namer, unless_disconnected, usage)
from .state import ServerState
from .streaming import ChoiceDelta, StreamedRequest, stream_sse
from .tool_calls import ToolRequestError, ToolSettings
from .tool_parsers import ToolCallParser, merge_calls


def chat_logprobs(name: Callable[[int], str], steps: List[Dict[int, float]], top: int) -> Dict[str, Any]:
    """OpenAI's chat logprobs; ``name`` gives each token's text (``requests.token_namer``)."""
    content = []
    for step in steps:
        items = list(step.items())
        chosen, lp = items[0]
        text = name(chosen)
        alts = sorted(items, key=lambda kv: -kv[1])[:top]
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": name(t), "logprob": v, "bytes": list(name(t).encode())}
                                         for t, v in alts]})
    return {"content": content}


def router(state: ServerState) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/chat/completions", responses=api_responses(ChatCompletionResponse, ChatCompletionChunk))
    async def chat(req: ChatCompletionRequest, request: Request):
        """Answer a conversation, rendered with the tokenizer's chat template."""
        check_model(state, req.model)
        req.check_supported()
        check_priority(state, req.priority)
        check_choices(state, 1, req.n)
        tools = req.tool_settings()
        try:
            tools.check_parser(state.tool_call_parser)
        except ToolRequestError as exc:
            raise APIError(400, str(exc), exc.param) from None
        processor = state.engine.processor
        try:
            prompt = processor.chat_prompt(template_messages(req.messages), tools=tools.template_tools(),
                                           **req.template_options(state.trust_request_chat_template))
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), "messages") from None
        checked = check_prompt(processor, prompt, "messages", req.truncate_prompt_tokens, req.cache_salt)
        ids = checked.prompt_token_ids
        max_tokens = resolve_max_tokens(state, req.max_completion_tokens or req.max_tokens, len(ids), None)
        if req.use_beam_search:
            return await _beam_search(state, request, req, checked, beam_params(req, max_tokens))
        top = (req.top_logprobs or 0) if req.logprobs else None
        params = to_sampling_params(req, max_tokens, top)
        if tools.keeps_special_tokens(state.tool_call_parser):
            params = dataclasses.replace(params, skip_special_tokens=False)
        prepared = prepare_request(processor, checked, params, "messages", req.priority)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if req.stream:
            return StreamingResponse(_stream(state, req, tools, rid, prepared), media_type="text/event-stream")
        return await _complete(state, request, req, tools, rid, prepared)

    return api


async def _beam_search(state: ServerState, request: Request, req: ChatCompletionRequest, checked: CheckedPrompt,
                       params: BeamSearchParams) -> JSONResponse:
    """``use_beam_search``: the conversation's ``n`` best answers, best first, as the choices."""
    rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    out = await unless_disconnected(request, run_beam_search(state, rid, checked, params, req.priority))
    choices = [{"index": j, "message": {"role": "assistant", "content": req.echoed() + s.text}, "logprobs": None,
                "finish_reason": s.finish_reason, "stop_reason": None} for j, s in enumerate(out.sequences)]
    return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()),
                         "model": state.model_name, "choices": choices,
                         "usage": usage(len(checked.prompt_token_ids), completion_tokens(out))})


async def _complete(state: ServerState, request: Request, req: ChatCompletionRequest, tools: ToolSettings, rid: str,
                    prepared: PreparedRequest) -> JSONResponse:
    ids = prepared.prompt_token_ids
    final = await unless_disconnected(request, final_output(state, rid, prepared))
    name = token_namer(state.tokenizer, req.return_tokens_as_token_ids)
    choices = []
    for c in final.outputs:
        logprobs = chat_logprobs(name, c.logprobs or [], req.top_logprobs or 0) if req.logprobs else None
        message: Dict[str, Any] = {"role": "assistant", "content": req.echoed() + c.text}
        parser = tools.parser(state.tool_call_parser)
        if parser is not None:
            content, deltas = parser.feed(c.text, final=True)
            if deltas:
                message = {"role": "assistant", "content": req.echoed() + content or None,
                           "tool_calls": merge_calls(deltas)}
        choice = {"index": c.index, "message": message, "logprobs": logprobs,
                  "finish_reason": tools.finish_reason(c.finish_reason, parser is not None and parser.calls > 0),
                  "stop_reason": c.stop_reason}
        if req.return_token_ids:
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    completion = sum(len(c.token_ids) for c in final.outputs)
    body = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
            "choices": choices, "usage": usage(len(ids), completion)}
    if req.prompt_logprobs is not None:  # vLLM's, for the rendered conversation
        body["prompt_logprobs"] = scored_prompt(state.tokenizer, final, req.prompt_logprobs)
    if req.return_token_ids:
        body["prompt_token_ids"] = ids
    return JSONResponse(body)


def _stream(state: ServerState, req: ChatCompletionRequest, tools: ToolSettings, rid: str,
            prepared: PreparedRequest) -> AsyncIterator[str]:
    parsers: Dict[int, Optional[ToolCallParser]] = {}  # per choice: its calls are found as its text grows
    name = token_namer(state.tokenizer, req.return_tokens_as_token_ids)

    def choice(d: ChoiceDelta) -> Dict[str, Any]:
        parser = parsers.setdefault(d.index, tools.parser(state.tool_call_parser))
        if d.opening:  # each choice opens with the assistant's role
            delta: Dict[str, Any] = {"role": "assistant", "content": d.text}
        elif parser is None:
            delta = {"content": d.text} if d.text else {}
        else:
            content, calls = parser.feed(d.text, final=d.finish_reason is not None)
            delta = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = [c.to_dict() for c in calls]
        lps = None
        if req.logprobs and d.logprobs is not None:
            lps = chat_logprobs(name, d.logprobs, req.top_logprobs or 0)
        finish = tools.finish_reason(d.finish_reason, parser is not None and parser.calls > 0)
        out = {"index": d.index, "delta": delta, "logprobs": lps, "finish_reason": finish, "stop_reason": d.stop_reason}
        if req.return_token_ids:  # vLLM's: each chunk's new tokens (the prompt's: the first chunk, above the choices)
            out["token_ids"] = d.token_ids
        return out

    return stream_sse(state, rid, "chat.completion.chunk", [StreamedRequest(rid, prepared, 0, req.echoed())], choice,
                      req.include_usage,
                      first_extra={"prompt_token_ids": prepared.prompt_token_ids} if req.return_token_ids else None)
