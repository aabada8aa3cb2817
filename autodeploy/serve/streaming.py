"""Streamed responses (server-sent events), one implementation for both endpoints.

``ChoiceStreamer`` turns the growing outputs of one request into per-choice ``ChoiceDelta``s
that never need taking back (``IncrementalText`` holds back what could still become a stop
string or is an incomplete character), each choice's logprob steps not sent yet, and exactly
one final delta per choice. ``stream_sse`` runs the requests at once and frames the
deltas as chunks; an endpoint only says how one choice of its chunk looks
(``format_choice``). The stream ends with a usage chunk (only when the client asked with
``stream_options.include_usage``, as OpenAI does) and ``[DONE]``; an error after the
headers went out travels in the stream as an error event, then ``[DONE]``.
"""

import asyncio
import json
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Optional, Sequence, Union

from ..runtime.outputs import RequestOutput
from ..runtime.request_processor import PreparedRequest
from ..utils.logging import get_logger
from .protocol import APIError
from .requests import run_prompt, usage
from .state import ServerState

logger = get_logger(__name__)


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


@dataclass(frozen=True)
class ChoiceDelta:
    """What one chunk says about one choice."""

    index: int  # the choice's index in the response
    text: str  # the new text ("" when there is none)
    finish_reason: Optional[str] = None
    logprobs: Optional[List[Dict[int, float]]] = None  # the steps not sent before; None: the output has none
    offset: int = 0  # characters of the choice's text (opening included) sent before ``text``
    # the request's prompt log-probabilities, in the choice's first delta once the prompt ran
    # (only when the request scores its prompt: SamplingParams.prompt_logprobs)
    prompt_logprobs: Optional[List[Optional[Dict[int, float]]]] = None
    opening: bool = False  # the choice's opening chunk, sent before generation starts
    first: bool = False  # the choice's first chunk (the opening one where there is one)
    token_ids: List[int] = field(default_factory=list)  # the tokens not sent before
    stop_reason: Union[int, str, None] = None  # with the final delta: the stop token or string


@dataclass(frozen=True)
class StreamedRequest:
    """One prepared request; its n choices are the response's ``first_index``, ``first_index + 1``, ...

    ``opening``: each choice first gets a chunk with this text (the echoed prompt, or "" for
    chat's role chunk), which also counts in the choice's text offsets; None: no such chunk."""

    request_id: str
    prepared: PreparedRequest
    first_index: int = 0
    opening: Optional[str] = None


class ChoiceStreamer:
    """The choices of one streamed request: ``update`` takes each output as it grows and
    returns the deltas to send, at most one final delta per choice."""

    def __init__(self, request: StreamedRequest):
        n = request.prepared.params.n
        self.request = request
        self.base = len(request.opening or "")
        self.texts = [IncrementalText(request.prepared.params.stop_strings) for _ in range(n)]
        self.sent_tokens = [0] * n
        self.sent_prompt = [False] * n  # the prompt's log-probabilities went out with a delta
        self.finished = [False] * n
        self.completion_tokens = 0  # known once the request finished
        self.started = [False] * n  # a choice's first chunk (its opening one, if any) went out

    def opening(self) -> List[ChoiceDelta]:
        text = self.request.opening
        if text is None:
            return []
        self.started = [True] * len(self.texts)
        return [ChoiceDelta(self.request.first_index + j, text, opening=True, first=True)
                for j in range(len(self.texts))]

    def update(self, out: RequestOutput) -> List[ChoiceDelta]:
        deltas = []
        for c in out.outputs:
            if self.finished[c.index]:
                continue  # its last chunk went out already
            offset = self.base + self.texts[c.index].sent
            text = self.texts[c.index].delta(c.text, c.finish_reason is not None)
            if text or c.finish_reason is not None:
                steps = c.logprobs[self.sent_tokens[c.index]:] if c.logprobs else None
                new_ids = c.token_ids[self.sent_tokens[c.index]:]
                self.sent_tokens[c.index] = len(c.token_ids)
                first, self.started[c.index] = not self.started[c.index], True
                self.finished[c.index] = c.finish_reason is not None
                scored = None
                if out.prompt_logprobs is not None and not self.sent_prompt[c.index]:
                    scored, self.sent_prompt[c.index] = out.prompt_logprobs, True  # complete: a token was sampled
                deltas.append(ChoiceDelta(self.request.first_index + c.index, text, c.finish_reason, steps, offset,
                                          prompt_logprobs=scored, first=first, token_ids=list(new_ids),
                                          stop_reason=c.stop_reason))
        if out.finished:
            self.completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return deltas


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _merged(state: ServerState, requests: Sequence[StreamedRequest],
                  streamers: Sequence[ChoiceStreamer]) -> AsyncIterator[ChoiceDelta]:
    """The deltas of every request as they come, all requests running at once (so a prompt list
    is batched by the engine, not generated one prompt after another). The first failure ends
    the stream; the requests still running are then cancelled, which aborts them."""
    queue: "asyncio.Queue[Any]" = asyncio.Queue()
    done = object()

    async def pump(request: StreamedRequest, streamer: ChoiceStreamer) -> None:
        try:
            async for out in run_prompt(state, request.request_id, request.prepared):
                for delta in streamer.update(out):
                    queue.put_nowait(delta)
            queue.put_nowait(done)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(r, s)) for r, s in zip(requests, streamers)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def stream_sse(state: ServerState, rid: str, obj: str, requests: Sequence[StreamedRequest],
                     format_choice: Callable[[ChoiceDelta], Dict[str, Any]],
                     include_usage: bool = False, first_extra: Optional[Dict[str, Any]] = None) -> AsyncIterator[str]:
    """The event stream of a response made of ``requests`` (all running at once): a chunk
    ``{"id", "object": obj, "created", "model", "choices": [format_choice(delta)]}`` per delta,
    then the usage chunk if ``include_usage``, and ``[DONE]``; the first chunk also has the
    fields of ``first_extra``. Whatever fails after the headers
    went out (an ``APIError``, or a bug: logged, reported as an internal error) ends the stream
    with an error event and ``[DONE]``, never with a broken connection."""
    created = int(time.time())

    pending_extra = dict(first_extra or {})

    def chunk(choices: List[Dict[str, Any]], **extra: Any) -> str:
        extra = {**pending_extra, **extra}
        pending_extra.clear()
        return sse({"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": choices,
                    **extra})

    streamers = [ChoiceStreamer(r) for r in requests]
    try:
        for streamer in streamers:
            for delta in streamer.opening():
                yield chunk([format_choice(delta)])
        async with aclosing(_merged(state, requests, streamers)) as deltas:  # closed (aborting) on a disconnect
            async for delta in deltas:
                yield chunk([format_choice(delta)])
        if include_usage:
            prompt_tokens = sum(len(r.prepared.prompt_token_ids) for r in requests)
            yield chunk([], usage=usage(prompt_tokens, sum(s.completion_tokens for s in streamers)))
        yield "data: [DONE]\n\n"
    except APIError as exc:  # after the headers went out, errors travel in the stream
        yield sse(exc.body())
        yield "data: [DONE]\n\n"
    except Exception as exc:  # noqa: BLE001 - a bug must not break the connection without a word
        logger.exception("internal error while streaming %s", rid)
        yield sse(APIError(500, f"internal error: {type(exc).__name__}").body())
        yield "data: [DONE]\n\n"
