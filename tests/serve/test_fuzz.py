"""Random request bodies (valid and invalid fields, wrong types, huge numbers, unicode, nesting):
the server answers every one with a status below 500 and a JSON body (or, for a stream it
accepted, well-formed events without a server error), and is healthy afterwards."""

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from serve_utils import SERVED_NAME, sse_events

HUGE_INTS = st.sampled_from([2**31, 2**32, 2**53 + 1, 2**63, 2**64, 10**30, -(2**63) - 1, -(10**30)])
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-10, 10), st.integers(), HUGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e308, -1e308, 5e-324, 1e-30, -0.0]),
    st.text(max_size=20), st.sampled_from(["", "\u0000", "\ud7ff\ue000", "😀" * 5, "\u202e", "null", "1e999"]),
)
JUNK = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=8)


def field(valid):
    return st.one_of(valid, JUNK)


TOKEN_IDS = st.lists(st.one_of(st.integers(0, 600), HUGE_INTS, st.integers(-5, -1)), max_size=8)
PROMPT = st.one_of(
    st.text(max_size=40), st.lists(st.text(max_size=20), max_size=3), TOKEN_IDS, st.lists(TOKEN_IDS, max_size=3),
    st.just("word " * 200),
)
MESSAGE = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))},
    optional={"content": field(st.one_of(
        st.text(max_size=40),
        st.lists(st.fixed_dictionaries({"type": field(st.sampled_from(["text", "image_url"]))},
                                       optional={"text": field(st.text(max_size=20))}), max_size=3)))})
# function calling: tools with small schemas, some the schema compiler refuses (patternProperties)
TOOL = st.fixed_dictionaries({"type": field(st.just("function")), "function": field(st.fixed_dictionaries(
    {"name": field(st.sampled_from(["f", "g", "bad name", ""]))},
    optional={"parameters": field(st.sampled_from([
        {"type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"]},
        {"type": "object", "patternProperties": {"a": {}}}, {"type": "string"}, {}]))}))})
TOOL_CALL = st.fixed_dictionaries({"type": field(st.just("function")), "function": field(st.fixed_dictionaries(
    {"name": field(st.text(max_size=4)), "arguments": field(st.sampled_from(['{"x": "a"}', "[1]", "{", ""]))}))},
    optional={"id": field(st.text(max_size=4))})
MESSAGE = st.one_of(MESSAGE, st.fixed_dictionaries(
    {"role": field(st.sampled_from(["assistant", "tool", "user"]))},
    optional={"content": field(st.one_of(st.none(), st.text(max_size=10))),
              "tool_calls": field(st.lists(TOOL_CALL, max_size=2)), "tool_call_id": field(st.text(max_size=4))}))
TOOL_CHOICE = st.one_of(st.sampled_from(["none", "auto", "required"]), st.fixed_dictionaries(
    {"type": field(st.just("function")), "function": field(st.fixed_dictionaries(
        {"name": field(st.sampled_from(["f", "g", "h"]))}))}))
COMMON = {
    "model": st.one_of(st.sampled_from([SERVED_NAME] * 4 + ["tiny-llama", ""]), JUNK),
    "max_tokens": field(st.integers(-2, 200)),
    "temperature": field(st.floats(-1, 3)),
    "top_p": field(st.floats(-0.5, 1.5)),
    "top_k": field(st.integers(-3, 600)),
    "n": field(st.integers(-1, 20)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({}, optional={"include_usage": field(st.booleans())})),
    "stop": field(st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=9))),
    "seed": field(st.integers()),
    "presence_penalty": field(st.floats(-3, 3)),
    "frequency_penalty": field(st.floats(-3, 3)),
    "repetition_penalty": field(st.floats(-1, 3)),
    "min_p": field(st.floats(-0.5, 1.5)),
    "min_tokens": field(st.integers(-2, 8)),
    "stop_token_ids": field(st.lists(st.integers(-2, 600), max_size=3)),
    "ignore_eos": field(st.booleans()),
    "logit_bias": field(st.dictionaries(st.text(max_size=4), st.floats(-100, 100), max_size=2)),
    "bad_words": field(st.lists(st.text(max_size=6), max_size=3)),
    "skip_special_tokens": field(st.booleans()),
    "prompt_logprobs": field(st.integers(-2, 22)),
    "allowed_token_ids": field(st.lists(st.integers(-2, 600), max_size=3)),
    "truncate_prompt_tokens": field(st.integers(-3, 200)),
    "return_token_ids": field(st.booleans()),
    "return_tokens_as_token_ids": field(st.booleans()),
    "cache_salt": field(st.text(max_size=4)),
    "use_beam_search": field(st.booleans()),
    "length_penalty": field(st.floats(-2, 3)),
    "priority": field(st.integers(-3, 3)),
    "user": field(st.text(max_size=10)),
}
COMPLETION = st.fixed_dictionaries({"prompt": field(PROMPT)}, optional={
    **COMMON, "logprobs": field(st.integers(-1, 7)), "echo": field(st.booleans()),
    "best_of": field(st.integers(0, 3)), "suffix": field(st.text(max_size=5)),
})
CHAT = st.fixed_dictionaries({"messages": field(st.lists(MESSAGE, max_size=3))}, optional={
    **COMMON, "max_completion_tokens": field(st.integers(-1, 200)), "logprobs": field(st.booleans()),
    "top_logprobs": field(st.integers(-1, 25)), "tools": field(st.lists(field(TOOL), max_size=2)),
    "tool_choice": field(TOOL_CHOICE), "parallel_tool_calls": field(st.booleans()),
    "add_generation_prompt": field(st.booleans()), "continue_final_message": field(st.booleans()),
    "chat_template_kwargs": field(st.dictionaries(st.sampled_from(["enable_thinking", "x", "tools", "messages"]),
                                                  JUNK, max_size=2)),
    "documents": field(st.lists(st.dictionaries(st.sampled_from(["title", "text"]), JUNK, max_size=2), max_size=2)),
    "chat_template": field(st.sampled_from(["{{ messages[0].content }}", "{% for m in messages %}"])),
    "response_format": field(st.fixed_dictionaries({"type": field(st.sampled_from(["text", "json_object"]))})),
    "guided_regex": field(st.text(alphabet="ab()[]*+?|{}^$.\\-,0123456789", max_size=8)),
    "guided_choice": field(st.lists(st.text(max_size=3), max_size=3)),
    "guided_grammar": field(st.sampled_from(["root ::= ", 'root ::= "a" | b\nb ::= [0-9]+',
                                             'root ::= "(" root ")" | "x"'])
                            .flatmap(lambda head: st.text(alphabet='" |()[]ab-z*+?{}0123\\#\n:=', max_size=12)
                                     .map(lambda tail: head + tail))),
    "guided_json": field(st.one_of(JUNK, st.fixed_dictionaries({"type": field(st.sampled_from(
        ["object", "string", "integer", "array", "boolean", "null", "number"]))}),
        # recursion, well-formed or not: a tree, an endless one, one beside other keywords
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.fixed_dictionaries(
            {"next": st.sampled_from([{"$ref": "#"}, {"$ref": "#", "maxItems": 1}, {"anyOf": [{"$ref": "#"}]}])}),
            "required": st.sampled_from([[], ["next"]])}))),
})


def _int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def bounded(body, chat):
    """Keep valid requests cheap: a valid max_tokens becomes 1..4, a valid n 1..3 (chat's
    default of "fill the context" becomes 3 tokens). Invalid values are left as they are."""
    if not isinstance(body, dict):
        return body
    for key in ("max_tokens", "max_completion_tokens"):
        if _int(body.get(key)) and 5 <= body[key] <= 200:
            body[key] = body[key] % 4 + 1
    if _int(body.get("n")) and 4 <= body["n"] <= 16:
        body["n"] = body["n"] % 3 + 1
    if chat and not any(_int(body.get(k)) for k in ("max_tokens", "max_completion_tokens")):
        body["max_tokens"] = 3
    return body


def _check(server, http, path, body):
    raw = json.dumps(body, allow_nan=True).encode()  # NaN/Infinity too: Python's parser reads them
    if len(raw) > 4096:
        return
    with http.stream("POST", f"{server.url}{path}", content=raw, headers={"content-type": "application/json"}) as r:
        text = r.read().decode("utf-8")
    assert r.status_code < 500, (r.status_code, text, raw)
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(text.splitlines())
        assert events and events[-1] == "[DONE]", (text, raw)
        for e in events[:-1]:
            chunk = json.loads(e)
            assert "error" not in chunk, (chunk, raw)
        return
    payload = json.loads(text)
    assert isinstance(payload, dict), (text, raw)
    if r.status_code >= 400:
        assert set(payload) == {"error"} and set(payload["error"]) == {"message", "type", "param", "code"}, text
    else:
        assert payload["choices"] and "usage" in payload, text
        for c in payload["choices"]:
            # abort: the request's settings left no token possible (e.g. its allowed tokens all banned)
            assert c["finish_reason"] in ("stop", "length", "abort", "tool_calls"), text


FUZZ = settings(max_examples=60, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=60) as client:
        yield client


@FUZZ
@given(body=st.one_of(COMPLETION, COMPLETION, COMPLETION, JUNK))
def test_fuzz_completions(server, http, body):
    _check(server, http, "/v1/completions", bounded(body, chat=False))


@FUZZ
@given(body=st.one_of(CHAT, CHAT, CHAT, JUNK))
def test_fuzz_chat(server, http, body):
    _check(server, http, "/v1/chat/completions", bounded(body, chat=True))


def test_healthy_after_fuzz(server):
    assert server.alive, server.log_tail()
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    m = server.wait_idle(timeout=5)
    assert m["autodeploy_kv_pages_used"] == 0 and m["autodeploy_requests_running"] == 0
    r = server.client().completions.create(model=SERVED_NAME, prompt="still there?", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
