"""What both endpoints share: turning a request's fields into checked, prepared engine requests
(every check failure a 400 in OpenAI's shape), running them, and the usage block.

The checks themselves live in the engine's ``RequestProcessor``; this module only maps its
``InvalidRequestError``s to ``APIError``s naming the request field they concern.
"""

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Optional, Tuple, Union

from fastapi import Request

from ..runtime.outputs import RequestOutput
from ..runtime.request_processor import CheckedPrompt, PreparedRequest, RequestProcessor
from ..runtime.sampling_params import InvalidRequestError, SamplingParams
from .async_engine import EngineError
from .protocol import CLIENT_CLOSED, APIError, ChatCompletionRequest, CompletionRequest
from .state import ServerState


def check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise APIError(404, f"the model '{name}' does not exist; this server serves '{state.model_name}'",
                       "model", "model_not_found")


def check_priority(state: ServerState, priority: int) -> None:
    """A priority other than 0 needs an engine that schedules by priority (vLLM's rule)."""
    if priority and state.scheduling_policy != "priority":
        raise APIError(400, f"'priority' {priority}: this server serves requests in arrival order; start it with "
                            "--scheduling_policy priority (or send priority 0)", "priority")


def check_choices(state: ServerState, num_prompts: int, n: int) -> None:
    """At most ``--max-choices-per-request`` sequences (prompts x n) per request."""
    limit = state.max_choices_per_request
    if num_prompts * n > limit:
        what = f"{num_prompts} prompts x n={n}" if num_prompts > 1 else f"n={n}"
        raise APIError(400, f"this request asks for {num_prompts * n} choices ({what}); this server allows at most "
                            f"{limit} per request: send fewer prompts, a smaller n, or several requests",
                       "prompt" if num_prompts > 1 else "n")


def resolve_max_tokens(state: ServerState, requested: Optional[int], prompt_len: int, default: Optional[int]) -> int:
    """The request's max_tokens for a prompt that fits (``RequestProcessor.check``): the server's
    default fits what is left; an explicit value that does not fit is a 400, as OpenAI does."""
    room = state.max_seq_len - prompt_len
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


def to_sampling_params(req: Union[CompletionRequest, ChatCompletionRequest], max_tokens: int,
                       logprobs: Optional[int], prompt_logprobs: Optional[int] = None) -> SamplingParams:
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
            # scored once for every use of it (completions' echo, vLLM's prompt_logprobs)
            prompt_logprobs=max((k for k in (prompt_logprobs, req.prompt_logprobs) if k is not None), default=None),
            ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            bad_words=req.bad_words,
            allowed_token_ids=req.allowed_token_ids,
            truncate_prompt_tokens=req.truncate_prompt_tokens,
            stop_token_ids=req.stop_token_ids,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_p=req.min_p or 0.0,
            min_tokens=req.min_tokens or 0,
            logit_bias={int(t): b for t, b in req.logit_bias.items()} if req.logit_bias else None,
            guided=req.guided(),
        )
    except InvalidRequestError as exc:
        raise APIError(400, str(exc)) from None


def check_prompt(processor: RequestProcessor, prompt: Any, param: str, truncate: Optional[int] = None,
                 cache_salt: Optional[str] = None) -> CheckedPrompt:
    """``prompt`` (text, token ids, or a prompt mapping) tokenized and checked; ``cache_salt``
    (vLLM's) goes with it to the prefix cache."""
    if cache_salt is not None:
        if isinstance(prompt, str):
            prompt = {"prompt": prompt}
        elif isinstance(prompt, list):
            prompt = {"prompt_token_ids": prompt}
        prompt = {**prompt, "cache_salt": cache_salt}
    try:
        return processor.check(prompt, truncate)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param, exc.code) from None


def prepare_request(processor: RequestProcessor, checked: CheckedPrompt, params: SamplingParams,
                    param: str, priority: int = 0) -> PreparedRequest:
    try:
        return processor.prepare(checked, params, priority)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param, exc.code) from None


def token_namer(tokenizer: Any, as_ids: Optional[bool]) -> Callable[[int], str]:
    """How logprobs name a token: its text, or with vLLM's ``return_tokens_as_token_ids``
    ``"token_id:<id>"`` (a token whose text is part of a UTF-8 character stays identifiable)."""
    if as_ids:
        return lambda t: f"token_id:{t}"
    return lambda t: tokenizer.decode([t])


def top_alternatives(entry: Dict[int, float], top: int) -> List[Tuple[int, float]]:
    """The ``top`` most likely tokens of a prompt-logprobs entry, most likely first (the entry may
    hold more: one scoring serves echo's logprobs and prompt_logprobs, with the larger count)."""
    return sorted(entry.items(), key=lambda kv: -kv[1])[:top]  # stable: the prompt's token first among ties


def scored_prompt(tokenizer: Any, final: RequestOutput, top: int) -> List[Optional[Dict[str, Dict[str, Any]]]]:
    """vLLM's ``prompt_logprobs``: per prompt token (the first null: nothing precedes it) ``{token
    id: {"logprob", "rank", "decoded_token"}}``, the prompt's token with its rank, then the ``top``
    most likely tokens ranked 1 to ``top`` (the engine scored more when echo's logprobs asked for
    more). A -inf log-probability is written -9999.0, as vLLM does: JSON has no infinity."""
    assert final.prompt_logprobs is not None and final.prompt_ranks is not None
    out: List[Optional[Dict[str, Dict[str, Any]]]] = []
    for token, entry, rank in zip(final.prompt_token_ids, final.prompt_logprobs, final.prompt_ranks):
        if entry is None:
            out.append(None)
            continue
        best = top_alternatives(entry, top)
        ranked = [(token, entry[token], rank)] + [(t, v, i + 1) for i, (t, v) in enumerate(best) if t != token]
        out.append({str(t): {"logprob": max(v, -9999.0), "rank": r, "decoded_token": tokenizer.decode([t])}
                    for t, v, r in ranked})
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


async def run_prompt(state: ServerState, request_id: str, request: PreparedRequest) -> AsyncIterator[RequestOutput]:
    """The outputs of one prepared request as they grow; engine failures become ``APIError``s."""
    try:
        async for out in state.engine.generate(request_id, request):
            yield out
    except InvalidRequestError as exc:
        raise APIError(400, str(exc)) from None
    except EngineError as exc:
        raise APIError(500, f"the engine failed while serving this request: {exc}") from None


async def final_output(state: ServerState, request_id: str, request: PreparedRequest) -> RequestOutput:
    final: Optional[RequestOutput] = None
    async for out in run_prompt(state, request_id, request):
        final = out
    assert final is not None
    return final


async def gather_or_cancel(*works: Awaitable[Any]) -> List[Any]:
    """``asyncio.gather``, except that the first failure cancels the others (their requests
    are aborted and their pages freed) instead of leaving them generating for nobody."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # wait for the aborts; nothing unretrieved
        raise


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``; if the client goes away first, cancel it (which aborts its requests and
    frees their pages) instead of generating for nobody."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # retrieve its end: no "never retrieved" log
            raise APIError(CLIENT_CLOSED, "the client closed the connection")
