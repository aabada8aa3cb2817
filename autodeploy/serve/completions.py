"""``POST /v1/completions``: prompts in, text completions out, whole or streamed (with ``echo``
and the legacy completions logprobs format: tokens, token_logprobs, top_logprobs, text_offset).

Every prompt of the request is one engine request of ``n`` choices; choice ``j`` of prompt
``i`` is the response's choice ``i * n + j``.
"""

import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Tuple

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..runtime.request_processor import PreparedRequest
from .openapi import CompletionChunk, CompletionResponse, api_responses
from .protocol import APIError, CompletionRequest
from .requests import (check_choices, check_model, check_prompt, final_output, gather_or_cancel, prepare_request,
                       resolve_max_tokens, to_sampling_params, unless_disconnected, usage)
from .state import ServerState
from .streaming import ChoiceDelta, StreamedRequest, stream_sse

# per prompt: (its text, its token ids, the prepared request)
Plan = Tuple[str, List[int], PreparedRequest]


def completion_logprobs(tokenizer: Any, steps: List[Dict[int, float]], offset: int) -> Dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    for step in steps:
        chosen, lp = next(iter(step.items()))
        text = tokenizer.decode([chosen])
        tokens.append(text)
        token_lps.append(lp)
        tops.append({tokenizer.decode([t]): v for t, v in step.items()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def router(state: ServerState) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/completions", responses=api_responses(CompletionResponse, CompletionChunk))
    async def completions(req: CompletionRequest, request: Request):
        """Complete one prompt or a list of them (strings or token ids), ``n`` choices each."""
        check_model(state, req.model)
        req.check_supported()
        processor = state.engine.processor
        prompts = req.prompts()
        check_choices(state, len(prompts), req.n)
        plans: List[Plan] = []
        for p in prompts:
            if not isinstance(p, (str, list)):
                raise APIError(400, "'prompt' must be a string, a list of strings, or token ids", "prompt")
            checked = check_prompt(processor, p, "prompt")
            max_tokens = resolve_max_tokens(state, req.max_tokens, len(checked.prompt_token_ids), 16)
            params = to_sampling_params(req, max_tokens, req.logprobs)
            text = checked.prompt if checked.prompt is not None else (processor.decode(checked.prompt_token_ids) or "")
            plans.append((text, checked.prompt_token_ids, prepare_request(processor, checked, params, "prompt")))
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        if req.stream:
            return StreamingResponse(_stream(state, req, rid, plans), media_type="text/event-stream")
        return await _complete(state, request, req, rid, plans)

    return api


async def _complete(state: ServerState, request: Request, req: CompletionRequest, rid: str,
                    plans: List[Plan]) -> JSONResponse:
    choices, prompt_tokens, completion_tokens = [], 0, 0
    finals = await unless_disconnected(request, gather_or_cancel(
        *[final_output(state, f"{rid}-{i}", prepared) for i, (_, _, prepared) in enumerate(plans)]))
    for i, ((text, ids, _), final) in enumerate(zip(plans, finals)):
        prompt_tokens += len(ids)
        for c in final.outputs:
            completion_tokens += len(c.token_ids)
            body = (text if req.echo else "") + c.text
            logprobs = None
            if req.logprobs is not None and c.logprobs is not None:
                logprobs = completion_logprobs(state.tokenizer, c.logprobs, len(text) if req.echo else 0)
            choices.append({"index": i * req.n + c.index, "text": body, "logprobs": logprobs,
                            "finish_reason": c.finish_reason})
    return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
                         "choices": choices, "usage": usage(prompt_tokens, completion_tokens)})


def _stream(state: ServerState, req: CompletionRequest, rid: str, plans: List[Plan]) -> AsyncIterator[str]:
    requests = [StreamedRequest(f"{rid}-{i}", prepared, i * req.n, text if req.echo else None)
                for i, (text, _, prepared) in enumerate(plans)]

    def choice(d: ChoiceDelta) -> Dict[str, Any]:
        # text_offset counts from the start of the choice's text (the echoed prompt included)
        lps = completion_logprobs(state.tokenizer, d.logprobs, d.offset) if (req.logprobs is not None and d.logprobs) \
            else None
        return {"index": d.index, "text": d.text, "logprobs": lps, "finish_reason": d.finish_reason}

    return stream_sse(state, rid, "text_completion", requests, choice, req.include_usage)
