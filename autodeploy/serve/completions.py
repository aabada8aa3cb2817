"""``POST /v1/completions``: prompts in, text completions out, whole or streamed (with ``echo``
and the legacy completions logprobs format: tokens, token_logprobs, top_logprobs, text_offset).

Every prompt of the request is one engine request of ``n`` choices; choice ``j`` of prompt
``i`` is the response's choice ``i * n + j``.

``echo`` with ``logprobs`` scores the prompt, as OpenAI's legacy API does and as evaluation
harnesses (lm-eval's ``local-completions``) need for loglikelihoods: the logprobs list one entry
per prompt token the model saw (the first ``null``), then the generated tokens; ``max_tokens: 0``
with ``echo`` scores without generating. A string prompt is tokenized with the tokenizer's
special tokens (a BOS token for most models), a token-id prompt is used as sent; either way the
prompt entries are exactly the tokens scored, a BOS the server added included (its text is not
part of the echoed prompt, so it takes no room in ``text_offset``).
"""

import time
import uuid
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Tuple

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..runtime.detokenizer import IncrementalDetokenizer
from ..runtime.beam_search import BeamSearchParams
from ..runtime.request_processor import CheckedPrompt, PreparedRequest
from .beam_search import beam_params, completion_tokens, run_beam_search
from .openapi import CompletionChunk, CompletionResponse, api_responses
from .protocol import APIError, CompletionRequest
from .requests import (check_choices, check_model, check_priority, check_prompt, final_output, gather_or_cancel,
                       prepare_request, resolve_max_tokens, scored_prompt, to_sampling_params, token_namer,
                       top_alternatives, unless_disconnected, usage)
from .state import ServerState
from .streaming import ChoiceDelta, StreamedRequest, stream_sse

# per prompt: (its text, its token ids, the prepared request)
Plan = Tuple[str, List[int], PreparedRequest]
LogprobsBlock = Dict[str, List[Any]]
PromptLogprobs = List[Optional[Dict[int, float]]]
TokenName = Callable[[int], str]


def _top_by_text(name: TokenName, entry: Dict[int, float]) -> Dict[str, float]:
    """``{token text: logprob}``: the legacy format keys by text, and two ids can share one (e.g.
    byte tokens); the first wins - the scored token, then the alternatives, most likely first."""
    out: Dict[str, float] = {}
    for t, v in entry.items():
        out.setdefault(name(t), v)
    return out


def completion_logprobs(tokenizer: Any, name: TokenName, steps: List[Dict[int, float]], offset: int) -> LogprobsBlock:
    """The generated tokens' entries; ``text_offset`` from their text (whatever ``name`` shows)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for step in steps:
        chosen, lp = next(iter(step.items()))
        text = tokenizer.decode([chosen])
        tokens.append(name(chosen))
        token_lps.append(lp)
        tops.append(_top_by_text(name, step))
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(tokenizer: Any, name: TokenName, ids: List[int], scored: PromptLogprobs, from_text: bool,
                    top: int) -> LogprobsBlock:
    """The prompt's entries: its token ids' texts, each one's log probability given the tokens
    before it (``None`` for the first) and the ``top`` alternatives. ``text_offset`` is where each
    token's text starts in the echoed prompt, found by detokenizing the prompt incrementally;
    special tokens take no room when the echo is the user's own text (``from_text``), since the
    server added them."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=from_text)
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for token, entry in zip(ids, scored):
        offsets.append(offset)
        offset += len(detok.add(token))
        tokens.append(name(token))
        token_lps.append(None if entry is None else entry[token])
        tops.append(None if entry is None else _top_by_text(name, {token: entry[token], **dict(
            top_alternatives(entry, top))}))
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _joined(first: Optional[LogprobsBlock], second: Optional[LogprobsBlock]) -> Optional[LogprobsBlock]:
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def choice_logprobs(state: ServerState, req: CompletionRequest, plan: Plan, scored: Optional[PromptLogprobs],
                    steps: Optional[List[Dict[int, float]]], offset: int) -> Optional[LogprobsBlock]:
    """A choice's logprobs block: the prompt's entries (``scored``: passed when they are due,
    with ``echo``), then those of the generated ``steps``, whose text starts at ``offset``."""
    if req.logprobs is None:
        return None
    _, ids, prepared = plan
    name = token_namer(state.tokenizer, req.return_tokens_as_token_ids)
    prompt = (prompt_logprobs(state.tokenizer, name, ids, scored, prepared.prompt is not None, req.logprobs)
              if scored else None)
    generated = completion_logprobs(state.tokenizer, name, steps, offset) if steps else None
    return _joined(prompt, generated) or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def router(state: ServerState) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/completions", responses=api_responses(CompletionResponse, CompletionChunk))
    async def completions(req: CompletionRequest, request: Request):
        """Complete one prompt or a list of them (strings or token ids), ``n`` choices each."""
        check_model(state, req.model)
        req.check_supported()
        check_priority(state, req.priority)
        processor = state.engine.processor
        prompts = req.prompts()
        check_choices(state, len(prompts), req.n)
        plans: List[Plan] = []
        beams: List[Tuple[str, CheckedPrompt, BeamSearchParams]] = []
        for p in prompts:
            if not isinstance(p, (str, list)):
                raise APIError(400, "'prompt' must be a string, a list of strings, or token ids", "prompt")
            checked = check_prompt(processor, p, "prompt", req.truncate_prompt_tokens, req.cache_salt)
            max_tokens = resolve_max_tokens(state, req.max_tokens, len(checked.prompt_token_ids), 16)
            text = checked.prompt if checked.prompt is not None else (processor.decode(checked.prompt_token_ids) or "")
            if req.use_beam_search:
                beams.append((text, checked, beam_params(req, max_tokens)))
                continue
            params = to_sampling_params(req, max_tokens, req.logprobs, prompt_logprobs=_prompt_scoring(req))
            prepared = prepare_request(processor, checked, params, "prompt", req.priority)
            plans.append((text, checked.prompt_token_ids, prepared))
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        if beams:
            return await _beam_search(state, request, req, rid, beams)
        if req.stream:
            return StreamingResponse(_stream(state, req, rid, plans), media_type="text/event-stream")
        return await _complete(state, request, req, rid, plans)

    return api


def _prompt_scoring(req: CompletionRequest) -> Optional[int]:
    """``prompt_logprobs`` of the engine request: echo with logprobs scores the prompt (and
    ``max_tokens: 0``, allowed only with echo, scores it even without ``logprobs``)."""
    if req.echo and req.logprobs is not None:
        return req.logprobs
    return 0 if req.max_tokens == 0 else None


async def _beam_search(state: ServerState, request: Request, req: CompletionRequest, rid: str,
                       beams: List[Tuple[str, CheckedPrompt, BeamSearchParams]]) -> JSONResponse:
    """``use_beam_search``: each prompt's ``n`` best hypotheses, best first, as its choices."""
    outputs = await unless_disconnected(request, gather_or_cancel(*[
        run_beam_search(state, f"{rid}-{i}", checked, params, req.priority)
        for i, (_, checked, params) in enumerate(beams)]))
    choices = []
    for i, ((text, _, _), out) in enumerate(zip(beams, outputs)):
        choices += [{"index": i * req.n + j, "text": (text if req.echo else "") + s.text, "logprobs": None,
                     "finish_reason": s.finish_reason, "stop_reason": None} for j, s in enumerate(out.sequences)]
    prompt_tokens = sum(len(checked.prompt_token_ids) for _, checked, _ in beams)
    return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
                         "choices": choices,
                         "usage": usage(prompt_tokens, sum(completion_tokens(out) for out in outputs))})


async def _complete(state: ServerState, request: Request, req: CompletionRequest, rid: str,
                    plans: List[Plan]) -> JSONResponse:
    choices, prompt_tokens, completion_tokens = [], 0, 0
    finals = await unless_disconnected(request, gather_or_cancel(
        *[final_output(state, f"{rid}-{i}", prepared) for i, (_, _, prepared) in enumerate(plans)]))
    for i, (plan, final) in enumerate(zip(plans, finals)):
        text, ids, _ = plan
        prompt_tokens += len(ids)
        for c in final.outputs:
            completion_tokens += len(c.token_ids)
            body = (text if req.echo else "") + c.text
            logprobs = choice_logprobs(state, req, plan, final.prompt_logprobs if req.echo else None, c.logprobs,
                                       len(text) if req.echo else 0)
            choice = {"index": i * req.n + c.index, "text": body, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if req.prompt_logprobs is not None:  # vLLM's, per choice
                choice["prompt_logprobs"] = scored_prompt(state.tokenizer, final, req.prompt_logprobs)
            if req.return_token_ids:
                choice.update(prompt_token_ids=ids, token_ids=c.token_ids)
            choices.append(choice)
    return JSONResponse({"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
                         "choices": choices, "usage": usage(prompt_tokens, completion_tokens)})


def _stream(state: ServerState, req: CompletionRequest, rid: str, plans: List[Plan]) -> AsyncIterator[str]:
    requests = [StreamedRequest(f"{rid}-{i}", prepared, i * req.n, text if req.echo else None)
                for i, (text, _, prepared) in enumerate(plans)]
    plan_of = {r.first_index: plan for r, plan in zip(requests, plans)}

    def choice(d: ChoiceDelta) -> Dict[str, Any]:
        # text_offset counts from the start of the choice's text (the echoed prompt included);
        # the prompt's entries (echo) come with the choice's first chunk after the prompt ran
        lps = None
        plan = plan_of[d.index - d.index % req.n]
        if d.logprobs or d.prompt_logprobs:
            lps = choice_logprobs(state, req, plan, d.prompt_logprobs, d.logprobs, d.offset)
        out = {"index": d.index, "text": d.text, "logprobs": lps, "finish_reason": d.finish_reason,
               "stop_reason": d.stop_reason}
        if req.return_token_ids:  # vLLM's: the prompt's ids in the choice's first chunk, then each chunk's new ones
            out["token_ids"] = d.token_ids
            if d.first:
                out["prompt_token_ids"] = plan[1]
        return out

    return stream_sse(state, rid, "text_completion", requests, choice, req.include_usage)
